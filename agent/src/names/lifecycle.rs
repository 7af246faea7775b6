//! Name changes: rename, deprecate, retire, restore, and role assignments.
//!
//! Every change is first a [`Plan`]: what changes in the store, what happens to the callers
//! of the name (from the callers rollup), and what needs `--force`. Planning is pure (no
//! store access), so each rule is a unit test; `api.rs` applies a plan in one transaction
//! and reloads the registry.
//!
//! Rules (each refusal says why and what to do instead):
//! - names use letters, digits and `. _ - / :` (Hugging Face ids included), start with a
//!   letter or digit; look-alike Unicode, spaces and control characters are refused;
//! - a rename target must be a name served now, and not a deprecated or retired one (so no
//!   cycles a -> b -> a, and no chains: names that pointed at the old name move along);
//! - renaming onto a name that serves a different model needs `--force`;
//! - a sunset must be a real date after today (a past sunset would retire the name at
//!   once: that is `retire`);
//! - retiring a name that was called in the window, or before its announced sunset, needs
//!   `--force`; roles that point at a retired name move to its replacement (or the retire is
//!   refused, so no job gets a `<ROLE>_MODEL` that does not work).

use serde::Serialize;

use super::callers::CallersReport;
use super::{Inner, NameRecord, NameState, Resolution, days_from_civil, resolve_in, served_model, suggest};
use crate::models::Catalog;
use crate::store::names::{NameOp, NameRow, NewHistory};

/// A change that cannot be made as asked. `--force` does not help; the message says what would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// Bad input: an odd name, a bad date, a cycle, a target that is not served.
    #[error("{0}")]
    Invalid(String),
    /// The name is not known at all.
    #[error("{0}")]
    NotFound(String),
}

impl LifecycleError {
    pub fn status_code(&self) -> u16 {
        match self {
            LifecycleError::Invalid(_) => 422,
            LifecycleError::NotFound(_) => 404,
        }
    }
}

/// What a change will do, shown by `--dry-run` and before every change.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub action: &'static str,
    pub name: String,
    pub from_state: String,
    pub to_state: String,
    pub from_target: Option<String>,
    pub to_target: Option<String>,
    pub sunset: Option<String>,
    /// What happens, one sentence each.
    pub effects: Vec<String>,
    /// Worth knowing, not blocking.
    pub warnings: Vec<String>,
    /// Why this needs `--force` (empty: it can be applied as is).
    pub needs_force: Vec<String>,
    /// Roles this change moves (the snapshot is rewritten when non-empty).
    pub roles_changed: Vec<String>,
    #[serde(skip)]
    pub ops: Vec<NameOp>,
    #[serde(skip)]
    pub history: Vec<NewHistory>,
}

/// Inputs every plan needs.
pub struct Ctx<'a> {
    pub catalog: &'a Catalog,
    pub inner: &'a Inner,
    /// Today (UTC), `YYYY-MM-DD`.
    pub today: &'a str,
    /// Who asks (recorded in the history).
    pub actor: &'a str,
    /// The callers of the name in the preflight window.
    pub callers: &'a CallersReport,
    /// Status for retired names (for the message preview).
    pub retired_status: u16,
}

/// How a name stands right now.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Current {
    /// In the registry.
    Registry(NameRecord),
    /// A catalog model's own name.
    Model,
    /// A catalog alias of `of`.
    Alias {
        of: String,
    },
    /// A role (served as its model, or unassigned).
    Role,
    Unknown,
}

fn current(ctx: &Ctx<'_>, name: &str) -> Current {
    if let Some(rec) = ctx.inner.names.get(name) {
        return Current::Registry(rec.clone());
    }
    if let Some(m) = ctx.catalog.get(name) {
        return if m.name == name { Current::Model } else { Current::Alias { of: m.name.clone() } };
    }
    if ctx.inner.roles.contains_key(name) {
        return Current::Role;
    }
    Current::Unknown
}

fn state_label(c: &Current) -> (String, Option<String>) {
    match c {
        Current::Registry(r) => (r.state.as_str().to_string(), r.replacement.clone()),
        Current::Model => ("active".into(), None),
        Current::Alias { of } => ("active".into(), Some(of.clone())),
        Current::Role => ("role".into(), None),
        Current::Unknown => ("unknown".into(), None),
    }
}

/// Checks a name a client would send: letters, digits, `. _ - / :`, 1-128 characters,
/// starting with a letter or digit, no `//`, `..` or trailing `/`.
pub fn validate_name(name: &str) -> Result<(), LifecycleError> {
    let shown = name.escape_debug().to_string();
    if name.is_empty() {
        return Err(LifecycleError::Invalid("the name is empty; give a model name such as `dots.ocr`".into()));
    }
    if name.chars().count() > 128 {
        return Err(LifecycleError::Invalid(format!(
            "name `{}…` is {} characters long; the limit is 128",
            shown.chars().take(32).collect::<String>(),
            name.chars().count()
        )));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-/:".contains(*c))) {
        let what = if c == ' ' {
            "a space".to_string()
        } else if c.is_control() {
            format!("a control character ({})", c.escape_unicode())
        } else if !c.is_ascii() {
            format!("`{c}` ({}, not ASCII: look-alike letters make names nobody can tell apart)", c.escape_unicode())
        } else {
            format!("`{c}`")
        };
        return Err(LifecycleError::Invalid(format!("name `{shown}` contains {what}; names may use letters, digits and . _ - / : only")));
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(LifecycleError::Invalid(format!("name `{shown}` must start with a letter or a digit")));
    }
    if name.ends_with('/') || name.contains("//") || name.contains("..") {
        return Err(LifecycleError::Invalid(format!(
            "name `{shown}` has an empty path part (`//`, `..` or a trailing `/`); write it as the model id, e.g. `Qwen/Qwen3-8B`"
        )));
    }
    Ok(())
}

