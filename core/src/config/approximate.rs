//! `approximate` and `workers[].kv_mode`: routing without (or ahead of) KV events. The filter
//! records its own decisions as predicted blocks on the chosen worker for `ttl_ms`
//! (`crate::approx`), and text requests without token ids are hashed in fixed byte chunks.

use serde::Deserialize;

use super::ConfigError;

/// Where a worker's cached prefixes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum WorkerKvMode {
    /// KV events only (precise).
    #[serde(rename = "events")]
    Events,
    /// No events expected: the worker is not polled; predicted entries only.
    #[serde(rename = "approximate")]
    Approximate,
    /// Events, with predicted entries bridging the event lag.
    #[serde(rename = "events+approximate")]
    EventsAndApproximate,
}

impl WorkerKvMode {
    pub fn has_events(self) -> bool {
        self != WorkerKvMode::Approximate
    }

    pub fn has_predictions(self) -> bool {
        self != WorkerKvMode::Events
    }
}

/// Compiled `approximate` object. Present (or implied by a worker's `kv_mode`) = the predicted
/// store exists and text requests are routed by text prefix hashing.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApproximateConfig {
    /// How long a routing decision counts as cached blocks on the chosen worker. `>= 1`.
    pub ttl_ms: u64,
    /// Predicted (hash, worker) entries kept per VM; the oldest go first. `>= 1`.
    pub max_blocks: usize,
    /// Blocks recorded per decision (a prompt's leading blocks). `1..=4096`.
    pub max_record_blocks: usize,
    /// Bytes of rendered text per text block; `0` = 4 * `block_size` (about one KV block of
    /// English text).
    pub text_chunk_bytes: usize,
}

impl Default for ApproximateConfig {
    fn default() -> Self {
        ApproximateConfig {
            ttl_ms: 120_000,
            max_blocks: 65_536,
            max_record_blocks: 1024,
            text_chunk_bytes: 0,
        }
    }
}

/// Range checks and the `text_chunk_bytes` default.
pub(super) fn finish(c: &mut ApproximateConfig, block_size: u32) -> Result<(), ConfigError> {
    let range = |field: &str, got: u64, lo: u64, hi: u64, expected: &'static str| {
        if (lo..=hi).contains(&got) {
            Ok(())
        } else {
            Err(ConfigError::OutOfRange {
                field: format!("approximate.{field}"),
                expected,
                got: got.to_string(),
            })
        }
    };
    range("ttl_ms", c.ttl_ms, 1, 86_400_000, "within [1, 86400000]")?;
    range(
        "max_blocks",
        c.max_blocks as u64,
        1,
        1 << 24,
        "within [1, 16777216]",
    )?;
    range(
        "max_record_blocks",
        c.max_record_blocks as u64,
        1,
        4096,
        "within [1, 4096]",
    )?;
    range(
        "text_chunk_bytes",
        c.text_chunk_bytes as u64,
        0,
        65_536,
        "within [0, 65536]",
    )?;
    if c.text_chunk_bytes == 0 {
        c.text_chunk_bytes = 4 * block_size.max(1) as usize;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use crate::config::{Config, WorkerKvMode};

    fn parse(extra: &str, worker_extra: &str) -> Result<Config, String> {
        let json = format!(
            r#"{{{extra} "block_size": 16, "workers": [{{"id": 1, "address": "10.0.0.1:80"{worker_extra}}}]}}"#
        );
        Config::from_json(json.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn on_by_default_through_the_workers_mode_and_off_with_events_only() {
        let c = parse("", "").unwrap();
        assert!(c.approximate.is_some() && c.tokenizer.is_none());
        assert_eq!(c.workers[0].kv_mode, WorkerKvMode::EventsAndApproximate);
        let c = parse("", r#", "kv_mode": "events""#).unwrap();
        assert!(c.approximate.is_none());
        assert_eq!(c.workers[0].kv_mode, WorkerKvMode::Events);
        let c = parse("", r#", "kv_mode": "events+approximate""#).unwrap();
        let a = c.approximate.unwrap();
        assert_eq!((a.ttl_ms, a.text_chunk_bytes), (120_000, 64));
        assert_eq!(c.workers[0].kv_mode, WorkerKvMode::EventsAndApproximate);
        let c = parse(
            r#""approximate": {"ttl_ms": 5, "text_chunk_bytes": 100},"#,
            "",
        )
        .unwrap();
        assert_eq!(c.approximate.unwrap().text_chunk_bytes, 100);
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse("", r#", "kv_mode": "guess""#).unwrap_err();
        assert!(e.contains("workers[0].kv_mode"), "{e}");
        let e = parse(r#""approximate": {"ttl": 5},"#, "").unwrap_err();
        assert!(e.contains("approximate") && e.contains("ttl"), "{e}");
        let e = parse(r#""approximate": {"ttl_ms": 0},"#, "").unwrap_err();
        assert!(e.contains("approximate.ttl_ms"), "{e}");
        let e = parse(r#""tokenizer": {"timeout_ms": 0},"#, "").unwrap_err();
        assert!(e.contains("tokenizer.timeout_ms"), "{e}");
        let e = parse(r#""tokenizer": {"chat_path": "render"},"#, "").unwrap_err();
        assert!(e.contains("tokenizer.chat_path"), "{e}");
        let e = parse(r#""tokenizer": {"clustr": "x"},"#, "").unwrap_err();
        assert!(e.contains("tokenizer") && e.contains("clustr"), "{e}");
        let c = parse(r#""tokenizer": {"address": "10.0.0.9:8000"},"#, "").unwrap();
        assert_eq!(
            c.tokenizer.unwrap().chat_path,
            "/v1/chat/completions/render"
        );
    }
}
