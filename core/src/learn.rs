//! Closed-loop timing: how fast each worker really is, learned from what clients experience.
//! Pure (no host calls); the adapter feeds it and stores it.
//!
//! When the router sends a request to a worker it predicts the request's time to first token
//! there ([`crate::ttft`], with the default timing polynomials, which describe no particular
//! engine). When the first token arrives the adapter hands the observed time and that prediction
//! to [`TimingRecord::observe`]. Per worker the record keeps decayed sums of both, and the
//! worker's *timing factor* is their ratio: observed ≈ factor × predicted. Every later
//! prediction for the worker is multiplied by it, so
//!
//! * a worker 2x slower than the polynomial (or than its neighbours) is priced 2x, whatever
//!   its hardware, with nothing configured;
//! * a worker whose queue grows beyond what the router booked (other replicas' traffic, long
//!   decodes, a slow engine) sees its observed times rise, its factor rise, and traffic move off
//!   it: an open-loop hot spot corrects itself.
//!
//! Forgetting: each sample multiplies the sums by `1 - 1/SAMPLE_MEMORY` (a burst is learned
//! within tens of requests), and the sums and the sample count halve every `HALF_LIFE_MS` of
//! wall time, so a worker that stopped getting traffic because it looked slow drifts back to the
//! prior and is tried again. Prior: with `n` samples (decayed in time) the factor is the
//! geometric blend `ratio^t * prior^(1-t)`, `t = min(n / PRIOR_SAMPLES, 1)`, the prior being
//! the fleet's mean factor, so a new worker starts at its peers' speed and is priced by its
//! own after a few samples.
//!
//! A record is 40 bytes, one shared-data key per worker entry of the configuration
//! (`ekr.timing.<index>`): bounded by the configuration, never per request.

use crate::store::{SharedStore, StoreError};

/// Samples whose weight is `1/e` of the newest one's.
pub const SAMPLE_MEMORY: f64 = 32.0;
/// Wall-time half-life of what was learned (ms).
pub const HALF_LIFE_MS: f64 = 30_000.0;
/// Samples after which a worker's own ratio is trusted alone (before, it is blended with the
/// prior in proportion).
pub const PRIOR_SAMPLES: f64 = 4.0;
/// A sample's observed/predicted ratio is clamped to `[1/MAX_RATIO, MAX_RATIO]`.
const MAX_RATIO: f64 = 32.0;
/// Factors are kept within `[1/MAX_FACTOR, MAX_FACTOR]`.
pub const MAX_FACTOR: f64 = 256.0;
/// Predictions shorter than this teach nothing (a fully cached prompt on an idle worker is
/// predicted at ~0 ms; its observed time is network and one step).
pub const MIN_PREDICTED_MS: f64 = 1.0;

/// Bytes of an encoded record.
pub const RECORD_LEN: usize = 40;
const MAGIC: u32 = 0x4b52_5431; // "KRT1"

/// Shared-data key of worker entry `index`'s record.
pub fn key(index: usize) -> String {
    format!("ekr.timing.{index}")
}

/// One worker's learned timing. `Default` is "nothing learned".
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimingRecord {
    /// Decayed sum of observed TTFTs (ms).
    pub observed_ms: f64,
    /// Decayed sum of the predictions for the same requests (ms).
    pub predicted_ms: f64,
    /// Sample count, decayed in wall time only (so steady traffic trusts its own ratio fully,
    /// and an idle worker's trust fades).
    pub weight: f64,
    /// When the sums were last decayed (ms since the epoch).
    pub updated_ms: u64,
    /// Samples ever taken (not decayed; for stats).
    pub samples: u32,
}

impl TimingRecord {
    /// The sums as of `now_ms` (wall-time decay only).
    fn decayed(&self, now_ms: u64) -> TimingRecord {
        let dt = now_ms.saturating_sub(self.updated_ms) as f64;
        let keep = if dt > 0.0 {
            0.5f64.powf(dt / HALF_LIFE_MS)
        } else {
            1.0
        };
        TimingRecord {
            observed_ms: self.observed_ms * keep,
            predicted_ms: self.predicted_ms * keep,
            weight: self.weight * keep,
            updated_ms: now_ms.max(self.updated_ms),
            samples: self.samples,
        }
    }