/// Checks a sunset date: a real `YYYY-MM-DD` after today.
pub fn validate_sunset(sunset: &str, today: &str, name: &str) -> Result<(), LifecycleError> {
    let Some(day) = days_from_civil(sunset) else {
        return Err(LifecycleError::Invalid(format!("sunset `{}` is not a date; use YYYY-MM-DD, e.g. 2026-12-31", sunset.escape_debug())));
    };
    let today_days = days_from_civil(today).unwrap_or(0);
    if day <= today_days {
        return Err(LifecycleError::Invalid(format!(
            "sunset {sunset} is not in the future (today is {today}, UTC): a sunset tells callers when `{name}` stops working, so it must be a later date; to stop serving `{name}` now, use `gpuhub names retire {name}`"
        )));
    }
    Ok(())
}

/// Points `role` from `from` to `to` as part of a plan (op, history row, effect).
fn move_role(plan: &mut Plan, ctx: &Ctx<'_>, role: &str, from: &str, to: &str, why: String) {
    plan.ops.push(NameOp::Role { role: role.to_string(), model: to.to_string(), by: ctx.actor.to_string() });
    plan.history.push(history(ctx, "role-set", role, (None, Some(from.to_string())), (None, Some(to.to_string())), None, why));
    let var = gpuhub_wire::snapshot::role_env_var(role).unwrap_or_default();
    plan.effects.push(format!(
        "role `{role}` moves from `{from}` to `{to}`: jobs started from now on get {var}={to}; services outside Slurm: re-run `gpuhub env`"
    ));
    plan.roles_changed.push(role.to_string());
}

fn history(
    ctx: &Ctx<'_>,
    action: &str,
    subject: &str,
    from: (Option<String>, Option<String>),
    to: (Option<String>, Option<String>),
    sunset: Option<String>,
    note: String,
) -> NewHistory {
    NewHistory {
        actor: ctx.actor.to_string(),
        action: action.to_string(),
        subject: subject.to_string(),
        from_state: from.0,
        to_state: to.0,
        from_target: from.1,
        to_target: to.1,
        sunset_date: sunset,
        note,
    }
}

fn row(ctx: &Ctx<'_>, name: &str, state: NameState, replacement: Option<String>, since: Option<String>, sunset: Option<String>) -> NameRow {
    NameRow {
        name: name.to_string(),
        state: state.as_str().to_string(),
        replacement,
        since_date: since,
        sunset_date: sunset,
        updated_us: 0,
        updated_by: ctx.actor.to_string(),
    }
}

fn suggestions(ctx: &Ctx<'_>, asked: &str) -> String {
    let candidates: Vec<String> = ctx.catalog.all_names().cloned().chain(ctx.inner.names.keys().cloned()).collect();
    let s = suggest::closest(asked, &candidates, 3);
    if s.is_empty() {
        String::new()
    } else {
        format!("; did you mean {}?", s.iter().map(|x| format!("`{x}`")).collect::<Vec<_>>().join(" or "))
    }
}

fn env_hint(inner: &Inner, name: &str) -> String {
    let vars: Vec<String> = inner
        .roles
        .iter()
        .filter(|(_, m)| m.as_deref() == Some(name))
        .filter_map(|(r, _)| gpuhub_wire::snapshot::role_env_var(r))
        .collect();
    if vars.is_empty() { String::new() } else { format!(" (or set {})", vars.join(", ")) }
}

/// The message a caller of `name` would get after the change (preview for the plan).
fn preview(ctx: &Ctx<'_>, after: &Inner, name: &str) -> String {
    let r = resolve_in(ctx.catalog, after, name);
    match super::refusal_for(name, &r, ctx.retired_status) {
        Some(f) => format!("HTTP {} {}: \"{}\"", f.status, f.code, f.message),
        None => match r {
            Resolution::Deprecated { model, sunset, .. } => {
                format!(
                    "served by `{model}` with Deprecation{} and Link headers",
                    sunset.map(|s| format!(", Sunset ({s})")).unwrap_or_default()
                )
            }
            other => format!("served by `{}`", other.model().unwrap_or("?")),
        },
    }
}

/// The registry after `ops` (for previews).
fn after(inner: &Inner, ops: &[NameOp]) -> Inner {
    let mut next = inner.clone();
    for op in ops {
        match op {
            NameOp::Put(r) => {
                let state = NameState::parse(&r.state).unwrap_or(NameState::Retired);
                next.names.insert(
                    r.name.clone(),
                    NameRecord {
                        state,
                        replacement: r.replacement.clone(),
                        since: r.since_date.clone(),
                        sunset: r.sunset_date.clone(),
                        updated_us: 0,
                        updated_by: r.updated_by.clone(),
                    },
                );
            }
            NameOp::Delete { name } => {
                next.names.remove(name);
            }
            NameOp::Role { role, model, .. } => {
                next.roles.insert(role.clone(), if model.is_empty() { None } else { Some(model.clone()) });
            }
            NameOp::RoleReset { .. } | NameOp::Marker { .. } => {}
        }
    }
    next
}

