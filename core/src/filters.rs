//! Eligibility filters, applied before scoring in this order:
//!
//! 0. membership: only routable workers (`WorkerConfig::routable`: not a vacant pool entry, not
//!    a host Envoy reports unhealthy while healthy ones exist); none left is `NoWorkers`, a pin
//!    on one is `PinnedWorkerUnknown`;
//! 1. allow-list (`nvext.allowed_worker_ids`; ids the configuration does not know are ignored);
//! 2. pin: worker id (+ DP rank). The worker must exist (`PinnedWorkerUnknown`) and survive the
//!    allow-list; a worker owning several ranks needs an explicit rank (`PinnedRankRequired`);
//! 3. DP-rank bounds: a pinned rank outside `[dp_start, dp_start + dp_size)` is
//!    `PinnedRankInvalid`; a rank without a worker keeps the slots with that rank;
//! 4. model (`workers[].models` empty = any model);
//! 5. required taints (the worker carries all);
//! 6. busy thresholds on the slot's current load (this request not included). Over-threshold
//!    slots are dropped; if none is left the request is rejected (`PinnedWorkerOverloaded` for a
//!    pinned request, else `AllWorkersOverloaded`).
//!
//! Stages 1-5 that empty the candidate set return `NoCompatibleWorker` with the stage as reason.

use crate::config::Config;
use crate::load::{kv_fill, SlotLoad};
use crate::request::{LlmRequest, Pin};
use crate::route_error::{Incompatibility, RouteError};
use crate::types::SlotIdx;

/// Slots (ascending) that may serve `request` with effective pin `pin`.
pub fn eligible_slots(
    config: &Config,
    request: &LlmRequest,
    pin: Pin,
    load: &[SlotLoad],
) -> Result<Vec<SlotIdx>, RouteError> {
    let mut slots = Vec::new();
    eligible_slots_into(config, request, pin, load, &[], &mut slots)?;
    Ok(slots)
}

