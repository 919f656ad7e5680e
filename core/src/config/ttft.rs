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
    /// holds costs the fleet more than the request's own wait. Unset (the default): the number
    /// of requests expected to arrive at the slot while this one waits there (Little's law on
    /// the fleet's requests in flight and their observed lifetime; see [`crate::ttft`]), so
    /// an idle fleet spreads freely and a busy one keeps prefixes where they are. `0..=100`.
    pub compute_weight: Option<f64>,
    /// Balance guard: a slot with more requests in flight than this times the candidates' mean,
    /// plus one, is not chosen (the least loaded always qualifies). A popular prefix is thus
    /// copied to more workers before its holder becomes a hot spot, whatever the predictions
    /// say. 0 turns the guard off; else `1..=100`.
    pub max_load_ratio: f64,
    /// Weight of the request-share term of the adaptive policy: a worker that received more
    /// than its share of this VM's recent requests (the last ~16 per worker, its share weighed
    /// by its learned speed) has its cost multiplied by `1 + weight * excess`, where `excess` is
    /// how far its share is above its fair one (0.3 = 30% above). Requests in flight miss the
    /// sessions that are between turns, whose next turns will land where their history is; this
    /// spreads new sessions before a worker collects more of them than the rest. 0 turns it
    /// off; else `0..=100`.
    pub share_weight: f64,
    /// Learn each worker's timing from the responses (observed against predicted time to first
    /// token, [`crate::learn`]) and scale its predictions by it. On by default.
    pub learn: bool,
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
            compute_weight: None,
            max_load_ratio: 1.3,
            share_weight: 2.0,
            learn: true,
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
    super::check::timing_poly("ttft.decode_step_ms_poly", &c.decode_step_ms_poly)?;
    if c.default_output_tokens == 0 || c.default_output_tokens > MAX_CHUNK_TOKENS {
        return Err(ConfigError::OutOfRange {
            field: "ttft.default_output_tokens".to_string(),
            expected: "within [1, 16777216]",
            got: c.default_output_tokens.to_string(),
        });
    }
    if c.max_load_ratio != 0.0 && !(1.0..=100.0).contains(&c.max_load_ratio) {
        return Err(ConfigError::OutOfRange {
            field: "ttft.max_load_ratio".to_string(),
            expected: "0 (off) or within [1, 100]",
            got: c.max_load_ratio.to_string(),
        });
    }
    if !(0.0..=100.0).contains(&c.share_weight) {
        return Err(ConfigError::OutOfRange {
            field: "ttft.share_weight".to_string(),
            expected: "within [0, 100]",
            got: c.share_weight.to_string(),
        });
    }
    if let Some(w) = c.compute_weight {
        if !(0.0..=MAX_COMPUTE_WEIGHT).contains(&w) {
            return Err(ConfigError::OutOfRange {
                field: "ttft.compute_weight".to_string(),
                expected: "within [0, 100]",
                got: w.to_string(),
            });
        }
    }
    Ok(())
}