fn callers_effect(ctx: &Ctx<'_>, name: &str, what: &str) -> String {
    let c = ctx.callers;
    if c.calls == 0 {
        format!("{}; {what}", c.summary())
    } else {
        format!("{}: {what}; tell {} to use the new name{}", c.summary(), c.users.join(", "), env_hint(ctx.inner, name))
    }
}

/// The name callers of `target` should be sent to: `target` must be served and current.
fn check_target(ctx: &Ctx<'_>, old: &str, target: &str) -> Result<String, LifecycleError> {
    validate_name(target)?;
    match current(ctx, target) {
        Current::Registry(rec) => match rec.state {
            NameState::Active => served_model(ctx.catalog, ctx.inner, target).ok_or_else(|| {
                LifecycleError::Invalid(format!(
                    "`{target}` points at `{}`, which is not served; pick a served name",
                    rec.replacement.unwrap_or_default()
                ))
            }),
            NameState::Deprecated | NameState::Retired if rec.replacement.as_deref() == Some(old) => Err(LifecycleError::Invalid(format!(
                "renaming `{old}` to `{target}` would make a cycle: `{target}` was itself renamed to `{old}`{}; to undo that rename, run `gpuhub names restore {target}`",
                rec.since.map(|d| format!(" on {d}")).unwrap_or_default()
            ))),
            NameState::Deprecated => Err(LifecycleError::Invalid(format!(
                "`{target}` is deprecated itself (renamed to `{}`); rename `{old}` to the current name `{}` instead",
                rec.replacement.clone().unwrap_or_default(),
                rec.replacement.unwrap_or_default()
            ))),
            NameState::Retired => Err(LifecycleError::Invalid(format!(
                "`{target}` is retired; a rename target must be a name served now (see `gpuhub names list`)"
            ))),
        },
        Current::Model | Current::Alias { .. } => {
            served_model(ctx.catalog, ctx.inner, target).ok_or_else(|| LifecycleError::Invalid(format!("`{target}` is not served")))
        }
        Current::Role => {
            Err(LifecycleError::Invalid(format!("`{target}` is a role, not a model name; rename to the role's model (see `gpuhub roles`)")))
        }
        Current::Unknown => Err(LifecycleError::Invalid(format!(
            "`{target}` is not served here{}; serve it first ({SERVE_FIRST}), then rename",
            suggestions(ctx, target)
        ))),
    }
}

/// `gpuhub names rename OLD NEW [--sunset DATE]`: OLD becomes a deprecated name of NEW,
/// still served; roles and names that pointed at OLD move to NEW.
pub fn plan_rename(ctx: &Ctx<'_>, old: &str, new: &str, sunset: Option<&str>, action: &'static str) -> Result<Plan, LifecycleError> {
    validate_name(old)?;
    validate_name(new)?;
    if old == new {
        return Err(LifecycleError::Invalid(format!("`{old}` and `{new}` are the same name; nothing to rename")));
    }
    if let Some(s) = sunset {
        validate_sunset(s, ctx.today, old)?;
    }
    let new_model = check_target(ctx, old, new)?;
    let cur = current(ctx, old);
    let (from_state, from_target) = state_label(&cur);
    let mut plan = Plan {
        action,
        name: old.to_string(),
        from_state,
        to_state: "deprecated".into(),
        from_target,
        to_target: Some(new.to_string()),
        sunset: sunset.map(str::to_string),
        effects: Vec::new(),
        warnings: Vec::new(),
        needs_force: Vec::new(),
        roles_changed: Vec::new(),
        ops: Vec::new(),
        history: Vec::new(),
    };
    let mut since = ctx.today.to_string();
    match &cur {
        Current::Role => {
            return Err(LifecycleError::Invalid(format!("`{old}` is a role; change its model with `gpuhub roles set {old} MODEL`")));
        }
        Current::Registry(rec) if rec.state == NameState::Deprecated && rec.replacement.as_deref() == Some(new) => {
            if rec.sunset.as_deref() == sunset || sunset.is_none() {
                return Err(LifecycleError::Invalid(format!(
                    "`{old}` is already renamed to `{new}`{}; nothing to do (to change the sunset, pass --sunset DATE)",
                    rec.sunset.as_ref().map(|s| format!(" (sunset {s})")).unwrap_or_default()
                )));
            }
            since = rec.since.clone().unwrap_or(since);
            plan.effects.push(format!(
                "the sunset of `{old}` moves from {} to {}",
                rec.sunset.as_deref().unwrap_or("none"),
                sunset.unwrap_or("none")
            ));
        }
        Current::Registry(rec) if rec.state == NameState::Retired => {
            plan.warnings.push(format!(
                "`{old}` is retired now; after this its callers are served again (as `{new_model}`) with deprecation headers"
            ));
        }
        Current::Unknown => {
            if ctx.callers.calls == 0 {
                plan.needs_force.push(format!(
                    "`{old}` is not a name this node knows and nobody called it in the window{}; --force registers it anyway",
                    suggestions(ctx, old)
                ));
            } else {
                plan.effects.push(format!(
                    "`{old}` is not served now: {} calls got a 404; after this they are served by `{new_model}`",
                    ctx.callers.calls
                ));
            }
        }
        Current::Registry(_) | Current::Model | Current::Alias { .. } => {
            if let Some(old_model) = served_model(ctx.catalog, ctx.inner, old)
                && old_model != new_model
            {
                plan.needs_force.push(format!(
                    "`{new}` already exists and serves model `{new_model}`, but `{old}` serves `{old_model}`: a rename keeps the model and changes its name; with --force, callers of `{old}` get `{new_model}` instead"
                ));
            }
        }
    }
    if sunset.is_none() {
        plan.warnings.push(format!("no --sunset: callers get a Deprecation header without a date; add one later with `gpuhub names rename {old} {new} --sunset YYYY-MM-DD`"));
    }
    plan.ops.push(NameOp::Put(row(ctx, old, NameState::Deprecated, Some(new.to_string()), Some(since), sunset.map(str::to_string))));
    plan.history.push(history(
        ctx,
        action,
        old,
        (Some(plan.from_state.clone()), plan.from_target.clone()),
        (Some("deprecated".into()), Some(new.to_string())),
        sunset.map(str::to_string),
        String::new(),
    ));
    // Names that pointed at OLD follow it, so there are no chains a -> b -> c.
    for (other, rec) in &ctx.inner.names {
        if other != old && rec.replacement.as_deref() == Some(old) {
            plan.ops.push(NameOp::Put(row(ctx, other, rec.state, Some(new.to_string()), rec.since.clone(), rec.sunset.clone())));
            plan.history.push(history(
                ctx,
                "repoint",
                other,
                (Some(rec.state.as_str().into()), Some(old.to_string())),
                (Some(rec.state.as_str().into()), Some(new.to_string())),
                rec.sunset.clone(),
                format!("follows the rename of `{old}`"),
            ));
            plan.effects.push(format!("`{other}` ({}) pointed at `{old}`; it now points at `{new}`", rec.state.as_str()));
        }
    }
    // Roles that named OLD move to NEW: jobs started from now on get the new name.
    for (role, model) in &ctx.inner.roles {
        if model.as_deref() == Some(old) {
            move_role(&mut plan, ctx, role, old, new, format!("follows the rename of `{old}`"));
        }
    }
    let next = after(ctx.inner, &plan.ops);
    plan.effects.insert(0, format!("calls to `{old}` keep working: {}", preview(ctx, &next, old)));
    plan.effects.push(callers_effect(ctx, old, "they keep working until the name is retired"));
    Ok(plan)
}

