//! Closed-loop timing: how fast each worker really is, learned from what clients experience.
//! Pure (no host calls); the adapter feeds it and stores it.
//!
//! When the router sends a request to a worker it predicts the request's time to first token
//! there ([`crate::ttft`], with the default timing polynomials, which describe no particular
//! engine). When the first token arrives the adapter hands the observed time and that prediction
//! to [`TimingRecord::observe`]. Per worker the record keeps decayed, prediction-weighted sums
//! of the log ratio `ln(observed / predicted)`, and [`LearnedTimings::refresh`] turns every
//! worker's sums into its *timing factor*: observed ≈ factor × predicted. Every later prediction
//! for the worker is multiplied by it, so a worker 2x slower than the polynomial (or than its
//! neighbours) is priced 2x, whatever its hardware, with nothing configured.
//!
//! A worker's samples are noisy: its TTFTs include queueing the router did not see (other Envoy
//! replicas' requests, long decodes) and jitter, and a worker priced high by noise gets few new
//! samples to correct it. So the factors are *empirical-Bayes* estimates: each worker's mean
//! log ratio is shrunk toward the fleet's by how much of the spread between workers its own
//! noise explains (James-Stein):
//!
//! ```text
//! factor = exp(fleet + B (mean - fleet)),  B = between² / (between² + within² / n)
//! ```
//!
//! `within²` is the pooled variance of single samples around their worker's mean, `n` the
//! worker's effective sample count and `between²` the variance of the workers' means beyond what
//! that noise alone would give. On a fleet of one speed the workers' means differ by noise,
//! `between²` is ~0 and every worker is priced at the fleet's factor; on a fleet whose speeds
//! differ the means differ by more than noise and each worker is priced by its own. A new worker
//! (`n` = 0), and one with less than [`MIN_WORKER_SAMPLES`] (a single sample may be all queue),
//! is priced at the fleet's factor.
//!
//! The polynomials are no engine's own, so their error depends on the prompt's size (a tiny
//! prompt is mostly the polynomial's per-step constant). `mean` is therefore each worker's mean
//! read at the fleet's mean size: `mean_w - slope (size_w - size_fleet)`, size being the log of
//! the own prefill and `slope` the fleet's within-worker regression of the log ratio on it, and
//! `within²` the spread around each worker's line. A worker that happened to get the short
//! prompts is not priced by the polynomial's error on them.
//!
//! Forgetting: each sample multiplies the sums by `1 - 1/SAMPLE_MEMORY` (a change is learned
//! within tens of requests), and the sums halve every `HALF_LIFE_MS` of wall time, so a worker
//! that stopped getting traffic because it looked slow drifts back to the fleet's factor and is
//! tried again.
//!
//! A record is 72 bytes, one shared-data key per worker entry of the configuration
//! (`ekr.timing.<index>`): bounded by the configuration, never per request.

use crate::events::TimingSums;
use crate::store::{SharedStore, StoreError};

/// Samples whose weight is `1/e` of the newest one's.
pub const SAMPLE_MEMORY: f64 = 32.0;
/// Wall-time half-life of what was learned (ms).
pub const HALF_LIFE_MS: f64 = 30_000.0;
/// With fewer than two workers learned, there is no spread to measure: a worker's own mean is
/// blended with the prior as `n / (n + PRIOR_SAMPLES)`.
pub const PRIOR_SAMPLES: f64 = 4.0;
/// A sample's observed/predicted ratio is clamped to `[1/MAX_RATIO, MAX_RATIO]`.
const MAX_RATIO: f64 = 32.0;
/// Factors are kept within `[1/MAX_FACTOR, MAX_FACTOR]`.
pub const MAX_FACTOR: f64 = 256.0;
/// Predictions shorter than this teach nothing (a fully cached prompt on an idle worker is
/// predicted at ~0 ms; its observed time is network and one step).
pub const MIN_PREDICTED_MS: f64 = 1.0;
/// The least spread of single log-ratio samples assumed (a fleet without jitter would
/// otherwise trust one sample fully).
const MIN_SAMPLE_VARIANCE: f64 = 0.01;

/// A worker with fewer effective samples than this (one sample, or a few long aged: the count
/// halves with every half-life) is priced at the fleet's factor and left out of the spread
/// between workers: one sample can be all queue (a short prompt that waited behind
/// another replica's long prefill, 13x its prediction), and priced by it the worker got no
/// request from that Envoy again (`loadgen sim`, three Envoys: factors of 12-18x on one worker
/// of a fleet of one speed).
pub const MIN_WORKER_SAMPLES: f64 = 1.5;

