//! `decide()`: filters -> score -> pick. Pure: it reads the configuration, the request, the
//! slots' overlaps and loads, and draws randomness from the caller's [`SelectorState`]; booking
//! the decision in the load table is the caller's job (with `Decision::prefill_tokens` and
//! `Decision::prompt_blocks`).
//!
//! * Effective pin = header pin merged over the body pin ([`Pin::merge`]). Client hints (pins,
//!   allow-lists, taints) only reach here when `client_routing_hints` is `honor`; otherwise the
//!   adapter leaves them unread.
//! * `isl_tokens` = the number of token ids, or for a text-only request `ceil(text_chars / 4)`
//!   (the usual ~4 characters per token of English BPE vocabularies; only load is estimated from
//!   it — a text-only request gets overlap credit only when the adapter hashed its text
//!   (`text_prefix`, approximate mode: reason `kv-text`), else none (reason `kv-text-only`).
//!   Ids from the tokenizer service (`rendered`) are routed like token ids, reason `kv-render`.
//! * `affinity` set (kv mode, requests with a prefix): the max-overlap slot wins unless its load
//!   exceeds the least-loaded candidate's by the configured margins ([`crate::affinity`]); the
//!   cost decides otherwise. Scores and fallbacks are the cost's either way.
//! * `ttft` set (kv mode): each slot's score is its predicted time to first token in ms, plus
//!   `ttft.compute_weight` times the request's own prefill time there ([`crate::ttft`]),
//!   instead of the Dynamo cost; the lowest wins (ties random, or the softmax of
//!   `router_temperature`), and fallbacks, headers and the affinity gate's ties use it too.
//! * Overlaps of stale slots (`stale_slots[slot]`) count as zero: their blocks are unknown.
//!   Missing entries in `overlaps` / `load` / `stale_slots` read as zero / idle / fresh.
//! * Fallbacks (pinned requests get none): other eligible slots on a different address from the
//!   choice and from each other, best first (by cost in `kv` mode, else fewest in-flight).

use crate::affinity::{affine_slot, AffinityCandidate};
use crate::config::{Config, KvPolicy, RoutingMode, TtftConfig};
use crate::cost;
use crate::filters;
use crate::learn::{LearnedTimings, Prediction};
use crate::load::placed::Placements;
use crate::load::SlotLoad;
use crate::request::{LlmRequest, Pin};
use crate::rng::Rng;
pub use crate::route_error::{Incompatibility, RouteError};
use crate::select;
use crate::ttft::{self, predicted_ttft, EngineTiming, PredictedTtft, TtftInputs};
use crate::types::{Overlap, SlotIdx};

/// Characters per token assumed for requests without token ids.
pub const CHARS_PER_TOKEN_ESTIMATE: usize = 4;

pub struct RouteInput<'a> {
    pub request: &'a LlmRequest,
    /// Already gated by `client_routing_hints` (default when not honoured).
    pub header_pin: Pin,
    /// The prompt's KV blocks, `ceil(isl_tokens / block_size)`: use [`prompt_blocks`].
    pub prompt_blocks: u32,
    /// Per slot; empty = no overlap information.
    pub overlaps: &'a [Overlap],
    /// Per slot (`LoadTable::view`).
    pub load: &'a [SlotLoad],
    /// Per slot; may be empty.
    pub stale_slots: &'a [bool],
    /// Per slot, the KV usage its worker last reported (a fraction of its capacity); may be
    /// empty. Read by the busy threshold (`busy.decode_blocks_fraction`) and the predicted policy
    /// (decode step time, `ttft.admission_wait`).
    pub kv_usage: &'a [Option<f64>],
    /// Per worker entry, the timing learned from its responses (`ttft.learn`); `None` = 1.
    pub learned: Option<&'a LearnedTimings>,
    /// Requests expected to arrive per ms at each slot (the adaptive `ttft.compute_weight`);
    /// 0 when unknown.
    pub arrivals_per_ms: f64,
}

/// Requests per slot the request-share term remembers (`ttft.share_weight`).
const SHARE_MEMORY_PER_SLOT: f64 = 16.0;

/// Per-VM selection state: the random source, the round-robin counter and the recent requests
/// per slot.
#[derive(Clone, Debug)]
pub struct SelectorState {
    pub rng: Rng,
    pub round_robin_counter: u64,
    /// Per slot, the requests this VM sent it, decayed by `1 / (16 x slots)` per request: the
    /// last ~16 per slot, in units of `recent_unit` (a request adds the unit, which grows by the
    /// decay instead of every count shrinking by it: O(1) per request).
    recent: Vec<f64>,
    recent_unit: f64,
    /// This VM's placements on their way to the other VMs of its Envoy, and what it has heard
    /// of theirs ([`crate::load::placed`]): their requests join `recent` too.
    pub placements: Placements,
    /// Buffers a decision reuses, so that a decision allocates nothing once they have grown
    /// (the scores and fallbacks come back through [`SelectorState::recycle`]).
    buffers: Buffers,
}

/// See [`SelectorState::buffers`].
#[derive(Clone, Debug, Default)]
struct Buffers {
    candidates: Vec<SlotIdx>,
    costs: Vec<f64>,
    scores: Vec<(SlotIdx, f64)>,
    fallbacks: Vec<SlotIdx>,
    best: Vec<((SlotIdx, f64), std::net::SocketAddr)>,
}

impl SelectorState {
    pub fn new(seed: u64) -> SelectorState {
        SelectorState {
            rng: Rng::new(seed),
            round_robin_counter: 0,
            recent: Vec::new(),
            recent_unit: 1.0,
            placements: Placements::default(),
            buffers: Buffers::default(),
        }
    }

    /// Takes back a decision's vectors for the next one (a caller done with `decision`).
    pub fn recycle(&mut self, decision: Decision) {
        let Decision {
            mut scores,
            mut fallbacks,
            ..
        } = decision;
        scores.clear();
        fallbacks.clear();
        self.buffers.scores = scores;
        self.buffers.fallbacks = fallbacks;
    }

    /// This VM sent `slot` a request. Allocates only when the number of slots changes.
    fn record_request(&mut self, slots: usize, slot: SlotIdx) {
        self.placements.note(slots, usize::from(slot));
        self.add_recent(slots, usize::from(slot), 1);
    }

    /// The other VMs of this Envoy sent `placed[slot]` requests to each slot since the last
    /// call ([`crate::load::placed`]): they count as sent now.
    pub fn record_others(&mut self, slots: usize, placed: &[u32]) {
        for (slot, &n) in placed.iter().enumerate().filter(|(_, &n)| n > 0) {
            self.add_recent(slots, slot, n);
        }
    }

    /// `n` requests sent to `slot` now.
    fn add_recent(&mut self, slots: usize, slot: usize, n: u32) {
        if self.recent.len() != slots {
            self.recent.clear();
            self.recent.resize(slots, 0.0);
            self.recent_unit = 1.0;
        }
        let keep = 1.0 - 1.0 / (SHARE_MEMORY_PER_SLOT * slots as f64);
        // n requests at once: the unit grows by the decay of each, and each adds the new unit
        // (a hair more weight than one at a time gives the first of them).
        self.recent_unit /= keep.powi(i32::try_from(n).unwrap_or(i32::MAX));
        if let Some(r) = self.recent.get_mut(slot) {
            *r += f64::from(n) * self.recent_unit;
        }
        // Rescale long before the unit could overflow (every ~10^5 requests per slot).
        if self.recent_unit > 1e100 {
            let unit = self.recent_unit;
            self.recent.iter_mut().for_each(|r| *r /= unit);
            self.recent_unit = 1.0;
        }
    }
}

/// Why a slot was chosen (for the response header and stats).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// KV cost model with token ids.
    Kv,
    /// KV cost model on load alone (no token ids, zero overlap).
    KvTextOnly,
    /// KV cost model with token ids from the tokenizer service.
    KvRender,
    /// KV cost model with text prefix hashes (approximate mode).
    KvText,
    /// The request pinned a worker (any mode but `direct`).
    Pinned,
    Direct,
    Random,
    RoundRobin,
    LeastLoaded,
    PowerOfTwo,
    DeviceAwareWeighted,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Kv => "kv",
            Reason::KvTextOnly => "kv-text-only",
            Reason::KvRender => "kv-render",
            Reason::KvText => "kv-text",
            Reason::Pinned => "pinned",
            Reason::Direct => "direct",
            Reason::Random => "random",
            Reason::RoundRobin => "round-robin",
            Reason::LeastLoaded => "least-loaded",
            Reason::PowerOfTwo => "power-of-two",
            Reason::DeviceAwareWeighted => "device-aware-weighted",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub slot: SlotIdx,
    /// Next best, up to `config.fallback_count`, each on a distinct address.
    pub fallbacks: Vec<SlotIdx>,
    /// The chosen slot's overlap as used (zero for text-only requests and stale slots).
    pub overlap: Overlap,
    /// The chosen slot's cost (`kv` mode only).
    pub cost: Option<f64>,
    /// Every scored slot with its cost (`kv` mode; empty otherwise).
    pub scores: Vec<(SlotIdx, f64)>,
    /// Prefill tokens to book: `isl_tokens - overlap.device_blocks * block_size`, saturating.
    pub prefill_tokens: u32,
    /// Decode blocks to book: the prompt's blocks not already on the chosen slot's device,
    /// `prompt_blocks - overlap.device_blocks` (see `cost` module docs).
    pub prompt_blocks: u32,
    pub isl_tokens: u32,
    pub reason: Reason,
    /// The chosen slot's time to first token as the timing polynomials predict it, before the
    /// learned factor (`kv` mode with a `ttft` model): what the response is compared with.
    pub prediction: Option<Prediction>,
}

