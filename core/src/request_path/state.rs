//! The per-VM state the request path shares across requests: the effective configuration, the
//! index replica, the selector, the load views, predictions, the render cache and the learned
//! timings. The adapter's `VmState` owns it beside its own (metrics, poller, membership calls).

use super::host::{Host, WorkerHistogram};
use crate::approx::PredictedStore;
use crate::config::{Config, KvPolicy, RoutingMode, UnseenTraffic};
use crate::events::ReportedLoad;
use crate::learn;
use crate::load::recent::RecentBookings;
use crate::load::share::{self, TrafficShare};
use crate::load::{add_other_routers, merge_reported, reported_requests, SlotLoad};
use crate::load_store::{PendingReleases, ViewCache};
use crate::membership::effective_config;
use crate::render::RenderCache;
use crate::replication::log::{DeviceChanges, LogHead, Replica};
use crate::router::SelectorState;
use crate::types::{Overlap, SlotIdx};
use std::rc::Rc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Weight of a new lifetime sample in the VM's mean (Little's law's `L`).
const LIFETIME_WEIGHT: f64 = 1.0 / 64.0;

/// Everything the request path keeps between requests.
pub struct RoutingState {
    /// The effective configuration: `base_config` with the published membership applied
    /// (pool entries' addresses, routability). The same as `base_config` without membership.
    pub config: Rc<Config>,
    /// The configuration as compiled.
    pub base_config: Rc<Config>,
    /// `(members_seen, members_generation)` of the head `config` was built from.
    pub members_applied: (bool, u64),
    pub nonce: u64,
    pub replica: Replica,
    pub selector: SelectorState,
    pub next_request_key: u64,
    /// Reused per request so that overlap lookup allocates nothing.
    pub overlaps: Vec<Overlap>,
    /// Reused per request: the load table's per-slot view.
    pub load_view: Vec<SlotLoad>,
    /// The load shards this VM viewed last, reused while their bytes are unchanged.
    pub load_views: ViewCache,
    /// What the last published head says of each slot (stale flag, reported load).
    pub slot_reports: SlotReports,
    /// Load releases that contention deferred; retried until they land.
    pub releases: PendingReleases,
    /// Predicted blocks (approximate mode), when configured.
    pub predicted: Option<PredictedStore>,
    /// Prompts the tokenizer service rendered (empty without `tokenizer`).
    pub render_cache: RenderCache,
    /// Every worker's learned timing as last read (`ttft.learn`).
    pub learned: learn::LearnedTimings,
    /// Mean lifetime (routing to release, ms) of the requests this VM routed; 0 before the first.
    pub lifetime_ms: f64,
    /// This Envoy's own requests in flight against the workers' reports (`load::share`).
    pub traffic_share: TrafficShare,
    /// When the inferred scale was last recorded (`load.traffic_scale_pct`, once a second).
    pub traffic_share_recorded_ms: u64,
    /// This VM's own bookings of the last moments, for what the other replicas likely sent
    /// (`load::recent`).
    pub recent_bookings: RecentBookings,
    /// Reused on every tick by [`RoutingState::share_placements`].
    placed_by_others: Vec<u32>,
}

impl RoutingState {
    /// The state of a freshly configured VM. `fingerprint` names the configuration in the
    /// shared log; `nonce` seeds this VM's randomness and request keys.
    pub fn new(config: Rc<Config>, fingerprint: u64, nonce: u64) -> Self {
        let mut replica = Replica::new(&config, fingerprint);
        if config.approximate.is_some() {
            replica.device_changes = Some(DeviceChanges::default());
        }
        let slots = config.slots.len();
        RoutingState {
            replica,
            selector: SelectorState::new(nonce),
            next_request_key: 0,
            overlaps: Vec::with_capacity(slots),
            load_view: Vec::with_capacity(slots),
            load_views: ViewCache::default(),
            slot_reports: SlotReports::new(slots),
            nonce,
            base_config: Rc::clone(&config),
            members_applied: (false, 0),
            releases: PendingReleases::default(),
            predicted: config
                .approximate
                .as_ref()
                .map(|a| PredictedStore::new(a.max_blocks)),
            render_cache: config.tokenizer.as_ref().map_or_else(
                || RenderCache::new(0, 0),
                |t| RenderCache::new(t.cache_entries, t.cache_max_tokens),
            ),
            config,
            learned: learn::LearnedTimings::default(),
            lifetime_ms: 0.0,
            traffic_share: TrafficShare::default(),
            traffic_share_recorded_ms: 0,
            recent_bookings: RecentBookings::default(),
            placed_by_others: Vec::new(),
        }
    }

