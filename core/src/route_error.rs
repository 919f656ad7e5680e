//! Why a request cannot be routed: [`RouteError`] and the filter stage that left no candidate
//! ([`Incompatibility`]). Shared by `filters` (which raises them) and `router` (which returns them).

use std::fmt;

use crate::text::excerpt;
use crate::types::{DpRank, SlotIdx, WorkerId};

/// Why a request cannot be routed.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteError {
    /// `mode: direct` and the request pins no worker.
    PinRequired,
    /// The pinned worker id is not in the configuration.
    PinnedWorkerUnknown {
        worker_id: WorkerId,
    },
    /// The pinned rank is outside the worker's `[dp_start, dp_start + dp_size)`.
    PinnedRankInvalid {
        worker_id: WorkerId,
        dp_rank: DpRank,
        dp_start: DpRank,
        dp_size: u32,
    },
    /// The pinned worker owns several ranks and the request named none.
    PinnedRankRequired {
        worker_id: WorkerId,
        dp_start: DpRank,
        dp_size: u32,
    },
    PinnedWorkerOverloaded {
        worker_id: WorkerId,
    },
    /// Every slot that passed the other filters is over a busy threshold.
    AllWorkersOverloaded {
        eligible: usize,
    },
    NoCompatibleWorker {
        reason: Incompatibility,
    },
    /// With `membership`: the routed cluster has no host now.
    NoWorkers,
    /// A cost came out NaN/infinite (corrupt load or overlap input).
    NonFiniteCost {
        slot: SlotIdx,
        cost: f64,
    },
}

/// Which filter left no candidate.
#[derive(Clone, Debug, PartialEq)]
pub enum Incompatibility {
    AllowList { allowed: Vec<WorkerId> },
    PinnedOutsideAllowList { worker_id: WorkerId },
    NoSlotWithRank { dp_rank: DpRank },
    ModelNotServed { model: String },
    MissingTaints { taints: Vec<String> },
}

impl RouteError {
    /// HTTP status for the local reply:
    /// * 400 — the request itself is inconsistent with the configuration: no pin in `direct`
    ///   mode, a rank out of range or missing for a multi-rank worker;
    /// * 404 — it names something that does not exist: an unknown worker id, or a model no
    ///   worker serves (as OpenAI answers an unknown model);
    /// * 503 — nothing can take it now: overloaded, or no worker matches the allow-list, rank or
    ///   taints (a fleet/configuration condition, possibly temporary);
    /// * 500 — a non-finite cost (a bug or corrupt state).
    pub fn http_status(&self) -> u32 {
        match self {
            RouteError::PinRequired
            | RouteError::PinnedRankInvalid { .. }
            | RouteError::PinnedRankRequired { .. } => 400,
            RouteError::PinnedWorkerUnknown { .. } => 404,
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::ModelNotServed { .. },
            } => 404,
            RouteError::PinnedWorkerOverloaded { .. }
            | RouteError::AllWorkersOverloaded { .. }
            | RouteError::NoCompatibleWorker { .. }
            | RouteError::NoWorkers => 503,
            RouteError::NonFiniteCost { .. } => 500,
        }
    }

    /// A stable snake_case name for stats (`rejected.<kind>`) and the JSON error `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            RouteError::PinRequired => "pin_required",
            RouteError::PinnedWorkerUnknown { .. } => "pinned_worker_unknown",
            RouteError::PinnedRankInvalid { .. } => "pinned_rank_invalid",
            RouteError::PinnedRankRequired { .. } => "pinned_rank_required",
            RouteError::PinnedWorkerOverloaded { .. } => "pinned_worker_overloaded",
            RouteError::AllWorkersOverloaded { .. } => "all_workers_overloaded",
            RouteError::NoCompatibleWorker { .. } => "no_compatible_worker",
            RouteError::NoWorkers => "no_workers",
            RouteError::NonFiniteCost { .. } => "non_finite_cost",
        }
    }

    /// `Retry-After` seconds for overload rejections (load drains within about a second).
    pub fn retry_after_secs(&self) -> Option<u32> {
        match self {
            RouteError::PinnedWorkerOverloaded { .. }
            | RouteError::AllWorkersOverloaded { .. }
            | RouteError::NoWorkers => Some(1),
            _ => None,
        }
    }
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteError::PinRequired => write!(
                f,
                "routing mode is direct: the request must name a worker (nvext.backend_instance_id or x-worker-instance-id)"
            ),
            RouteError::PinnedWorkerUnknown { worker_id } => {
                write!(f, "pinned worker {worker_id} is not configured")
            }
            RouteError::PinnedRankInvalid {
                worker_id,
                dp_rank,
                dp_start,
                dp_size,
            } => write!(
                f,
                "pinned dp_rank {dp_rank} is outside worker {worker_id}'s ranks [{dp_start}, {})",
                u64::from(*dp_start) + u64::from(*dp_size)
            ),
            RouteError::PinnedRankRequired {
                worker_id,
                dp_start,
                dp_size,
            } => write!(
                f,
                "worker {worker_id} owns {dp_size} DP ranks starting at {dp_start}: pin one with nvext.dp_rank or x-dp-rank"
            ),
            RouteError::PinnedWorkerOverloaded { worker_id } => {
                write!(f, "pinned worker {worker_id} is over its busy thresholds")
            }
            RouteError::AllWorkersOverloaded { eligible } => {
                write!(f, "all {eligible} eligible worker slots are over their busy thresholds")
            }
            RouteError::NoCompatibleWorker { reason } => match reason {
                Incompatibility::AllowList { allowed } => write!(
                    f,
                    "no configured worker is in nvext.allowed_worker_ids {}",
                    list_excerpt(allowed.iter().map(|id| id.to_string()))
                ),
                Incompatibility::PinnedOutsideAllowList { worker_id } => {
                    write!(f, "pinned worker {worker_id} is not in nvext.allowed_worker_ids")
                }
                Incompatibility::NoSlotWithRank { dp_rank } => {
                    write!(f, "no configured worker owns dp_rank {dp_rank}")
                }
                Incompatibility::ModelNotServed { model } => {
                    write!(f, "no eligible worker serves model \"{}\"", excerpt(model, 64))
                }
                Incompatibility::MissingTaints { taints } => write!(
                    f,
                    "no eligible worker carries all required taints {}",
                    list_excerpt(taints.iter().map(|t| format!("{:?}", excerpt(t, 32))))
                ),
            },
            RouteError::NoWorkers => write!(
                f,
                "no worker is available: the routed cluster has no host now (membership)"
            ),
            RouteError::NonFiniteCost { slot, cost } => {
                write!(f, "internal error: cost of slot {slot} is not finite ({cost})")
            }
        }
    }
}

impl std::error::Error for RouteError {}

/// Client-supplied lists in error messages: the first few items and the count, never the whole.
fn list_excerpt(items: impl ExactSizeIterator<Item = String>) -> String {
    const SHOWN: usize = 4;
    let total = items.len();
    let shown: Vec<String> = items.take(SHOWN).collect();
    if total > SHOWN {
        format!("[{}, … {total} in all]", shown.join(", "))
    } else {
        format!("[{}]", shown.join(", "))
    }
}
