//! The OpenAI routes a model may serve through the gateway.
//!
//! Each catalog entry declares its routes by name (`routes = ["chat", "completions"]`, or its
//! template's); the gateway forwards a `/v1/...` call only when the path is one of those
//! routes' paths. Everything else a worker listens on (vLLM's `/v1/load_lora_adapter`,
//! `/tokenize`, speaches' `POST /v1/models/{id}` download, ...) is management, and a caller
//! must never reach it through the gateway: a path that is no route's path is refused before
//! the body is read, a route the model does not declare is refused with the routes it serves.

use serde::{Deserialize, Serialize};

/// One OpenAI route (the names are config values: keep them stable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Route {
    #[serde(rename = "chat")]
    Chat,
    #[serde(rename = "completions")]
    Completions,
    #[serde(rename = "embeddings")]
    Embeddings,
    #[serde(rename = "audio.speech")]
    AudioSpeech,
    #[serde(rename = "audio.transcriptions")]
    AudioTranscriptions,
    #[serde(rename = "audio.translations")]
    AudioTranslations,
    #[serde(rename = "images")]
    Images,
    #[serde(rename = "responses")]
    Responses,
    #[serde(rename = "rerank")]
    Rerank,
    #[serde(rename = "moderations")]
    Moderations,
}

impl Route {
    pub const ALL: [Route; 10] = [
        Route::Chat,
        Route::Completions,
        Route::Embeddings,
        Route::AudioSpeech,
        Route::AudioTranscriptions,
        Route::AudioTranslations,
        Route::Images,
        Route::Responses,
        Route::Rerank,
        Route::Moderations,
    ];

    /// The name used in `routes = [...]`.
    pub fn name(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
            Route::AudioSpeech => "audio.speech",
            Route::AudioTranscriptions => "audio.transcriptions",
            Route::AudioTranslations => "audio.translations",
            Route::Images => "images",
            Route::Responses => "responses",
            Route::Rerank => "rerank",
            Route::Moderations => "moderations",
        }
    }

    /// The gateway paths of this route (all `POST` with a body that names the model).
    pub fn paths(self) -> &'static [&'static str] {
        match self {
            Route::Chat => &["/v1/chat/completions"],
            Route::Completions => &["/v1/completions"],
            Route::Embeddings => &["/v1/embeddings"],
            Route::AudioSpeech => &["/v1/audio/speech"],
            Route::AudioTranscriptions => &["/v1/audio/transcriptions"],
            Route::AudioTranslations => &["/v1/audio/translations"],
            Route::Images => &["/v1/images/generations", "/v1/images/edits", "/v1/images/variations"],
            Route::Responses => &["/v1/responses"],
            Route::Rerank => &["/v1/rerank"],
            Route::Moderations => &["/v1/moderations"],
        }
    }

    /// The route a request path belongs to (`None`: not an inference route).
    pub fn for_path(path: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.paths().contains(&path))
    }

    pub fn parse(name: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Every route name, for error messages.
    pub fn all_names() -> String {
        Route::ALL.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ")
    }
}

/// `routes` as a human list of paths: `/v1/chat/completions, /v1/completions`.
pub fn describe(routes: &[Route]) -> String {
    routes.iter().flat_map(|r| r.paths().iter().copied()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_one_route_and_management_paths_to_none() {
        assert_eq!(Route::for_path("/v1/chat/completions"), Some(Route::Chat));
        assert_eq!(Route::for_path("/v1/images/edits"), Some(Route::Images));
        assert_eq!(Route::for_path("/v1/audio/transcriptions"), Some(Route::AudioTranscriptions));
        for management in
            ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/v1/models/x", "/v1/chat/completions/x", "/health"]
        {
            assert_eq!(Route::for_path(management), None, "{management} must not be an inference route");
        }
        // Every path belongs to exactly one route, and names round-trip.
        let mut seen = std::collections::BTreeSet::new();
        for r in Route::ALL {
            assert_eq!(Route::parse(r.name()), Some(r));
            for p in r.paths() {
                assert!(seen.insert(*p), "{p} listed twice");
                assert_eq!(Route::for_path(p), Some(r));
            }
        }
        assert_eq!(describe(&[Route::Chat, Route::Rerank]), "/v1/chat/completions, /v1/rerank");
    }
}