/// `gpuhub names deprecate NAME [--replacement NEW] [--sunset DATE]`: a rename to the given
/// replacement, or to the model NAME is an alias of.
pub fn plan_deprecate(ctx: &Ctx<'_>, name: &str, replacement: Option<&str>, sunset: Option<&str>) -> Result<Plan, LifecycleError> {
    validate_name(name)?;
    let target = match replacement {
        Some(r) => r.to_string(),
        None => match current(ctx, name) {
            Current::Registry(rec) if rec.state != NameState::Retired => rec.replacement.clone().ok_or_else(|| {
                LifecycleError::Invalid(format!(
                    "`{name}` has no replacement on record; say which name callers should move to with --replacement NAME"
                ))
            })?,
            Current::Registry(_) => {
                return Err(LifecycleError::Invalid(format!("`{name}` is retired; `gpuhub names restore {name}` first, or rename it")));
            }
            Current::Alias { of } => of,
            Current::Model => {
                return Err(LifecycleError::Invalid(format!(
                    "`{name}` is a model's own name; say which name callers should move to with --replacement NAME, or retire it"
                )));
            }
            Current::Role => {
                return Err(LifecycleError::Invalid(format!("`{name}` is a role; change its model with `gpuhub roles set {name} MODEL`")));
            }
            Current::Unknown => return Err(LifecycleError::NotFound(format!("`{name}` is not a known name{}", suggestions(ctx, name)))),
        },
    };
    plan_rename(ctx, name, &target, sunset, "deprecate")
}