    /// A key for one request's load entry, unique across the VMs of this process.
    pub fn new_request_key(&mut self) -> u64 {
        self.next_request_key += 1;
        xxh3_64_with_seed(&self.next_request_key.to_le_bytes(), self.nonce)
    }

    /// Applies the shared log's new batches to this VM's index (and what they bring: stale flags,
    /// reported load, membership).
    pub fn sync_replica(&mut self, host: &mut impl Host) {
        let config = Rc::clone(&self.config);
        let report = self.replica.sync(host.store(), &config, host.now_ms());
        // Batches skipped (snapshot or lost sync) held changes this VM never saw.
        let skipped = report.snapshot_loaded || report.lost_sync;
        self.forget_settled_predictions(host, skipped);
        self.follow_membership();
        self.slot_reports.refresh(&self.replica.head, &self.config);
        host.count("events.applied", report.events_applied);
        host.count("events.rejected", report.events_rejected);
        host.count("index.evicted", report.evicted);
        if report.snapshot_loaded {
            host.count("log.snapshot_loaded", 1);
        }
        if report.lost_sync {
            host.count("log.lost_sync", 1);
            log::warn!("kv-router: this VM fell behind the shared event log; its index restarts from the latest batches");
        }
    }

    /// Rebuilds the effective configuration when the head's membership generation moved.
    pub fn follow_membership(&mut self) {
        if self.base_config.membership.is_none() {
            return;
        }
        let head = &self.replica.head;
        let seen = (head.members_seen, head.members_generation);
        if seen == self.members_applied {
            return;
        }
        self.config = Rc::new(effective_config(&self.base_config, head));
        self.members_applied = seen;
    }

    /// Drops the predictions the engines' events since the last sync settled: blocks a slot's
    /// engine now reports stored (the index holds them; a prediction kept past that would
    /// outlive a later removal read by a VM that never held it), blocks taken off a slot's
    /// device tier, slots cleared. `skipped`: the replica jumped over batches, so every
    /// prediction on a slot with events goes (what those batches said is unknown).
    pub fn forget_settled_predictions(&mut self, host: &mut impl Host, skipped: bool) {
        let (Some(changes), Some(store)) = (
            self.replica.device_changes.as_mut(),
            self.predicted.as_mut(),
        ) else {
            return;
        };
        if !skipped
            && changes.cleared.is_empty()
            && changes.lost.is_empty()
            && changes.stored.is_empty()
        {
            return;
        }
        // Decisions other VMs published before these changes may still be unread in the ring:
        // take them in first, so that what is forgotten now goes with them (read after, they
        // would credit a worker with blocks its engine has just dropped).
        let report = store.sync(host.store(), host.now_ms());
        host.count("approx.applied", report.applied);
        host.count("approx.skipped", report.skipped);
        if skipped {
            let config = &self.config;
            let slots = (0..config.slots.len()).filter_map(|s| SlotIdx::try_from(s).ok());
            for slot in slots {
                if config
                    .worker_of_slot(slot)
                    .is_some_and(|w| w.kv_mode.has_events())
                {
                    store.forget_slot(slot);
                }
            }
        }
        for slot in changes.cleared.drain(..) {
            store.forget_slot(slot);
        }
        let mut confirmed = 0;
        for (slot, hash) in changes.stored.drain(..) {
            confirmed += u64::from(store.forget(slot, hash));
        }
        host.count("approx.confirmed", confirmed);
        let mut refuted = 0;
        for (slot, hash) in changes.lost.drain(..) {
            refuted += u64::from(store.forget(slot, hash));
        }
        host.count("approx.refuted", refuted);
    }