    /// Takes one request's observed TTFT against its prediction (both in ms). Returns whether
    /// the sample was used (finite, and a prediction of at least [`MIN_PREDICTED_MS`]).
    pub fn observe(&mut self, observed_ms: f64, predicted_ms: f64, now_ms: u64) -> bool {
        if !(observed_ms.is_finite() && predicted_ms.is_finite())
            || predicted_ms < MIN_PREDICTED_MS
            || observed_ms < 0.0
        {
            return false;
        }
        let observed = observed_ms.clamp(predicted_ms / MAX_RATIO, predicted_ms * MAX_RATIO);
        let keep = 1.0 - 1.0 / SAMPLE_MEMORY;
        let mut r = self.decayed(now_ms);
        r.observed_ms = r.observed_ms * keep + observed;
        r.predicted_ms = r.predicted_ms * keep + predicted_ms;
        r.weight += 1.0;
        r.samples = r.samples.saturating_add(1);
        *self = r;
        true
    }

    /// The worker's timing factor at `now_ms`, blended with `prior` (the fleet's factor).
    pub fn factor(&self, prior: f64, now_ms: u64) -> f64 {
        let prior = clamp_factor(prior);
        let r = self.decayed(now_ms);
        if !(r.weight > 1e-9 && r.predicted_ms > 0.0 && r.observed_ms > 0.0) {
            return prior;
        }
        let ratio = clamp_factor(r.observed_ms / r.predicted_ms);
        let trust = (r.weight / PRIOR_SAMPLES).min(1.0);
        clamp_factor((trust * ratio.ln() + (1.0 - trust) * prior.ln()).exp())
    }

    /// Decayed samples at `now_ms`.
    pub fn weight_at(&self, now_ms: u64) -> f64 {
        self.decayed(now_ms).weight
    }

    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        let parts: [&[u8]; 6] = [
            &MAGIC.to_le_bytes(),
            &self.samples.to_le_bytes(),
            &self.observed_ms.to_le_bytes(),
            &self.predicted_ms.to_le_bytes(),
            &self.weight.to_le_bytes(),
            &self.updated_ms.to_le_bytes(),
        ];
        let mut at = 0;
        for p in parts {
            if let Some(dst) = out.get_mut(at..at + p.len()) {
                dst.copy_from_slice(p);
            }
            at += p.len();
        }
        out
    }

    /// `None` for anything but a record [`Self::encode`] wrote with finite, non-negative sums.
    pub fn decode(bytes: &[u8]) -> Option<TimingRecord> {
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
        };
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        if bytes.len() != RECORD_LEN || u32_at(0)? != MAGIC {
            return None;
        }
        let r = TimingRecord {
            samples: u32_at(4)?,
            observed_ms: f64::from_bits(u64_at(8)?),
            predicted_ms: f64::from_bits(u64_at(16)?),
            weight: f64::from_bits(u64_at(24)?),
            updated_ms: u64_at(32)?,
        };
        let sane = |v: f64| v.is_finite() && v >= 0.0;
        (sane(r.observed_ms) && sane(r.predicted_ms) && sane(r.weight)).then_some(r)
    }
}

/// Adds one sample to worker entry `index`'s shared record (get, observe, CAS set; a few retries
/// when another VM wrote meanwhile). Returns the record as written, `None` when the sample was
/// unusable or every attempt lost its race (the sample is dropped: one of many).
pub fn record_sample(
    store: &impl SharedStore,
    index: usize,
    observed_ms: f64,
    predicted_ms: f64,
    now_ms: u64,
) -> Option<TimingRecord> {
    let key = key(index);
    for _ in 0..4 {
        let (bytes, cas) = store.get(&key);
        let mut record = bytes
            .as_deref()
            .and_then(TimingRecord::decode)
            .unwrap_or_default();
        if !record.observe(observed_ms, predicted_ms, now_ms) {
            return None;
        }
        match store.set(&key, &record.encode(), cas) {
            Ok(()) => return Some(record),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return None,
        }
    }
    None
}