/// `gpuhub names retire NAME`: the name stops being served; its callers get the
/// self-explaining error. Needs `--force` while it has callers in the window or before its
/// announced sunset.
pub fn plan_retire(ctx: &Ctx<'_>, name: &str) -> Result<Plan, LifecycleError> {
    validate_name(name)?;
    let cur = current(ctx, name);
    let (from_state, from_target) = state_label(&cur);
    let (replacement, since, sunset) = match &cur {
        Current::Registry(rec) if rec.state == NameState::Retired => {
            return Err(LifecycleError::Invalid(format!(
                "`{name}` is already retired{}; nothing to do",
                rec.since.as_ref().map(|d| format!(" (renamed on {d})")).unwrap_or_default()
            )));
        }
        Current::Registry(rec) => (rec.replacement.clone(), rec.since.clone(), rec.sunset.clone()),
        Current::Alias { of } => (Some(of.clone()), None, None),
        Current::Model => (None, None, None),
        Current::Role => {
            return Err(LifecycleError::Invalid(format!(
                "`{name}` is a role; to leave it without a model, run `gpuhub roles unset {name}`"
            )));
        }
        Current::Unknown => return Err(LifecycleError::NotFound(format!("`{name}` is not a known name{}", suggestions(ctx, name)))),
    };
    let mut plan = Plan {
        action: "retire",
        name: name.to_string(),
        from_state,
        to_state: "retired".into(),
        from_target,
        to_target: replacement.clone(),
        sunset: sunset.clone(),
        effects: Vec::new(),
        warnings: Vec::new(),
        needs_force: Vec::new(),
        roles_changed: Vec::new(),
        ops: Vec::new(),
        history: Vec::new(),
    };
    if ctx.callers.calls > 0 {
        plan.needs_force.push(format!(
            "{}; retiring it now breaks them: tell {} to use {}, wait until they stop, or pass --force",
            ctx.callers.summary(),
            ctx.callers.users.join(", "),
            replacement.as_ref().map(|r| format!("`{r}`")).unwrap_or_else(|| "another model".into())
        ));
    }
    if let Some(s) = &sunset
        && days_from_civil(s) > days_from_civil(ctx.today)
    {
        plan.needs_force.push(format!("the announced sunset of `{name}` is {s}; retiring it before then breaks the promise its Sunset header made (--force to retire early)"));
    }
    if matches!(cur, Current::Model) {
        plan.warnings.push(format!("`{name}` is a catalog model's own name: the model stays configured but cannot be called as `{name}`"));
    }
    let since = since.unwrap_or_else(|| ctx.today.to_string());
    plan.ops.push(NameOp::Put(row(ctx, name, NameState::Retired, replacement.clone(), Some(since), sunset.clone())));
    plan.history.push(history(
        ctx,
        "retire",
        name,
        (Some(plan.from_state.clone()), plan.from_target.clone()),
        (Some("retired".into()), replacement.clone()),
        sunset,
        String::new(),
    ));
    // No job may get a <ROLE>_MODEL that is refused.
    for (role, model) in &ctx.inner.roles {
        if model.as_deref() != Some(name) {
            continue;
        }
        match &replacement {
            Some(r) => move_role(&mut plan, ctx, role, name, r, format!("follows the retirement of `{name}`")),
            None => {
                return Err(LifecycleError::Invalid(format!(
                    "role `{role}` still points at `{name}`; move it first (`gpuhub roles set {role} MODEL`, or `gpuhub roles unset {role}`) so no job gets a name that is refused"
                )));
            }
        }
    }
    let next = after(ctx.inner, &plan.ops);
    plan.effects.insert(0, format!("calls to `{name}` get {}", preview(ctx, &next, name)));
    Ok(plan)
}

/// `gpuhub names restore NAME`: undoes a deprecation or retirement; the name is served again
/// without deprecation headers (as the catalog says, or as an alias of its replacement).
pub fn plan_restore(ctx: &Ctx<'_>, name: &str) -> Result<Plan, LifecycleError> {
    validate_name(name)?;
    let rec = match current(ctx, name) {
        Current::Registry(rec) => rec,
        Current::Model | Current::Alias { .. } | Current::Role => {
            return Err(LifecycleError::Invalid(format!("`{name}` is active; nothing to restore")));
        }
        Current::Unknown => return Err(LifecycleError::NotFound(format!("`{name}` is not a known name{}", suggestions(ctx, name)))),
    };
    if rec.state == NameState::Active {
        return Err(LifecycleError::Invalid(format!(
            "`{name}` is active (an alias of `{}`); nothing to restore",
            rec.replacement.unwrap_or_default()
        )));
    }
    let in_catalog = ctx.catalog.get(name).is_some();
    let mut plan = Plan {
        action: "restore",
        name: name.to_string(),
        from_state: rec.state.as_str().into(),
        to_state: "active".into(),
        from_target: rec.replacement.clone(),
        to_target: if in_catalog { None } else { rec.replacement.clone() },
        sunset: None,
        effects: Vec::new(),
        warnings: Vec::new(),
        needs_force: Vec::new(),
        roles_changed: Vec::new(),
        ops: Vec::new(),
        history: Vec::new(),
    };
    if in_catalog {
        plan.ops.push(NameOp::Delete { name: name.to_string() });
    } else {
        let target = rec.replacement.clone().ok_or_else(|| {
            LifecycleError::Invalid(format!("`{name}` has no replacement on record, so nothing would serve it; rename it to a served name instead: `gpuhub names rename {name} MODEL`"))
        })?;
        if served_model(ctx.catalog, ctx.inner, &target).is_none() {
            return Err(LifecycleError::Invalid(format!(
                "`{name}` pointed at `{target}`, which is not served any more; rename it to a served name instead: `gpuhub names rename {name} MODEL`"
            )));
        }
        plan.ops.push(NameOp::Put(row(ctx, name, NameState::Active, Some(target), None, None)));
    }
    plan.history.push(history(
        ctx,
        "restore",
        name,
        (Some(plan.from_state.clone()), rec.replacement.clone()),
        (Some("active".into()), plan.to_target.clone()),
        None,
        String::new(),
    ));
    let next = after(ctx.inner, &plan.ops);
    plan.effects.push(format!("calls to `{name}` are {} without deprecation headers", preview(ctx, &next, name)));
    plan.effects.push("roles are not changed (`gpuhub roles set ROLE MODEL` moves one)".into());
    Ok(plan)
}

/// How a model name comes to be served, for the refusals of a rename or role change to it.
const SERVE_FIRST: &str = "a [[models]] entry or alias of that name in agent.toml, then `gpuhub models reload`; or, with [mlflow] registry_poll_s, a registered model tagged served_by=gateway with gpuhub.name";

