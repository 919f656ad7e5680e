//! `tokenizer`: the engine-side tokenizer service that turns text requests into the engine's
//! exact prompt ids (vLLM's `/v1/chat/completions/render` and `/v1/completions/render`, or
//! `/tokenize`), so that text requests get exact prefix routing.

use serde::Deserialize;

use super::check::url_path;
use super::ConfigError;

/// Compiled `tokenizer` object. Absent = text requests are never sent to a tokenizer.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerConfig {
    /// The Envoy cluster the call goes through.
    pub cluster: String,
    /// `ip:port` (or host) of the tokenizer service, sent as `:authority` and
    /// `x-envoy-original-dst-host` (for an ORIGINAL_DST cluster). Empty = the cluster decides.
    pub address: String,
    /// Path for chat requests (`messages`).
    pub chat_path: String,
    /// Path for completions requests (string `prompt`).
    pub completions_path: String,
    /// Call timeout; the request is routed by the text rule when it passes. `1..=60000`.
    pub timeout_ms: u64,
    /// Rendered prompts kept per VM (a repeated prompt is not tokenized twice). `0` = no cache.
    pub cache_entries: usize,
    /// Total token ids kept per VM in that cache (4 bytes each).
    pub cache_max_tokens: usize,
    /// Larger replies are not read (routed by the text rule).
    pub max_response_bytes: usize,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig {
            cluster: "tokenizer".to_string(),
            address: String::new(),
            chat_path: "/v1/chat/completions/render".to_string(),
            completions_path: "/v1/completions/render".to_string(),
            timeout_ms: 200,
            cache_entries: 4096,
            cache_max_tokens: 1 << 20,
            max_response_bytes: 4 << 20,
        }
    }
}

/// Rules serde cannot express, each error naming its field.
pub(super) fn check_tokenizer(c: &TokenizerConfig) -> Result<(), ConfigError> {
    if c.cluster.is_empty() {
        return Err(ConfigError::Invalid {
            field: "tokenizer.cluster".to_string(),
            detail: "must not be empty".to_string(),
        });
    }
    url_path("tokenizer.chat_path", &c.chat_path)?;
    url_path("tokenizer.completions_path", &c.completions_path)?;
    if !(1..=60_000).contains(&c.timeout_ms) {
        return Err(ConfigError::OutOfRange {
            field: "tokenizer.timeout_ms".to_string(),
            expected: "within [1, 60000]",
            got: c.timeout_ms.to_string(),
        });
    }
    if c.max_response_bytes == 0 || c.max_response_bytes as u64 > super::MAX_BYTES_LIMIT {
        return Err(ConfigError::OutOfRange {
            field: "tokenizer.max_response_bytes".to_string(),
            expected: "within [1, 1 GiB]",
            got: c.max_response_bytes.to_string(),
        });
    }
    Ok(())
}