/// Worker entry `index`'s shared record (nothing learned when absent or unreadable).
pub fn read_record(store: &impl SharedStore, index: usize) -> TimingRecord {
    store
        .get(&key(index))
        .0
        .as_deref()
        .and_then(TimingRecord::decode)
        .unwrap_or_default()
}

fn clamp_factor(f: f64) -> f64 {
    if f.is_finite() && f > 0.0 {
        f.clamp(1.0 / MAX_FACTOR, MAX_FACTOR)
    } else {
        1.0
    }
}

/// Every worker entry's record and factor, as one VM last read them.
#[derive(Clone, Debug)]
pub struct LearnedTimings {
    pub records: Vec<TimingRecord>,
    /// Per worker entry, the factor the router multiplies predictions by.
    pub factors: Vec<f64>,
    /// The fleet's factor (the prior of a worker with few samples).
    pub fleet: f64,
}

impl Default for LearnedTimings {
    /// Nothing learned: every factor 1 (also before the first refresh).
    fn default() -> Self {
        LearnedTimings {
            records: Vec::new(),
            factors: Vec::new(),
            fleet: 1.0,
        }
    }
}

impl LearnedTimings {
    /// Resizes to `workers` entries (new ones learned nothing).
    pub fn resize(&mut self, workers: usize) {
        self.records.resize(workers, TimingRecord::default());
        self.factors.resize(workers, 1.0);
    }

    /// Recomputes the factors at `now_ms`: the fleet's as the sample-weighted geometric mean of
    /// the workers' own ratios (1 when nothing was learned), then each worker's blended with it.
    pub fn refresh(&mut self, now_ms: u64) {
        let (mut sum, mut weights) = (0.0, 0.0);
        for r in &self.records {
            let w = r.weight_at(now_ms);
            if w > 1e-9 {
                sum += w * r.factor(1.0, now_ms).ln();
                weights += w;
            }
        }
        self.fleet = if weights > 0.0 {
            clamp_factor((sum / weights).exp())
        } else {
            1.0
        };
        self.factors.clear();
        let fleet = self.fleet;
        self.factors
            .extend(self.records.iter().map(|r| r.factor(fleet, now_ms)));
    }