/// Input tokens of a request: its token ids, else `ceil(text_chars / 4)`; saturates at u32::MAX.
pub fn isl_tokens(request: &LlmRequest) -> u32 {
    let n = match request.token_count() {
        Some(n) => n,
        None => request.text_chars.div_ceil(CHARS_PER_TOKEN_ESTIMATE),
    };
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// `ceil(isl_tokens / block_size)`: the value for [`RouteInput::prompt_blocks`].
pub fn prompt_blocks(config: &Config, request: &LlmRequest) -> u32 {
    isl_tokens(request).div_ceil(config.block_size.max(1))
}

/// Chooses a slot for one request; see the module docs.
pub fn decide(
    config: &Config,
    input: &RouteInput,
    state: &mut SelectorState,
) -> Result<Decision, RouteError> {
    let request = input.request;
    let pin = Pin::merge(input.header_pin, request.pin);
    if config.mode == RoutingMode::Direct && pin.worker_id.is_none() {
        return Err(RouteError::PinRequired);
    }
    let mut candidates = std::mem::take(&mut state.buffers.candidates);
    filters::eligible_slots_into(
        config,
        request,
        pin,
        input.load,
        input.kv_usage,
        &mut candidates,
    )?;
    // The balance guard is the predicted policy's: the Dynamo cost's decode term balances alone.
    let predicted = config.policy == KvPolicy::Predicted;
    if let (RoutingMode::Kv, Some(t), None, true) =
        (config.mode, &config.ttft, pin.worker_id, predicted)
    {
        let learned = input.learned.filter(|_| t.learn);
        keep_balanced(
            &Slowness::new(config, learned),
            &mut candidates,
            input.load,
            t.max_load_ratio,
        );
    }

    let has_tokens = request.has_token_ids();
    let has_prefix = has_tokens || request.text_prefix;
    let isl = isl_tokens(request);
    let overlap_of = |slot: SlotIdx| -> Overlap {
        let i = usize::from(slot);
        if !has_prefix || input.stale_slots.get(i).copied().unwrap_or(false) {
            return Overlap::default();
        }
        input.overlaps.get(i).copied().unwrap_or_default()
    };
    let load_of = |slot: SlotIdx| {
        input
            .load
            .get(usize::from(slot))
            .copied()
            .unwrap_or_default()
    };

    let mut scores = std::mem::take(&mut state.buffers.scores);
    scores.clear();
    // The scores' costs alone, contiguous for the pick (`kv` mode).
    let mut costs = std::mem::take(&mut state.buffers.costs);
    costs.clear();
    let rng = &mut state.rng;
    let chosen = match config.mode {
        RoutingMode::Kv => {
            scores.reserve(candidates.len());
            // Per-request terms hoisted out of the per-slot loop (at 1,000 slots it dominates).
            let kv = cost::KvCost::new(&config.cost, config.block_size, isl, input.prompt_blocks);
            // The seed's Dynamo cost prices tokens; the default prices prefill work.
            let kv = match config.policy {
                KvPolicy::Dynamo => kv,
                _ => kv.with_work(&config.load.prefill_time_ms_poly),
            };
            let no_taints = request.preferred_taints.is_empty();
            costs.reserve(candidates.len());
            let mut min_cost = None;
            // The worker's configured and learned slowness relative to the fleet scales its cost
            // (`adaptive`).
            let learned = match (&config.ttft, input.learned) {
                (Some(t), Some(l)) if t.learn && config.policy == KvPolicy::Adaptive => Some(l),
                _ => None,
            };
            let slowness = Slowness::new(config, learned);
            let adaptive = config.policy == KvPolicy::Adaptive;
            let plain = no_taints && config.policy != KvPolicy::Predicted;
            if plain {
                // The usual case in a loop of its own: nothing per slot but its inputs and cost
                // (the same values and the same cost as the general loop below).
                let overlaps = if has_prefix { input.overlaps } else { &[] };
                let mut min = score_plain(&kv, &candidates, overlaps, input, &mut costs)?;
                if adaptive {
                    min = f64::INFINITY;
                    for (cost, &slot) in costs.iter_mut().zip(&candidates) {
                        *cost *= slowness.of(slot);
                        min = min.min(*cost);
                    }
                }
                min_cost = Some(min);
                scores.extend(candidates.iter().copied().zip(costs.iter().copied()));
            }
            // Otherwise (preferred taints, TTFT scores): the general loop.
            let general = !plain;
            for &slot in candidates.iter().filter(|_| general) {
                // The slot's worker is looked up only when a preference needs it.
                let multiplier = if no_taints {
                    1.0
                } else {
                    config.worker_of_slot(slot).map_or(1.0, |w| {
                        cost::preferred_taint_multiplier(&w.taints, &request.preferred_taints)
                    })
                };
                let score = match (&config.ttft, config.policy) {
                    (Some(t), KvPolicy::Predicted) => {
                        ttft_score(config, t, input, slot, isl, overlap_of(slot), load_of(slot))
                            .map_err(|e| e.cost)
                            .and_then(|p| {
                                let score = p.score_ms * multiplier;
                                if score.is_finite() {
                                    Ok(score)
                                } else {
                                    Err(score)
                                }
                            })
                    }
                    _ => {
                        let speed = if adaptive { slowness.of(slot) } else { 1.0 };
                        let load = input.load.get(usize::from(slot));
                        kv.cost(&overlap_of(slot), load.unwrap_or(&IDLE), multiplier * speed)
                    }
                };
                let score = score.map_err(|cost| RouteError::NonFiniteCost { slot, cost })?;
                costs.push(score);
                scores.push((slot, score));
            }
            // The adaptive policy's request-share term (`ttft.share_weight`).
            let share_weight = match (&config.ttft, config.policy) {
                (Some(t), KvPolicy::Adaptive) if t.share_weight > 0.0 => t.share_weight,
                _ => 0.0,
            };
            if share_weight > 0.0 && candidates.len() > 1 {
                let min = weigh_by_share(
                    &slowness,
                    Shares {
                        requests: &state.recent,
                        request_unit: state.recent_unit,
                    },
                    share_weight,
                    &candidates,
                    &mut costs,
                );
                for (score, cost) in scores.iter_mut().zip(&costs) {
                    score.1 = *cost;
                }
                min_cost = Some(min);
            }
            let affine = match &config.affinity {
                Some(affinity) if has_prefix => {
                    let gate: Vec<AffinityCandidate> = scores
                        .iter()
                        .map(|&(slot, cost)| AffinityCandidate {
                            slot,
                            overlap_blocks: overlap_of(slot).device_blocks,
                            load: load_of(slot),
                            cost,
                        })
                        .collect();
                    affine_slot(affinity, &gate, isl, config.block_size)
                }
                _ => None,
            };
            affine.or_else(|| {
                let t = config.router_temperature;
                match min_cost {
                    Some(min) => select::pick_by_cost_given_min(&costs, min, t, rng),
                    None => select::pick_by_cost(&costs, t, rng),
                }
                .and_then(|i| scores.get(i).map(|(s, _)| *s))
            })
        }
        RoutingMode::Random => select::random(&candidates, rng),
        RoutingMode::RoundRobin => select::round_robin(&candidates, &mut state.round_robin_counter),
        // The pin filter left exactly the pinned slot.
        RoutingMode::Direct => candidates.first().copied(),
        RoutingMode::LeastLoaded => select::least_loaded(&candidates, input.load, rng),
        RoutingMode::PowerOfTwo => select::power_of_two(&candidates, input.load, rng),
        RoutingMode::DeviceAwareWeighted => {
            select::device_aware_weighted(config, &candidates, input.load, rng)
        }
    };
    state.buffers.costs = costs;
    // eligible_slots never returns an empty set, so every mode picks; stay total anyway.
    let slot = chosen.ok_or(RouteError::AllWorkersOverloaded { eligible: 0 })?;
    if config.mode == RoutingMode::Kv && config.policy == KvPolicy::Adaptive {
        state.record_request(config.slots.len(), slot);
    }

    let reason = match (config.mode, pin.worker_id.is_some()) {
        (RoutingMode::Direct, _) => Reason::Direct,
        (_, true) => Reason::Pinned,
        (RoutingMode::Kv, false) if has_tokens && request.rendered => Reason::KvRender,
        (RoutingMode::Kv, false) if has_tokens => Reason::Kv,
        (RoutingMode::Kv, false) if request.text_prefix => Reason::KvText,
        (RoutingMode::Kv, false) => Reason::KvTextOnly,
        (RoutingMode::Random, false) => Reason::Random,
        (RoutingMode::RoundRobin, false) => Reason::RoundRobin,
        (RoutingMode::LeastLoaded, false) => Reason::LeastLoaded,
        (RoutingMode::PowerOfTwo, false) => Reason::PowerOfTwo,
        (RoutingMode::DeviceAwareWeighted, false) => Reason::DeviceAwareWeighted,
    };

    let mut fallbacks = std::mem::take(&mut state.buffers.fallbacks);
    fallbacks.clear();
    if pin.worker_id.is_none() {
        fallbacks_into(
            config,
            slot,
            &candidates,
            &scores,
            input.load,
            &mut fallbacks,
            &mut state.buffers.best,
        );
    }
    state.buffers.candidates = candidates;

    let overlap = overlap_of(slot);
    let prediction = match &config.ttft {
        Some(t) if config.mode == RoutingMode::Kv => {
            ttft_score(config, t, input, slot, isl, overlap, load_of(slot))
                .ok()
                .map(|p| {
                    let (timing, chunk) = slot_engine(config, t, slot);
                    Prediction {
                        ttft_ms: p.base_ms,
                        own_ms: ttft::own_prefill_ms(
                            &timing,
                            p.uncached_tokens,
                            f64::from(isl) - p.uncached_tokens,
                            chunk,
                        ),
                    }
                })
        }
        _ => None,
    };
    let cached_tokens = u64::from(overlap.device_blocks) * u64::from(config.block_size);
    let prefill_tokens = u64::from(isl).saturating_sub(cached_tokens) as u32;
    Ok(Decision {
        slot,
        fallbacks,
        overlap,
        cost: cost_of(&scores, slot),
        scores,
        prefill_tokens,
        prompt_blocks: cost::new_decode_blocks(input.prompt_blocks, &overlap),
        isl_tokens: isl,
        reason,
        prediction,
    })
}

/// An idle slot's load, for slots the load view does not cover.
const IDLE: SlotLoad = SlotLoad {
    prefill_tokens: 0.0,
    decode_blocks: 0.0,
    active_requests: 0,
};

/// How much slower each slot's worker is than the fleet ([`Slowness::of`]), with what is the
/// same for every slot computed once per decision.
#[derive(Clone, Copy)]
struct Slowness<'a> {
    config: &'a Config,
    learned: Option<&'a LearnedTimings>,
    /// The fleet polynomial's time for the reference prompt, which a worker's own is set against.
    fleet_ms: f64,
}

