//! The per-VM state that the root context owns and request contexts share. Its own module so
//! that `http` and `root` both depend on it rather than on each other.

use super::metrics::Metrics;
use super::poller::Poller;
use crate::approx::PredictedStore;
use crate::config::Config;
use crate::load::{merge_reported, SlotLoad};
use crate::load_store::{PendingReleases, ViewCache};
use crate::render::RenderCache;
use crate::replication::log::Replica;
use crate::router::SelectorState;
use crate::types::Overlap;
use std::rc::Rc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Everything a VM keeps between requests. Request contexts borrow it briefly; callbacks use
/// `try_borrow_mut` so that a re-entrant host callback can never panic.
pub struct VmState {
    /// The effective configuration: `base_config` with the published membership applied
    /// (pool entries' addresses, routability). The same as `base_config` without membership.
    pub config: Rc<Config>,
    /// The configuration as compiled.
    pub base_config: Rc<Config>,
    /// `(members_seen, members_generation)` of the head `config` was built from.
    pub(super) members_applied: (bool, u64),
    pub(super) members_call: Option<super::members::MembersCall>,
    pub(super) next_members_poll_ms: u64,
    pub(super) fingerprint: u64,
    pub nonce: u64,
    pub replica: Replica,
    pub selector: SelectorState,
    pub metrics: Metrics,
    pub(super) poller: Poller,
    pub(super) next_request_key: u64,
    /// Reused per request so that overlap lookup allocates nothing.
    pub overlaps: Vec<Overlap>,
    /// Reused per request: the load table's per-slot view.
    pub load_view: Vec<SlotLoad>,
    /// Per slot, its worker's reported KV usage (filled for `ttft.admission_wait` only).
    pub kv_usage: Vec<Option<f64>>,
    /// The load shards this VM viewed last, reused while their bytes are unchanged.
    pub load_views: ViewCache,
    /// Per slot, the worker id and the load gauges last recorded for it (only changes are).
    pub slot_gauges: Vec<Option<(u64, [u64; 3])>>,
    pub(super) block_size_warned: Vec<bool>,
    /// Stale flags per slot, from the poller's last published head (refreshed on each sync).
    pub stale_slots: Vec<bool>,
    /// Load releases that contention deferred; retried until they land.
    pub releases: PendingReleases,
    /// Predicted blocks (approximate mode), when configured.
    pub predicted: Option<PredictedStore>,
    /// Prompts the tokenizer service rendered (empty without `tokenizer`).
    pub render_cache: RenderCache,
    /// This VM's linear memory as last added to the `vm.linear_memory_bytes` gauge.
    pub(super) linear_memory_reported: u64,
}

impl VmState {
    /// A key for one request's load entry, unique across the VMs of this process.
    pub fn new_request_key(&mut self) -> u64 {
        self.next_request_key += 1;
        xxh3_64_with_seed(&self.next_request_key.to_le_bytes(), self.nonce)
    }

    /// Folds each worker's reported counters (from the last head) into the local load view.
    pub fn merge_reported_load(&self, load: &mut [SlotLoad]) {
        for (slot, view) in self.config.slots.iter().zip(load.iter_mut()) {
            let index = usize::from(slot.worker);
            let reported = self
                .replica
                .head
                .workers
                .get(index)
                .and_then(|w| w.reported);
            if let (Some(reported), Some(worker)) = (reported, self.config.workers.get(index)) {
                merge_reported(view, &reported, worker.kv_capacity_blocks, worker.dp_size);
            }
        }
    }
}

impl VmState {
    /// Fills `out` with each slot's reported KV usage (per rank, a fraction of capacity), from
    /// the last head.
    pub fn reported_kv_usage(&self, out: &mut Vec<Option<f64>>) {
        out.clear();
        out.extend(self.config.slots.iter().map(|slot| {
            let worker = self.replica.head.workers.get(usize::from(slot.worker))?;
            worker.reported.map(|r| r.kv_usage)
        }));
    }
}

impl VmState {
    /// Drops the predictions the engines' events since the last sync refuted (blocks taken off
    /// a slot's device tier, slots cleared).
    pub fn forget_lost_predictions(&mut self) {
        let (Some(losses), Some(store)) =
            (self.replica.device_losses.as_mut(), self.predicted.as_mut())
        else {
            return;
        };
        for slot in losses.slots.drain(..) {
            store.forget_slot(slot);
        }
        let mut refuted = 0;
        for (slot, hash) in losses.blocks.drain(..) {
            refuted += u64::from(store.forget(slot, hash));
        }
        self.metrics.add("approx.refuted", refuted);
    }

    /// Applies the routing decisions other VMs published since the last sync.
    pub fn sync_predictions(&mut self, now_ms: u64) {
        let Some(store) = self.predicted.as_mut() else {
            return;
        };
        let report = store.sync(&super::host::HostStore, now_ms);
        self.metrics.add("approx.applied", report.applied);
        self.metrics.add("approx.skipped", report.skipped);
    }
}

pub fn worker_id(config: &Config, worker: u16) -> u64 {
    config.workers.get(usize::from(worker)).map_or(0, |w| w.id)
}
