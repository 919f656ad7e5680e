//! Dynamo's KV cost model. Lower is better. Pure: no side effects.
//!
//! ```text
//! raw_prefill_blocks = (active_prefill_tokens + isl_tokens) / block_size
//! credit = overlap_score_credit * device_blocks + host_cache_hit_weight * host_blocks
//!        + disk_cache_hit_weight * disk_blocks + shared_cache_multiplier * shared_beyond_device_blocks
//! adjusted_prefill_blocks = max(raw_prefill_blocks - credit, 0)
//! decode_blocks = active_decode_blocks + new_blocks          (this request included)
//! cost = (prefill_load_scale * adjusted_prefill_blocks + decode_blocks
//!         + decode_active_request_weight * active_requests) * preferred_taint_multiplier
//! ```
//!
//! * `new_blocks` = the prompt's blocks minus those already cached on the slot's device
//!   ([`new_decode_blocks`]): prefix-cached device blocks are shared with the requests that hold
//!   them, not allocated again. This is also what the router books in the load table, and it is
//!   what makes the documented worked example (decode 10/5/9 with a 10-block prompt and device
//!   overlaps 2/5/8) consistent: each slot's decode load is its existing load plus 8/5/2.
//! * `shared_beyond_device_blocks` is taken as 0: shared / external / remote storage arrives as the
//!   `Disk` tier (see `StorageTier::parse`) and is credited with `disk_cache_hit_weight`; there is
//!   no separate cluster-wide shared-cache signal to count twice. `shared_cache_multiplier` is
//!   accepted for configuration compatibility and has no effect.
//! * `active_requests` is the slot's in-flight count before this request.

use std::fmt;

use crate::config::CostWeights;
use crate::load::SlotLoad;
use crate::prefill_work::WorkShape;
use crate::types::Overlap;

/// Everything the cost of one slot depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostInputs {
    pub isl_tokens: u32,
    /// The prompt's KV blocks, `ceil(isl_tokens / block_size)`.
    pub prompt_blocks: u32,
    pub overlap: Overlap,
    pub load: SlotLoad,
    /// [`preferred_taint_multiplier`] of the slot's worker (1.0 = no preference).
    pub preferred_multiplier: f64,
}

/// The terms of one slot's cost, for headers, logs and tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlotCost {
    pub raw_prefill_blocks: f64,
    pub credit_blocks: f64,
    pub adjusted_prefill_blocks: f64,
    pub decode_blocks: f64,
    pub cost: f64,
}

/// A cost that is NaN or infinite: the inputs are corrupt; never pick on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NonFiniteCost {
    pub cost: f64,
}

impl fmt::Display for NonFiniteCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cost is not finite ({})", self.cost)
    }
}

/// KV blocks this request adds to a slot's decode load: its prompt blocks not already on the
/// slot's device.
pub fn new_decode_blocks(prompt_blocks: u32, overlap: &Overlap) -> u32 {
    prompt_blocks.saturating_sub(overlap.device_blocks)
}

/// `exp(-tanh(sum of the weights of preferred taints the worker carries))`: in `(e^-1, e^1)`,
/// below 1 for a preferred worker, above 1 for a negatively weighted one.
pub fn preferred_taint_multiplier(worker_taints: &[String], preferred: &[(String, f64)]) -> f64 {
    let sum: f64 = preferred
        .iter()
        .filter(|(t, _)| worker_taints.iter().any(|w| w == t))
        .map(|(_, w)| *w)
        .sum();
    (-sum.tanh()).exp()
}

/// The cost's per-request terms, computed once for every slot of a decision (the one place the
/// formula above is written).
#[derive(Clone, Copy, Debug)]
pub struct KvCost {
    /// A copy: the per-slot loop keeps the weights in registers, where a reference would be
    /// re-read after every cost it stores.
    weights: CostWeights,
    bs: f64,
    isl: f64,
    prompt_blocks: u32,
    /// The credit of an empty overlap (`w * 0.0` summed as in [`KvCost::terms`]: 0 for finite
    /// weights, NaN otherwise) and the decode blocks it adds, for [`KvCost::unchecked_cost`].
    zero_credit: f64,
    zero_new_blocks: f64,
    /// With [`KvCost::with_work`]: the prefill polynomial's shape, and the request's work from
    /// scratch.
    work: Option<(WorkShape, f64)>,
}

impl KvCost {
    pub fn new(
        weights: &CostWeights,
        block_size: u32,
        isl_tokens: u32,
        prompt_blocks: u32,
    ) -> Self {
        let zero = Overlap::default();
        KvCost {
            weights: *weights,
            bs: f64::from(block_size.max(1)),
            isl: f64::from(isl_tokens),
            prompt_blocks,
            zero_credit: credit_blocks(weights, &zero),
            zero_new_blocks: f64::from(new_decode_blocks(prompt_blocks, &zero)),
            work: None,
        }
    }

