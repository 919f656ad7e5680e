//! The predicted-TTFT score (the `ttft` option of `kv` mode). Lower is better. Pure.
//!
//! ```text
//! uncached = max(isl - block_size * (overlap_score_credit * device_blocks
//!              + host_cache_hit_weight * host_blocks + disk_cache_hit_weight * disk_blocks), 0)
//! context  = isl - uncached                                    (the cached prefix)
//! W(t, c)  = (P(c + t) - P(c)) / rate    (P = poly beyond its constant, rate = its linear term)
//! work     = active_prefill_work(worker) + W(uncached, context)  (prefill runs in arrival order)
//! steps    = max(ceil(active_prefill_work / W(chunk, 0) + uncached / chunk), 1)
//! prefill  = steps * poly(0) + rate * work
//! decode   = steps * decode_poly(fill)   if requests in flight, else 0
//!            (fill = the larger of decode_blocks / kv_capacity_blocks and the reported KV usage)
//! admit    = short * lifetime / used    (ttft.admission_wait; 0 when short <= 0, see below)
//! ttft_ms  = (prefill + decode + admit) * factor * preferred_taint_multiplier
//! own      = the same prefill of W(uncached, context) alone, at fleet_poly
//! weight   = compute_weight, or (unset) min(arrivals_per_ms * ttft_ms, 100)
//! score_ms = ttft_ms + weight * own * fleet_factor * preferred_taint_multiplier
//! ```
//!
//! * `poly` is the worker's own `prefill_time_ms_poly`, else `load.prefill_time_ms_poly` (the
//!   fleet's, `fleet_poly`; the mocker's 4.21e-7 T^2 + 0.0152 T + 16.5 by default), and `chunk`
//!   the worker's `max_num_batched_tokens` (else `ttft.chunk_tokens`): an engine with
//!   chunked prefill computes the queue ahead of the request, then the request, in steps of at
//!   most `chunk` tokens. Each step pays the polynomial's constant; its tokens attend to every
//!   token of their sequence before them, a cached prefix included, so the attention of a long
//!   prompt grows with its whole length, not with its step's ([`prefill_work_tokens`]). Booked
//!   prefills are work in token-equivalents (`W`), so a queue is the sum of its prompts' own
//!   costs.
//! * Cached blocks count through the Dynamo cost's own credits, so the tiers weigh the same in
//!   both policies (a host-tier block is reloaded, not free).
//! * `factor` is the worker's timing learned from its responses ([`crate::learn`]: observed over
//!   predicted TTFT), `fleet_factor` the fleet's; both 1 with `ttft.learn` off. So the
//!   polynomials only give the shape; each worker's own speed, and the queueing the router
//!   cannot see, come from what its clients experienced.
//! * Unset, `compute_weight` is the number of requests expected to arrive at the slot while this
//!   one waits there (`arrivals_per_ms`: the fleet's requests in flight over their observed
//!   lifetime, by Little's law, per slot): each of them waits for this request's own compute.
//!   An idle fleet thus spreads freely (weight ~0) and a saturated one keeps prefixes where they
//!   are cached. A fixed `compute_weight` charges the request's own prefill compute again: every
//!   request that queues behind it on the slot waits for it too. The TTFT alone gives a
//!   conversation's history up as soon as the holder's queue costs more than recomputing the
//!   history elsewhere; the recomputation then delays the next requests there. With weight `w`
//!   the holder keeps the request until its queue costs `1 + w` times the recomputation. It is
//!   priced at the fleet's polynomial on every worker, so it is equal for every slot when no slot
//!   holds a prefix and changes nothing about balance, in a mixed fleet too: at each worker's
//!   own speed, weight `w` would count a fast engine's lead `1 + w` times over (measured on a
//!   mock fleet of speeds 1 and 3 at weight 4: TTFT mean 215 ms against 151 priced at the
//!   fleet's, p99 1,324 against 649).
//! * The decode term is small by design: each step of a busy worker also decodes its running
//!   requests (`decode_poly` of its KV fill; fill 0 without a configured capacity).
//! * The admission term (`ttft.admission_wait`) is the wait for KV room. An engine allocates a
//!   prompt's blocks when it admits the prompt and admits in arrival order, so on a cache full of
//!   running requests a long prompt waits, and everything behind it, until enough of them finish.
//!   With the worker's capacity `C` (blocks per rank) and its reported KV usage `u`:
//!   `used = u * C`, `free = C - used - C / 100` (vLLM's 1% watermark),
//!   `short = ceil(uncached / block_size) + active_prefill_tokens / block_size - free` (the
//!   booked prefills ahead need their blocks first), and the running requests free `used`
//!   blocks over their lifetime, `lifetime = output_tokens * decode_poly(u)`, by Little's law.
//!   `output_tokens` is the request's own limit (its best guess of its neighbours'), else
//!   `ttft.default_output_tokens`.

use crate::config::{CostWeights, TtftConfig};
use crate::cost::NonFiniteCost;
use crate::load::{kv_fill, SlotLoad};
use crate::prefill_work::{horner, prefill_work_tokens, token_rate_ms};
use crate::types::Overlap;

