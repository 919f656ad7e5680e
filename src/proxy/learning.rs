//! The closed loop's host side ([`crate::learn`]): each streamed response's first token is a
//! sample of its worker's timing, written to the worker's shared record; the tick reads the
//! records back (a bounded batch per tick) and recomputes the factors routing multiplies by.

use crate::config::Config;
use crate::learn;

use super::host::HostStore;
use super::vm::VmState;

/// Records read per tick: at 8 workers all of them, at 1,000 each one every ~16 ticks.
const RECORDS_PER_TICK: usize = 64;
/// Weight of a new lifetime sample in the VM's mean (Little's law's `L`).
const LIFETIME_WEIGHT: f64 = 1.0 / 64.0;

/// Per worker entry, its histograms' ids (named once, not per response).
#[derive(Clone, Copy, Debug)]
pub struct WorkerHistograms {
    pub worker_id: u64,
    pub ttft: Option<u32>,
    pub itl: Option<u32>,
    pub error: Option<u32>,
}

/// What a booking remembers to learn from its response.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub worker_index: usize,
    pub routed_ms: u64,
    /// The polynomials' prediction for the chosen slot; `None` when there is nothing to learn
    /// (another policy, or the request moved to a retry's host).
    pub predicted_ms: Option<f64>,
}

impl VmState {
    /// The first token arrived `now` for a request routed as `sample` says.
    pub fn learn_first_token(&mut self, sample: &Sample, now: u64) {
        let observed = now.saturating_sub(sample.routed_ms) as f64;
        let ids = self.worker_histograms(sample.worker_index);
        self.metrics.histogram("ttft_ms", observed as u64);
        self.metrics
            .record(ids.and_then(|h| h.ttft), observed as u64);
        let Some(predicted) = sample.predicted_ms else {
            return;
        };
        let factor = self.learned.factor(sample.worker_index);
        if predicted >= learn::MIN_PREDICTED_MS {
            // How far off the learned prediction was, in percent of it.
            let expected = predicted * factor;
            let error = ((observed - expected).abs() / expected * 100.0).min(1e6) as u64;
            self.metrics.histogram("prediction_error_pct", error);
            self.metrics.record(ids.and_then(|h| h.error), error);
        }
        if let Some(record) =
            learn::record_sample(&HostStore, sample.worker_index, observed, predicted, now)
        {
            if let Some(r) = self.learned.records.get_mut(sample.worker_index) {
                *r = record;
            }
        } else {
            self.metrics.inc("learn.samples_dropped");
        }
    }

    /// A streamed response from worker entry `worker_index` ended `now`: `chunks` body chunks
    /// after its first token at `first_token_ms` give its mean inter-token latency.
    pub fn record_itl(&mut self, worker_index: usize, first_token_ms: u64, chunks: u32, now: u64) {
        if chunks < 2 || first_token_ms == 0 {
            return;
        }
        let itl = now.saturating_sub(first_token_ms) / u64::from(chunks - 1);
        let id = self.worker_histograms(worker_index).and_then(|h| h.itl);
        self.metrics.histogram("itl_ms", itl);
        self.metrics.record(id, itl);
    }

    /// Worker entry `index`'s histogram ids (`worker.<id>.ttft_ms`, `.itl_ms`,
    /// `.prediction_error_pct`), named on first use and again when the entry's worker changes.
    fn worker_histograms(&mut self, index: usize) -> Option<WorkerHistograms> {
        let worker_id = self.config.workers.get(index)?.id;
        if self.histogram_ids.len() <= index {
            self.histogram_ids.resize(index + 1, None);
        }
        if let Some(Some(h)) = self.histogram_ids.get(index) {
            if h.worker_id == worker_id {
                return Some(*h);
            }
        }
        let h = WorkerHistograms {
            worker_id,
            ttft: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.ttft_ms")),
            itl: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.itl_ms")),
            error: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.prediction_error_pct")),
        };
        if let Some(slot) = self.histogram_ids.get_mut(index) {
            *slot = Some(h);
        }
        Some(h)
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

    /// The tick: reads the next batch of shared records and recomputes every factor; records
    /// the learned factors as gauges (`worker.<id>.timing_factor_milli`) when they change.
    pub fn refresh_learned(&mut self, config: &Config, now: u64) {
        if !config.ttft.as_ref().is_some_and(|t| t.learn) {
            return;
        }
        let workers = config.workers.len();
        self.learned.resize(workers);
        for _ in 0..workers.min(RECORDS_PER_TICK) {
            let i = self.learned_cursor % workers.max(1);
            self.learned_cursor = i + 1;
            if let Some(r) = self.learned.records.get_mut(i) {
                *r = learn::read_record(&HostStore, i);
            }
        }
        self.learned.refresh(now);
    }
}
