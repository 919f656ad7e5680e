//! `engine_priority`: the filter writes each routed request's scheduling priority into its body
//! (vLLM's `priority` field; the engine started with `--scheduling-policy priority` serves the
//! lowest first, then in arrival order). See [`crate::priority`] for the value.

use serde::Deserialize;

use super::ConfigError;

/// Largest accepted `engine_priority.arrival_weight`.
pub const MAX_ARRIVAL_WEIGHT: f64 = 1000.0;

/// Compiled `engine_priority` object.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnginePriorityConfig {
    /// How much a millisecond of arrival counts against a millisecond of predicted prefill: 0
    /// (the default) orders the engine's waiting queue by predicted prefill alone (shortest
    /// first); 1 by the time each request would finish if served alone on arrival; large values
    /// approach arrival order. `0..=1000`.
    pub arrival_weight: f64,
}

impl Default for EnginePriorityConfig {
    fn default() -> Self {
        EnginePriorityConfig {
            arrival_weight: 0.0,
        }
    }
}

/// Rules serde cannot express.
pub(super) fn check_engine_priority(c: &EnginePriorityConfig) -> Result<(), ConfigError> {
    super::check::f64_in(
        "engine_priority.arrival_weight",
        c.arrival_weight,
        0.0,
        MAX_ARRIVAL_WEIGHT,
        "within [0, 1000]",
    )
}