    /// Applies the routing decisions other VMs published since the last sync.
    pub fn sync_predictions(&mut self, host: &mut impl Host, now_ms: u64) {
        let Some(store) = self.predicted.as_mut() else {
            return;
        };
        let report = store.sync(host.store(), now_ms);
        host.count("approx.applied", report.applied);
        host.count("approx.skipped", report.skipped);
    }

    /// The tick's side of the closed loop (with `ttft.learn`): reads the next batch of the
    /// workers' shared timing records ([`learn::RECORDS_PER_TICK`]) and recomputes the factors
    /// routing multiplies by.
    pub fn refresh_learned(&mut self, store: &impl crate::store::SharedStore, now_ms: u64) {
        if !self.config.ttft.as_ref().is_some_and(|t| t.learn) {
            return;
        }
        let workers = self.config.workers.len();
        self.learned.resize(workers);
        // What the other Envoys learned, as the bridges relayed it with their pages (as of the
        // page's arrival; not from a stale report).
        let relayed = self.config.load.unseen_traffic == UnseenTraffic::Relayed;
        let polls = &self.replica.head.workers;
        for (i, others) in self.learned.others.iter_mut().enumerate() {
            *others = polls
                .get(i)
                .filter(|w| relayed && !w.stale)
                .and_then(|w| {
                    let sums = w.reported.as_ref()?.other_routers?.timing?;
                    Some(learn::TimingRecord::from_sums(&sums, w.last_ok_ms))
                })
                .unwrap_or_default();
        }
        self.learned
            .read_next(store, workers, learn::RECORDS_PER_TICK, now_ms);
    }

    /// With `load.unseen_traffic: relayed`, samples this Envoy's requests in flight against the
    /// other routers' relayed ones on every tick: evenly in time, so that neither the bursts in
    /// which decisions crowd nor the relay's lag skews the ratio
    /// ([`TrafficShare::relayed_ratio`], which scales [`crate::load::recent`]).
    pub fn sample_traffic_on_tick(&mut self, store: &dyn crate::store::SharedStore, now_ms: u64) {
        let config = Rc::clone(&self.config);
        if !config.load.reported_load || config.load.unseen_traffic != UnseenTraffic::Relayed {
            return;
        }
        let mut snapshot = crate::load_store::read_snapshot(store, config.slots.len());
        let mut load = std::mem::take(&mut self.load_view);
        snapshot.view_with(now_ms, &mut load, &mut self.load_views);
        self.slot_reports
            .sample_share(&config, &mut self.traffic_share, &load, now_ms);
        self.load_view = load;
    }

    /// The request-share term's placements across this Envoy's VMs, on every tick
    /// ([`crate::load::placed`]): adds this VM's since the last tick to the process's totals,
    /// and counts in its share term what the other VMs placed meanwhile. Only for the adaptive
    /// policy with its share term on.
    pub fn share_placements(&mut self, store: &dyn crate::store::SharedStore) {
        let config = &self.config;
        let share_on = config.mode == RoutingMode::Kv
            && config.policy == KvPolicy::Adaptive
            && config.ttft.as_ref().is_some_and(|t| t.share_weight > 0.0);
        if !share_on {
            return;
        }
        let slots = config.slots.len();
        let mut others = std::mem::take(&mut self.placed_by_others);
        if self.selector.placements.exchange(store, slots, &mut others) {
            self.selector.record_others(slots, &others);
        }
        self.placed_by_others = others;
    }

    /// Whether some worker's bridge relays other routers' bookings (another Envoy declared
    /// there lately): this Envoy shares the fleet with other routers ([`crate::tick`]).
    pub fn hears_other_routers(&self) -> bool {
        self.slot_reports.others_heard
    }