    /// Prices prefill as work ([`crate::prefill_work`]) of the polynomial `poly`: the request's
    /// own term is its work after the slot's credited prefix, the booked load the work ahead
    /// (booked as such). A long prompt then weighs what its attention costs, and a cached prefix
    /// is credited with all it saves. Unchanged without a per-token rate.
    pub fn with_work(mut self, poly: &[f64]) -> Self {
        self.work = WorkShape::of(poly).map(|shape| (shape, shape.from_scratch(self.isl)));
        self
    }

    /// The slot's cost and its terms. Inlined into the decision's loop, where only `cost` is
    /// read: the other terms are not kept.
    #[inline]
    pub fn terms(
        &self,
        o: &Overlap,
        load: &SlotLoad,
        preferred_multiplier: f64,
    ) -> Result<SlotCost, NonFiniteCost> {
        let new_blocks = f64::from(new_decode_blocks(self.prompt_blocks, o));
        let credit = credit_blocks(&self.weights, o);
        let t = self.unchecked_terms(load, credit, new_blocks, preferred_multiplier);
        if !t.cost.is_finite() {
            return Err(NonFiniteCost { cost: t.cost });
        }
        Ok(t)
    }

    /// The formula itself; the cost may be NaN or infinite (callers check).
    #[inline(always)]
    fn unchecked_terms(
        &self,
        load: &SlotLoad,
        credit_blocks: f64,
        new_blocks: f64,
        preferred_multiplier: f64,
    ) -> SlotCost {
        let w = &self.weights;
        let (own, credit_blocks) = match &self.work {
            None => (self.isl, credit_blocks),
            // The credited prefix saves its own work from scratch: what is left is the rest of
            // the prompt's work after it.
            Some((shape, isl_work)) => {
                let cached = (credit_blocks * self.bs).clamp(0.0, self.isl);
                // A NaN credit (corrupt weights) stays NaN, for the caller's check.
                let saved = if cached > 0.0 || cached.is_nan() {
                    shape.from_scratch(cached)
                } else {
                    0.0
                };
                (*isl_work, saved / self.bs)
            }
        };
        let raw_prefill_blocks = (load.prefill_tokens + own) / self.bs;
        // `f64::max` would turn a NaN into 0 and hide corrupt inputs: keep NaN for the check.
        let diff = raw_prefill_blocks - credit_blocks;
        let adjusted_prefill_blocks = if diff.is_nan() { diff } else { diff.max(0.0) };
        let decode_blocks = load.decode_blocks + new_blocks;
        let cost = (w.prefill_load_scale * adjusted_prefill_blocks
            + decode_blocks
            + w.decode_active_request_weight * f64::from(load.active_requests))
            * preferred_multiplier;
        SlotCost {
            raw_prefill_blocks,
            credit_blocks,
            adjusted_prefill_blocks,
            decode_blocks,
            cost,
        }
    }

    /// [`KvCost::cost`] without a preference, possibly not finite: for a loop that checks every
    /// slot's cost at once. An empty overlap takes the terms computed once per request.
    #[inline(always)]
    pub fn unchecked_cost(&self, o: &Overlap, load: &SlotLoad) -> f64 {
        if *o == Overlap::default() {
            self.unchecked_terms(load, self.zero_credit, self.zero_new_blocks, 1.0)
                .cost
        } else {
            let new_blocks = f64::from(new_decode_blocks(self.prompt_blocks, o));
            self.unchecked_terms(load, credit_blocks(&self.weights, o), new_blocks, 1.0)
                .cost
        }
    }

    /// The slot's cost; `Err(cost)` when it is not finite.
    #[inline]
    pub fn cost(
        &self,
        o: &Overlap,
        load: &SlotLoad,
        preferred_multiplier: f64,
    ) -> Result<f64, f64> {
        self.terms(o, load, preferred_multiplier)
            .map(|t| t.cost)
            .map_err(|e| e.cost)
    }
}

/// The overlap's credit in blocks (`shared_cache_multiplier` weighs shared blocks beyond the
/// device prefix, none here).
#[inline]
fn credit_blocks(w: &CostWeights, o: &Overlap) -> f64 {
    let shared_beyond_device_blocks = 0.0;
    w.overlap_score_credit * f64::from(o.device_blocks)
        + w.host_cache_hit_weight * f64::from(o.host_blocks)
        + w.disk_cache_hit_weight * f64::from(o.disk_blocks)
        + w.shared_cache_multiplier * shared_beyond_device_blocks
}