/// The pooled slope of the log ratio on the log own prefill is kept within `±MAX_SLOPE`.
const MAX_SLOPE: f64 = 2.0;

/// Records a tick reads ([`LearnedTimings::read_next`]): at 8 workers all of them, at 1,000
/// each one every ~16 ticks.
pub const RECORDS_PER_TICK: usize = 64;

/// Bytes of an encoded record.
pub const RECORD_LEN: usize = 72;
const MAGIC: u32 = 0x4b52_5433; // "KRT3"

/// Shared-data key of worker entry `index`'s record.
pub fn key(index: usize) -> String {
    format!("ekr.timing.{index}")
}

/// What the timing polynomials predicted for one request on the worker it was sent to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// The whole time to first token: the queue ahead, the request's own prefill, the decode
    /// steps in between (ms).
    pub ttft_ms: f64,
    /// The request's own uncached prefill alone (ms): the part of the time that is the worker's
    /// compute, not a queue the router may not have seen.
    pub own_ms: f64,
}

/// One worker's learned timing: decayed sums over its samples, each sample weighted by `p`, the
/// predicted time of its own prefill. A sample whose time is mostly its own compute says how
/// fast the worker is; one whose time is mostly a queue (a cached prompt behind other
/// requests, some of them other replicas' that the router did not see) says little of it.
/// `Default` is "nothing learned".
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimingRecord {
    /// Σ p, Σ p·x, Σ p·x², Σ p², Σ p·z, Σ p·z², Σ p·x·z over the samples, x being
    /// ln(observed / predicted) and z ln(own prefill) (the sample's size, for the mix
    /// adjustment); `(Σ p)² / Σ p²` is the effective sample count. The same sums another
    /// Envoy's declaration carries (`timing=`).
    pub sums: TimingSums,
    /// When the sums were last decayed (ms since the epoch).
    pub updated_ms: u64,
    /// Samples ever taken (not decayed; for stats).
    pub samples: u32,
}

