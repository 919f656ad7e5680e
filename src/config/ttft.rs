//! `ttft`: the predicted-TTFT policy of `kv` mode. When set, each eligible worker is scored by
//! the time to first token a request would see there (its prefill queue plus the compute of the
//! prompt's uncached tokens, with the prefill-time polynomial `load.prefill_time_ms_poly`, plus the
//! decode steps interleaved with that prefill) instead of the Dynamo cost, and the lowest wins.
//! The Dynamo cost counts a long multi-turn prompt's blocks as decode load wherever it goes; what
//! a request waits for is the prefill work ahead of it and its own uncached tokens.

use serde::Deserialize;

use super::ConfigError;

/// Largest accepted `ttft.chunk_tokens`.
pub const MAX_CHUNK_TOKENS: u32 = 1 << 24;

/// Largest accepted `ttft.compute_weight`.
pub const MAX_COMPUTE_WEIGHT: f64 = 100.0;

/// Compiled `ttft` object.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TtftConfig {
    /// Prefill tokens an engine step computes (chunked prefill), for workers without
    /// `max_num_batched_tokens`. `1..=2^24`.
    pub chunk_tokens: u32,
    /// Decode step time in ms as a polynomial in the worker's decode load as a fraction of its
    /// `kv_capacity_blocks` (0 without one), lowest degree first; added once per prefill step
    /// while the worker has requests in flight. 1..=8 finite coefficients; results clamp at 0.
    pub decode_step_ms_poly: Vec<f64>,
    /// Weight of the request's own prefill compute on the slot (its uncached tokens alone, in
    /// `chunk` steps of `load.prefill_time_ms_poly`), added to the prediction: the requests that
    /// queue behind it there wait for that compute too, so recomputing a prefix another worker
    /// holds costs the fleet more than the request's own wait. 0 (the default) scores the
    /// request's TTFT alone. `0..=100`.
    pub compute_weight: f64,
    /// Adds the predicted wait for KV room to the score ([`crate::ttft`]'s admission term): an
    /// engine admits a prompt only when its cache has free blocks for it, so on a worker whose
    /// cache is full of running requests a prompt waits until they finish and free theirs. Needs
    /// the worker's `kv_capacity_blocks` and its reported KV usage (`load.reported_load` and
    /// events that carry `load`); without them the term is 0.
    pub admission_wait: bool,
    /// Output length assumed for a request that gives none (`max_completion_tokens`,
    /// `max_tokens`, `nvext.agent_hints.osl`), for the admission term: how long running requests
    /// hold their blocks. `1..=2^24`.
    pub default_output_tokens: u32,
}

impl Default for TtftConfig {
    fn default() -> Self {
        TtftConfig {
            chunk_tokens: 8192,
            // Dynamo's mocker: -25.74 u^2 + 54.01 u + 5.74 ms per decode step.
            decode_step_ms_poly: vec![5.74, 54.01, -25.74],
            compute_weight: 0.0,
            admission_wait: false,
            default_output_tokens: 256,
        }
    }
}

/// Rules serde cannot express.
pub(super) fn check_ttft(c: &TtftConfig) -> Result<(), ConfigError> {
    if c.chunk_tokens == 0 || c.chunk_tokens > MAX_CHUNK_TOKENS {
        return Err(ConfigError::OutOfRange {
            field: "ttft.chunk_tokens".to_string(),
            expected: "within [1, 16777216]",
            got: c.chunk_tokens.to_string(),
        });
    }
    super::compile::timing_poly("ttft.decode_step_ms_poly", &c.decode_step_ms_poly)?;
    if c.default_output_tokens == 0 || c.default_output_tokens > MAX_CHUNK_TOKENS {
        return Err(ConfigError::OutOfRange {
            field: "ttft.default_output_tokens".to_string(),
            expected: "within [1, 16777216]",
            got: c.default_output_tokens.to_string(),
        });
    }
    if !(0.0..=MAX_COMPUTE_WEIGHT).contains(&c.compute_weight) {
        return Err(ConfigError::OutOfRange {
            field: "ttft.compute_weight".to_string(),
            expected: "within [0, 100]",
            got: c.compute_weight.to_string(),
        });
    }
    Ok(())
}