/// What the prediction for one slot depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftInputs {
    pub isl_tokens: u32,
    pub overlap: Overlap,
    pub load: SlotLoad,
    /// Prefill tokens per engine step on this slot's worker, `>= 1`.
    pub chunk_tokens: u32,
    /// The worker's KV capacity per rank, when configured.
    pub kv_capacity_blocks: Option<u32>,
    /// The worker's own last report of its KV usage (a fraction of its capacity), if any.
    pub kv_usage: Option<f64>,
    /// The request's expected output tokens, `>= 1` (for the admission term).
    pub output_tokens: u32,
    pub preferred_multiplier: f64,
    /// The worker's learned timing factor ([`crate::learn`]): observed over predicted time to
    /// first token. Multiplies the prediction; 1 when nothing is learned.
    pub timing_factor: f64,
    /// The fleet's learned factor: multiplies the compute term (equal on every slot).
    pub fleet_factor: f64,
    /// Requests expected to arrive at this slot per ms (the fleet's rate over its slots), for
    /// the adaptive compute weight; 0 when unknown.
    pub arrivals_per_ms: f64,
}

/// The terms of one slot's prediction, for logs and tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictedTtft {
    /// This request's tokens to compute on the slot (tier-weighted).
    pub uncached_tokens: f64,
    /// The prefill work ahead of it plus its own, in token-equivalents
    /// ([`prefill_work_tokens`]).
    pub work_tokens: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// The predicted wait for KV room (0 unless `ttft.admission_wait`).
    pub admission_ms: f64,
    pub ttft_ms: f64,
    /// `prefill + decode + admission` before the learned factor and any preference: what the
    /// timing polynomials alone predict, which [`crate::learn`] compares with the observed TTFT.
    pub base_ms: f64,
    /// `compute_weight` times the request's own prefill time (tier-weighted uncached tokens).
    pub compute_ms: f64,
    /// What the router minimises: `ttft_ms + compute_ms`.
    pub score_ms: f64,
}

/// Prefill time of `tokens` computed in steps of at most `chunk` tokens, each step paying the
/// polynomial of its own tokens: the fallback for a polynomial without a per-token rate.
fn chunked_prefill_ms(poly: &[f64], tokens: f64, chunk: f64) -> f64 {
    let full_chunks = (tokens / chunk).floor();
    let rest = tokens - full_chunks * chunk;
    full_chunks * step_prefill_ms(poly, chunk) + step_prefill_ms(poly, rest)
}

/// Engine steps (fractional) and time (ms) of a prefill of `work` token-equivalents
/// ([`prefill_work_tokens`]) over `steps` steps: each step pays the polynomial's constant, the
/// work its per-token rate. A prompt within one step from scratch is the polynomial of its
/// tokens. `None` without a per-token rate.
fn work_ms(poly: &[f64], work: f64, steps: f64) -> Option<f64> {
    let rate = token_rate_ms(poly)?;
    let constant = poly.first().copied().unwrap_or(0.0);
    Some(steps * constant + rate * work)
}

/// Steps of at most `chunk` tokens (one when `None`) that `tokens` take.
fn steps_of(tokens: f64, chunk: Option<f64>) -> f64 {
    match chunk {
        Some(c) if c >= 1.0 => (tokens / c).ceil().max(1.0),
        _ => 1.0,
    }
}

/// Steps and time (ms) of `tokens` new tokens after `context` cached ones, computed alone in
/// steps of at most `chunk` tokens (one step when `None`).
fn prefill_alone_ms(poly: &[f64], tokens: f64, context: f64, chunk: Option<f64>) -> (f64, f64) {
    if tokens.is_nan() || tokens <= 0.0 {
        return (0.0, 0.0);
    }
    let steps = steps_of(tokens, chunk);
    let work = prefill_work_tokens(poly, tokens, context);
    let ms = work_ms(poly, work, steps).unwrap_or_else(|| match chunk {
        Some(c) if c >= 1.0 => chunked_prefill_ms(poly, tokens, c),
        _ => step_prefill_ms(poly, tokens),
    });
    (steps, ms)
}

/// How long the engine computes `tokens` uncached prompt tokens after `context` cached ones
/// alone (ms), in steps of at most `chunk` tokens (the worker's `max_num_batched_tokens`, or
/// `ttft.chunk_tokens`), as [`predicted_ttft`] prices them: each step's constant and the
/// prompt's work ([`prefill_work_tokens`]; a 112k-token prompt from scratch ~7.3 s with the
/// default polynomial, not the ~2.3 s of 14 steps priced from scratch each). This is the decay
/// time of a booked prefill (`load.prefill_load_model: polynomial`). Finite and `>= 0`.
pub fn prefill_duration_ms(poly: &[f64], tokens: f64, context: f64, chunk: Option<u32>) -> f64 {
    let chunk = chunk.filter(|c| *c > 0).map(f64::from);
    let (_, ms) = prefill_alone_ms(poly, tokens, context, chunk);
    if ms.is_finite() {
        ms.max(0.0)
    } else {
        0.0
    }
}