/// What one record says, as of a time: its mean log ratio, the spread of its samples around it,
/// and how many samples it is worth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub mean_log: f64,
    /// Σ p · (x - mean)² over Σ p: the samples' variance around the mean.
    pub variance: f64,
    pub effective_samples: f64,
    /// The weighted mean of the samples' log own prefill (their size).
    pub mean_size: f64,
    /// The weighted variance of the samples' log own prefill.
    pub size_variance: f64,
    /// The weighted covariance of the log ratio with the log own prefill.
    pub covariance: f64,
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
        self.scaled(keep, now_ms.max(self.updated_ms))
    }

    fn scaled(&self, keep: f64, updated_ms: u64) -> TimingRecord {
        TimingRecord {
            sums: self.sums.scaled(keep),
            updated_ms,
            samples: self.samples,
        }
    }

    /// Takes one request's observed TTFT (ms) against its prediction. Returns whether the
    /// sample was used (finite, and a whole prediction and own prefill of at least
    /// [`MIN_PREDICTED_MS`]).
    pub fn observe(&mut self, observed_ms: f64, predicted: Prediction, now_ms: u64) -> bool {
        let Prediction { ttft_ms, own_ms } = predicted;
        if !(observed_ms.is_finite() && ttft_ms.is_finite() && own_ms.is_finite())
            || ttft_ms < MIN_PREDICTED_MS
            || own_ms < MIN_PREDICTED_MS
            || observed_ms < 0.0
        {
            return false;
        }
        let observed = observed_ms.clamp(ttft_ms / MAX_RATIO, ttft_ms * MAX_RATIO);
        let x = (observed / ttft_ms).ln();
        let p = own_ms.min(ttft_ms);
        let z = p.ln();
        let decayed = self.decayed(now_ms);
        let mut r = decayed.scaled(1.0 - 1.0 / SAMPLE_MEMORY, decayed.updated_ms);
        let t = &mut r.sums;
        t.predicted_ms += p;
        t.log_ratio += p * x;
        t.log_ratio_sq += p * x * x;
        t.predicted_sq += p * p;
        t.log_own += p * z;
        t.log_own_sq += p * z * z;
        t.cross += p * x * z;
        r.samples = r.samples.saturating_add(1);
        *self = r;
        true
    }

    /// The sums as of `now_ms`, without their clock: what this Envoy declares to the bridge for
    /// the other Envoys in front of the worker.
    pub fn sums_at(&self, now_ms: u64) -> TimingSums {
        self.decayed(now_ms).sums
    }

    /// A record of `sums` as of `at_ms` (the other routers' sums, as relayed); nothing learned
    /// when they are not valid sums.
    pub fn from_sums(sums: &TimingSums, at_ms: u64) -> TimingRecord {
        if !sums.is_valid() {
            return TimingRecord::default();
        }
        TimingRecord {
            sums: *sums,
            updated_ms: at_ms,
            samples: 0,
        }
    }

    /// This record's sums and `other`'s, both as of `now_ms` (the later of their clocks): what
    /// both learned, as one record would hold it had it taken both sets of samples.
    pub fn plus(&self, other: &TimingRecord, now_ms: u64) -> TimingRecord {
        let at = now_ms.max(self.updated_ms).max(other.updated_ms);
        let (a, b) = (self.decayed(at), other.decayed(at));
        TimingRecord {
            sums: a.sums.plus(&b.sums),
            updated_ms: at,
            samples: a.samples.saturating_add(b.samples),
        }
    }

    /// The record as of `now_ms`; `None` when nothing is left of what was learned.
    pub fn summary(&self, now_ms: u64) -> Option<Summary> {
        let r = self.decayed(now_ms).sums;
        if !(r.predicted_ms > 1e-9 && r.predicted_sq > 0.0) {
            return None;
        }
        let w = r.predicted_ms;
        let mean_log = r.log_ratio / w;
        let variance = (r.log_ratio_sq / w - mean_log * mean_log).max(0.0);
        let effective_samples = w * w / r.predicted_sq;
        let mean_size = r.log_own / w;
        let size_variance = (r.log_own_sq / w - mean_size * mean_size).max(0.0);
        let covariance = r.cross / w - mean_log * mean_size;
        // Their sum is finite only if each is (or an overflow refuses a record of huge sums).
        let sum = mean_log + variance + effective_samples + mean_size + size_variance + covariance;
        sum.is_finite().then_some(Summary {
            mean_log,
            variance,
            effective_samples,
            mean_size,
            size_variance,
            covariance,
        })
    }

    /// Effective samples left at `now_ms` (0 when nothing was learned).
    pub fn weight_at(&self, now_ms: u64) -> f64 {
        self.summary(now_ms).map_or(0.0, |s| s.effective_samples)
    }

    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut out = [0u8; RECORD_LEN];
        let sums = <[f64; 7]>::from(self.sums).map(f64::to_le_bytes);
        let parts = [MAGIC.to_le_bytes(), self.samples.to_le_bytes()];
        let updated = self.updated_ms.to_le_bytes();
        let bytes = parts.iter().flatten().chain(sums.iter().flatten());
        let bytes = bytes.chain(updated.iter());
        for (dst, b) in out.iter_mut().zip(bytes) {
            *dst = *b;
        }
        out
    }

    /// `None` for anything but a record [`Self::encode`] wrote with finite sums (the weights
    /// non-negative).
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
        let mut sums = [0.0; 7];
        for (i, v) in sums.iter_mut().enumerate() {
            *v = f64::from_bits(u64_at(8 + 8 * i)?);
        }
        let r = TimingRecord {
            samples: u32_at(4)?,
            sums: TimingSums::from(sums),
            updated_ms: u64_at(64)?,
        };
        r.sums.is_valid().then_some(r)
    }
}