/// `gpuhub roles set ROLE MODEL` / `gpuhub roles unset ROLE` (`model = None`).
pub fn plan_role(ctx: &Ctx<'_>, role: &str, model: Option<&str>) -> Result<Plan, LifecycleError> {
    let Some(var) = gpuhub_wire::snapshot::role_env_var(role) else {
        return Err(LifecycleError::Invalid(format!(
            "role `{}` must be 1-64 letters, digits, - or _, starting with a letter (it becomes <ROLE>_MODEL)",
            role.escape_debug()
        )));
    };
    let old = ctx.inner.roles.get(role).cloned();
    if let Some(m) = model {
        validate_name(m)?;
        if ctx.inner.roles.contains_key(m) && ctx.catalog.get(m).is_none() && !ctx.inner.names.contains_key(m) {
            return Err(LifecycleError::Invalid(format!("`{m}` is a role, not a model name; assign a model (see `gpuhub names list`)")));
        }
        match resolve_in(ctx.catalog, ctx.inner, m) {
            Resolution::Active { .. } => {}
            Resolution::Deprecated { .. } => {
                let rep = ctx.inner.names.get(m).and_then(|r| r.replacement.clone()).unwrap_or_default();
                return Err(LifecycleError::Invalid(format!("`{m}` is deprecated (renamed to `{rep}`); assign `{rep}`")));
            }
            Resolution::Retired { .. } => {
                return Err(LifecycleError::Invalid(format!("`{m}` is retired; assign a served model (see `gpuhub names list`)")));
            }
            Resolution::RoleUnassigned { .. } | Resolution::RoleUnserved { .. } | Resolution::Unknown { .. } => {
                return Err(LifecycleError::Invalid(format!(
                    "`{m}` is not served here{}; serve it first ({SERVE_FIRST}), then assign it",
                    suggestions(ctx, m)
                )));
            }
        }
    }
    if old.as_ref().map(|o| o.as_deref()) == Some(model) {
        return Err(LifecycleError::Invalid(match model {
            Some(m) => format!("role `{role}` is already `{m}`; nothing to do"),
            None => format!("role `{role}` has no model already; nothing to do"),
        }));
    }
    let old_model = old.clone().flatten();
    let mut plan = Plan {
        action: if model.is_some() { "role-set" } else { "role-unset" },
        name: role.to_string(),
        from_state: match &old {
            None => "new".into(),
            Some(None) => "unassigned".into(),
            Some(Some(_)) => "assigned".into(),
        },
        to_state: if model.is_some() { "assigned".into() } else { "unassigned".into() },
        from_target: old_model.clone(),
        to_target: model.map(str::to_string),
        sunset: None,
        effects: Vec::new(),
        warnings: Vec::new(),
        needs_force: Vec::new(),
        roles_changed: vec![role.to_string()],
        ops: vec![NameOp::Role { role: role.to_string(), model: model.unwrap_or("").to_string(), by: ctx.actor.to_string() }],
        history: Vec::new(),
    };
    plan.history.push(history(ctx, plan.action, role, (None, old_model.clone()), (None, model.map(str::to_string)), None, String::new()));
    match model {
        Some(m) => plan.effects.push(format!(
            "jobs started from now on get {var}={m}; running jobs keep their environment; services outside Slurm: re-run `gpuhub env`"
        )),
        None => {
            plan.effects.push(format!("jobs started from now on get no {var}; calls to `{role}` get HTTP 503 role_unassigned"));
            if let Some(o) = &old_model {
                plan.effects.push(format!("`{o}` itself stays served (retire it with `gpuhub names retire {o}`)"));
            }
        }
    }
    if old.is_none() {
        plan.warnings.push(format!("`{role}` is a new role"));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::Config;
    use crate::names::NameRegistry;
    use crate::store::names::CallerRow;

    fn setup() -> (Arc<Catalog>, Inner) {
        let cfg = Config::from_toml(crate::names::tests::LAB).unwrap();
        let cat = Arc::new(Catalog::from_config(&cfg.file));
        let reg = NameRegistry::new(cat.clone(), &cfg.file.names);
        (cat, reg.view())
    }

    fn no_callers(name: &str) -> CallersReport {
        CallersReport::build(name, 0, vec![], 10)
    }

    fn some_callers(name: &str) -> CallersReport {
        let c = CallerRow {
            user_name: "alice".into(),
            app: "ocr-app".into(),
            job_id: String::new(),
            client_addr: "127.0.0.1".into(),
            user_agent: "curl".into(),
            calls: 5,
            refused: 0,
            first_us: 1,
            last_us: 2,
        };
        CallersReport::build(name, 0, vec![c], 10)
    }

    fn ctx<'a>(cat: &'a Catalog, inner: &'a Inner, callers: &'a CallersReport) -> Ctx<'a> {
        Ctx { catalog: cat, inner, today: "2026-11-30", actor: "root", callers, retired_status: 404 }
    }

    fn apply(inner: &Inner, plan: &Plan) -> Inner {
        after(inner, &plan.ops)
    }

    #[test]
    fn odd_names_are_refused_with_the_character() {
        for (bad, want) in [
            ("svc ocr", "a space"),
            ("svc\tocr", "control character"),
            ("dоts.ocr", "not ASCII"), // Cyrillic о
            ("-x", "start with a letter"),
            ("a//b", "empty path part"),
            ("", "empty"),
            ("x\"y", "`\"`"),
        ] {
            let err = validate_name(bad).unwrap_err().to_string();
            assert!(err.contains(want), "{bad:?}: {err}");
        }
        assert!(validate_name(&"a".repeat(129)).unwrap_err().to_string().contains("limit is 128"));
        for good in ["dots.ocr", "Qwen/Qwen3-8B", "svc-ocr", "m:v1", "a_b"] {
            validate_name(good).unwrap();
        }
    }

    #[test]
    fn sunsets_must_be_future_dates() {
        let past = validate_sunset("2020-01-01", "2026-11-30", "svc-ocr").unwrap_err().to_string();
        assert!(past.contains("not in the future") && past.contains("gpuhub names retire svc-ocr"), "{past}");
        assert!(validate_sunset("2026-11-30", "2026-11-30", "x").is_err(), "today is not in the future");
        assert!(validate_sunset("31/12/2026", "2026-11-30", "x").unwrap_err().to_string().contains("use YYYY-MM-DD"));
        assert!(validate_sunset("2026-02-30", "2026-01-01", "x").is_err());
        validate_sunset("2026-12-01", "2026-11-30", "x").unwrap();
    }

    #[test]
    fn the_incident_rename_moves_roles_and_keeps_serving() {
        let (cat, mut inner) = setup();
        // Before the rename: svc-ocr is a served alias and the OCR role names it.
        inner.names.insert(
            "svc-ocr".into(),
            NameRecord {
                state: NameState::Active,
                replacement: Some("dots.ocr".into()),
                since: None,
                sunset: None,
                updated_us: 0,
                updated_by: "x".into(),
            },
        );
        inner.roles.insert("ocr".into(), Some("svc-ocr".into()));
        let callers = some_callers("svc-ocr");
        let c = ctx(&cat, &inner, &callers);
        let plan = plan_rename(&c, "svc-ocr", "dots.ocr", Some("2026-12-31"), "rename").unwrap();
        assert!(plan.needs_force.is_empty(), "{:?}", plan.needs_force);
        assert_eq!(plan.roles_changed, vec!["ocr"]);
        let text = plan.effects.join("\n");
        assert!(text.contains("OCR_MODEL=dots.ocr"), "{text}");
        assert!(text.contains("alice/ocr-app"), "{text}");
        assert!(text.contains("Sunset (2026-12-31)"), "{text}");
        let next = apply(&inner, &plan);
        assert_eq!(
            resolve_in(&cat, &next, "svc-ocr"),
            Resolution::Deprecated { model: "dots.ocr".into(), since: Some("2026-11-30".into()), sunset: Some("2026-12-31".into()) }
        );
        assert_eq!(next.roles["ocr"].as_deref(), Some("dots.ocr"));
        assert_eq!(plan.history.len(), 2);
        assert_eq!(
            (plan.history[0].actor.as_str(), plan.history[0].from_state.as_deref(), plan.history[0].to_state.as_deref()),
            ("root", Some("active"), Some("deprecated"))
        );
    }

    #[test]
    fn cycles_chains_and_missing_targets_are_refused() {
        let (cat, inner) = setup();
        let callers = no_callers("x");
        let c = ctx(&cat, &inner, &callers);
        // svc-ocr -> dots.ocr exists; dots.ocr -> svc-ocr would be a cycle.
        let err = plan_rename(&c, "dots.ocr", "svc-ocr", None, "rename").unwrap_err().to_string();
        assert!(err.contains("cycle") && err.contains("gpuhub names restore svc-ocr"), "{err}");
        let err = plan_rename(&c, "demo-chat", "nope-model", None, "rename").unwrap_err().to_string();
        assert!(err.contains("not served here") && err.contains("[[models]]"), "{err}");
        let err = plan_rename(&c, "dots.ocr", "dots.ocr", None, "rename").unwrap_err().to_string();
        assert!(err.contains("same name"), "{err}");
        let err = plan_rename(&c, "svc-ocr", "dots.ocr", None, "rename").unwrap_err().to_string();
        assert!(err.contains("already renamed"), "{err}");
        let err = plan_rename(&c, "ocr", "dots.ocr", None, "rename").unwrap_err().to_string();
        assert!(err.contains("is a role"), "{err}");
        let err = plan_rename(&c, "x", "ocr", None, "rename").unwrap_err().to_string();
        assert!(err.contains("is a role"), "{err}");
    }

    #[test]
    fn renaming_onto_a_name_of_another_model_needs_force() {
        let (cat, inner) = setup();
        let callers = some_callers("chat-latest");
        let c = ctx(&cat, &inner, &callers);
        let plan = plan_rename(&c, "chat-latest", "dots.ocr", None, "rename").unwrap();
        assert!(plan.needs_force.iter().any(|r| r.contains("already exists and serves model `dots.ocr`")), "{:?}", plan.needs_force);
    }

    #[test]
    fn chains_are_flattened_when_the_target_is_renamed() {
        let (cat, mut inner) = setup();
        // chat-latest is an alias of demo-chat; a registry name old-chat -> chat-latest.
        inner.names.insert(
            "old-chat".into(),
            NameRecord {
                state: NameState::Deprecated,
                replacement: Some("chat-latest".into()),
                since: None,
                sunset: None,
                updated_us: 0,
                updated_by: "x".into(),
            },
        );
        let callers = no_callers("chat-latest");
        let c = ctx(&cat, &inner, &callers);
        let plan = plan_rename(&c, "chat-latest", "demo-chat", None, "rename").unwrap();
        let next = apply(&inner, &plan);
        assert_eq!(next.names["old-chat"].replacement.as_deref(), Some("demo-chat"));
        assert!(plan.history.iter().any(|h| h.action == "repoint" && h.subject == "old-chat"));
    }

    #[test]
    fn unknown_old_names_need_callers_or_force() {
        let (cat, inner) = setup();
        let none = no_callers("svc-ocrr");
        let plan = plan_rename(&ctx(&cat, &inner, &none), "svc-ocrr", "dots.ocr", None, "rename").unwrap();
        assert!(plan.needs_force.iter().any(|r| r.contains("did you mean `svc-ocr`")), "{:?}", plan.needs_force);
        // A name that vanished from the catalog while apps still call it: map it back.
        let some = some_callers("svc-tts");
        let plan = plan_rename(&ctx(&cat, &inner, &some), "svc-tts", "demo-chat", None, "rename").unwrap();
        assert!(plan.needs_force.is_empty());
        assert!(plan.effects.iter().any(|e| e.contains("got a 404")), "{:?}", plan.effects);
    }

    #[test]
    fn retire_needs_force_with_callers_or_before_sunset_and_previews_the_error() {
        let (cat, inner) = setup();
        let callers = some_callers("svc-ocr");
        let plan = plan_retire(&ctx(&cat, &inner, &callers), "svc-ocr").unwrap();
        assert_eq!(plan.needs_force.len(), 2, "{:?}", plan.needs_force);
        assert!(plan.needs_force[0].contains("alice"), "{:?}", plan.needs_force);
        assert!(plan.needs_force[1].contains("2026-12-31"), "{:?}", plan.needs_force);
        assert!(
            plan.effects[0].contains(
                "HTTP 404 model_not_found: \"model `svc-ocr` was renamed to `dots.ocr` on 2026-06-17; set OCR_MODEL or use `dots.ocr`\""
            ),
            "{}",
            plan.effects[0]
        );
        let none = no_callers("svc-ocr");
        let c = Ctx { today: "2027-01-01", ..ctx(&cat, &inner, &none) };
        assert!(plan_retire(&c, "svc-ocr").unwrap().needs_force.is_empty());
        assert!(plan_retire(&c, "nope").unwrap_err().to_string().contains("not a known name"));
    }

    #[test]
    fn retire_moves_roles_or_refuses() {
        let (cat, mut inner) = setup();
        let none = no_callers("x");
        inner.roles.insert("chat".into(), Some("chat-latest".into()));
        let plan = plan_retire(&ctx(&cat, &inner, &none), "chat-latest").unwrap();
        assert_eq!(apply(&inner, &plan).roles["chat"].as_deref(), Some("demo-chat"));
        inner.roles.insert("chat".into(), Some("demo-chat".into()));
        let err = plan_retire(&ctx(&cat, &inner, &none), "demo-chat").unwrap_err().to_string();
        assert!(err.contains("role `chat` still points at `demo-chat`"), "{err}");
    }

    #[test]
    fn restore_undoes_and_then_refuses() {
        let (cat, inner) = setup();
        let none = no_callers("x");
        let c = ctx(&cat, &inner, &none);
        let plan = plan_restore(&c, "svc-ocr").unwrap();
        let next = apply(&inner, &plan);
        assert_eq!(resolve_in(&cat, &next, "svc-ocr"), Resolution::Active { model: "dots.ocr".into() });
        let c2 = ctx(&cat, &next, &none);
        assert!(plan_restore(&c2, "svc-ocr").unwrap_err().to_string().contains("nothing to restore"));
        assert!(plan_restore(&c2, "dots.ocr").unwrap_err().to_string().contains("nothing to restore"));
        // Restore a catalog alias that was retired: the registry row goes away.
        let r = plan_retire(&c2, "chat-latest").unwrap();
        let retired = apply(&next, &r);
        let p = plan_restore(&ctx(&cat, &retired, &none), "chat-latest").unwrap();
        assert!(matches!(p.ops[0], NameOp::Delete { .. }));
    }

    #[test]
    fn roles_take_served_current_names_only() {
        let (cat, inner) = setup();
        let none = no_callers("x");
        let c = ctx(&cat, &inner, &none);
        let p = plan_role(&c, "tts", Some("demo-chat")).unwrap();
        assert!(p.effects[0].contains("TTS_MODEL=demo-chat"), "{:?}", p.effects);
        assert!(
            plan_role(&c, "ocr", Some("svc-ocr"))
                .unwrap_err()
                .to_string()
                .contains("deprecated (renamed to `dots.ocr`); assign `dots.ocr`")
        );
        let nope = plan_role(&c, "ocr", Some("nope")).unwrap_err().to_string();
        assert!(nope.contains("not served here") && nope.contains("gpuhub models reload") && nope.contains("served_by=gateway"), "{nope}");
        assert!(plan_role(&c, "ocr", Some("dots.ocr")).unwrap_err().to_string().contains("already"));
        assert!(plan_role(&c, "bad role", Some("dots.ocr")).unwrap_err().to_string().contains("must be"));
        let u = plan_role(&c, "ocr", None).unwrap();
        assert!(u.effects[0].contains("503"), "{:?}", u.effects);
        assert!(plan_role(&c, "tts", None).unwrap_err().to_string().contains("no model already"));
    }

    #[test]
    fn deprecate_defaults_to_the_alias_target() {
        let (cat, inner) = setup();
        let none = no_callers("x");
        let c = ctx(&cat, &inner, &none);
        let p = plan_deprecate(&c, "chat-latest", None, Some("2027-01-31")).unwrap();
        assert_eq!(p.to_target.as_deref(), Some("demo-chat"));
        assert!(plan_deprecate(&c, "demo-chat", None, None).unwrap_err().to_string().contains("--replacement"));
    }
}