/// The request's own `uncached_tokens` after `context` cached ones, alone, in steps of
/// `chunk_tokens`, on an engine of `timing` (ms): the part of a prediction's `base_ms` that is
/// its own compute, not the queue ahead. Computed for the chosen slot only, for the learning
/// ([`crate::learn::Prediction`]).
pub fn own_prefill_ms(
    timing: &EngineTiming,
    uncached_tokens: f64,
    context: f64,
    chunk_tokens: u32,
) -> f64 {
    let chunk = Some(f64::from(chunk_tokens.max(1)));
    prefill_alone_ms(timing.prefill_ms_poly, uncached_tokens, context, chunk).1
}

/// Prefill time of `tokens` in one step; 0 for none (no work, no step).
fn step_prefill_ms(poly: &[f64], tokens: f64) -> f64 {
    if tokens <= 0.0 {
        return 0.0;
    }
    horner(poly, tokens).max(0.0)
}

/// How fast one worker's engine is: its own polynomials, else the fleet's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineTiming<'a> {
    /// Prefill time (ms) of one step by its tokens: the worker's, else
    /// `load.prefill_time_ms_poly`.
    pub prefill_ms_poly: &'a [f64],
    /// The fleet's `load.prefill_time_ms_poly`: the price of the compute term, the same on
    /// every worker.
    pub fleet_prefill_ms_poly: &'a [f64],
    /// Decode step time (ms) by KV fill: `ttft.decode_step_ms_poly`.
    pub decode_step_ms_poly: &'a [f64],
}

/// The predicted TTFT of one slot on an engine of `timing`; see the module docs.
pub fn predicted_ttft(
    config: &TtftConfig,
    weights: &CostWeights,
    timing: &EngineTiming,
    block_size: u32,
    inputs: &TtftInputs,
) -> Result<PredictedTtft, NonFiniteCost> {
    let prefill_poly = timing.prefill_ms_poly;
    let load = &inputs.load;
    if !(load.prefill_tokens.is_finite() && load.decode_blocks.is_finite()) {
        return Err(NonFiniteCost {
            cost: load.prefill_tokens + load.decode_blocks,
        });
    }
    let bs = f64::from(block_size.max(1));
    let o = &inputs.overlap;
    let cached_blocks = weights.overlap_score_credit * f64::from(o.device_blocks)
        + weights.host_cache_hit_weight * f64::from(o.host_blocks)
        + weights.disk_cache_hit_weight * f64::from(o.disk_blocks);
    let isl = f64::from(inputs.isl_tokens);
    let uncached_tokens = (isl - bs * cached_blocks).max(0.0);
    let context = isl - uncached_tokens;
    let chunk = f64::from(inputs.chunk_tokens.max(1));
    // The booked prefills ahead are work already (booked as [`prefill_work_tokens`]); their
    // steps are counted as if each were from scratch (their lengths are not kept).
    let queued = load.prefill_tokens.max(0.0);
    let work_tokens = queued + prefill_work_tokens(prefill_poly, uncached_tokens, context);
    let queued_steps = queued / prefill_work_tokens(prefill_poly, chunk, 0.0).max(1.0);
    let steps = (queued_steps + uncached_tokens / chunk).ceil().max(1.0);
    let prefill_ms = if work_tokens > 0.0 {
        work_ms(prefill_poly, work_tokens, steps)
            .unwrap_or_else(|| chunked_prefill_ms(prefill_poly, queued + uncached_tokens, chunk))
    } else {
        0.0
    };
    let decode_ms = if load.active_requests > 0 {
        // The engine's usage counts every block its running requests read, other routers' and
        // shared prefixes included: what a decode step reads.
        let fill = kv_fill(
            load.decode_blocks,
            inputs.kv_capacity_blocks,
            inputs.kv_usage,
        );
        let fill = fill.min(1.0);
        steps.max(1.0) * horner(timing.decode_step_ms_poly, fill).max(0.0)
    } else {
        0.0
    };
    let admission_ms = if config.admission_wait {
        admission_wait_ms(timing, bs, uncached_tokens, inputs)
    } else {
        0.0
    };
    let factor = finite_positive(inputs.timing_factor);
    let ttft_ms = (prefill_ms + decode_ms + admission_ms) * factor * inputs.preferred_multiplier;
    // Configured, or the requests expected to queue behind this one while it waits here.
    let weight = match config.compute_weight {
        Some(w) => w,
        None => (inputs.arrivals_per_ms.max(0.0) * ttft_ms).min(crate::config::MAX_COMPUTE_WEIGHT),
    };
    let compute_ms = if weight > 0.0 {
        weight
            * prefill_alone_ms(
                timing.fleet_prefill_ms_poly,
                uncached_tokens,
                context,
                Some(chunk),
            )
            .1
            * finite_positive(inputs.fleet_factor)
            * inputs.preferred_multiplier
    } else {
        0.0
    };
    let score_ms = ttft_ms + compute_ms;
    if !score_ms.is_finite() {
        return Err(NonFiniteCost { cost: score_ms });
    }
    Ok(PredictedTtft {
        uncached_tokens,
        work_tokens,
        prefill_ms,
        decode_ms,
        admission_ms,
        ttft_ms,
        base_ms: prefill_ms + decode_ms + admission_ms,
        compute_ms,
        score_ms,
    })
}

