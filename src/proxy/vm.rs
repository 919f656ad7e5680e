//! The per-VM state that the root context owns and request contexts share. Its own module so
//! that `http` and `root` both depend on it rather than on each other.

use super::metrics::Metrics;
use super::poller::Poller;
use crate::approx::PredictedStore;
use crate::config::Config;
use crate::events::ReportedLoad;
use crate::load::{merge_reported, SlotLoad};
use crate::load_store::{PendingReleases, ViewCache};
use crate::render::RenderCache;
use crate::replication::log::{LogHead, Replica};
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
    /// The load shards this VM viewed last, reused while their bytes are unchanged.
    pub load_views: ViewCache,
    /// Per slot, the worker id and the load gauges last recorded for it (only changes are).
    pub slot_gauges: Vec<Option<(u64, [u64; 3])>>,
    pub(super) block_size_warned: Vec<bool>,
    /// What the last published head says of each slot (stale flag, reported load).
    pub slot_reports: SlotReports,
    /// Load releases that contention deferred; retried until they land.
    pub releases: PendingReleases,
    /// Predicted blocks (approximate mode), when configured.
    pub predicted: Option<PredictedStore>,
    /// Prompts the tokenizer service rendered (empty without `tokenizer`).
    pub render_cache: RenderCache,
    /// This VM's linear memory as last added to the `vm.linear_memory_bytes` gauge.
    pub(super) linear_memory_reported: u64,
    /// Every worker's learned timing as last read (`ttft.learn`).
    pub learned: crate::learn::LearnedTimings,
    /// The next worker record the tick reads.
    pub(super) learned_cursor: usize,
    /// Mean lifetime (routing to release, ms) of the requests this VM routed; 0 before the first.
    pub lifetime_ms: f64,
    /// Per worker entry, the (id, factor, samples) last recorded as gauges.
    pub(super) timing_published: Vec<Option<(u64, u64, u64)>>,
    /// Per worker entry, its histograms' ids.
    pub(super) histogram_ids: Vec<Option<super::learning::WorkerHistograms>>,
}

impl VmState {
    /// A key for one request's load entry, unique across the VMs of this process.
    pub fn new_request_key(&mut self) -> u64 {
        self.next_request_key += 1;
        xxh3_64_with_seed(&self.next_request_key.to_le_bytes(), self.nonce)
    }
}

/// Per slot, what the poller's last published head says of its worker, in slot order: rebuilt
/// in one pass when the head's version or the configuration changes, not per request.
#[derive(Default)]
pub struct SlotReports {
    /// Events from the worker are overdue: its index entries may be out of date.
    pub stale: Vec<bool>,
    /// The worker's own counters (with `load.reported_load`).
    pub reported: Vec<Option<ReportedLoad>>,
    /// Each `reported` KV usage alone, the form `RouteInput::kv_usage` takes.
    pub kv_usage: Vec<Option<f64>>,
    /// `(head version, configuration)` the vectors were built from (the `Rc` held so that a
    /// new configuration can never reuse its address).
    built_for: Option<(u64, Rc<Config>)>,
}

impl SlotReports {
    /// For `slots` slots, all fresh and none reported (before any head is seen).
    pub fn new(slots: usize) -> Self {
        SlotReports {
            stale: vec![false; slots],
            ..SlotReports::default()
        }
    }

    /// Rebuilds the vectors if `head` or `config` moved since the last call.
    pub fn refresh(&mut self, head: &LogHead, config: &Rc<Config>) {
        if let Some((version, built)) = &self.built_for {
            if *version == head.version && Rc::ptr_eq(built, config) {
                return;
            }
        }
        self.built_for = Some((head.version, Rc::clone(config)));
        self.stale.clear();
        self.reported.clear();
        self.kv_usage.clear();
        for slot in &config.slots {
            let worker = head.workers.get(usize::from(slot.worker));
            let reported = worker.and_then(|w| w.reported);
            self.stale.push(worker.is_some_and(|w| w.stale));
            self.reported.push(reported);
            self.kv_usage.push(reported.map(|r| r.kv_usage));
        }
    }

    /// Folds each slot's reported counters into the local load view.
    pub fn merge_into(&self, config: &Config, load: &mut [SlotLoad]) {
        for ((slot, reported), view) in config.slots.iter().zip(&self.reported).zip(load) {
            let worker = config.workers.get(usize::from(slot.worker));
            if let (Some(reported), Some(worker)) = (reported, worker) {
                merge_reported(view, reported, worker.kv_capacity_blocks, worker.dp_size);
            }
        }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)] // test code
mod tests {
    use super::*;
    use crate::replication::log::WorkerPollState;

    fn config() -> Rc<Config> {
        let json = r#"{"workers": [
            {"id": 1, "address": "10.0.0.1:8000", "kv_capacity_blocks": 1000},
            {"id": 2, "address": "10.0.0.2:8000", "kv_capacity_blocks": 1000}]}"#;
        Rc::new(Config::from_json(json.as_bytes()).unwrap())
    }

    fn head(version: u64, second_worker_usage: f64) -> LogHead {
        let reported = ReportedLoad {
            num_waiting: 0,
            num_running: 3,
            kv_usage: second_worker_usage,
        };
        LogHead {
            version,
            workers: vec![
                WorkerPollState {
                    stale: true,
                    ..WorkerPollState::default()
                },
                WorkerPollState {
                    reported: Some(reported),
                    ..WorkerPollState::default()
                },
            ],
            ..LogHead::default()
        }
    }

    #[test]
    fn slot_reports_follow_the_head_version_and_the_configuration() {
        let config = config();
        let mut reports = SlotReports::new(config.slots.len());
        assert_eq!(reports.stale, [false, false]);
        reports.refresh(&head(1, 0.5), &config);
        assert_eq!(reports.stale, [true, false]);
        assert_eq!(reports.kv_usage, [None, Some(0.5)]);
        let mut load = vec![SlotLoad::default(); 2];
        reports.merge_into(&config, &mut load);
        assert_eq!(load[1].decode_blocks, 500.0);
        assert_eq!(load[1].active_requests, 3);
        assert_eq!(load[0], SlotLoad::default());

        // Same version: the head's routing state did not move, nothing is rebuilt.
        reports.refresh(&head(1, 0.9), &config);
        assert_eq!(reports.kv_usage, [None, Some(0.5)]);
        // A new version, or a new configuration at the same version, rebuilds.
        reports.refresh(&head(2, 0.9), &config);
        assert_eq!(reports.kv_usage, [None, Some(0.9)]);
        let reconfigured = Rc::new(Config::clone(&config));
        reports.refresh(&head(2, 0.25), &reconfigured);
        assert_eq!(reports.kv_usage, [None, Some(0.25)]);
    }
}