    /// Worker entry `index`'s factor (the fleet's for an unknown one).
    pub fn factor(&self, index: usize) -> f64 {
        self.factors
            .get(index)
            .copied()
            .unwrap_or(self.fleet.max(0.0))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn near(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    #[test]
    fn before_the_first_refresh_every_factor_is_one() {
        let t = LearnedTimings::default();
        assert_eq!((t.factor(0), t.factor(7), t.fleet), (1.0, 1.0, 1.0));
        let mut t = LearnedTimings::default();
        t.resize(3);
        assert_eq!(t.factor(2), 1.0);
    }

    #[test]
    fn nothing_learned_is_the_prior() {
        let r = TimingRecord::default();
        assert_eq!(r.factor(1.0, 0), 1.0);
        assert_eq!(r.factor(2.5, 1000), 2.5);
    }

    #[test]
    fn a_worker_twice_as_slow_as_predicted_learns_two() {
        let mut r = TimingRecord::default();
        for i in 0..64 {
            assert!(r.observe(200.0, 100.0, i * 10));
        }
        let f = r.factor(1.0, 640);
        assert!(near(f, 2.0, 0.01), "{f}");
        // Few samples stay close to the prior.
        let mut few = TimingRecord::default();
        few.observe(200.0, 100.0, 0);
        let f1 = few.factor(1.0, 0);
        assert!(f1 > 1.15 && f1 < 1.25, "{f1}");
    }

    #[test]
    fn a_worker_that_speeds_up_is_relearned_within_its_sample_memory() {
        let mut r = TimingRecord::default();
        for i in 0..200 {
            r.observe(300.0, 100.0, i);
        }
        assert!(near(r.factor(1.0, 200), 3.0, 0.03));
        for i in 0..100 {
            r.observe(100.0, 100.0, 200 + i);
        }
        let f = r.factor(1.0, 300);
        assert!(f < 1.2, "after 100 samples at 1x the factor is {f}");
    }

    #[test]
    fn an_idle_worker_drifts_back_to_the_prior() {
        let mut r = TimingRecord::default();
        for i in 0..100 {
            r.observe(400.0, 100.0, i);
        }
        assert!(near(r.factor(1.0, 100), 4.0, 0.03));
        // Six half-lives later: ~1.6 samples of weight left, the prior has over half the say.
        let later = 100 + 6 * HALF_LIFE_MS as u64;
        let f = r.factor(1.0, later);
        assert!(f > 1.5 && f < 2.2, "{f}");
        let much_later = 100 + 20 * HALF_LIFE_MS as u64;
        assert!(r.factor(1.0, much_later) < 1.01);
    }

    #[test]
    fn outliers_and_useless_samples_are_bounded() {
        let mut r = TimingRecord::default();
        assert!(!r.observe(f64::NAN, 100.0, 0));
        assert!(!r.observe(100.0, 0.2, 0));
        assert!(!r.observe(-1.0, 100.0, 0));
        assert_eq!(r, TimingRecord::default());
        for i in 0..100 {
            r.observe(1e12, 10.0, i);
        }
        assert!(r.factor(1.0, 100) <= MAX_RATIO * 1.0001);
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let mut r = TimingRecord::default();
        r.observe(123.0, 45.0, 1_700_000_000_000);
        let bytes = r.encode();
        assert_eq!(TimingRecord::decode(&bytes), Some(r));
        assert_eq!(TimingRecord::decode(&bytes[1..]), None);
        let mut bad = bytes;
        bad[0] ^= 1;
        assert_eq!(TimingRecord::decode(&bad), None);
        let mut nan = bytes;
        nan[8..16].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        assert_eq!(TimingRecord::decode(&nan), None);
    }

    #[test]
    fn samples_from_every_vm_land_in_one_shared_record() {
        use crate::store::fake::MemStore;
        let store = MemStore::new();
        assert_eq!(read_record(&store, 3), TimingRecord::default());
        record_sample(&store, 3, 300.0, 100.0, 10).unwrap();
        // Another VM writes between this one's get and set: the CAS retry keeps both samples.
        let raced = std::rc::Rc::new(std::cell::Cell::new(false));
        let flag = std::rc::Rc::clone(&raced);
        store.set_hook(move |s, op| {
            if matches!(op, crate::store::fake::Op::Set(_)) && !flag.get() {
                flag.set(true);
                record_sample(s, 3, 300.0, 100.0, 10);
            }
        });
        let written = record_sample(&store, 3, 300.0, 100.0, 10).unwrap();
        store.clear_hook();
        assert!(raced.get());
        assert_eq!(written.samples, 3);
        assert_eq!(read_record(&store, 3), written);
        assert_eq!(read_record(&store, 2), TimingRecord::default());
        assert!(record_sample(&store, 3, 300.0, 0.0, 10).is_none());
    }

    #[test]
    fn a_mixed_fleet_learns_each_workers_relative_speed() {
        // Workers 1x, 2x and 4x slower than predicted; a new fourth worker starts at the
        // fleet's factor.
        let mut t = LearnedTimings::default();
        t.resize(4);
        for i in 0..100u64 {
            for (w, slow) in [1.0, 2.0, 4.0].iter().enumerate() {
                t.records[w].observe(50.0 * slow, 50.0, i);
            }
        }
        t.refresh(100);
        assert!(near(t.factor(0), 1.0, 0.03));
        assert!(near(t.factor(1), 2.0, 0.03));
        assert!(near(t.factor(2), 4.0, 0.03));
        assert!(near(t.fleet, 2.0, 0.03), "{}", t.fleet);
        assert!(near(t.factor(3), t.fleet, 1e-9));
        assert!(near(t.factor(99), t.fleet, 1e-9));
    }
}