/// Prompt size at which a worker's own prefill polynomial is compared with the fleet's.
const REFERENCE_PROMPT_TOKENS: f64 = 4096.0;

/// A prefill polynomial's time for the reference prompt from scratch, in one step (ms).
fn reference_ms(poly: &[f64]) -> f64 {
    ttft::prefill_duration_ms(poly, REFERENCE_PROMPT_TOKENS, 0.0, None)
}

impl<'a> Slowness<'a> {
    fn new(config: &'a Config, learned: Option<&'a LearnedTimings>) -> Self {
        Slowness {
            config,
            learned,
            fleet_ms: reference_ms(&config.load.prefill_time_ms_poly),
        }
    }

    /// `slot`'s worker's configured slowness (its own `prefill_time_ms_poly`'s time for the
    /// reference prompt over the fleet's; 1 without one, or when either time is not positive)
    /// times its learned timing factor over the fleet's. The factor is learned against the
    /// worker's own polynomial, so a worker whose polynomial already says it is 3x slower
    /// learns a factor like the rest: without the first term, configuring a worker's speed
    /// would take it out of the cost.
    fn of(&self, slot: SlotIdx) -> f64 {
        let Some(s) = self.config.slots.get(usize::from(slot)) else {
            return 1.0;
        };
        let worker = usize::from(s.worker);
        let learned = match self.learned {
            Some(l) if l.fleet > 0.0 => l.factor(worker) / l.fleet,
            _ => 1.0,
        };
        let own = self.config.workers.get(worker);
        let configured = match own.and_then(|w| w.prefill_time_ms_poly.as_deref()) {
            Some(poly) => {
                let own_ms = reference_ms(poly);
                if own_ms > 0.0 && self.fleet_ms > 0.0 {
                    (own_ms / self.fleet_ms).clamp(1.0 / 256.0, 256.0)
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        configured * learned
    }
}

/// What the request-share term weighs: per slot, the requests this VM sent it lately
/// ([`SelectorState`]).
struct Shares<'a> {
    /// In units of `request_unit` ([`SelectorState::recent`]).
    requests: &'a [f64],
    request_unit: f64,
}

/// Multiplies each candidate's cost by `1 + weight * excess`, `excess` being how far the slot's
/// share of this VM's recent requests is above its fair share (its speed over the candidates',
/// speed being the inverse of its configured and learned relative slowness); returns the new minimum. The
/// shares start from pseudo-counts spread fairly, so the first requests (and a VM that has seen
/// few) do not look lopsided. (Other Envoys' requests enter through the load instead:
/// `load::share`.)
fn weigh_by_share(
    slowness: &Slowness,
    shares: Shares,
    weight: f64,
    candidates: &[SlotIdx],
    costs: &mut [f64],
) -> f64 {
    let unit = if shares.request_unit > 0.0 {
        shares.request_unit
    } else {
        1.0
    };
    let requests_of = |slot: SlotIdx| {
        let count = shares.requests.get(usize::from(slot)).copied();
        count.filter(|c| c.is_finite() && *c > 0.0).unwrap_or(0.0) / unit
    };
    let speed_of = |slot: SlotIdx| 1.0 / slowness.of(slot);
    let (mut total_requests, mut total_speed) = (0.0, 0.0);
    for &slot in candidates {
        total_requests += requests_of(slot);
        total_speed += speed_of(slot);
    }
    let request_prior = SHARE_MEMORY_PER_SLOT / 2.0 * candidates.len() as f64;
    let mut min = f64::INFINITY;
    for (cost, &slot) in costs.iter_mut().zip(candidates) {
        if total_speed > 0.0 {
            let fair = speed_of(slot) / total_speed;
            let share =
                (requests_of(slot) + request_prior * fair) / (total_requests + request_prior);
            // Rounding leaves a fair share a hair above 1: no penalty below one part in 10^6.
            let excess = share / fair - 1.0;
            if excess > 1e-6 && excess.is_finite() {
                *cost *= 1.0 + weight * excess;
            }
        }
        min = min.min(*cost);
    }
    min
}

/// The balance guard (`ttft.max_load_ratio`): drops the candidates with more requests in flight
/// than `ratio` times the candidates' mean plus one, each worker's count weighed by its speed
/// (its learned timing factor over the fleet's: a worker twice as fast may hold twice the
/// requests). The least loaded is at or below the mean, so at least one candidate stays.
/// `ratio` 0: no guard.
fn keep_balanced(
    slowness: &Slowness,
    candidates: &mut Vec<SlotIdx>,
    load: &[SlotLoad],
    ratio: f64,
) {
    if ratio <= 0.0 || candidates.len() < 2 {
        return;
    }
    let weighed = |s: &SlotIdx| {
        let active = load.get(usize::from(*s)).map_or(0, |l| l.active_requests);
        f64::from(active) * slowness.of(*s)
    };
    let total: f64 = candidates.iter().map(weighed).sum();
    let cap = ratio * total / candidates.len() as f64 + 1.0;
    if candidates.iter().any(|s| weighed(s) > cap) {
        candidates.retain(|s| weighed(s) <= cap);
    }
}

/// The usual KV scoring (no preferred taints, no TTFT): each candidate's cost, in candidate
/// order, appended to `costs`; returns their minimum (`f64::min` folded from infinity). One tight
/// pass (at 1,000 slots it dominates the decision): the costs are checked for finiteness once,
/// after the loop, and every slot is read straight from the slices when all of them are
/// candidates and every input covers them (the usual case).
fn score_plain(
    kv: &cost::KvCost,
    candidates: &[SlotIdx],
    overlaps: &[Overlap],
    input: &RouteInput,
    costs: &mut Vec<f64>,
) -> Result<f64, RouteError> {
    let n = candidates.len();
    // Candidates are distinct and ascending, so `n` of them ending at slot `n - 1` are every
    // slot, in order: then each slot's inputs are the slices' items, read in step.
    let every_slot = candidates.last().is_none_or(|&s| usize::from(s) + 1 == n)
        && input.load.len() == n
        && overlaps.len() == n
        && !input.stale_slots.iter().any(|&s| s);
    if every_slot {
        costs.extend(
            input
                .load
                .iter()
                .zip(overlaps)
                .map(|(l, o)| kv.unchecked_cost(o, l)),
        );
    } else {
        let idle = SlotLoad::default();
        let none = Overlap::default();
        costs.extend(candidates.iter().map(|&slot| {
            let i = usize::from(slot);
            let overlap = match input.stale_slots.get(i) {
                Some(true) => &none,
                _ => overlaps.get(i).unwrap_or(&none),
            };
            kv.unchecked_cost(overlap, input.load.get(i).unwrap_or(&idle))
        }));
    }
    // The minimum as `f64::min` folds it, and the sum: a cost that is not finite makes the sum
    // so (or a sum of huge costs overflows: then the scan below finds nothing), so the costs
    // are checked once, after the loop.
    let (min, sum) = costs.iter().fold((f64::INFINITY, 0.0), |(m, s), &c| {
        (if c < m { c } else { m }, s + c)
    });
    if !sum.is_finite() {
        let bad = candidates
            .iter()
            .zip(costs.iter())
            .find(|(_, c)| !c.is_finite());
        if let Some((&slot, &cost)) = bad {
            return Err(RouteError::NonFiniteCost { slot, cost });
        }
    }
    Ok(min)
}

/// The cost `scores` gives `slot` (scores are in ascending slot order, as the candidates).
fn cost_of(scores: &[(SlotIdx, f64)], slot: SlotIdx) -> Option<f64> {
    match scores.binary_search_by_key(&slot, |(s, _)| *s) {
        Ok(i) => scores.get(i).map(|(_, c)| *c),
        // Not in order after all: look at each.
        Err(_) => scores.iter().find(|(s, _)| *s == slot).map(|(_, c)| *c),
    }
}

/// The predicted TTFT of `slot` ([`crate::ttft`]), with its worker's timing, step size and
/// capacity.
fn ttft_score(
    config: &Config,
    ttft: &TtftConfig,
    input: &RouteInput,
    slot: SlotIdx,
    isl_tokens: u32,
    overlap: Overlap,
    load: SlotLoad,
) -> Result<PredictedTtft, cost::NonFiniteCost> {
    let worker = config.worker_of_slot(slot);
    let learned = input.learned.filter(|_| ttft.learn);
    let (timing_factor, fleet_factor) = match (learned, config.slots.get(usize::from(slot))) {
        (Some(l), Some(s)) => (l.factor(usize::from(s.worker)), l.fleet),
        (Some(l), None) => (l.fleet, l.fleet),
        (None, _) => (1.0, 1.0),
    };
    let (timing, chunk_tokens) = slot_engine(config, ttft, slot);
    let inputs = TtftInputs {
        isl_tokens,
        overlap,
        load,
        chunk_tokens,
        kv_capacity_blocks: worker.and_then(|w| w.kv_capacity_blocks),
        kv_usage: input.kv_usage.get(usize::from(slot)).copied().flatten(),
        output_tokens: input
            .request
            .osl_hint_tokens
            .or(input.request.max_tokens)
            .unwrap_or(ttft.default_output_tokens),
        preferred_multiplier: 1.0,
        timing_factor,
        fleet_factor,
        arrivals_per_ms: input.arrivals_per_ms,
    };
    predicted_ttft(ttft, &config.cost, &timing, config.block_size, &inputs)
}

/// `slot`'s worker's timing polynomials (its own, else the fleet's) and prefill step size.
fn slot_engine<'a>(
    config: &'a Config,
    ttft: &'a TtftConfig,
    slot: SlotIdx,
) -> (EngineTiming<'a>, u32) {
    let worker = config.worker_of_slot(slot);
    let fleet_prefill = &config.load.prefill_time_ms_poly;
    let fleet_decode = &ttft.decode_step_ms_poly;
    let timing = EngineTiming {
        prefill_ms_poly: worker.map_or(fleet_prefill, |w| w.prefill_poly(fleet_prefill)),
        fleet_prefill_ms_poly: fleet_prefill,
        decode_step_ms_poly: worker.map_or(fleet_decode, |w| w.decode_poly(fleet_decode)),
    };
    let chunk = worker
        .and_then(|w| w.max_num_batched_tokens)
        .unwrap_or(ttft.chunk_tokens);
    (timing, chunk)
}

/// The fallbacks: the best `fallback_count` candidates (by cost, else fewest in flight; ties by
/// slot) on distinct addresses other than the choice's, best first. That is each address's best
/// candidate, and of those the best few, so one pass keeps them: a candidate that does not beat
/// the worst kept is dropped at one compare (at 1,000 slots nearly all are), one that does
/// replaces its address's entry if it beats it, or else takes a place. Slots sharing an address
/// (DP ranks of one engine, or entries on one host) cost no sort.
#[cfg(test)]
fn fallbacks(
    config: &Config,
    chosen: SlotIdx,
    candidates: &[SlotIdx],
    scores: &[(SlotIdx, f64)],
    load: &[SlotLoad],
) -> Vec<SlotIdx> {
    let mut out = Vec::new();
    fallbacks_into(
        config,
        chosen,
        candidates,
        scores,
        load,
        &mut out,
        &mut Vec::new(),
    );
    out
}

/// The fallbacks into `out`, `best` as scratch (both reused across decisions).
fn fallbacks_into(
    config: &Config,
    chosen: SlotIdx,
    candidates: &[SlotIdx],
    scores: &[(SlotIdx, f64)],
    load: &[SlotLoad],
    out: &mut Vec<SlotIdx>,
    best: &mut Vec<((SlotIdx, f64), std::net::SocketAddr)>,
) {
    let k = config.fallback_count;
    if k == 0 {
        return;
    }
    let by_load = |s: &SlotIdx| {
        (
            *s,
            load.get(usize::from(*s))
                .map_or(0.0, |l| f64::from(l.active_requests)),
        )
    };
    let address = |s: SlotIdx| config.worker_of_slot(s).map(|w| w.address);
    let taken = address(chosen);
    if scores.is_empty() {
        best_on_distinct_addresses(candidates.iter().map(by_load), k, taken, address, best);
    } else {
        best_on_distinct_addresses(scores.iter().copied(), k, taken, address, best);
    }
    out.extend(best.iter().map(|((slot, _), _)| *slot));
}

/// The pass of [`fallbacks`] over `items`, in a loop of its own: the worst kept stays in
/// registers, and the kept list is touched only by an item that beats it.
fn best_on_distinct_addresses(
    items: impl Iterator<Item = (SlotIdx, f64)>,
    k: usize,
    taken: Option<std::net::SocketAddr>,
    address: impl Fn(SlotIdx) -> Option<std::net::SocketAddr>,
    best: &mut Vec<((SlotIdx, f64), std::net::SocketAddr)>,
) {
    // Total (slots are distinct).
    let better = |a: &(SlotIdx, f64), b: &(SlotIdx, f64)| {
        a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)) == std::cmp::Ordering::Less
    };
    best.clear();
    best.reserve(k + 1);
    // The worst kept once `k` are kept: a higher score, or the same score (bit for bit) on a
    // higher slot, loses at once (anything else, such as -0 against +0, is left to `better`).
    let mut bar: Option<(SlotIdx, f64)> = None;
    for item in items {
        if let Some((bar_slot, bar_score)) = bar {
            if item.1 > bar_score
                || (item.1.to_bits() == bar_score.to_bits() && item.0 > bar_slot)
                || !better(&item, &(bar_slot, bar_score))
            {
                continue;
            }
        }
        let Some(a) = address(item.0).filter(|a| Some(*a) != taken) else {
            continue;
        };
        if let Some(i) = best.iter().position(|(_, other)| *other == a) {
            if best.get(i).is_some_and(|(kept, _)| !better(&item, kept)) {
                continue;
            }
            best.remove(i);
        }
        let at = best.partition_point(|(kept, _)| better(kept, &item));
        best.insert(at, (item, a));
        best.truncate(k);
        if best.len() >= k {
            bar = best.last().map(|(worst, _)| *worst);
        }
    }
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
    use crate::config::{Config, CostWeights};

    /// A configuration with `extra` fields: the seed's Dynamo cost, unless `extra` names a
    /// policy or configures the `ttft` model (then the predicted policy).
    fn config(extra: &str, workers: &str) -> Config {
        let policy = if extra.contains("\"policy\"") {
            ""
        } else if extra.contains("\"ttft\"") {
            "\"policy\": \"predicted\","
        } else {
            "\"policy\": \"dynamo\","
        };
        let sep = if extra.is_empty() { "" } else { "," };
        let json = format!("{{{policy}{extra}{sep} \"workers\": [{workers}]}}");
        Config::from_json(json.as_bytes()).unwrap()
    }

    const THREE: &str = r#"{"id": 1, "address": "10.0.0.1:8000"},
                           {"id": 2, "address": "10.0.0.2:8000"},
                           {"id": 3, "address": "10.0.0.3:8000"}"#;

    fn tokens(n: u32) -> LlmRequest {
        LlmRequest {
            token_ids: Some((0..n).collect()),
            ..LlmRequest::default()
        }
    }

    fn dev(blocks: u32) -> Overlap {
        Overlap {
            device_blocks: blocks,
            ..Overlap::default()
        }
    }

    fn decode_load(blocks: &[f64]) -> Vec<SlotLoad> {
        blocks
            .iter()
            .map(|b| SlotLoad {
                decode_blocks: *b,
                ..SlotLoad::default()
            })
            .collect()
    }

    fn active_load(active: &[u32]) -> Vec<SlotLoad> {
        active
            .iter()
            .map(|a| SlotLoad {
                active_requests: *a,
                ..SlotLoad::default()
            })
            .collect()
    }

    fn route(
        c: &Config,
        req: &LlmRequest,
        overlaps: &[Overlap],
        load: &[SlotLoad],
        seed: u64,
    ) -> Result<Decision, RouteError> {
        let input = RouteInput {
            request: req,
            header_pin: Pin::default(),
            prompt_blocks: prompt_blocks(c, req),
            overlaps,
            load,
            stale_slots: &[],
            kv_usage: &[],
            learned: None,
            arrivals_per_ms: 0.0,
        };
        decide(c, &input, &mut SelectorState::new(seed))
    }

    const FOUR: &str = r#"{"id": 1, "address": "10.0.0.1:8000"},
                          {"id": 2, "address": "10.0.0.2:8000"},
                          {"id": 3, "address": "10.0.0.3:8000"},
                          {"id": 4, "address": "10.0.0.4:8000"}"#;

    /// Sends `n` requests of 40 blocks through one VM's state, worker 1 holding `held` blocks of
    /// each (nothing else loaded), and counts the requests per worker.
    fn share_run(c: &Config, held: u32, n: usize, state: &mut SelectorState) -> [usize; 4] {
        let req = tokens(40 * 16);
        let overlaps = [dev(held), dev(0), dev(0), dev(0)];
        let load = decode_load(&[0.0; 4]);
        let mut count = [0; 4];
        for _ in 0..n {
            let input = RouteInput {
                request: &req,
                header_pin: Pin::default(),
                prompt_blocks: prompt_blocks(c, &req),
                overlaps: &overlaps,
                load: &load,
                stale_slots: &[],
                kv_usage: &[],
                learned: None,
                arrivals_per_ms: 0.0,
            };
            let d = decide(c, &input, state).unwrap();
            count[usize::from(d.slot)] += 1;
        }
        count
    }

    #[test]
    fn new_sessions_spread_by_their_share_and_sessions_stay_on_their_history() {
        // A new session whose shared 2-block system prompt one worker holds: 76 there against
        // 80 elsewhere. Without the share term every such session lands on the holder.
        let off = config(
            r#""block_size": 16, "policy": "adaptive", "ttft": {"share_weight": 0}"#,
            FOUR,
        );
        let count = share_run(&off, 2, 40, &mut SelectorState::new(1));
        assert_eq!(count, [40, 0, 0, 0]);
        // At the defaults the holder keeps a lead of a few requests, and the rest spread.
        let on = config(r#""block_size": 16, "policy": "adaptive""#, FOUR);
        let mut state = SelectorState::new(1);
        let count = share_run(&on, 2, 40, &mut state);
        assert!(count.iter().all(|&c| (7..=13).contains(&c)), "{count:?}");
        assert!(
            count[0] >= count[1].max(count[2]).max(count[3]),
            "{count:?}"
        );
        // A continuing session (36 of its 40 blocks on worker 1: 8 there against 80) stays,
        // though worker 1 then holds every one of the last requests.
        let count = share_run(&on, 36, 40, &mut state);
        assert_eq!(count, [40, 0, 0, 0]);
    }

    #[test]
    fn a_vm_spreads_by_the_placements_of_the_other_vms_of_its_envoy() {
        // Two VMs of one Envoy (Envoy's worker threads). VM a sent 40 turns of sessions
        // continuing on worker 1; VM b, which sent nothing, puts a new session whose system
        // prompt worker 1 holds there first, as a lone VM does...
        let on = config(r#""block_size": 16, "policy": "adaptive""#, FOUR);
        let store = crate::store::fake::MemStore::new();
        let (mut a, mut b) = (SelectorState::new(1), SelectorState::new(2));
        let mut heard = Vec::new();
        assert!(b.placements.exchange(&store, 4, &mut heard));
        assert_eq!(share_run(&on, 36, 40, &mut a), [40, 0, 0, 0]);
        assert!(a.placements.exchange(&store, 4, &mut heard));
        assert_eq!(heard, vec![0; 4], "nobody else placed anything");
        let mut alone = b.clone();
        assert_eq!(share_run(&on, 2, 1, &mut alone), [1, 0, 0, 0]);
        // ... until its tick's exchange tells it where a's went, once: then its new sessions
        // go elsewhere, as a's would.
        assert!(b.placements.exchange(&store, 4, &mut heard));
        assert_eq!(heard, vec![40, 0, 0, 0]);
        b.record_others(4, &heard);
        assert_eq!(share_run(&on, 2, 6, &mut a.clone())[0], 0);
        assert_eq!(share_run(&on, 2, 6, &mut b)[0], 0);
        assert!(b.placements.exchange(&store, 4, &mut heard));
        assert_eq!(heard, vec![0; 4]);
    }

    /// The request counts, kept in growing units, are the decayed counts: each request keeps
    /// `1 - 1/(16 x slots)` of every count and adds one to its slot's (also past a rescale).
    #[test]
    fn recent_requests_decay_per_request() {
        let mut state = SelectorState::new(1);
        let slots = 4;
        let keep = 1.0 - 1.0 / (SHARE_MEMORY_PER_SLOT * slots as f64);
        let mut naive = [0.0f64; 4];
        for i in 0..200_000u32 {
            let slot = [0u16, 0, 1, 3][(i % 4) as usize];
            state.record_request(slots, slot);
            naive.iter_mut().for_each(|c| *c *= keep);
            naive[usize::from(slot)] += 1.0;
        }
        for (slot, want) in naive.iter().enumerate() {
            let got = state.recent[slot] / state.recent_unit;
            assert!(
                (got - want).abs() < 1e-6 * want.max(1.0),
                "slot {slot}: {got} vs {want}"
            );
        }
        assert!(naive[0] > 31.0 && naive[2] == 0.0, "{naive:?}");
    }

    #[test]
    fn the_balance_guard_skips_a_hot_spot_but_never_every_slot() {
        // Slot 0 holds the whole prompt but has 10 requests in flight; the mean is 4, so the
        // cap is 1.3 * 4 + 1 = 6.2: the holder is skipped for the least predicted of the rest.
        let c = config(r#""block_size": 16, "ttft": {}"#, THREE);
        let req = tokens(160);
        let overlaps = [dev(10), dev(0), dev(0)];
        let d = route(&c, &req, &overlaps, &active_load(&[10, 1, 1]), 1).unwrap();
        assert_ne!(d.slot, 0, "{d:?}");
        // Within the cap the holder wins.
        let d = route(&c, &req, &overlaps, &active_load(&[6, 3, 3]), 1).unwrap();
        assert_eq!(d.slot, 0, "{d:?}");
        // Off: the holder wins despite its queue of requests (no prefill booked).
        let off = config(r#""block_size": 16, "ttft": {"max_load_ratio": 0}"#, THREE);
        let d = route(&off, &req, &overlaps, &active_load(&[10, 1, 1]), 1).unwrap();
        assert_eq!(d.slot, 0, "{d:?}");
        // Everyone equally loaded: nobody is skipped.
        let unlearned = Slowness::new(&c, None);
        let mut candidates = vec![0, 1, 2];
        keep_balanced(&unlearned, &mut candidates, &active_load(&[9, 9, 9]), 1.3);
        assert_eq!(candidates, [0, 1, 2]);
        keep_balanced(&unlearned, &mut candidates, &active_load(&[0, 0, 50]), 1.0);
        assert_eq!(candidates, [0, 1]);
        // A worker learned 3x as fast (factor 1/3 of the others') may hold 3x the requests.
        let mut learned = LearnedTimings::default();
        learned.resize(3);
        learned.factors = vec![1.0 / 3.0, 1.0, 1.0];
        learned.fleet = 1.0;
        let mut candidates = vec![0, 1, 2];
        let load = active_load(&[9, 3, 3]);
        keep_balanced(
            &Slowness::new(&c, Some(&learned)),
            &mut candidates,
            &load,
            1.3,
        );
        assert_eq!(candidates, [0, 1, 2]);
        keep_balanced(&unlearned, &mut candidates, &load, 1.3);
        assert_eq!(candidates, [1, 2]);
    }

    #[test]
    fn the_adaptive_policy_is_the_default_and_dynamo_one_line_away() {
        let default =
            Config::from_json(br#"{"workers": [{"id": 1, "address": "10.0.0.1:80"}]}"#).unwrap();
        assert_eq!(default.policy, KvPolicy::Adaptive);
        let ttft = default
            .ttft
            .as_ref()
            .expect("the timing model learns by default");
        assert!(ttft.learn && ttft.compute_weight.is_none());
        let dynamo = config("", THREE);
        assert_eq!(dynamo.policy, KvPolicy::Dynamo);
        assert!(dynamo.ttft.is_none());
        let both = br#"{"policy": "dynamo", "ttft": {}, "workers": [{"id": 1, "address": "10.0.0.1:80"}]}"#;
        let err = Config::from_json(both).unwrap_err().to_string();
        assert!(err.contains("ttft") && err.contains("dynamo"), "{err}");
    }

    /// The worked example's request (160 tokens, device overlaps 2 / 5 / 8, decode loads
    /// 2 / 0 / 7) decided under `c` with `learned`.
    fn worked_example_decision(c: &Config, learned: Option<&LearnedTimings>) -> Decision {
        let req = tokens(160);
        let overlaps = [dev(2), dev(5), dev(8)];
        let load = decode_load(&[2.0, 0.0, 7.0]);
        let input = RouteInput {
            request: &req,
            header_pin: Pin::default(),
            prompt_blocks: prompt_blocks(c, &req),
            overlaps: &overlaps,
            load: &load,
            stale_slots: &[],
            kv_usage: &[],
            learned,
            arrivals_per_ms: 0.0,
        };
        decide(c, &input, &mut SelectorState::new(1)).unwrap()
    }

    /// Three scores in slot order, each within 0.1 above `expect` (a prompt of 160 tokens is a
    /// little more work than its tokens).
    fn scores_about(scores: &[(SlotIdx, f64)], expect: [f64; 3]) -> bool {
        scores.len() == 3
            && scores
                .iter()
                .zip(expect)
                .enumerate()
                .all(|(i, (&(s, c), e))| usize::from(s) == i && c >= e && c < e + 0.1)
    }

    /// `n` workers all at one learned factor.
    fn learned_alike(n: usize, factor: f64) -> LearnedTimings {
        let mut learned = LearnedTimings::default();
        learned.resize(n);
        learned.factors = vec![factor; n];
        learned.fleet = factor;
        learned
    }

    #[test]
    fn adaptive_scales_each_workers_cost_by_its_learned_slowness() {
        // The worked example's costs 18 / 10 / 11, with worker 2 learned 2x slower than the
        // fleet (factors 1, 2, 1: fleet 1): 18 / 20 / 11, and worker 3 wins.
        let c = config(r#""block_size": 16, "policy": "adaptive""#, THREE);
        let mut learned = learned_alike(3, 1.0);
        learned.factors[1] = 2.0;
        let d = worked_example_decision(&c, Some(&learned));
        assert!(
            scores_about(&d.scores, [18.0, 20.0, 11.0]),
            "{:?}",
            d.scores
        );
        assert_eq!(d.slot, 2);
        // Nothing learned: the seed's costs.
        let d = worked_example_decision(&c, None);
        assert!(
            scores_about(&d.scores, [18.0, 10.0, 11.0]),
            "{:?}",
            d.scores
        );
        // The time-to-first-token model still predicts the choice, for the learning.
        assert!(d
            .prediction
            .is_some_and(|p| p.ttft_ms > 0.0 && p.own_ms > 0.0 && p.own_ms <= p.ttft_ms));
    }

    #[test]
    fn a_workers_own_timing_scales_its_cost_with_or_without_learning() {
        // The worked example's costs 18 / 10 / 11, worker 2 configured 2x slower than the fleet
        // (its own prefill polynomial): 18 / 20 / 11 before anything is learned, and still when
        // every worker has learned the same factor against its own polynomial (which is what an
        // accurate one gives). Worker 3 wins both times; without the polynomial worker 2 does.
        let fleet = r#""block_size": 16, "policy": "adaptive", "load": {"prefill_time_ms_poly": [0, 0.01]}"#;
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000"},
                         {"id": 2, "address": "10.0.0.2:8000", "prefill_time_ms_poly": [0, 0.02]},
                         {"id": 3, "address": "10.0.0.3:8000"}"#;
        let c = config(fleet, workers);
        let learned = learned_alike(3, 0.7);
        for learned in [None, Some(&learned)] {
            let d = worked_example_decision(&c, learned);
            assert!(
                scores_about(&d.scores, [18.0, 20.0, 11.0]),
                "{:?}",
                d.scores
            );
            assert_eq!(d.slot, 2);
        }
        let d = worked_example_decision(&config(fleet, THREE), None);
        assert!(
            scores_about(&d.scores, [18.0, 10.0, 11.0]),
            "{:?}",
            d.scores
        );
        assert_eq!(d.slot, 1);
    }

    /// Dynamo docs worked example (`"policy": "dynamo"`): block size 16, 160-token prompt (raw prefill 10
    /// blocks everywhere), device overlaps 2/5/8, decode 10/5/9 including this request. The
    /// request adds its blocks not already on the device (8/5/2), so the slots' existing decode
    /// loads are 2/0/7. Costs 8+10 = 18, 5+5 = 10, 2+9 = 11: worker 2 wins.
    #[test]
    fn worked_example() {
        let c = config(r#""block_size": 16"#, THREE);
        let req = tokens(160);
        let d = route(
            &c,
            &req,
            &[dev(2), dev(5), dev(8)],
            &decode_load(&[2.0, 0.0, 7.0]),
            1,
        )
        .unwrap();
        assert_eq!(d.scores, vec![(0, 18.0), (1, 10.0), (2, 11.0)]);
        assert_eq!(d.slot, 1);
        assert_eq!(c.workers[usize::from(d.slot)].id, 2);
        assert_eq!(d.cost, Some(10.0));
        assert_eq!(d.reason, Reason::Kv);
        assert_eq!(d.overlap, dev(5));
        assert_eq!(d.isl_tokens, 160);
        assert_eq!(d.prefill_tokens, 160 - 5 * 16);
        assert_eq!(d.prompt_blocks, 5);
        // Fallbacks by cost: worker 3 (11) then worker 1 (18).
        assert_eq!(d.fallbacks, vec![2, 0]);
    }

    #[test]
    fn affinity_keeps_the_longest_prefix_within_the_margins() {
        // The worked example: the cost picks slot 1 (overlap 5); slot 2 holds 8 blocks.
        let overlaps = [dev(2), dev(5), dev(8)];
        let load = decode_load(&[2.0, 0.0, 7.0]);
        let c = config(r#""block_size": 16, "affinity": {}"#, THREE);
        let d = route(&c, &tokens(160), &overlaps, &load, 1).unwrap();
        assert_eq!(d.slot, 2);
        assert_eq!(d.overlap, dev(8));
        assert_eq!(d.scores, vec![(0, 18.0), (1, 10.0), (2, 11.0)]);
        assert_eq!(d.reason, Reason::Kv);
        // Slot 2 with 5 more requests in flight than the others: over the default margin of 4.
        let mut busy = load.clone();
        busy[2].active_requests = 5;
        let d = route(&c, &tokens(160), &overlaps, &busy, 1).unwrap();
        assert_eq!(d.slot, 1);
        // A text-only request has no prefix: the cost decides.
        let text = LlmRequest {
            text_chars: 640,
            ..LlmRequest::default()
        };
        let d = route(&c, &text, &overlaps, &load, 1).unwrap();
        assert_eq!(d.overlap, Overlap::default());
        assert!(Config::from_json(
            br#"{"affinity": {"min_overlap_blocks": 0}, "workers": [{"id": 1, "address": "a:1"}]}"#
        )
        .is_err());
        assert!(Config::from_json(
            br#"{"affinity": {"margin": 1}, "workers": [{"id": 1, "address": "a:1"}]}"#
        )
        .is_err());
    }

    #[test]
    fn host_and_disk_credits_change_the_choice() {
        let c = config(r#""block_size": 16"#, THREE);
        let req = tokens(160);
        // Slot 0: 8 host blocks -> credit 6 -> 4 + 10 = 14. Slot 1: 8 disk -> credit 2 -> 8 + 10 = 18.
        // Slot 2: nothing -> 10 + 10 = 20.
        let overlaps = [
            Overlap {
                host_blocks: 8,
                ..Overlap::default()
            },
            Overlap {
                disk_blocks: 8,
                ..Overlap::default()
            },
            Overlap::default(),
        ];
        let d = route(&c, &req, &overlaps, &[], 1).unwrap();
        assert_eq!(d.scores, vec![(0, 14.0), (1, 18.0), (2, 20.0)]);
        assert_eq!(d.slot, 0);
        // Host blocks still need prefill compute booked? No: only device blocks are "cached".
        assert_eq!(d.prefill_tokens, 160);
    }

    #[test]
    fn ties_are_broken_randomly_across_seeds() {
        let c = config("", THREE);
        let req = tokens(128);
        let load = decode_load(&[5.0, 0.0, 0.0]);
        let mut seen = [0u32; 3];
        for seed in 0..400 {
            seen[usize::from(route(&c, &req, &[], &load, seed).unwrap().slot)] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 150 && seen[2] > 150, "{seen:?}");
    }

    #[test]
    fn temperature_samples_by_softmax() {
        let c = config(r#""router_temperature": 0.5"#, THREE);
        let req = tokens(64);
        // One-block prompt, zero overlap: costs 1 + decode = 10, 15, 20 (normalised 0, .5, 1).
        let load = decode_load(&[9.0, 14.0, 19.0]);
        let mut state = SelectorState::new(3);
        let mut counts = [0u32; 3];
        let n = 20_000;
        for _ in 0..n {
            let input = RouteInput {
                request: &req,
                header_pin: Pin::default(),
                prompt_blocks: 1,
                overlaps: &[],
                load: &load,
                stale_slots: &[],
                kv_usage: &[],
                learned: None,
                arrivals_per_ms: 0.0,
            };
            counts[usize::from(decide(&c, &input, &mut state).unwrap().slot)] += 1;
        }
        let w = [1.0, (-1.0f64).exp(), (-2.0f64).exp()];
        let s: f64 = w.iter().sum();
        for i in 0..3 {
            let f = f64::from(counts[i]) / f64::from(n);
            assert!(
                (f - w[i] / s).abs() < 0.015,
                "slot {i}: {f} vs {}",
                w[i] / s
            );
        }
    }

    #[test]
    fn text_only_requests_route_on_load_with_zero_overlap() {
        let c = config(r#""block_size": 16"#, THREE);
        let req = LlmRequest {
            text_chars: 641,
            ..LlmRequest::default()
        };
        assert_eq!(isl_tokens(&req), 161);
        assert_eq!(prompt_blocks(&c, &req), 11);
        // Slot 0 would win on overlap, but text-only requests get none.
        let d = route(
            &c,
            &req,
            &[dev(10), dev(0), dev(0)],
            &decode_load(&[1.0, 3.0, 0.5]),
            1,
        )
        .unwrap();
        assert_eq!(d.slot, 2);
        assert_eq!(d.reason, Reason::KvTextOnly);
        assert_eq!(d.overlap, Overlap::default());
        assert_eq!(d.prefill_tokens, 161);
        assert_eq!(d.prompt_blocks, 11);
    }

    #[test]
    fn stale_slots_lose_their_overlap() {
        let c = config(r#""block_size": 16"#, THREE);
        let req = tokens(160);
        let input = RouteInput {
            request: &req,
            header_pin: Pin::default(),
            prompt_blocks: 10,
            overlaps: &[dev(10), dev(0), dev(0)],
            load: &decode_load(&[5.0, 1.0, 2.0]),
            stale_slots: &[true, false, false],
            kv_usage: &[],
            learned: None,
            arrivals_per_ms: 0.0,
        };
        // Slot 0 would cost 0 + 5 + 0 = 5 with its overlap; stale, it costs 10 + 5 + 10 = 25.
        let d = decide(&c, &input, &mut SelectorState::new(1)).unwrap();
        assert_eq!(d.slot, 1);
        assert_eq!(d.scores[0], (0, 25.0));
        assert_eq!(d.overlap, Overlap::default());
    }

    #[test]
    fn preferred_taints_tilt_the_choice() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000"},
                         {"id": 2, "address": "10.0.0.2:8000", "taints": ["fast"]}"#;
        let c = config(r#""block_size": 16"#, workers);
        let mut req = tokens(160);
        // Costs 20 vs 22 without preference; 22 * exp(-tanh(1)) = 10.27 with.
        let load = decode_load(&[0.0, 2.0]);
        assert_eq!(route(&c, &req, &[], &load, 1).unwrap().slot, 0);
        req.preferred_taints = vec![("fast".to_string(), 1.0)];
        let d = route(&c, &req, &[], &load, 1).unwrap();
        assert_eq!(d.slot, 1);
        assert!((d.cost.unwrap() - 22.0 * (-(1.0f64).tanh()).exp()).abs() < 1e-9);
        assert_eq!(d.scores[0], (0, 20.0));
    }

    #[test]
    fn non_finite_cost_is_an_error() {
        let c = config("", THREE);
        let load = vec![
            SlotLoad::default(),
            SlotLoad {
                prefill_tokens: f64::NAN,
                ..SlotLoad::default()
            },
            SlotLoad::default(),
        ];
        let e = route(&c, &tokens(10), &[], &load, 1).unwrap_err();
        assert!(matches!(e, RouteError::NonFiniteCost { slot: 1, .. }));
        assert_eq!(e.http_status(), 500);
    }

    // ---- filters -------------------------------------------------------------------------

    /// Error messages quote client lists and names only in part: a 200,000-id allow-list must not
    /// come back as a 1.4 MB error body.
    #[test]
    fn errors_quote_client_input_only_in_part() {
        let allowed: Vec<u64> = (1000..201_000).collect();
        let e = RouteError::NoCompatibleWorker {
            reason: Incompatibility::AllowList { allowed },
        }
        .to_string();
        assert_eq!(
            e,
            "no configured worker is in nvext.allowed_worker_ids [1000, 1001, 1002, 1003, … 200000 in all]"
        );
        let e = RouteError::NoCompatibleWorker {
            reason: Incompatibility::MissingTaints {
                taints: vec!["t".repeat(100_000), "b".to_string()],
            },
        }
        .to_string();
        assert!(e.len() < 200, "{e}");
        assert!(e.ends_with(r#""b"]"#), "{e}");
        let e = RouteError::NoCompatibleWorker {
            reason: Incompatibility::ModelNotServed {
                model: "m".repeat(1 << 20),
            },
        }
        .to_string();
        assert!(e.len() < 200, "{e}");
    }

    #[test]
    fn allow_list_restricts_candidates() {
        let c = config("", THREE);
        let mut req = tokens(64);
        req.allowed_worker_ids = Some(vec![3, 99]);
        for seed in 0..20 {
            assert_eq!(route(&c, &req, &[], &[], seed).unwrap().slot, 2);
        }
        req.allowed_worker_ids = Some(vec![99]);
        let e = route(&c, &req, &[], &[], 1).unwrap_err();
        assert!(matches!(
            e,
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::AllowList { .. }
            }
        ));
        assert_eq!(e.http_status(), 503);
        req.allowed_worker_ids = Some(vec![1]);
        req.pin.worker_id = Some(2);
        assert_eq!(
            route(&c, &req, &[], &[], 1).unwrap_err(),
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::PinnedOutsideAllowList { worker_id: 2 }
            }
        );
    }

    #[test]
    fn pins_select_exactly_their_slot_and_skip_fallbacks() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000"},
                         {"id": 2, "address": "10.0.0.2:8000", "dp_start": 4, "dp_size": 2}"#;
        let c = config("", workers);
        let mut req = tokens(64);
        req.pin = Pin {
            worker_id: Some(2),
            dp_rank: Some(5),
        };
        // Worker 1 is far cheaper but the pin wins.
        let load = decode_load(&[0.0, 50.0, 50.0]);
        let d = route(&c, &req, &[], &load, 1).unwrap();
        assert_eq!((d.slot, d.reason), (2, Reason::Pinned));
        assert!(d.fallbacks.is_empty());

        req.pin.dp_rank = Some(6);
        let e = route(&c, &req, &[], &load, 1).unwrap_err();
        assert_eq!(
            e,
            RouteError::PinnedRankInvalid {
                worker_id: 2,
                dp_rank: 6,
                dp_start: 4,
                dp_size: 2
            }
        );
        assert_eq!(e.http_status(), 400);
        assert!(e.to_string().contains("[4, 6)"), "{e}");

        req.pin.dp_rank = None;
        let e = route(&c, &req, &[], &load, 1).unwrap_err();
        assert!(matches!(
            e,
            RouteError::PinnedRankRequired { worker_id: 2, .. }
        ));
        assert_eq!(e.http_status(), 400);

        // A single-rank worker needs no rank.
        req.pin = Pin {
            worker_id: Some(1),
            dp_rank: None,
        };
        assert_eq!(route(&c, &req, &[], &load, 1).unwrap().slot, 0);

        req.pin.worker_id = Some(42);
        let e = route(&c, &req, &[], &load, 1).unwrap_err();
        assert_eq!(e, RouteError::PinnedWorkerUnknown { worker_id: 42 });
        assert_eq!(e.http_status(), 404);

        // A rank alone keeps the slots with that rank.
        req.pin = Pin {
            worker_id: None,
            dp_rank: Some(4),
        };
        let d = route(&c, &req, &[], &load, 1).unwrap();
        assert_eq!((d.slot, d.reason), (1, Reason::Kv));
        req.pin.dp_rank = Some(9);
        assert_eq!(
            route(&c, &req, &[], &load, 1).unwrap_err(),
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::NoSlotWithRank { dp_rank: 9 }
            }
        );
    }

    #[test]
    fn header_pin_overrides_body_pin() {
        let c = config("", THREE);
        let mut req = tokens(64);
        req.pin.worker_id = Some(1);
        let input = RouteInput {
            request: &req,
            header_pin: Pin {
                worker_id: Some(3),
                dp_rank: None,
            },
            prompt_blocks: 1,
            overlaps: &[],
            load: &[],
            stale_slots: &[],
            kv_usage: &[],
            learned: None,
            arrivals_per_ms: 0.0,
        };
        let d = decide(&c, &input, &mut SelectorState::new(1)).unwrap();
        assert_eq!(d.slot, 2);
    }

    #[test]
    fn model_and_required_taints_filter() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000", "models": ["a"], "taints": ["x"]},
                         {"id": 2, "address": "10.0.0.2:8000", "models": ["b"], "taints": ["x", "y"]},
                         {"id": 3, "address": "10.0.0.3:8000", "taints": ["y"]}"#;
        let c = config("", workers);
        let mut req = tokens(64);
        req.model = Some("b".to_string());
        let slots: Vec<SlotIdx> = (0..50)
            .map(|s| route(&c, &req, &[], &[], s).unwrap().slot)
            .collect();
        assert!(slots.iter().all(|s| *s == 1 || *s == 2));
        assert!(slots.contains(&1) && slots.contains(&2));
        req.required_taints = vec!["x".to_string()];
        assert_eq!(route(&c, &req, &[], &[], 1).unwrap().slot, 1);
        req.required_taints = vec!["x".to_string(), "z".to_string()];
        let e = route(&c, &req, &[], &[], 1).unwrap_err();
        assert!(matches!(
            e,
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::MissingTaints { .. }
            }
        ));
        req.required_taints.clear();
        req.model = Some("c".to_string());
        // Worker 3 serves any model.
        assert_eq!(route(&c, &req, &[], &[], 1).unwrap().slot, 2);
        let c2 = config(
            "",
            r#"{"id": 1, "address": "10.0.0.1:8000", "models": ["a"]}"#,
        );
        let e = route(&c2, &req, &[], &[], 1).unwrap_err();
        assert_eq!(
            e,
            RouteError::NoCompatibleWorker {
                reason: Incompatibility::ModelNotServed {
                    model: "c".to_string()
                }
            }
        );
        assert_eq!(e.http_status(), 404);
    }

    #[test]
    fn busy_thresholds_exclude_and_reject() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000", "kv_capacity_blocks": 100, "max_num_batched_tokens": 1000},
                         {"id": 2, "address": "10.0.0.2:8000", "kv_capacity_blocks": 100, "max_num_batched_tokens": 1000}"#;
        let c = config(r#""busy": {"decode_blocks_fraction": 0.8}"#, workers);
        let req = tokens(64);
        // Slot 0 is cheaper on cost but over 80% of its KV capacity.
        let load = vec![
            SlotLoad {
                decode_blocks: 81.0,
                ..SlotLoad::default()
            },
            SlotLoad {
                decode_blocks: 80.0,
                prefill_tokens: 100_000.0,
                ..SlotLoad::default()
            },
        ];
        let d = route(&c, &req, &[dev(1), dev(0)], &load, 1).unwrap();
        assert_eq!(d.slot, 1);
        assert!(d.fallbacks.is_empty(), "the busy slot is no fallback");
        // The engine's own report counts too: slot 0 booked nothing, but its worker says 85% of
        // its cache is in use (other routers' requests, or prefixes its requests hold).
        let idle = decode_load(&[0.0, 0.0]);
        let usage = [Some(0.85), Some(0.1)];
        let overlaps = [dev(1), dev(0)];
        let input = RouteInput {
            request: &req,
            header_pin: Pin::default(),
            prompt_blocks: prompt_blocks(&c, &req),
            overlaps: &overlaps,
            load: &idle,
            stale_slots: &[],
            kv_usage: &usage,
            learned: None,
            arrivals_per_ms: 0.0,
        };
        let d = decide(&c, &input, &mut SelectorState::new(1)).unwrap();
        assert_eq!(d.slot, 1, "{:?}", d.scores);
        assert_eq!(d.scores.len(), 1, "{:?}", d.scores);
        let d = decide(
            &c,
            &RouteInput {
                kv_usage: &[],
                ..input
            },
            &mut SelectorState::new(1),
        );
        assert_eq!(
            d.unwrap().slot,
            0,
            "without the report slot 0 holds the prefix"
        );

        let both = decode_load(&[90.0, 95.0]);
        let e = route(&c, &req, &[], &both, 1).unwrap_err();
        assert_eq!(e, RouteError::AllWorkersOverloaded { eligible: 2 });
        assert_eq!((e.http_status(), e.retry_after_secs()), (503, Some(1)));
        let mut pinned = req.clone();
        pinned.pin.worker_id = Some(1);
        let e = route(&c, &pinned, &[], &both, 1).unwrap_err();
        assert_eq!(e, RouteError::PinnedWorkerOverloaded { worker_id: 1 });
        assert_eq!((e.http_status(), e.retry_after_secs()), (503, Some(1)));

        let prefill = |p: f64| SlotLoad {
            prefill_tokens: p,
            ..SlotLoad::default()
        };
        let c = config(r#""busy": {"prefill_tokens": 500}"#, workers);
        assert_eq!(
            route(&c, &req, &[], &[prefill(501.0), prefill(500.0)], 1)
                .unwrap()
                .slot,
            1
        );
        let c = config(r#""busy": {"prefill_tokens_fraction": 0.5}"#, workers);
        assert_eq!(
            route(&c, &req, &[], &[prefill(400.0), prefill(501.0)], 1)
                .unwrap()
                .slot,
            0
        );
    }

    // ---- basic modes ----------------------------------------------------------------------

    fn distribution(c: &Config, load: &[SlotLoad], n: usize) -> (Vec<u32>, Reason) {
        let req = tokens(64);
        let mut state = SelectorState::new(11);
        let mut counts = vec![0u32; c.num_slots()];
        let mut reason = Reason::Kv;
        for _ in 0..n {
            let input = RouteInput {
                request: &req,
                header_pin: Pin::default(),
                prompt_blocks: 1,
                overlaps: &[],
                load,
                stale_slots: &[],
                kv_usage: &[],
                learned: None,
                arrivals_per_ms: 0.0,
            };
            let d = decide(c, &input, &mut state).unwrap();
            assert!(d.scores.is_empty() && d.cost.is_none());
            counts[usize::from(d.slot)] += 1;
            reason = d.reason;
        }
        (counts, reason)
    }

    #[test]
    fn random_mode_is_uniform() {
        let c = config(r#""mode": "random""#, THREE);
        let (counts, reason) = distribution(&c, &active_load(&[100, 0, 0]), 30_000);
        assert_eq!(reason, Reason::Random);
        for k in counts {
            assert!((9_300..10_700).contains(&k), "{k}");
        }
    }

    #[test]
    fn round_robin_mode_cycles_exactly() {
        let c = config(r#""mode": "round-robin""#, THREE);
        let req = tokens(64);
        let mut state = SelectorState::new(0);
        let picks: Vec<SlotIdx> = (0..6)
            .map(|_| {
                let input = RouteInput {
                    request: &req,
                    header_pin: Pin::default(),
                    prompt_blocks: 1,
                    overlaps: &[],
                    load: &[],
                    stale_slots: &[],
                    kv_usage: &[],
                    learned: None,
                    arrivals_per_ms: 0.0,
                };
                decide(&c, &input, &mut state).unwrap().slot
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let (counts, reason) = distribution(&c, &[], 300);
        assert_eq!((counts, reason), (vec![100, 100, 100], Reason::RoundRobin));
    }

    #[test]
    fn direct_mode_requires_a_pin() {
        let c = config(
            r#""mode": "direct", "client_routing_hints": "honor""#,
            THREE,
        );
        let mut req = tokens(64);
        let e = route(&c, &req, &[], &[], 1).unwrap_err();
        assert_eq!(e, RouteError::PinRequired);
        assert_eq!(e.http_status(), 400);
        req.pin.worker_id = Some(3);
        let d = route(&c, &req, &[], &[], 1).unwrap();
        assert_eq!((d.slot, d.reason), (2, Reason::Direct));
    }

    #[test]
    fn least_loaded_mode_splits_ties_and_avoids_load() {
        let c = config(r#""mode": "least-loaded""#, THREE);
        let (counts, reason) = distribution(&c, &active_load(&[2, 1, 1]), 10_000);
        assert_eq!(reason, Reason::LeastLoaded);
        assert_eq!(counts[0], 0);
        assert!((4_500..5_500).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn power_of_two_mode_distribution() {
        let c = config(r#""mode": "power-of-two""#, THREE);
        let (counts, reason) = distribution(&c, &active_load(&[0, 5, 9]), 30_000);
        assert_eq!(reason, Reason::PowerOfTwo);
        // Least loaded wins 2 of the 3 pairs, the middle one 1 of 3, the most loaded never.
        assert_eq!(counts[2], 0);
        assert!((19_400..20_600).contains(&counts[0]), "{counts:?}");
    }

    #[test]
    fn device_aware_weighted_mode() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000", "device": "cpu"},
                         {"id": 2, "address": "10.0.0.2:8000", "device": "gpu"},
                         {"id": 3, "address": "10.0.0.3:8000", "device": "gpu"}"#;
        let c = config(
            r#""mode": "device-aware-weighted", "device_ratio": 8"#,
            workers,
        );
        // CPU: 1 / (1 * 1) = 1; GPU: (7 + 8) / (2 * 8) = 0.94 -> GPU group, least loaded = slot 1.
        let (counts, reason) = distribution(&c, &active_load(&[1, 7, 8]), 100);
        assert_eq!(reason, Reason::DeviceAwareWeighted);
        assert_eq!(counts, vec![0, 100, 0]);
        // GPU: (9 + 8) / 16 = 1.06 > 1 -> the CPU worker.
        let (counts, _) = distribution(&c, &active_load(&[1, 9, 8]), 100);
        assert_eq!(counts, vec![100, 0, 0]);
        // One class only: plain least-loaded.
        let gpus = config(r#""mode": "device-aware-weighted""#, THREE);
        let (counts, _) = distribution(&gpus, &active_load(&[3, 2, 1]), 100);
        assert_eq!(counts, vec![0, 0, 100]);
    }

    #[test]
    fn fallbacks_skip_same_address_and_respect_the_count() {
        let workers = r#"{"id": 1, "address": "10.0.0.1:8000", "dp_size": 2},
                         {"id": 2, "address": "10.0.0.2:8000"},
                         {"id": 3, "address": "10.0.0.3:8000"},
                         {"id": 4, "address": "10.0.0.4:8000"}"#;
        let c = config(r#""fallback_count": 2, "block_size": 16"#, workers);
        let req = tokens(16);
        // Slots 0,1 (worker 1) cheapest, then 4, 3, 2.
        let load = decode_load(&[0.0, 0.5, 9.0, 8.0, 7.0]);
        let d = route(&c, &req, &[], &load, 1).unwrap();
        assert_eq!(d.slot, 0);
        assert_eq!(d.fallbacks, vec![4, 3]);
        let c0 = config(r#""fallback_count": 0"#, workers);
        assert!(route(&c0, &req, &[], &load, 1)
            .unwrap()
            .fallbacks
            .is_empty());
    }

    /// The fallbacks as the full sort gave them before the partial selection.
    fn fallbacks_by_full_sort(
        config: &Config,
        chosen: SlotIdx,
        scores: &[(SlotIdx, f64)],
    ) -> Vec<SlotIdx> {
        let mut ranked = scores.to_vec();
        ranked.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let address = |s: SlotIdx| config.worker_of_slot(s).map(|w| w.address);
        let mut used = vec![address(chosen)];
        let mut out = Vec::new();
        for (slot, _) in ranked {
            if out.len() >= config.fallback_count {
                break;
            }
            let a = address(slot);
            if a.is_some() && !used.contains(&a) {
                used.push(a);
                out.push(slot);
            }
        }
        out
    }

    /// The plain scoring loop against the per-slot cost (the general loop's formula), on random
    /// loads, overlaps, stale flags and candidate subsets: the same cost for every candidate,
    /// bit for bit, the same minimum as `f64::min` folds, and the first non-finite cost in
    /// candidate order reported as the error.
    #[test]
    fn the_plain_scoring_loop_scores_as_the_per_slot_cost() {
        let mut rng = Rng::new(5);
        let weights = CostWeights {
            decode_active_request_weight: 0.5,
            prefill_load_scale: 1.5,
            ..CostWeights::default()
        };
        let (mut every_slot, mut subsets, mut errors) = (0, 0, 0);
        for round in 0..600u64 {
            let n = 1 + rng.index(200);
            let isl = rng.index(20_000) as u32;
            let prompt_blocks = isl.div_ceil(16);
            let kv = cost::KvCost::new(&weights, 16, isl, prompt_blocks);
            let load: Vec<SlotLoad> = (0..n)
                .map(|_| SlotLoad {
                    prefill_tokens: rng.index(50_000) as f64,
                    decode_blocks: rng.index(5_000) as f64 / 3.0,
                    active_requests: rng.index(40) as u32,
                })
                .collect();
            let mut load = load;
            // Some rounds corrupt a few loads (NaN, infinity).
            if round % 7 == 0 {
                for _ in 0..1 + rng.index(3) {
                    let i = rng.index(n);
                    load[i].decode_blocks = [f64::NAN, f64::INFINITY][rng.index(2)];
                }
            }
            let overlaps: Vec<Overlap> = (0..n)
                .map(|_| match rng.index(4) {
                    0 => Overlap {
                        device_blocks: rng.index(100) as u32,
                        host_blocks: rng.index(3) as u32 * rng.index(20) as u32,
                        disk_blocks: 0,
                    },
                    _ => Overlap::default(),
                })
                .collect();
            let stale: Vec<bool> = match rng.index(3) {
                0 => (0..n).map(|_| rng.index(5) == 0).collect(),
                1 => vec![false; n],
                _ => Vec::new(),
            };
            let candidates: Vec<SlotIdx> = if rng.index(2) == 0 {
                (0..n as SlotIdx).collect()
            } else {
                (0..n as SlotIdx).filter(|_| rng.index(3) != 0).collect()
            };
            if candidates.len() == n && !stale.contains(&true) {
                every_slot += 1;
            } else {
                subsets += 1;
            }
            let req = LlmRequest::default();
            let input = RouteInput {
                request: &req,
                header_pin: Pin::default(),
                prompt_blocks,
                overlaps: &overlaps,
                load: &load,
                stale_slots: &stale,
                kv_usage: &[],
                learned: None,
                arrivals_per_ms: 0.0,
            };
            let mut costs = Vec::new();
            let got = score_plain(&kv, &candidates, &overlaps, &input, &mut costs);
            let want: Vec<(SlotIdx, Result<f64, f64>)> = candidates
                .iter()
                .map(|&s| {
                    let i = usize::from(s);
                    let o = if stale.get(i) == Some(&true) {
                        Overlap::default()
                    } else {
                        overlaps[i]
                    };
                    (s, kv.cost(&o, &load[i], 1.0))
                })
                .collect();
            match want.iter().find(|(_, c)| c.is_err()) {
                Some(&(slot, Err(cost))) => {
                    errors += 1;
                    match got {
                        Err(RouteError::NonFiniteCost { slot: s, cost: c }) => {
                            assert_eq!(s, slot, "round {round}");
                            assert_eq!(c.is_nan(), cost.is_nan(), "round {round}");
                        }
                        other => panic!("round {round}: {other:?}, want slot {slot} not finite"),
                    }
                }
                _ => {
                    let want_costs: Vec<u64> = want
                        .iter()
                        .map(|(_, c)| c.unwrap_or(f64::NAN).to_bits())
                        .collect();
                    let got_costs: Vec<u64> = costs.iter().map(|c| c.to_bits()).collect();
                    assert_eq!(got_costs, want_costs, "round {round}");
                    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
                    assert_eq!(got.unwrap().to_bits(), min.to_bits(), "round {round}");
                }
            }
        }
        // Both loops and the error path ran.
        assert!(every_slot > 100 && subsets > 100 && errors > 30);
    }

    #[test]
    fn partial_fallback_selection_matches_the_full_sort() {
        let mut rng = Rng::new(11);
        for round in 0..400u64 {
            let workers = 1 + rng.index(300);
            let addresses = 1 + rng.index(workers.min(40));
            let count = rng.index(17);
            let list: Vec<String> = (0..workers)
                .map(|i| {
                    format!(
                        r#"{{"id": {}, "address": "10.0.{}.1:8000"}}"#,
                        i + 1,
                        i % addresses
                    )
                })
                .collect();
            let c = config(&format!(r#""fallback_count": {count}"#), &list.join(","));
            // Few distinct scores (many ties), NaN-free but with infinities and signed zeros.
            let palette = [0.0, -0.0, 1.0, 2.5, 7.0, f64::INFINITY, 1e300];
            let mut scores: Vec<(SlotIdx, f64)> = Vec::new();
            for s in 0..workers {
                if rng.index(8) != 0 {
                    scores.push((s as SlotIdx, palette[rng.index(palette.len())]));
                }
            }
            let candidates: Vec<SlotIdx> = scores.iter().map(|(s, _)| *s).collect();
            let Some(&chosen) = candidates.get(rng.index(candidates.len().max(1))) else {
                continue;
            };
            let want = fallbacks_by_full_sort(&c, chosen, &scores);
            assert_eq!(
                fallbacks(&c, chosen, &candidates, &scores, &[]),
                want,
                "round {round}"
            );
            // Score-less modes rank by in-flight requests.
            let load = active_load(
                &(0..workers)
                    .map(|_| rng.index(4) as u32)
                    .collect::<Vec<_>>(),
            );
            let by_load: Vec<(SlotIdx, f64)> = candidates
                .iter()
                .map(|s| (*s, f64::from(load[usize::from(*s)].active_requests)))
                .collect();
            assert_eq!(
                fallbacks(&c, chosen, &candidates, &[], &load),
                fallbacks_by_full_sort(&c, chosen, &by_load),
                "round {round}, by load"
            );
        }
    }

    #[test]
    fn reasons_have_stable_names() {
        assert_eq!(Reason::Kv.as_str(), "kv");
        assert_eq!(Reason::KvTextOnly.as_str(), "kv-text-only");
        assert_eq!(Reason::Pinned.as_str(), "pinned");
        assert_eq!(Reason::RoundRobin.as_str(), "round-robin");
        assert_eq!(
            Reason::DeviceAwareWeighted.as_str(),
            "device-aware-weighted"
        );
    }
}
