//! The tick's gauges: per-slot load and worker state, learned timing factors, the VM's linear
//! memory; abandoned load entries reaped on the way.

use super::host::{self, HostStore};
use super::vm::{worker_id, VmState};
use crate::config::Config;
use crate::load_store;
use std::rc::Rc;

impl VmState {
    pub(super) fn publish_gauges(&mut self, now: u64) {
        let config = Rc::clone(&self.path.config);
        let slots = config.slots.len();
        let reaped = load_store::reap(&HostStore, slots, now, config.load.request_timeout_ms);
        self.metrics.add("load.reaped", reaped as u64);
        // Bytes first: a reader that sees the entries sees the bytes of the same tick.
        self.metrics.gauge(
            "index.bytes",
            self.path.replica.index.allocated_bytes() as u64,
        );
        self.metrics
            .gauge("index.entries", self.path.replica.index.entries() as u64);
        let stale = self
            .path
            .replica
            .head
            .workers
            .iter()
            .filter(|w| w.stale)
            .count();
        self.metrics.gauge("workers.stale", stale as u64);
        self.membership_gauges();
        let view = load_store::view(&HostStore, slots, now);
        self.slot_gauges.resize(slots, None);
        for ((slot_idx, load), published) in view.iter().enumerate().zip(&mut self.slot_gauges) {
            let Some(slot) = config.slots.get(slot_idx) else {
                continue;
            };
            let id = worker_id(&config, slot.worker);
            let values = [
                u64::from(load.active_requests),
                load.prefill_tokens.ceil() as u64,
                load.decode_blocks.ceil() as u64,
            ];
            // At 1,000 slots every tick would be 3,000 host calls (and names to format): only
            // what changed since the last tick is recorded.
            if *published == Some((id, values)) {
                continue;
            }
            let before = published.filter(|(was, _)| *was == id).map(|(_, v)| v);
            let name = format!("worker.{id}.rank.{}", slot.dp_rank);
            for ((suffix, value), old) in ["active_requests", "prefill_tokens", "decode_blocks"]
                .iter()
                .zip(values)
                .zip(0..)
            {
                if before.and_then(|b| b.get(old).copied()) != Some(value) {
                    self.metrics.gauge(&format!("{name}.{suffix}"), value);
                }
            }
            *published = Some((id, values));
        }
        self.metrics.gauge(
            "load.active_entries",
            view.iter().map(|l| u64::from(l.active_requests)).sum(),
        );
        if let Some(predicted) = &self.path.predicted {
            self.metrics.gauge("approx.entries", predicted.len() as u64);
        }
        self.metrics
            .gauge("load.deferred_releases", self.path.releases.len() as u64);
        self.timing_gauges(&config);
    }

    /// `worker.<id>.timing_factor_milli` (observed over predicted TTFT, x1000) and
    /// `worker.<id>.timing_samples`, recorded when they change.
    pub(super) fn timing_gauges(&mut self, config: &Config) {
        if !config.ttft.as_ref().is_some_and(|t| t.learn) {
            return;
        }
        self.timing_published.resize(config.workers.len(), None);
        for (i, published) in self.timing_published.iter_mut().enumerate() {
            let Some(worker) = config.workers.get(i) else {
                continue;
            };
            let milli = (self.path.learned.factor(i) * 1000.0).round() as u64;
            let samples = self
                .path
                .learned
                .records
                .get(i)
                .map_or(0, |r| u64::from(r.samples));
            let values = (worker.id, milli, samples);
            if *published == Some(values) {
                continue;
            }
            *published = Some(values);
            self.metrics
                .gauge(&format!("worker.{}.timing_factor_milli", worker.id), milli);
            self.metrics
                .gauge(&format!("worker.{}.timing_samples", worker.id), samples);
        }
    }

    /// `vm.linear_memory_bytes`: the wasm linear memory of every VM of the process, summed. It
    /// holds each index replica; a VM's linear memory never shrinks, so this is each VM's peak.
    pub(super) fn publish_linear_memory(&mut self) {
        let bytes = host::linear_memory_bytes();
        let delta = bytes as i64 - self.linear_memory_reported as i64;
        self.metrics.gauge_add("vm.linear_memory_bytes", delta);
        self.linear_memory_reported = bytes;
    }
}