/// Adds one sample to worker entry `index`'s shared record (get, observe, CAS set; a few retries
/// when another VM wrote meanwhile). Returns the record as written, `None` when the sample was
/// unusable or every attempt lost its race (the sample is dropped: one of many).
pub fn record_sample(
    store: &impl SharedStore,
    index: usize,
    observed_ms: f64,
    predicted: Prediction,
    now_ms: u64,
) -> Option<TimingRecord> {
    let key = key(index);
    for _ in 0..4 {
        let (bytes, cas) = store.get(&key);
        let mut record = bytes
            .as_deref()
            .and_then(TimingRecord::decode)
            .unwrap_or_default();
        if !record.observe(observed_ms, predicted, now_ms) {
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
    /// Per worker entry, what the other Envoys learned of it, as the bridge relayed it (their
    /// records summed; nothing learned without a relay). Learned alongside this Envoy's own.
    pub others: Vec<TimingRecord>,
    /// Per worker entry, the factor the router multiplies predictions by.
    pub factors: Vec<f64>,
    /// The fleet's factor (the prior of a worker with few samples).
    pub fleet: f64,
    /// The worker entry [`LearnedTimings::read_next`] reads first.
    cursor: usize,
}

impl Default for LearnedTimings {
    /// Nothing learned: every factor 1 (also before the first refresh).
    fn default() -> Self {
        LearnedTimings {
            records: Vec::new(),
            others: Vec::new(),
            factors: Vec::new(),
            fleet: 1.0,
            cursor: 0,
        }
    }
}

impl LearnedTimings {
    /// Resizes to `workers` entries (new ones learned nothing).
    pub fn resize(&mut self, workers: usize) {
        self.records.resize(workers, TimingRecord::default());
        self.others.resize(workers, TimingRecord::default());
        self.factors.resize(workers, 1.0);
    }

    /// The tick's part: reads the shared records of up to `max` of `workers` entries, each
    /// tick the next ones (at 8 workers all of them, at 1,000 each one every few ticks), then
    /// recomputes every factor.
    pub fn read_next(&mut self, store: &impl SharedStore, workers: usize, max: usize, now_ms: u64) {
        self.resize(workers);
        for _ in 0..workers.min(max) {
            let i = self.cursor % workers.max(1);
            self.cursor = i + 1;
            if let Some(r) = self.records.get_mut(i) {
                *r = read_record(store, i);
            }
        }
        self.refresh(now_ms);
    }

    /// Recomputes the factors at `now_ms`: the fleet's mean log ratio (weighted by the workers'
    /// effective samples; factor 1 when nothing was learned), then each worker's mean shrunk
    /// toward it by how much of the workers' spread is noise (see the module's doc).
    pub fn refresh(&mut self, now_ms: u64) {
        let nothing = TimingRecord::default();
        let others = self.others.iter().chain(std::iter::repeat(&nothing));
        let summaries: Vec<Option<Summary>> = self
            .records
            .iter()
            .zip(others)
            .map(|(own, others)| own.plus(others, now_ms).summary(now_ms))
            .collect();
        let learned = || summaries.iter().flatten();
        let samples: f64 = learned().map(|s| s.effective_samples).sum();
        // A value's mean over the fleet, each worker weighted by its effective samples.
        let fleet_mean = |value: &dyn Fn(&Summary) -> f64| {
            if samples > 1e-9 {
                learned()
                    .map(|s| s.effective_samples * value(s))
                    .sum::<f64>()
                    / samples
            } else {
                0.0
            }
        };
        // How the log ratio moves with the size of a sample's own prefill, within workers,
        // pooled (one slope for the fleet: the predictor's error in form, not a worker's
        // speed). Each worker's mean is then read at the fleet's mean size, so a worker that
        // happened to get the short prompts is not priced by the predictor's error on them.
        let size_spread = fleet_mean(&|s| s.size_variance);
        let slope = if size_spread > 1e-6 {
            (fleet_mean(&|s| s.covariance) / size_spread).clamp(-MAX_SLOPE, MAX_SLOPE)
        } else {
            0.0
        };
        let center = fleet_mean(&|s| s.mean_size);
        let adjusted = |s: &Summary| s.mean_log - slope * (s.mean_size - center);
        self.fleet = clamp_factor(fleet_mean(&adjusted).exp());
        let fleet_log = self.fleet.ln();
        // Single samples' spread around their worker's line, pooled over the fleet.
        let residual =
            |s: &Summary| s.variance - 2.0 * slope * s.covariance + slope * slope * s.size_variance;
        let within = fleet_mean(&residual).max(MIN_SAMPLE_VARIANCE);
        // The workers' means' spread beyond what their noise gives (method of moments), over
        // the workers with enough samples to say anything of their own.
        let trusted = || learned().filter(|s| s.effective_samples >= MIN_WORKER_SAMPLES);
        let workers = trusted().count();
        let between = if workers >= 2 {
            let (mut spread, mut noise) = (0.0, 0.0);
            for s in trusted() {
                spread += (adjusted(s) - fleet_log).powi(2);
                noise += within / s.effective_samples;
            }
            Some(((spread - noise) / workers as f64).max(0.0))
        } else {
            None
        };
        self.factors.clear();
        self.factors.extend(summaries.iter().map(|s| match s {
            None => self.fleet,
            Some(s) if s.effective_samples < MIN_WORKER_SAMPLES => self.fleet,
            Some(s) => {
                let own = match between {
                    Some(b) if b > 0.0 => b / (b + within / s.effective_samples),
                    Some(_) => 0.0,
                    None => s.effective_samples / (s.effective_samples + PRIOR_SAMPLES),
                };
                clamp_factor((fleet_log + own * (adjusted(s) - fleet_log)).exp())
            }
        }));
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
    use crate::rng::Rng;

    /// A prediction that is all the request's own prefill.
    fn all(ms: f64) -> Prediction {
        Prediction {
            ttft_ms: ms,
            own_ms: ms,
        }
    }

    fn near(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    /// Workers `slowness[i]` times slower than predicted, `samples` each, every sample's ratio
    /// multiplied by a jitter of `exp(±jitter)` (uniform in log).
    fn fleet(slowness: &[f64], samples: u64, jitter: f64, seed: u64) -> LearnedTimings {
        let mut rng = Rng::new(seed);
        let mut t = LearnedTimings::default();
        t.resize(slowness.len());
        for i in 0..samples {
            for (w, slow) in slowness.iter().enumerate() {
                let noise = ((rng.next_f64() * 2.0 - 1.0) * jitter).exp();
                t.records[w].observe(100.0 * slow * noise, all(100.0), i);
            }
        }
        t.refresh(samples);
        t
    }

    #[test]
    fn what_other_envoys_learned_counts_as_if_this_one_had_taken_their_samples() {
        // Three Envoys in front of a fleet of speeds 1, 2 and 4 (slowness 4, 2, 1), each taking
        // a third of the samples: one that also reads the others' relayed sums prices the
        // workers as one Envoy that took all of them would.
        let slowness = [4.0, 2.0, 1.0];
        let mut envoys = vec![LearnedTimings::default(); 3];
        let mut alone = LearnedTimings::default();
        alone.resize(3);
        for e in &mut envoys {
            e.resize(3);
        }
        let mut rng = Rng::new(5);
        for i in 0..30u64 {
            for (w, slow) in slowness.iter().enumerate() {
                let observed = 100.0 * slow * ((rng.next_f64() - 0.5) * 0.6).exp();
                let envoy = (i % 3) as usize;
                envoys[envoy].records[w].observe(observed, all(100.0), i * 10);
                alone.records[w].observe(observed, all(100.0), i * 10);
            }
        }
        let now = 300;
        alone.refresh(now);
        let mut first = envoys[0].clone();
        first.refresh(now);
        for w in 0..3 {
            // The bridge's sum of the other two Envoys' declarations, as of their declaration.
            let sums = envoys[1].records[w]
                .sums_at(now)
                .plus(&envoys[2].records[w].sums_at(now));
            first.others[w] = TimingRecord::from_sums(&sums, now);
        }
        let own_only: Vec<f64> = (0..3).map(|w| first.factor(w)).collect();
        assert!(
            (0..3).any(|w| !near(own_only[w], alone.factor(w), 0.02)),
            "a third of the samples prices alike: the test would not tell ({own_only:?})"
        );
        first.refresh(now);
        for (w, own) in own_only.iter().enumerate() {
            let (merged, all) = (first.factor(w), alone.factor(w));
            assert!(
                near(merged, all, 0.02),
                "worker {w}: {merged} with the others' sums, {all} for one Envoy with every \
                 sample ({own} from its own third)"
            );
        }
        // Sums that are not sums (a negative weight) teach nothing.
        let bad = TimingSums {
            predicted_ms: -1.0,
            ..TimingSums::default()
        };
        assert_eq!(TimingRecord::from_sums(&bad, now), TimingRecord::default());
        // The others' sums age like the own: a relay a half-life old weighs half.
        let record = TimingRecord::from_sums(&envoys[1].records[0].sums_at(now), now);
        let later = now + HALF_LIFE_MS as u64;
        assert!(near(
            record.weight_at(later) * 2.0,
            record.weight_at(now),
            1e-9
        ));
    }

    #[test]
    fn before_the_first_refresh_every_factor_is_one() {
        let t = LearnedTimings::default();
        assert_eq!((t.factor(0), t.factor(7), t.fleet), (1.0, 1.0, 1.0));
        let mut t = LearnedTimings::default();
        t.resize(3);
        assert_eq!(t.factor(2), 1.0);
        t.refresh(1_000);
        assert_eq!((t.factors.clone(), t.fleet), (vec![1.0; 3], 1.0));
    }

    #[test]
    fn a_worker_twice_as_slow_as_predicted_learns_two() {
        let t = fleet(&[2.0], 64, 0.0, 1);
        assert!(near(t.factor(0), 2.0, 0.01), "{}", t.factor(0));
        // A worker added later starts at the fleet's factor.
        assert!(near(t.factor(5), 2.0, 0.01));
    }

    #[test]
    fn queue_dominated_samples_say_little_of_speed() {
        // Long prompts computed as fast as predicted, alternating with cached prompts (2 ms of
        // their own) that waited 3x their prediction behind requests the router did not see:
        // the worker computes at the predicted speed (weighing by whole predictions would say
        // 1.25, counting samples alike 1.7).
        let mut t = LearnedTimings::default();
        t.resize(1);
        let queued = Prediction {
            ttft_ms: 50.0,
            own_ms: 2.0,
        };
        for i in 0..64 {
            assert!(t.records[0].observe(200.0, all(200.0), i));
            assert!(t.records[0].observe(150.0, queued, i));
        }
        t.refresh(64);
        assert!(t.factor(0) < 1.05, "{}", t.factor(0));
        // A fully cached prompt has nothing of its own to compute: it teaches nothing.
        let cached = Prediction {
            ttft_ms: 50.0,
            own_ms: 0.0,
        };
        assert!(!t.records[0].observe(150.0, cached, 65));
    }

    #[test]
    fn a_worker_that_speeds_up_is_relearned_within_its_sample_memory() {
        let mut t = fleet(&[3.0], 200, 0.0, 1);
        assert!(near(t.factor(0), 3.0, 0.03));
        for i in 0..100 {
            t.records[0].observe(100.0, all(100.0), 200 + i);
        }
        t.refresh(300);
        let f = t.factor(0);
        assert!(f < 1.2, "after 100 samples at 1x the factor is {f}");
    }

    #[test]
    fn a_fleet_of_one_speed_is_priced_as_one_whatever_its_noise() {
        // Eight equal workers, 15 samples each with a 2x jitter either way: each worker's own
        // mean strays by noise (the unshrunk estimate's spread), the factors do not, but for
        // the odd draw where one worker's noise looks like a real difference.
        let spread = |v: &mut dyn Iterator<Item = f64>| {
            let (lo, hi) = v.fold((f64::MAX, 0.0f64), |(lo, hi), f| (lo.min(f), hi.max(f)));
            hi / lo
        };
        let mut flat = 0;
        for seed in 1..=20 {
            let t = fleet(&[1.5; 8], 15, 2f64.ln(), seed);
            let shrunk = spread(&mut t.factors.iter().copied());
            let now = 15;
            let raw = spread(
                &mut t
                    .records
                    .iter()
                    .map(|r| r.summary(now).map_or(1.0, |s| s.mean_log.exp())),
            );
            assert!(
                raw > 1.15,
                "seed {seed}: the noise is large enough to matter ({raw})"
            );
            assert!(
                shrunk < 1.4 && shrunk <= raw,
                "seed {seed}: {shrunk} (unshrunk {raw})"
            );
            flat += usize::from(shrunk < 1.02);
            assert!(near(t.fleet, 1.5, 0.1), "seed {seed}: fleet {}", t.fleet);
        }
        assert!(flat >= 15, "{flat} of 20 fleets priced flat");
        // The same noise and samples on workers 1x, 2x and 4x apart: each is priced by its own.
        for seed in 1..=20 {
            let t = fleet(&[1.0, 1.0, 2.0, 2.0, 4.0, 4.0], 15, 2f64.ln(), seed);
            for (f, slow) in t.factors.iter().zip([1.0, 1.0, 2.0, 2.0, 4.0, 4.0]) {
                assert!(
                    near(*f / t.fleet, slow / 2.0, 0.3),
                    "seed {seed}: {:?}",
                    t.factors
                );
            }
        }
    }

    /// Workers `slowness[i]` times slower, each sent short prompts (own prefill 10 ms) and long
    /// ones (400 ms), worker `i` a share `long[i]` of long ones; the predictor errs by prompt
    /// size (observed = slowness × predicted × (own / 100 ms)^0.4, a 4.4x spread between the
    /// sizes) with a jitter of `exp(±0.3)`.
    fn mixes(slowness: &[f64], long: &[f64], samples: u64, seed: u64) -> LearnedTimings {
        let mut rng = Rng::new(seed);
        let mut t = LearnedTimings::default();
        t.resize(slowness.len());
        for i in 0..samples {
            for (w, (slow, long)) in slowness.iter().zip(long).enumerate() {
                let own = if rng.next_f64() < *long { 400.0 } else { 10.0 };
                let noise = ((rng.next_f64() * 2.0 - 1.0) * 0.3).exp();
                let observed = slow * own * (own / 100.0f64).powf(0.4) * noise;
                t.records[w].observe(observed, all(own), i);
            }
        }
        t.refresh(samples);
        t
    }

    #[test]
    fn a_worker_is_not_priced_by_the_sizes_it_happened_to_get() {
        // Equal workers, some sent mostly short prompts and some mostly long ones: their own
        // means differ by the predictor's error in form, their factors do not.
        let long = [0.03, 0.03, 0.03, 0.03, 0.5, 0.5, 0.5, 0.5];
        for seed in 1..=10 {
            let t = mixes(&[1.0; 8], &long, 60, seed);
            let spread = |v: &mut dyn Iterator<Item = f64>| {
                let (lo, hi) = v.fold((f64::MAX, 0.0f64), |(lo, hi), f| (lo.min(f), hi.max(f)));
                hi / lo
            };
            let raw = spread(&mut (0..8).map(|w| t.records[w].summary(60).unwrap().mean_log.exp()));
            assert!(raw > 1.4, "seed {seed}: own means spread {raw}");
            let priced = spread(&mut t.factors.iter().copied());
            assert!(
                priced < 1.15,
                "seed {seed}: {:?} (own means {raw})",
                t.factors
            );
        }
        // The slow half of a mixed fleet got the long prompts: it is priced 3x, not the 5-14x
        // its own means say.
        for seed in 1..=10 {
            let t = mixes(&[1.0, 1.0, 3.0, 3.0], &[0.03, 0.03, 0.5, 0.5], 60, seed);
            let own = |w: usize| t.records[w].summary(60).unwrap().mean_log;
            for w in [2, 3] {
                let relative = t.factor(w) / (t.factor(0) * t.factor(1)).sqrt();
                let unadjusted = (own(w) - (own(0) + own(1)) / 2.0).exp();
                assert!(
                    unadjusted > 4.5,
                    "seed {seed}: the mix confounds ({unadjusted})"
                );
                assert!(near(relative, 3.0, 0.2), "seed {seed}: {:?}", t.factors);
            }
        }
    }

    #[test]
    fn a_noisy_worker_is_trusted_as_far_as_its_samples_go() {
        // Three workers at 1x with many samples, a fourth 2x slower: with few noisy samples it
        // is priced between the fleet and its own mean, with many at its own.
        let noisy = |samples| {
            let mut t = fleet(&[1.0, 1.0, 1.0], 200, 0.5, 3);
            let mut rng = Rng::new(9);
            t.resize(4);
            for i in 0..samples {
                let noise = ((rng.next_f64() * 2.0 - 1.0) * 0.5).exp();
                t.records[3].observe(200.0 * noise, all(100.0), 200 + i);
            }
            t.refresh(200 + samples);
            // Its own mean, unshrunk, against the others'.
            let own = t.records[3].summary(200 + samples).unwrap().mean_log.exp() / t.factor(0);
            (t.factor(3) / t.factor(0), own)
        };
        let ((few, few_own), (many, _)) = (noisy(2), noisy(100));
        assert!(few > 1.05 && few < 1.9, "2 samples: {few}");
        assert!(
            few < few_own * 0.95,
            "2 samples: {few}, its own mean {few_own}"
        );
        assert!(near(many, 2.0, 0.1), "100 samples: {many}");
    }

    #[test]
    fn an_idle_worker_drifts_back_to_the_fleet() {
        // Worker 1 is 4x slower and stops getting traffic; worker 0 keeps getting it.
        let mut t = fleet(&[1.0, 4.0], 100, 0.3, 5);
        assert!(near(t.factor(1) / t.factor(0), 4.0, 0.1));
        let learned = t.records[1].weight_at(100);
        let mut rng = Rng::new(6);
        let mut now = 100;
        let mut at = |t: &mut LearnedTimings, half_lives: u64| {
            let until = now + half_lives * HALF_LIFE_MS as u64;
            while now < until {
                now += 1_000;
                let noise = ((rng.next_f64() * 2.0 - 1.0) * 0.3).exp();
                t.records[0].observe(100.0 * noise, all(100.0), now);
            }
            t.refresh(now);
            (t.factor(1) / t.factor(0), t.records[1].weight_at(now))
        };
        // What it learned weighs half as much per half-life: still priced as slow after one ...
        let (later, weight) = at(&mut t, 1);
        assert!(near(later, 4.0, 0.15), "{later}");
        assert!(near(weight, learned / 2.0, 0.01), "{weight} of {learned}");
        // ... tried again once under MIN_WORKER_SAMPLES are left: the fleet's factor.
        let (much_later, weight) = at(&mut t, 5);
        assert!(weight < MIN_WORKER_SAMPLES, "{weight}");
        assert_eq!(t.factor(1), t.fleet);
        assert!(much_later < 1.1, "{much_later}");
    }

    #[test]
    fn one_sample_that_was_all_queue_does_not_price_a_worker() {
        // Eight workers of one speed; a ninth's only sample waited 13x its prediction (a
        // short prompt behind another replica's long prefill).
        let mut t = fleet(&[1.0; 8], 20, 0.3, 11);
        t.resize(9);
        t.records[8].observe(13.0 * 20.0, all(20.0), 21);
        t.refresh(21);
        assert_eq!(t.factor(8), t.fleet, "{:?}", t.factors);
        // A second sample like it makes it a worker of its own.
        t.records[8].observe(13.0 * 20.0, all(20.0), 22);
        t.refresh(22);
        assert!(t.factor(8) > 4.0 * t.fleet, "{:?}", t.factors);
    }

    #[test]
    fn outliers_and_useless_samples_are_bounded() {
        let mut r = TimingRecord::default();
        assert!(!r.observe(f64::NAN, all(100.0), 0));
        assert!(!r.observe(100.0, all(0.2), 0));
        assert!(!r.observe(-1.0, all(100.0), 0));
        assert_eq!(r, TimingRecord::default());
        for i in 0..100 {
            r.observe(1e12, all(10.0), i);
        }
        let mut t = LearnedTimings {
            records: vec![r],
            ..LearnedTimings::default()
        };
        t.refresh(100);
        assert!(t.factor(0) <= MAX_RATIO * 1.0001);
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let mut r = TimingRecord::default();
        r.observe(123.0, all(45.0), 1_700_000_000_000);
        r.observe(12.0, all(45.0), 1_700_000_000_001);
        let bytes = r.encode();
        assert_eq!(TimingRecord::decode(&bytes), Some(r));
        assert_eq!(TimingRecord::decode(&bytes[1..]), None);
        let mut bad = bytes;
        bad[0] ^= 1;
        assert_eq!(TimingRecord::decode(&bad), None);
        let mut nan = bytes;
        nan[8..16].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        assert_eq!(TimingRecord::decode(&nan), None);
        let mut negative = bytes;
        negative[32..40].copy_from_slice(&(-1.0f64).to_bits().to_le_bytes());
        assert_eq!(TimingRecord::decode(&negative), None);
    }

    #[test]
    fn samples_from_every_vm_land_in_one_shared_record() {
        use crate::store::fake::MemStore;
        let store = MemStore::new();
        assert_eq!(read_record(&store, 3), TimingRecord::default());
        record_sample(&store, 3, 300.0, all(100.0), 10).unwrap();
        // Another VM writes between this one's get and set: the CAS retry keeps both samples.
        let raced = std::rc::Rc::new(std::cell::Cell::new(false));
        let flag = std::rc::Rc::clone(&raced);
        store.set_hook(move |s, op| {
            if matches!(op, crate::store::fake::Op::Set(_)) && !flag.get() {
                flag.set(true);
                record_sample(s, 3, 300.0, all(100.0), 10);
            }
        });
        let written = record_sample(&store, 3, 300.0, all(100.0), 10).unwrap();
        store.clear_hook();
        assert!(raced.get());
        assert_eq!(written.samples, 3);
        assert_eq!(read_record(&store, 3), written);
        assert_eq!(read_record(&store, 2), TimingRecord::default());
        assert!(record_sample(&store, 3, 300.0, all(0.0), 10).is_none());
    }

    #[test]
    fn a_mixed_fleet_learns_each_workers_relative_speed() {
        // Workers 1x, 2x and 4x slower than predicted; a new fourth worker starts at the
        // fleet's factor.
        let mut t = fleet(&[1.0, 2.0, 4.0], 100, 0.2, 7);
        t.resize(4);
        t.refresh(100);
        assert!(near(t.factor(0), 1.0, 0.05), "{:?}", t.factors);
        assert!(near(t.factor(1), 2.0, 0.05));
        assert!(near(t.factor(2), 4.0, 0.05));
        assert!(near(t.fleet, 2.0, 0.05), "{}", t.fleet);
        assert!(near(t.factor(3), t.fleet, 1e-9));
        assert!(near(t.factor(99), t.fleet, 1e-9));
    }
}