    /// The first token arrived `now` for a request routed as `sample` says: the observed TTFT
    /// (histograms) and, with a prediction, a sample in the worker's shared timing record.
    pub fn learn_first_token(&mut self, host: &mut impl Host, sample: &Sample, now: u64) {
        let observed = now.saturating_sub(sample.routed_ms) as f64;
        // The per-worker histograms only for an entry of the configuration.
        let worker = self.config.workers.get(sample.worker_index).map(|w| w.id);
        host.histogram("ttft_ms", observed as u64);
        if let Some(worker) = worker {
            let ttft = WorkerHistogram::TtftMs;
            host.worker_histogram(sample.worker_index, worker, ttft, observed as u64);
        }
        let Some(prediction) = sample.prediction else {
            return;
        };
        let predicted = prediction.ttft_ms;
        let factor = self.learned.factor(sample.worker_index);
        if predicted >= learn::MIN_PREDICTED_MS {
            // How far off the learned prediction was, in percent of it.
            let expected = predicted * factor;
            let error = ((observed - expected).abs() / expected * 100.0).min(1e6) as u64;
            host.histogram("prediction_error_pct", error);
            if let Some(worker) = worker {
                let kind = WorkerHistogram::PredictionErrorPct;
                host.worker_histogram(sample.worker_index, worker, kind, error);
            }
        }
        if let Some(record) =
            learn::record_sample(host.store(), sample.worker_index, observed, prediction, now)
        {
            if let Some(r) = self.learned.records.get_mut(sample.worker_index) {
                *r = record;
            }
        } else {
            host.count("learn.samples_dropped", 1);
        }
    }

    /// A streamed response from worker entry `worker_index` ended `now`: `chunks` body chunks
    /// after its first token at `first_token_ms` give its mean inter-token latency.
    pub fn record_itl(
        &self,
        host: &mut impl Host,
        worker_index: usize,
        first_token_ms: u64,
        chunks: u32,
        now: u64,
    ) {
        if chunks < 2 || first_token_ms == 0 {
            return;
        }
        let itl = now.saturating_sub(first_token_ms) / u64::from(chunks - 1);
        host.histogram("itl_ms", itl);
        if let Some(worker) = self.config.workers.get(worker_index) {
            host.worker_histogram(worker_index, worker.id, WorkerHistogram::ItlMs, itl);
        }
    }

    /// The request routed at `routed_ms` ended `now`: its lifetime feeds the mean.
    pub fn learn_lifetime(&mut self, routed_ms: u64, now: u64) {
        let lifetime = now.saturating_sub(routed_ms) as f64;
        self.lifetime_ms = if self.lifetime_ms > 0.0 {
            self.lifetime_ms + LIFETIME_WEIGHT * (lifetime - self.lifetime_ms)
        } else {
            lifetime
        };
    }

    /// Requests expected to arrive per ms at each of `load`'s slots: the requests in flight
    /// over their mean lifetime (Little's law), spread over the slots. 0 before any request
    /// ended.
    pub fn arrivals_per_ms(&self, active_requests: u64, slots: usize) -> f64 {
        if self.lifetime_ms <= 0.0 || slots == 0 {
            return 0.0;
        }
        active_requests as f64 / self.lifetime_ms / slots as f64
    }
}

/// What a booking remembers to learn from its response.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub worker_index: usize,
    pub routed_ms: u64,
    /// The polynomials' prediction for the chosen slot; `None` when there is nothing to learn
    /// (another mode, or the request moved to a retry's host).
    pub prediction: Option<learn::Prediction>,
}