/// `f` when finite and positive, else 1 (a factor that cannot be trusted changes nothing).
fn finite_positive(f: f64) -> f64 {
    if f.is_finite() && f > 0.0 {
        f
    } else {
        1.0
    }
}

/// The admission term (module docs): how long the prompt waits for free KV blocks. 0 without a
/// capacity or a reported usage, or with room to spare; finite and `>= 0`.
fn admission_wait_ms(timing: &EngineTiming, bs: f64, uncached_tokens: f64, i: &TtftInputs) -> f64 {
    let (Some(capacity), Some(usage)) = (i.kv_capacity_blocks, i.kv_usage) else {
        return 0.0;
    };
    if capacity == 0 || !usage.is_finite() {
        return 0.0;
    }
    let capacity = f64::from(capacity);
    let usage = usage.clamp(0.0, 1.0);
    let used = usage * capacity;
    let free = capacity - used - capacity / 100.0;
    // (The booked prefills ahead are work, at least their tokens: for long prompts this
    // overstates the blocks they need, erring toward waiting.)
    let need = (uncached_tokens / bs).ceil() + i.load.prefill_tokens.max(0.0) / bs;
    let short = need - free;
    if short <= 0.0 {
        return 0.0;
    }
    let step_ms = horner(timing.decode_step_ms_poly, usage).max(0.0);
    let lifetime_ms = f64::from(i.output_tokens.max(1)) * step_ms;
    let wait = short * lifetime_ms / used.max(1.0);
    if wait.is_finite() {
        wait
    } else {
        0.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    const POLY: [f64; 3] = [16.5, 0.0152, 4.21e-7];
    const DECODE: [f64; 3] = [5.74, 54.01, -25.74];
    const MOCKER: EngineTiming = EngineTiming {
        prefill_ms_poly: &POLY,
        fleet_prefill_ms_poly: &POLY,
        decode_step_ms_poly: &DECODE,
    };

    fn mocker_prefill(t: f64) -> f64 {
        4.21e-7 * t * t + 0.0152 * t + 16.5
    }

    fn inputs(isl: u32, device: u32, prefill: f64, active: u32) -> TtftInputs {
        TtftInputs {
            isl_tokens: isl,
            overlap: Overlap {
                device_blocks: device,
                ..Overlap::default()
            },
            load: SlotLoad {
                prefill_tokens: prefill,
                decode_blocks: 0.0,
                active_requests: active,
            },
            chunk_tokens: 8192,
            kv_capacity_blocks: None,
            kv_usage: None,
            output_tokens: 500,
            preferred_multiplier: 1.0,
            timing_factor: 1.0,
            fleet_factor: 1.0,
            arrivals_per_ms: 0.0,
        }
    }

    fn ttft(i: &TtftInputs) -> PredictedTtft {
        predicted_ttft(
            &TtftConfig::default(),
            &CostWeights::default(),
            &MOCKER,
            64,
            i,
        )
        .unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn idle_worker_pays_its_uncached_tokens_once() {
        // 4,096 tokens, 16 of 64 blocks cached: 3,072 tokens to compute after 1,024, nothing
        // ahead. They attend to the cached 1,024 too: the prompt's cost beyond its prefix's.
        let p = ttft(&inputs(4096, 16, 0.0, 0));
        assert_eq!(p.uncached_tokens, 3072.0);
        let own = 16.5 + beyond(4096.0) - beyond(1024.0);
        assert!(close(p.prefill_ms, own), "{p:?}");
        assert!(p.prefill_ms > mocker_prefill(3072.0), "{p:?}");
        assert_eq!(p.decode_ms, 0.0);
        // Fully cached and idle: nothing to wait for.
        assert_eq!(ttft(&inputs(4096, 64, 0.0, 0)).ttft_ms, 0.0);
    }

    #[test]
    fn queue_and_prompt_run_in_chunks_with_a_decode_step_each() {
        // 10,000 tokens of work queued, then 10,000 own tokens from scratch (their work
        // ~12,770): ~1 step of queue (a step from scratch is ~10,051 of work) and 2 own steps.
        let p = ttft(&inputs(10_000, 0, 10_000.0, 3));
        let own_work = beyond(10_000.0) / 0.0152;
        assert!(close(p.work_tokens, 10_000.0 + own_work), "{p:?}");
        let expect = 3.0 * 16.5 + 0.0152 * 10_000.0 + beyond(10_000.0);
        assert!(close(p.prefill_ms, expect), "{p:?}");
        // 3 steps, each with a decode step at fill ~0: 5.74 ms.
        assert!((p.decode_ms - 3.0 * 5.74).abs() < 1e-6, "{p:?}");
        // With a capacity the fill raises the decode step: 4,096 of 8,192 blocks -> u = 0.5.
        let mut i = inputs(10_000, 0, 10_000.0, 3);
        i.load.decode_blocks = 4096.0;
        i.kv_capacity_blocks = Some(8192);
        let step = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
        assert!((ttft(&i).decode_ms - 3.0 * step).abs() < 1e-9);
    }

    /// The mocker polynomial beyond its constant.
    fn beyond(t: f64) -> f64 {
        mocker_prefill(t) - 16.5
    }

    #[test]
    fn a_long_prompt_costs_its_whole_attention_in_its_steps() {
        // 112,941 tokens in 8,192-token steps: 14 steps, each attending to every token before
        // it: 14 step constants and the polynomial of the whole prompt, ~7.3 s (14 steps priced
        // from scratch each would be ~2.3 s).
        let long = prefill_duration_ms(&POLY, 112_941.0, 0.0, Some(8192));
        assert!(close(long, 14.0 * 16.5 + beyond(112_941.0)), "{long}");
        assert!(long > 7_000.0, "{long}");
        // One step (no step size): the same work, one constant.
        let whole = prefill_duration_ms(&POLY, 112_941.0, 0.0, None);
        assert!(close(whole, mocker_prefill(112_941.0)), "{whole}");
        // After a cached prefix the new tokens still attend to it: 1,000 tokens after 30,000
        // cost what the 31,000-token prompt costs beyond the 30,000 (~42 ms), not the ~31 ms
        // of a 1,000-token prompt.
        let after = prefill_duration_ms(&POLY, 1_000.0, 30_000.0, Some(8192));
        assert!(
            close(after, 16.5 + beyond(31_000.0) - beyond(30_000.0)),
            "{after}"
        );
        assert!(after > mocker_prefill(1_000.0) * 1.3, "{after}");
        // A prompt within one step from scratch is the polynomial of its tokens; nothing to
        // compute is 0.
        assert!(close(
            prefill_duration_ms(&POLY, 4096.0, 0.0, Some(8192)),
            mocker_prefill(4096.0)
        ));
        assert_eq!(prefill_duration_ms(&POLY, 0.0, 0.0, Some(8192)), 0.0);
        assert_eq!(prefill_duration_ms(&POLY, 0.0, 0.0, None), 0.0);
        // A negative or broken polynomial never yields a negative or non-finite duration.
        assert_eq!(prefill_duration_ms(&[-5.0], 10.0, 0.0, Some(8)), 0.0);
        assert_eq!(prefill_duration_ms(&[f64::NAN], 10.0, 0.0, None), 0.0);
        assert_eq!(prefill_duration_ms(&[], 10.0, 0.0, Some(0)), 0.0);
        assert_eq!(prefill_duration_ms(&POLY, f64::NAN, 0.0, Some(8192)), 0.0);
    }

    #[test]
    fn queued_works_add_up_as_each_prompts_own() {
        // Booked as work, a queue of one 100k-token prompt weighs what the prompt costs; ten
        // 10k-token prompts weigh ten times one of them, far less than one prompt of their sum.
        let work = |t: f64| prefill_work_tokens(&POLY, t, 0.0);
        assert!(close(work(100_000.0) * 0.0152, beyond(100_000.0)));
        assert!(work(100_000.0) > 10.0 * work(10_000.0) * 2.0);
        let queued = |w: f64| ttft(&inputs(1_000, 0, w, 1)).prefill_ms;
        let one_long = queued(work(100_000.0));
        let ten_short = queued(10.0 * work(10_000.0));
        assert!(one_long > 2.0 * ten_short, "{one_long} vs {ten_short}");
        // A polynomial without a per-token rate prices plain tokens.
        assert_eq!(prefill_work_tokens(&[5.0], 100.0, 50.0), 100.0);
        assert_eq!(prefill_work_tokens(&POLY, 0.0, 50.0), 0.0);
    }

    #[test]
    fn host_tier_blocks_count_as_partly_computed() {
        let mut i = inputs(1280, 4, 0.0, 0);
        i.overlap.host_blocks = 8;
        // 4 device blocks + 0.75 * 8 host blocks = 10 blocks credited: 1,280 - 640 = 640 tokens.
        assert_eq!(ttft(&i).uncached_tokens, 640.0);
    }

    #[test]
    fn compute_weight_charges_the_own_prefill_again() {
        let weighted = TtftConfig {
            compute_weight: Some(1.5),
            ..TtftConfig::default()
        };
        let p = |i: &TtftInputs| {
            predicted_ttft(&weighted, &CostWeights::default(), &MOCKER, 64, i).unwrap()
        };
        // 20,000 uncached tokens behind a queue: the TTFT is unchanged, the own compute is the
        // prompt's alone, in its 3 steps of 8,192 tokens.
        let w = p(&inputs(20_000, 0, 10_000.0, 0));
        let plain = ttft(&inputs(20_000, 0, 10_000.0, 0));
        assert!(close(w.ttft_ms, plain.ttft_ms));
        let own = 3.0 * 16.5 + beyond(20_000.0);
        assert!(close(w.compute_ms, 1.5 * own), "{w:?}");
        assert!(close(w.score_ms, w.ttft_ms + 1.5 * own));
        // At weight 0 the score is the TTFT.
        assert_eq!(plain.compute_ms, 0.0);
        assert_eq!(plain.score_ms, plain.ttft_ms);
        // A fully cached prompt computes nothing of its own.
        assert_eq!(p(&inputs(4096, 64, 5000.0, 1)).compute_ms, 0.0);
        // The preferred-taint multiplier scales it like the TTFT.
        let mut i = inputs(4096, 0, 0.0, 0);
        i.preferred_multiplier = 2.0;
        assert!(close(p(&i).compute_ms, 2.0 * 1.5 * mocker_prefill(4096.0)));
    }

    #[test]
    fn a_prompt_short_of_kv_room_waits_for_running_requests_to_free_it() {
        let admitting = TtftConfig {
            admission_wait: true,
            ..TtftConfig::default()
        };
        let p = |i: &TtftInputs| {
            predicted_ttft(&admitting, &CostWeights::default(), &MOCKER, 64, i).unwrap()
        };
        // 8,192 blocks, 90% used: 737.28 free after the 1% watermark (81.92). A 64,000-token
        // prompt needs 1,000 blocks and 6,400 booked tokens ahead 100 more: 362.72 short.
        let mut i = inputs(64_000, 0, 6_400.0, 20);
        i.kv_capacity_blocks = Some(8192);
        i.kv_usage = Some(0.9);
        let step = -25.74 * 0.81 + 54.01 * 0.9 + 5.74;
        let used = 0.9 * 8192.0;
        let expect = 362.72 * (500.0 * step) / used;
        let w = p(&i);
        assert!(close(w.admission_ms, expect), "{w:?} {expect}");
        assert!(close(w.ttft_ms, w.prefill_ms + w.decode_ms + expect));
        // Longer outputs hold the blocks longer: the wait scales with them.
        i.output_tokens = 1000;
        assert!(close(p(&i).admission_ms, 2.0 * expect));
        i.output_tokens = 500;
        // A cached prefix needs no new blocks: 600 of the 1,000 cached leaves 400 + 100 to find.
        i.overlap.device_blocks = 600;
        assert_eq!(p(&i).admission_ms, 0.0);
        i.overlap.device_blocks = 0;
        // Room to spare, no capacity, no report, or the option off: no wait.
        let mut roomy = i;
        roomy.kv_usage = Some(0.5);
        assert_eq!(p(&roomy).admission_ms, 0.0);
        let mut unknown = i;
        unknown.kv_capacity_blocks = None;
        assert_eq!(p(&unknown).admission_ms, 0.0);
        unknown = i;
        unknown.kv_usage = None;
        assert_eq!(p(&unknown).admission_ms, 0.0);
        unknown.kv_usage = Some(f64::NAN);
        assert_eq!(p(&unknown).admission_ms, 0.0);
        assert_eq!(ttft(&i).admission_ms, 0.0);
        // A full cache of nothing (usage 1 of a tiny capacity) stays finite.
        let mut tiny = i;
        tiny.kv_capacity_blocks = Some(1);
        tiny.kv_usage = Some(1.0);
        assert!(p(&tiny).admission_ms.is_finite());
    }

    #[test]
    fn corrupt_load_is_an_error() {
        let bad = inputs(1000, 0, f64::NAN, 1);
        let r = predicted_ttft(
            &TtftConfig::default(),
            &CostWeights::default(),
            &MOCKER,
            64,
            &bad,
        );
        assert!(r.is_err());
    }

    // Through `decide`: the policy as a user configures it.
    use crate::config::Config;
    use crate::request::{LlmRequest, Pin};
    use crate::router::{decide, prompt_blocks, RouteInput, SelectorState};

    /// The predicted policy, unless `extra` names one.
    fn config(extra: &str) -> Config {
        let policy = if extra.contains("\"policy\"") {
            ""
        } else {
            r#", "policy": "predicted""#
        };
        let json = format!(
            r#"{{"block_size": 64{policy}{extra}, "workers": [
                {{"id": 1, "address": "10.0.0.1:8000"}},
                {{"id": 2, "address": "10.0.0.2:8000"}},
                {{"id": 3, "address": "10.0.0.3:8000"}}]}}"#
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    fn load(prefill: f64, decode: f64, active: u32) -> SlotLoad {
        SlotLoad {
            prefill_tokens: prefill,
            decode_blocks: decode,
            active_requests: active,
        }
    }

    /// The slot `decide` picks for a 12,288-token prompt (192 blocks).
    fn pick(c: &Config, overlaps: &[u32], loads: &[SlotLoad], seed: u64) -> u16 {
        let req = LlmRequest {
            token_ids: Some((0..12_288).collect()),
            ..LlmRequest::default()
        };
        let overlaps: Vec<Overlap> = overlaps
            .iter()
            .map(|&d| Overlap {
                device_blocks: d,
                ..Overlap::default()
            })
            .collect();
        let input = RouteInput {
            request: &req,
            header_pin: Pin::default(),
            prompt_blocks: prompt_blocks(c, &req),
            overlaps: &overlaps,
            load: loads,
            stale_slots: &[],
            kv_usage: &[],
            learned: None,
            arrivals_per_ms: 0.0,
        };
        decide(c, &input, &mut SelectorState::new(seed))
            .unwrap()
            .slot
    }

    #[test]
    fn each_worker_is_priced_at_its_own_speed() {
        // Slot 2's engine is three times faster, its decode steps twice; slots 0 and 1 use the
        // fleet's polynomials.
        let mixed = || {
            let json = r#"{"block_size": 64, "policy": "predicted", "ttft": {}, "workers": [
                {"id": 1, "address": "10.0.0.1:8000"},
                {"id": 2, "address": "10.0.0.2:8000"},
                {"id": 3, "address": "10.0.0.3:8000",
                 "prefill_time_ms_poly": [5.5, 0.0050666666666666667, 1.4033333333333333e-7],
                 "decode_step_ms_poly": [2.87, 27.005, -12.87]}]}"#;
            Config::from_json(json.as_bytes()).unwrap()
        };
        let c = mixed();
        // Idle: 12,288 tokens take a third of the time there, so it takes them every time.
        let idle = [load(0.0, 0.0, 0); 3];
        for seed in 0..20 {
            assert_eq!(pick(&c, &[0, 0, 0], &idle, seed), 2);
        }
        // 12,288 tokens queued ahead there as well: 24,576 tokens at a third of the price
        // (~178 ms with its decode steps) still beat 12,288 idle ones at the full price (~255).
        let ahead = [load(0.0, 0.0, 0), load(0.0, 0.0, 0), load(12_288.0, 0.0, 1)];
        assert_eq!(pick(&c, &[0, 0, 0], &ahead, 7), 2);
        // 36,864 queued (~355 ms there) do not.
        let more = [load(0.0, 0.0, 0), load(0.0, 0.0, 0), load(36_864.0, 0.0, 1)];
        assert_ne!(pick(&c, &[0, 0, 0], &more, 7), 2);
        // The prediction itself: a third of the fleet polynomial's, to rounding; the decode
        // step (one request in flight, no capacity: fill 0) half of it.
        let worker = c.worker_of_slot(2).unwrap();
        let own = EngineTiming {
            prefill_ms_poly: worker.prefill_poly(&c.load.prefill_time_ms_poly),
            fleet_prefill_ms_poly: &c.load.prefill_time_ms_poly,
            decode_step_ms_poly: worker.decode_poly(&DECODE),
        };
        let i = inputs(4096, 0, 0.0, 1);
        let fast = predicted_ttft(
            &TtftConfig::default(),
            &CostWeights::default(),
            &own,
            64,
            &i,
        )
        .unwrap();
        let slow = ttft(&i);
        assert!(
            (fast.prefill_ms - slow.prefill_ms / 3.0).abs() < 1e-6,
            "{fast:?} {slow:?}"
        );
        assert!(
            close(fast.decode_ms, slow.decode_ms / 2.0),
            "{fast:?} {slow:?}"
        );
        // The compute term is priced at the fleet's polynomial everywhere: a speed lead is
        // counted once (in the TTFT), not again times the weight.
        let weighted = TtftConfig {
            compute_weight: Some(4.0),
            ..TtftConfig::default()
        };
        let w = |t: &EngineTiming| {
            predicted_ttft(&weighted, &CostWeights::default(), t, 64, &i).unwrap()
        };
        let (fast_w, slow_w) = (w(&own), w(&MOCKER));
        assert!(close(fast_w.compute_ms, slow_w.compute_ms), "{fast_w:?}");
        assert!(close(fast_w.compute_ms, 4.0 * mocker_prefill(4096.0)));
        assert!(close(fast_w.ttft_ms, fast.ttft_ms));
        // A worker without its own uses the fleet's.
        let plain = c.worker_of_slot(0).unwrap();
        assert_eq!(plain.prefill_poly(&POLY), &POLY[..]);
        assert_eq!(plain.decode_poly(&DECODE), &DECODE[..]);
    }

    #[test]
    fn a_long_history_on_a_busy_worker_beats_an_idle_worker() {
        // The predictions alone decide here: the balance guard is off.
        // Slot 1 holds 176 of the 192 blocks (a conversation's history) and is moderately busy:
        // 4,096 prefill tokens queued, 6 requests decoding 1,500 blocks. Slots 0 and 2 are idle.
        let overlaps = [0, 176, 0];
        let loads = [
            load(0.0, 0.0, 0),
            load(4096.0, 1500.0, 6),
            load(0.0, 0.0, 0),
        ];
        // Predicted: slot 1 computes 4,096 + 1,024 tokens (~111 ms), an idle slot 12,288 (~255 ms).
        let ttft = config(r#", "ttft": {"max_load_ratio": 0}"#);
        for seed in 0..20 {
            assert_eq!(pick(&ttft, &overlaps, &loads, seed), 1);
        }
        // The Dynamo cost counts the busy slot's 1,516 decode blocks and sends the turn away
        // from its history: 80 + 1,516 against 192 + 192 on an idle slot.
        let dynamo = config(r#", "policy": "dynamo""#);
        for seed in 0..20 {
            assert_ne!(pick(&dynamo, &overlaps, &loads, seed), 1);
        }
    }

    #[test]
    fn an_overloaded_holder_loses() {
        // The predictions alone decide here: the balance guard is off.
        // The same history behind a 40,000-token prefill queue: 41,024 tokens (~870 ms) to wait
        // for there against 12,288 (~255 ms) on slot 2; slot 0 has a short queue of its own.
        let overlaps = [0, 176, 0];
        let loads = [
            load(2048.0, 0.0, 1),
            load(40_000.0, 0.0, 8),
            load(0.0, 0.0, 0),
        ];
        let c = config(r#", "ttft": {"max_load_ratio": 0}"#);
        for seed in 0..20 {
            assert_eq!(pick(&c, &overlaps, &loads, seed), 2);
        }
        // With a shorter queue the holder keeps it: 8,000 + 1,024 tokens (~190 ms).
        let loads = [
            load(2048.0, 0.0, 1),
            load(8000.0, 0.0, 8),
            load(0.0, 0.0, 0),
        ];
        assert_eq!(pick(&c, &overlaps, &loads, 7), 1);
    }

    #[test]
    fn compute_weight_keeps_the_history_behind_a_longer_queue() {
        // The holder (176 of 192 blocks) has 16,384 tokens of prefill work queued: with its
        // 1,024 new tokens (after 11,264 cached: ~1,691 of work) ~308 ms to wait, against ~284 ms
        // for the 12,288 tokens on an idle slot. The TTFT alone gives the history up; with
        // weight 1 the idle slot also pays its recomputation again (~284 ms) against the
        // holder's 1,024 tokens (~42 ms), and the holder keeps it.
        let overlaps = [0, 176, 0];
        let loads = [
            load(2048.0, 0.0, 1),
            load(16_384.0, 0.0, 2),
            load(0.0, 0.0, 0),
        ];
        let plain = config(r#", "ttft": {}"#);
        let weighted = config(r#", "ttft": {"compute_weight": 1}"#);
        for seed in 0..20 {
            assert_eq!(pick(&plain, &overlaps, &loads, seed), 2);
            assert_eq!(pick(&weighted, &overlaps, &loads, seed), 1);
        }
        // A queue of three prompts (~38,555 of work to wait for, ~652 ms) outweighs even the
        // doubled recomputation (~284 + ~284 ms on an idle slot): balance still wins.
        let loads = [
            load(2048.0, 0.0, 1),
            load(36_864.0, 0.0, 4),
            load(0.0, 0.0, 0),
        ];
        assert_eq!(pick(&weighted, &overlaps, &loads, 3), 2);
        // Without a prefix anywhere the weight adds the same to every slot: least work wins.
        let loads = [
            load(2048.0, 0.0, 1),
            load(100.0, 0.0, 1),
            load(4096.0, 0.0, 1),
        ];
        for seed in 0..20 {
            assert_eq!(pick(&weighted, &[0, 0, 0], &loads, seed), 1);
        }
    }

    #[test]
    fn equal_predictions_are_split_at_random() {
        let c = config(r#", "ttft": {}"#);
        let idle = [load(0.0, 0.0, 0); 3];
        let mut counts = [0u32; 3];
        for seed in 0..3000 {
            counts[usize::from(pick(&c, &[0, 0, 0], &idle, seed))] += 1;
        }
        assert!(counts.iter().all(|n| (850..1150).contains(n)), "{counts:?}");
    }

    #[test]
    fn configuration_checks_name_the_field() {
        let c = config(r#", "ttft": {}"#);
        assert_eq!(c.ttft, Some(TtftConfig::default()));
        assert_eq!(config("").ttft, Some(TtftConfig::default()));
        assert_eq!(config(r#", "policy": "dynamo""#).ttft, None);
        let bad = |extra: &str| {
            let json = format!(
                r#"{{"ttft": {extra}, "workers": [{{"id": 1, "address": "10.0.0.1:8000"}}]}}"#
            );
            Config::from_json(json.as_bytes()).unwrap_err().to_string()
        };
        assert!(bad(r#"{"chunk_tokens": 0}"#).starts_with("ttft.chunk_tokens: must be"));
        assert!(bad(r#"{"decode_step_ms_poly": []}"#).starts_with("ttft.decode_step_ms_poly"));
        assert!(bad(r#"{"chunk": 5}"#).contains("unknown field"));
        assert!(bad(r#"{"compute_weight": -1}"#).starts_with("ttft.compute_weight: must be"));
        assert!(bad(r#"{"compute_weight": 101}"#).starts_with("ttft.compute_weight: must be"));
        assert!(bad(r#"{"default_output_tokens": 0}"#).starts_with("ttft.default_output_tokens"));
        assert!(bad(r#"{"admission_wait": 1}"#).contains("admission_wait"));
        let admitting = config(r#", "ttft": {"admission_wait": true, "default_output_tokens": 9}"#);
        let t = admitting.ttft.unwrap();
        assert_eq!((t.admission_wait, t.default_output_tokens), (true, 9));
    }
}