/// [`eligible_slots`] into `slots` (cleared first), so that the request path reuses one buffer.
pub fn eligible_slots_into(
    config: &Config,
    request: &LlmRequest,
    pin: Pin,
    load: &[SlotLoad],
    kv_usage: &[Option<f64>],
    slots: &mut Vec<SlotIdx>,
) -> Result<(), RouteError> {
    let num_slots = SlotIdx::try_from(config.slots.len()).unwrap_or(SlotIdx::MAX);
    slots.clear();
    slots.extend(0..num_slots);
    let worker_ok = |slots: &mut Vec<SlotIdx>,
                     keep: &dyn Fn(&crate::config::WorkerConfig) -> bool| {
        slots.retain(|s| config.worker_of_slot(*s).is_some_and(keep));
    };

    // 0. Membership: vacant pool entries and hosts Envoy reports unhealthy (while healthy ones
    //    exist) are out. Always true without `membership`.
    // Skipped when it would keep every slot (no vacant or unhealthy entry). One pass over the
    // workers also tells whether any has a model list (stage 4): at 1,000 workers each pass
    // reads every worker's entry.
    let (workers_routable, any_model_list) = config
        .workers
        .iter()
        .fold((true, false), |(routable, models), w| {
            (routable & w.routable, models | !w.models.is_empty())
        });
    let all_routable = workers_routable
        && config
            .slots
            .iter()
            .all(|s| usize::from(s.worker) < config.workers.len());
    if !all_routable {
        worker_ok(slots, &|w| w.routable);
    }
    if slots.is_empty() {
        return Err(RouteError::NoWorkers);
    }

    // 1. Allow-list.
    if let Some(allowed) = &request.allowed_worker_ids {
        worker_ok(slots, &|w| allowed.contains(&w.id));
        if slots.is_empty() {
            return Err(RouteError::NoCompatibleWorker {
                reason: Incompatibility::AllowList {
                    allowed: allowed.clone(),
                },
            });
        }
    }

    // 2 + 3. Pin and DP-rank bounds.
    match (pin.worker_id, pin.dp_rank) {
        (Some(worker_id), rank) => {
            let idx = config
                .worker_index(worker_id)
                .ok_or(RouteError::PinnedWorkerUnknown { worker_id })?;
            let w = config
                .workers
                .get(usize::from(idx))
                .ok_or(RouteError::PinnedWorkerUnknown { worker_id })?;
            if !w.routable {
                return Err(RouteError::PinnedWorkerUnknown { worker_id });
            }
            let slot = match rank {
                Some(dp_rank) => {
                    config
                        .slot_of(idx, dp_rank)
                        .ok_or(RouteError::PinnedRankInvalid {
                            worker_id,
                            dp_rank,
                            dp_start: w.dp_start,
                            dp_size: w.dp_size,
                        })?
                }
                None if w.dp_size == 1 => w.first_slot,
                None => {
                    return Err(RouteError::PinnedRankRequired {
                        worker_id,
                        dp_start: w.dp_start,
                        dp_size: w.dp_size,
                    })
                }
            };
            if !slots.contains(&slot) {
                return Err(RouteError::NoCompatibleWorker {
                    reason: Incompatibility::PinnedOutsideAllowList { worker_id },
                });
            }
            slots.clear();
            slots.push(slot);
        }
        (None, Some(dp_rank)) => {
            slots.retain(|s| config.slot(*s).is_some_and(|sl| sl.dp_rank == dp_rank));
            if slots.is_empty() {
                return Err(RouteError::NoCompatibleWorker {
                    reason: Incompatibility::NoSlotWithRank { dp_rank },
                });
            }
        }
        (None, None) => {}
    }

    // 4. Model.
    // (Skipped when every worker serves every model.)
    if let Some(model) = request.model.as_ref().filter(|_| any_model_list) {
        worker_ok(slots, &|w| w.serves_model(model));
        if slots.is_empty() {
            return Err(RouteError::NoCompatibleWorker {
                reason: Incompatibility::ModelNotServed {
                    model: model.clone(),
                },
            });
        }
    }

    // 5. Required taints.
    if !request.required_taints.is_empty() {
        worker_ok(slots, &|w| {
            request.required_taints.iter().all(|t| w.taints.contains(t))
        });
        if slots.is_empty() {
            return Err(RouteError::NoCompatibleWorker {
                reason: Incompatibility::MissingTaints {
                    taints: request.required_taints.clone(),
                },
            });
        }
    }

    // 6. Busy thresholds.
    let eligible = slots.len();
    let b = &config.busy;
    let any_threshold = b.decode_blocks_fraction.is_some()
        || b.prefill_tokens.is_some()
        || b.prefill_tokens_fraction.is_some();
    if any_threshold {
        slots.retain(|s| !is_busy(config, *s, load, kv_usage));
    }
    if slots.is_empty() {
        return Err(match pin.worker_id {
            Some(worker_id) => RouteError::PinnedWorkerOverloaded { worker_id },
            None => RouteError::AllWorkersOverloaded { eligible },
        });
    }
    Ok(())
}

/// Whether `slot` is over any configured busy threshold (strictly greater than).
/// The KV fill is the larger of the slot's booked decode blocks over its capacity and its
/// engine's reported KV usage (`kv_usage`, per slot; empty without reports).
pub fn is_busy(
    config: &Config,
    slot: SlotIdx,
    load: &[SlotLoad],
    kv_usage: &[Option<f64>],
) -> bool {
    let Some(l) = load.get(usize::from(slot)) else {
        return false;
    };
    let Some(w) = config.worker_of_slot(slot) else {
        return false;
    };
    let b = &config.busy;
    if let (Some(frac), Some(cap)) = (b.decode_blocks_fraction, w.kv_capacity_blocks) {
        let reported = kv_usage.get(usize::from(slot)).copied().flatten();
        if kv_fill(l.decode_blocks, Some(cap), reported) > frac {
            return true;
        }
    }
    if let Some(max) = b.prefill_tokens {
        if l.prefill_tokens > max as f64 {
            return true;
        }
    }
    if let (Some(frac), Some(batch)) = (b.prefill_tokens_fraction, w.max_num_batched_tokens) {
        if l.prefill_tokens / f64::from(batch) > frac {
            return true;
        }
    }
    false
}