/// The id of worker entry `index` (0 if there is none).
pub fn worker_id(config: &Config, index: usize) -> u64 {
    config.workers.get(index).map_or(0, |w| w.id)
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
    /// Some report relays other routers' bookings (`load.other_routers`).
    pub others_heard: bool,
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

    /// Samples this Envoy's own requests in flight (`load`, its own view) against what the
    /// workers report (fresh reports only) into `share`.
    pub fn sample_share(
        &self,
        config: &Config,
        share: &mut TrafficShare,
        load: &[SlotLoad],
        now_ms: u64,
    ) {
        let mut sample = share::Sample::default();
        let mut any = false;
        for (slot, view) in self.fresh_reports(config).zip(load) {
            let Some((dp_size, report)) = slot else {
                continue;
            };
            sample.own += f64::from(view.active_requests);
            sample.reported += reported_requests(report, dp_size);
            if let Some(others) = report.other_routers {
                sample.relayed += f64::from(others.requests) / f64::from(dp_size.max(1));
            }
            sample.prefill_tokens += view.prefill_tokens;
            sample.decode_blocks += view.decode_blocks;
            any = true;
        }
        if any {
            share.observe(sample, now_ms);
        }
    }

    /// Adds to the own view `load` the other routers' requests the reports show, each at the size
    /// of this Envoy's own (`load.unseen_traffic: per_worker`, `load::share`).
    pub fn add_unseen(&self, config: &Config, share: &TrafficShare, load: &mut [SlotLoad]) {
        let Some((prefill, blocks)) = share.per_request() else {
            return;
        };
        for (slot, view) in self.fresh_reports(config).zip(load.iter_mut()) {
            let Some((dp_size, report)) = slot else {
                continue;
            };
            let unseen =
                (reported_requests(report, dp_size) - f64::from(view.active_requests)).max(0.0);
            view.prefill_tokens += unseen * prefill;
            view.decode_blocks += unseen * blocks;
            let requests = f64::from(view.active_requests) + unseen.round();
            view.active_requests = requests.min(f64::from(u32::MAX)) as u32;
        }
    }

    /// Per slot, its worker's rank count and fresh report (`None`: stale or not reported).
    fn fresh_reports<'a>(
        &'a self,
        config: &'a Config,
    ) -> impl Iterator<Item = Option<(u32, &'a ReportedLoad)>> + 'a {
        let slots = config.slots.iter().zip(&self.reported).zip(&self.stale);
        slots.map(move |((slot, report), stale)| {
            let fresh = report.as_ref().filter(|_| !*stale)?;
            let worker = config.workers.get(usize::from(slot.worker));
            Some((worker.map_or(1, |w| w.dp_size), fresh))
        })
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
        self.others_heard = false;
        for slot in &config.slots {
            let worker = head.workers.get(usize::from(slot.worker));
            let reported = worker.and_then(|w| w.reported);
            self.others_heard |= reported.is_some_and(|r| r.other_routers.is_some());
            self.stale.push(worker.is_some_and(|w| w.stale));
            self.reported.push(reported);
            self.kv_usage.push(reported.map(|r| r.kv_usage));
        }
    }

    /// Folds the reports into `load` ([`merge_reported`]); `request_tokens` prices a reported
    /// waiting request this Envoy did not send.
    /// A stale report's waiting requests are not priced: they may be long gone.
    pub fn merge_into(&self, config: &Config, load: &mut [SlotLoad], request_tokens: f64) {
        let slots = config.slots.iter().zip(&self.reported).zip(&self.stale);
        for (((slot, reported), stale), view) in slots.zip(load) {
            let worker = config.workers.get(usize::from(slot.worker));
            if let (Some(reported), Some(worker)) = (reported, worker) {
                let tokens = if *stale { 0.0 } else { request_tokens };
                if !*stale && config.load.unseen_traffic == UnseenTraffic::Relayed {
                    add_other_routers(view, reported, worker.dp_size);
                }
                merge_reported(view, reported, worker.dp_size, tokens);
            }
        }
    }
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
            other_routers: None,
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
    fn only_a_fresh_reports_waiting_requests_join_the_queue() {
        let config = config();
        let waiting = ReportedLoad {
            num_waiting: 2,
            num_running: 1,
            kv_usage: 0.5,
            other_routers: None,
        };
        let mut head = head(1, 0.5);
        for w in &mut head.workers {
            w.reported = Some(waiting);
        }
        let mut reports = SlotReports::new(config.slots.len());
        reports.refresh(&head, &config);
        let mut load = vec![SlotLoad::default(); 2];
        reports.merge_into(&config, &mut load, 100.0);
        // Both report 3 requests, none of them this Envoy's; worker 1's events are overdue.
        assert_eq!(load[0].active_requests, 3);
        assert_eq!(load[0].prefill_tokens, 0.0, "stale: its queue may be gone");
        assert_eq!(load[1].prefill_tokens, 200.0);
    }

    #[test]
    fn other_routers_bookings_count_only_when_relayed_is_chosen_and_the_report_is_fresh() {
        let others = crate::events::Booked {
            requests: 4,
            prefill_tokens: 6000.0,
            decode_blocks: 20.0,
            timing: None,
        };
        let mut head = head(1, 0.5);
        for w in &mut head.workers {
            w.reported = Some(ReportedLoad {
                num_waiting: 0,
                num_running: 4,
                kv_usage: 0.5,
                other_routers: Some(others),
            });
        }
        for (unseen, expected) in [("off", 0.0), ("relayed", 6000.0)] {
            let json = format!(
                r#"{{"load": {{"unseen_traffic": "{unseen}"}}, "workers": [
                {{"id": 1, "address": "10.0.0.1:8000"}}, {{"id": 2, "address": "10.0.0.2:8000"}}]}}"#
            );
            let config = Rc::new(Config::from_json(json.as_bytes()).unwrap());
            let mut reports = SlotReports::new(config.slots.len());
            reports.refresh(&head, &config);
            let mut load = vec![SlotLoad::default(); 2];
            reports.merge_into(&config, &mut load, 100.0);
            assert_eq!(load[1].prefill_tokens, expected, "{unseen}");
            assert_eq!(load[1].decode_blocks, expected / 300.0, "{unseen}");
            assert_eq!(load[1].active_requests, 4, "{unseen}");
            // Worker 1's events are overdue: what the others booked there may be gone too.
            assert_eq!(load[0].prefill_tokens, 0.0, "{unseen}");
        }
    }

    #[test]
    fn what_the_other_envoys_learned_joins_the_own_learning_only_when_relayed_and_fresh() {
        use crate::learn::{Prediction, TimingRecord};
        // The other Envoys learned worker 2 to be 3x slower than predicted; this one learned
        // nothing of either worker.
        let mut theirs = TimingRecord::default();
        let predicted = Prediction {
            ttft_ms: 100.0,
            own_ms: 100.0,
        };
        for i in 0..40 {
            theirs.observe(300.0, predicted, i);
        }
        let others = crate::events::Booked {
            timing: Some(theirs.sums_at(40)),
            ..crate::events::Booked::default()
        };
        let mut head = head(1, 0.5);
        for w in &mut head.workers {
            w.last_ok_ms = 40;
            w.reported = Some(ReportedLoad {
                other_routers: Some(others),
                ..ReportedLoad::default()
            });
        }
        for (unseen, expected) in [("off", 1.0), ("relayed", 3.0)] {
            let json = format!(
                r#"{{"load": {{"unseen_traffic": "{unseen}"}}, "workers": [
                {{"id": 1, "address": "10.0.0.1:8000"}}, {{"id": 2, "address": "10.0.0.2:8000"}}]}}"#
            );
            let config = Rc::new(Config::from_json(json.as_bytes()).unwrap());
            let mut vm = RoutingState::new(config, 1, 1);
            vm.replica.head = head.clone();
            vm.refresh_learned(&crate::store::fake::MemStore::new(), 40);
            let f = vm.learned.factor(1);
            assert!((f - expected).abs() < 0.05 * expected, "{unseen}: {f}");
            // Worker 1's report is stale: nothing of it is taken.
            assert_eq!(vm.learned.others[0], TimingRecord::default(), "{unseen}");
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
        reports.merge_into(&config, &mut load, 0.0);
        assert_eq!(
            load[1].decode_blocks, 0.0,
            "the usage is not decode blocks of the cost"
        );
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
