//! A worker's own description of itself (the `worker` object of its event page or dump): DP
//! layout, device, capacity, batch budget, models, timing. With `membership`, a discovered host's
//! description overrides the `membership.worker` template on its pool entry; a static `workers`
//! entry for its address still wins (the description is ignored there).
//!
//! Slots are fixed when the configuration is compiled, so a description whose DP layout
//! (`dp_start`, `dp_size`) differs from the template's is not applied (the rest is); the poller
//! counts and logs it.

use crate::config::{is_timing_poly, WorkerConfig};

/// The description's wire type and bounds, shared with the bridge and the mock.
pub use kv_router_protocol::worker::{WorkerDescription, MAX_MODELS, MAX_MODEL_BYTES};

/// Why (part of) a description was not applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its DP layout differs from the slots the template reserves.
    Layout {
        template: (u32, u32),
        described: (u32, u32),
    },
    /// Its block size differs from the filter's `block_size`.
    BlockSize { expected: u32, got: u32 },
    /// More than [`MAX_MODELS`] models or a name longer than [`MAX_MODEL_BYTES`].
    Models,
    /// A zero capacity or batch budget.
    Zero { field: &'static str },
    /// A timing polynomial without 1 to 8 finite coefficients.
    Polynomial { field: &'static str },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Layout {
                template,
                described,
            } => write!(
                f,
                "DP ranks {}..+{} differ from the {}..+{} the template's slots reserve; keeping the template's",
                described.0, described.1, template.0, template.1
            ),
            Refusal::BlockSize { expected, got } => {
                write!(f, "block_size {got} differs from the filter's {expected}")
            }
            Refusal::Models => write!(
                f,
                "more than {MAX_MODELS} models or a model name over {MAX_MODEL_BYTES} bytes; keeping the template's models"
            ),
            Refusal::Zero { field } => write!(f, "{field} is 0; keeping the template's"),
            Refusal::Polynomial { field } => write!(
                f,
                "{field} is not 1 to 8 finite coefficients; keeping the template's"
            ),
        }
    }
}

/// The part of `described` that may be applied on top of `template` (its pool entry as
/// compiled), and what was refused. The result only holds fields that differ from nothing:
/// applying it with [`apply`] never changes the slot layout.
pub fn vet(
    template: &WorkerConfig,
    block_size: u32,
    described: &WorkerDescription,
) -> (WorkerDescription, Vec<Refusal>) {
    let mut out = described.clone();
    let mut refused = Vec::new();
    if let Some(got) = described.block_size {
        if got != block_size {
            refused.push(Refusal::BlockSize {
                expected: block_size,
                got,
            });
        }
    }
    let layout = (
        described.dp_start.unwrap_or(template.dp_start),
        described.dp_size.unwrap_or(template.dp_size),
    );
    if layout != (template.dp_start, template.dp_size) {
        refused.push(Refusal::Layout {
            template: (template.dp_start, template.dp_size),
            described: layout,
        });
    }
    out.dp_start = None;
    out.dp_size = None;
    if let Some(models) = &described.models {
        if models.len() > MAX_MODELS || models.iter().any(|m| m.len() > MAX_MODEL_BYTES) {
            refused.push(Refusal::Models);
            out.models = None;
        }
    }
    if described.kv_capacity_blocks == Some(0) {
        refused.push(Refusal::Zero {
            field: "kv_capacity_blocks",
        });
        out.kv_capacity_blocks = None;
    }
    if described.max_num_batched_tokens == Some(0) {
        refused.push(Refusal::Zero {
            field: "max_num_batched_tokens",
        });
        out.max_num_batched_tokens = None;
    }
    for (field, poly) in [
        ("prefill_time_ms_poly", &mut out.prefill_time_ms_poly),
        ("decode_step_ms_poly", &mut out.decode_step_ms_poly),
    ] {
        if poly.as_deref().is_some_and(|p| !is_timing_poly(p)) {
            refused.push(Refusal::Polynomial { field });
            *poly = None;
        }
    }
    (out, refused)
}

/// Applies a vetted description to its pool entry.
pub fn apply(worker: &mut WorkerConfig, d: &WorkerDescription) {
    if let Some(device) = d.device {
        worker.device = device;
    }
    if let Some(cap) = d.kv_capacity_blocks {
        worker.kv_capacity_blocks = Some(cap);
    }
    if let Some(batch) = d.max_num_batched_tokens {
        worker.max_num_batched_tokens = Some(batch);
    }
    if let Some(models) = &d.models {
        worker.models = models.clone();
    }
    if let Some(poly) = &d.prefill_time_ms_poly {
        worker.prefill_time_ms_poly = Some(poly.clone());
    }
    if let Some(poly) = &d.decode_step_ms_poly {
        worker.decode_step_ms_poly = Some(poly.clone());
    }
}
