//! The runtime catalog: model names, aliases and roles, as loaded from `[[models]]`/`[roles]`
//! and the MLflow registry's tagged models ([`super::registry`]).
//!
//! [`LiveCatalog`] is the one the agent serves: swapped whole when the registry's tagged
//! models change or agent.toml is reloaded, so a reader always sees one consistent catalog.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

use crate::config::{ConfigFile, ModelConfig};

/// Immutable view of the configured catalog. Runtime changes to names and roles live in the
/// name registry (`names/`), which starts from this.
#[derive(Debug, Default)]
pub struct Catalog {
    models: BTreeMap<String, Arc<ModelConfig>>,
    /// alias -> canonical model name (active aliases, not deprecated names).
    aliases: BTreeMap<String, String>,
    /// LoRA adapter -> the model whose worker serves it.
    adapters: BTreeMap<String, String>,
    /// role -> model name (`None`: role exists, no model assigned).
    roles: BTreeMap<String, Option<String>>,
    /// Names served because of MLflow registry tags (not `[[models]]` entries).
    from_registry: BTreeSet<String>,
    /// Built without a registry read (polling is on, MLflow has not answered yet): a model
    /// missing from it may still be tagged.
    registry_unread: bool,
}

impl Catalog {
    pub fn from_config(file: &ConfigFile) -> Catalog {
        Catalog::build(file, &[])
    }

    /// `[[models]]` of `file` and the registry's entries (validated by
    /// [`super::registry::build`] against `file`, so no name is used twice).
    pub fn build(file: &ConfigFile, registry: &[ModelConfig]) -> Catalog {
        let mut c = Catalog::default();
        for m in registry {
            c.from_registry.insert(m.name.clone());
            c.models.insert(m.name.clone(), Arc::new(m.clone()));
        }
        for m in &file.models {
            for a in &m.aliases {
                c.aliases.insert(a.clone(), m.name.clone());
            }
            for a in m.adapter_names() {
                c.adapters.insert(a.to_string(), m.name.clone());
            }
            if let Some(role) = &m.role {
                c.roles.insert(role.clone(), Some(m.name.clone()));
            }
            c.models.insert(m.name.clone(), Arc::new(m.clone()));
        }
        // `[roles]` wins over `role =` in a model entry; "" means "no model assigned".
        for (role, model) in &file.roles {
            c.roles.insert(role.clone(), if model.is_empty() { None } else { Some(model.clone()) });
        }
        c
    }

    /// The catalog entry for a canonical name, an active alias, or an adapter (its base model).
    pub fn get(&self, name: &str) -> Option<&Arc<ModelConfig>> {
        self.models
            .get(name)
            .or_else(|| self.aliases.get(name).and_then(|m| self.models.get(m)))
            .or_else(|| self.adapters.get(name).and_then(|m| self.models.get(m)))
    }

    /// The entry of a canonical name (not an alias or adapter).
    pub fn model(&self, name: &str) -> Option<&Arc<ModelConfig>> {
        self.models.get(name)
    }

    /// Whether `name` is a LoRA adapter (served by its base model's worker under its own name).
    pub fn is_adapter(&self, name: &str) -> bool {
        self.adapters.contains_key(name)
    }

    pub fn adapters_of(&self, model: &str) -> Vec<String> {
        self.adapters.iter().filter(|(_, m)| m.as_str() == model).map(|(a, _)| a.clone()).collect()
    }

    /// The catalog names that serve MLflow registered model `registered` (`mlflow_model`).
    pub fn serving(&self, registered: &str) -> Vec<String> {
        self.models().filter(|m| m.mlflow_model.as_deref() == Some(registered)).map(|m| m.name.clone()).collect()
    }

    pub fn models(&self) -> impl Iterator<Item = &Arc<ModelConfig>> {
        self.models.values()
    }

    pub fn aliases_of(&self, model: &str) -> Vec<String> {
        self.aliases.iter().filter(|(_, m)| m.as_str() == model).map(|(a, _)| a.clone()).collect()
    }

    pub fn roles(&self) -> &BTreeMap<String, Option<String>> {
        &self.roles
    }

    /// Every name the catalog serves (canonical names, aliases, adapters).
    pub fn all_names(&self) -> impl Iterator<Item = &String> {
        self.models.keys().chain(self.aliases.keys()).chain(self.adapters.keys())
    }

    /// Whether `name` is served because of MLflow registry tags.
    pub fn is_from_registry(&self, name: &str) -> bool {
        self.from_registry.contains(name)
    }

    /// The names served because of MLflow registry tags.
    pub fn registry_names(&self) -> &BTreeSet<String> {
        &self.from_registry
    }

    /// This catalog, marked as built before any registry read.
    pub fn registry_unread(mut self) -> Catalog {
        self.registry_unread = true;
        self
    }

    /// Whether it was built before any registry read (its registry models are unknown).
    pub fn is_registry_unread(&self) -> bool {
        self.registry_unread
    }
}

/// The catalog being served now. Readers take a cheap snapshot ([`LiveCatalog::load`]) and
/// use it for one decision; [`super::ModelManager::apply_catalog`] swaps it.
#[derive(Debug, Default)]
pub struct LiveCatalog {
    current: RwLock<Arc<Catalog>>,
}

impl LiveCatalog {
    pub fn new(catalog: Arc<Catalog>) -> LiveCatalog {
        LiveCatalog { current: RwLock::new(catalog) }
    }

    /// The catalog as it is now.
    pub fn load(&self) -> Arc<Catalog> {
        match self.current.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    pub(crate) fn store(&self, catalog: Arc<Catalog>) {
        match self.current.write() {
            Ok(mut g) => *g = catalog,
            Err(p) => *p.into_inner() = catalog,
        }
    }
}