/// The cost of one slot; see the module docs.
pub fn slot_cost(
    weights: &CostWeights,
    block_size: u32,
    inputs: &CostInputs,
) -> Result<SlotCost, NonFiniteCost> {
    KvCost::new(weights, block_size, inputs.isl_tokens, inputs.prompt_blocks).terms(
        &inputs.overlap,
        &inputs.load,
        inputs.preferred_multiplier,
    )
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    fn inputs(
        device: u32,
        host: u32,
        disk: u32,
        prefill_tokens: f64,
        decode_blocks: f64,
    ) -> CostInputs {
        CostInputs {
            isl_tokens: 160,
            prompt_blocks: 10,
            overlap: Overlap {
                device_blocks: device,
                host_blocks: host,
                disk_blocks: disk,
            },
            load: SlotLoad {
                prefill_tokens,
                decode_blocks,
                active_requests: 3,
            },
            preferred_multiplier: 1.0,
        }
    }

    #[test]
    fn worked_example_costs() {
        // Existing decode loads 2/0/7 plus this request's new blocks 8/5/2 = 10/5/9.
        let w = CostWeights::default();
        let c1 = slot_cost(&w, 16, &inputs(2, 0, 0, 0.0, 2.0)).unwrap();
        let c2 = slot_cost(&w, 16, &inputs(5, 0, 0, 0.0, 0.0)).unwrap();
        let c3 = slot_cost(&w, 16, &inputs(8, 0, 0, 0.0, 7.0)).unwrap();
        assert_eq!(c1.raw_prefill_blocks, 10.0);
        assert_eq!(
            (c1.adjusted_prefill_blocks, c1.decode_blocks, c1.cost),
            (8.0, 10.0, 18.0)
        );
        assert_eq!(
            (c2.adjusted_prefill_blocks, c2.decode_blocks, c2.cost),
            (5.0, 5.0, 10.0)
        );
        assert_eq!(
            (c3.adjusted_prefill_blocks, c3.decode_blocks, c3.cost),
            (2.0, 9.0, 11.0)
        );
    }

    #[test]
    fn host_and_disk_blocks_earn_partial_credit() {
        let w = CostWeights::default();
        // 4 host blocks past 2 device blocks: credit 2 + 0.75 * 4 = 5.
        let c = slot_cost(&w, 16, &inputs(2, 4, 0, 0.0, 0.0)).unwrap();
        assert_eq!(c.credit_blocks, 5.0);
        assert_eq!(c.adjusted_prefill_blocks, 5.0);
        // 4 disk blocks: credit 2 + 0.25 * 4 = 3.
        let c = slot_cost(&w, 16, &inputs(2, 0, 4, 0.0, 0.0)).unwrap();
        assert_eq!(c.credit_blocks, 3.0);
        assert_eq!(c.adjusted_prefill_blocks, 7.0);
        // Only device blocks are shared for decode: 10 - 2 new blocks either way.
        assert_eq!(c.decode_blocks, 8.0);
    }

    #[test]
    fn priced_as_work_a_cached_long_prefix_saves_its_attention_too() {
        const POLY: [f64; 3] = [16.5, 0.0152, 4.21e-7];
        let w = CostWeights::default();
        // A 60,000-token prompt (938 blocks of 64), 900 of them cached on the holder, whose
        // queue holds 150,000 tokens of work; an idle slot has nothing of it.
        let (isl, blocks) = (60_000, 938);
        let kv = |work: bool| {
            let kv = KvCost::new(&w, 64, isl, blocks);
            if work {
                kv.with_work(&POLY)
            } else {
                kv
            }
        };
        let holder = |kv: KvCost| {
            let o = Overlap {
                device_blocks: 900,
                ..Overlap::default()
            };
            let load = SlotLoad {
                prefill_tokens: 150_000.0,
                ..SlotLoad::default()
            };
            kv.terms(&o, &load, 1.0).unwrap()
        };
        let idle = |kv: KvCost| {
            kv.terms(&Overlap::default(), &SlotLoad::default(), 1.0)
                .unwrap()
        };
        // In tokens the queue outweighs the prefix: the idle slot wins (a cost of ~1,876
        // against ~2,419).
        assert!(idle(kv(false)).cost < holder(kv(false)).cost);
        // As work the 60,000 tokens are ~160,000 to compute from scratch, the 2,400 after the
        // prefix ~4,300 (they attend to it): the holder wins (~2,449 against ~3,433).
        let (h, i) = (holder(kv(true)), idle(kv(true)));
        assert!(h.cost < i.cost, "{h:?} {i:?}");
        let own = crate::prefill_work::prefill_work_tokens(&POLY, 2_400.0, 57_600.0);
        assert!(
            (h.adjusted_prefill_blocks - (150_000.0 + own) / 64.0).abs() < 1e-6,
            "{h:?}"
        );
        // Nothing cached, nothing credited; a constant polynomial changes nothing.
        assert_eq!(i.credit_blocks, 0.0);
        let flat = KvCost::new(&w, 64, isl, blocks).with_work(&[5.0]);
        assert_eq!(idle(flat), idle(kv(false)));
    }

    #[test]
    fn active_prefill_load_scale_and_request_weight() {
        let w = CostWeights {
            prefill_load_scale: 2.0,
            decode_active_request_weight: 0.5,
            overlap_score_credit: 0.5,
            ..CostWeights::default()
        };
        // raw = (320 + 160) / 16 = 30; credit 0.5 * 4 = 2; adjusted 28; decode 1 + 6 = 7;
        // cost = 2 * 28 + 7 + 0.5 * 3 = 64.5.
        let c = slot_cost(&w, 16, &inputs(4, 0, 0, 320.0, 1.0)).unwrap();
        assert_eq!(c.raw_prefill_blocks, 30.0);
        assert_eq!(c.cost, 64.5);
        // Credit larger than the prefill clamps at 0.
        let c = slot_cost(&CostWeights::default(), 16, &inputs(10, 40, 0, 0.0, 0.0)).unwrap();
        assert_eq!(c.adjusted_prefill_blocks, 0.0);
    }

    #[test]
    fn preferred_taints_scale_the_cost() {
        let taints = vec!["a100".to_string(), "eu".to_string()];
        let pref = vec![
            ("a100".to_string(), 0.5),
            ("us".to_string(), 5.0),
            ("eu".to_string(), 0.5),
        ];
        let m = preferred_taint_multiplier(&taints, &pref);
        assert!((m - (-(1.0f64).tanh()).exp()).abs() < 1e-12);
        assert!((m - 0.466_921).abs() < 1e-6, "{m}");
        assert_eq!(preferred_taint_multiplier(&taints, &[]), 1.0);
        let neg = preferred_taint_multiplier(&taints, &[("eu".to_string(), -100.0)]);
        assert!((neg - std::f64::consts::E).abs() < 1e-9);
        let mut i = inputs(5, 0, 0, 0.0, 0.0);
        i.preferred_multiplier = m;
        let c = slot_cost(&CostWeights::default(), 16, &i).unwrap();
        assert!((c.cost - 10.0 * m).abs() < 1e-12);
    }

    #[test]
    fn non_finite_cost_is_an_error() {
        let mut i = inputs(0, 0, 0, f64::NAN, 0.0);
        assert!(slot_cost(&CostWeights::default(), 16, &i).is_err());
        i.load.prefill_tokens = 0.0;
        i.load.decode_blocks = f64::INFINITY;
        assert!(slot_cost(&CostWeights::default(), 16, &i).is_err());
    }

    #[test]
    fn the_no_overlap_cost_is_the_cost_of_an_empty_overlap_bit_for_bit() {
        let weights = [
            CostWeights::default(),
            CostWeights {
                overlap_score_credit: -2.5,
                prefill_load_scale: 0.3,
                host_cache_hit_weight: -0.0,
                disk_cache_hit_weight: 7.0,
                shared_cache_multiplier: 1.0,
                decode_active_request_weight: 0.125,
            },
            CostWeights {
                shared_cache_multiplier: f64::INFINITY,
                ..CostWeights::default()
            },
        ];
        let values = [0.0, -0.0, 1.0, 3.7, 640.0, 1e300, f64::NAN, f64::INFINITY];
        for w in &weights {
            for (bs, isl) in [(16, 0), (64, 4096), (7, 100)] {
                let kv = KvCost::new(w, bs, isl, isl.div_ceil(bs));
                for (prefill, decode, active) in values
                    .iter()
                    .flat_map(|p| values.iter().map(move |d| (*p, *d)))
                    .flat_map(|(p, d)| [0, 1, 9].map(|a| (p, d, a)))
                {
                    let load = SlotLoad {
                        prefill_tokens: prefill,
                        decode_blocks: decode,
                        active_requests: active,
                    };
                    // Bit for bit (any NaN counts as one value).
                    let key = |x: f64| if x.is_nan() { u64::MAX } else { x.to_bits() };
                    let checked = kv.cost(&Overlap::default(), &load, 1.0);
                    assert_eq!(
                        key(kv.unchecked_cost(&Overlap::default(), &load)),
                        key(checked.unwrap_or_else(|cost| cost)),
                        "{w:?} {bs} {isl} {load:?}"
                    );
                }
            }
        }
    }
}
