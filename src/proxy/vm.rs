//! The per-VM state that the root context owns and request contexts share. Its own module so
//! that `http` and `root` both depend on it rather than on each other. The request path's share
//! of it is [`RoutingState`] (host-independent, `crate::request_path`); the rest is the
//! adapter's: metrics, the event poller, the membership call, the tick's bookkeeping.

use super::metrics::Metrics;
use super::poller::Poller;
use crate::config::Config;
use crate::request_path::RoutingState;
use crate::tick::TickCadence;

/// Everything a VM keeps between requests. Request contexts borrow it briefly; callbacks use
/// `try_borrow_mut` so that a re-entrant host callback can never panic.
pub struct VmState {
    /// What the request path reads and updates (configuration, index replica, load views...).
    pub path: RoutingState,
    pub(super) members_call: Option<MembersCall>,
    pub(super) next_members_poll_ms: u64,
    pub(super) fingerprint: u64,
    pub metrics: Metrics,
    pub(super) poller: Poller,
    /// Full ticks and, on the poller while other routers share the fleet, relay ticks.
    pub(super) cadence: TickCadence,
    /// Per slot, the worker id and the load gauges last recorded for it (only changes are).
    pub slot_gauges: Vec<Option<(u64, [u64; 3])>>,
    pub(super) block_size_warned: Vec<bool>,
    /// This VM's linear memory as last added to the `vm.linear_memory_bytes` gauge.
    pub(super) linear_memory_reported: u64,
    /// Per worker entry, the (id, factor, samples) last recorded as gauges.
    pub(super) timing_published: Vec<Option<(u64, u64, u64)>>,
    /// Per worker entry, its histograms' ids.
    pub(super) histogram_ids: Vec<Option<WorkerHistograms>>,
}

/// The membership admin call in flight (`members`).
#[derive(Clone, Copy, Debug)]
pub struct MembersCall {
    pub token: u32,
    pub deadline_ms: u64,
}

/// Per worker entry, its histograms' ids (named once, not per response).
#[derive(Clone, Copy, Debug)]
pub struct WorkerHistograms {
    pub worker_id: u64,
    pub ttft: Option<u32>,
    pub itl: Option<u32>,
    pub error: Option<u32>,
}

/// The id of worker entry `worker` (0 if there is none).
pub fn worker_id(config: &Config, worker: u16) -> u64 {
    crate::request_path::worker_id(config, usize::from(worker))
}
