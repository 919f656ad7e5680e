//! `affinity`: load-gated prefix affinity in `kv` mode. When set, a request goes to the worker
//! holding its longest cached prefix unless that worker is loaded beyond a margin over the
//! least-loaded candidate; only then does the Dynamo cost decide. The cost alone counts a long
//! conversation's whole prompt as decode load and its queue as prefill load, which can outweigh
//! the history the worker holds and send the next turn where nothing is cached.

use serde::Deserialize;

use super::ConfigError;

/// Compiled `affinity` object.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AffinityConfig {
    /// Affinity applies when the longest device overlap is at least this many blocks. `>= 1`.
    pub min_overlap_blocks: u32,
    /// The max-overlap worker is kept while its predicted prefill work (active prefill tokens
    /// plus this request's uncached tokens there) exceeds the least such work among the
    /// candidates by at most this many tokens.
    pub max_extra_prefill_tokens: u64,
    /// ... and while its in-flight requests exceed the fewest by at most this many.
    pub max_extra_requests: u32,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            min_overlap_blocks: 1,
            max_extra_prefill_tokens: 16_384,
            max_extra_requests: 4,
        }
    }
}

/// Rules serde cannot express.
pub(super) fn check_affinity(c: &AffinityConfig) -> Result<(), ConfigError> {
    if c.min_overlap_blocks == 0 {
        return Err(ConfigError::OutOfRange {
            field: "affinity.min_overlap_blocks".to_string(),
            expected: ">= 1",
            got: "0".to_string(),
        });
    }
    Ok(())
}
