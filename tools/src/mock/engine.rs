//! Engine mode: a vLLM-like simulator after the "mocker" of NVIDIA Dynamo
//! (github.com/ai-dynamo/dynamo, `lib/llm/src/mocker`), with its scheduler defaults.
//!
//! [`EngineCore`] is the deterministic model (no clocks, no threads): a waiting queue, continuous
//! batching with chunked prefill (at most `max_seqs` running, at most `max_batched_tokens` tokens
//! per step: one per decoding sequence, the rest for prefill chunks in arrival order, each at
//! most `long_prefill_token_threshold` while others run or wait), a paged [`KvCache`] with prefix
//! reuse, and preemption (the newest running sequence) when decode runs out of blocks.
//! [`EngineCore::step`] plans and applies one batch and says how long it takes, by the roofline
//! of [`super::timing`] (Llama-3.1-8B in bf16 on one H100 SXM), not by the filter's predictor
//! polynomials:
//!
//! * the step's work is its prefill chunks (each: its new tokens after the tokens of its sequence
//!   already in the cache, a cached prefix included) and its decoding sequences (one token after
//!   their context);
//! * step ms = 3 ms of overhead + max(linear-layer and attention FLOPs / effective FLOP/s,
//!   weights + the chunks' KV bytes / effective bandwidth), plus `host_reload_weight` of a new
//!   token's linear-layer time for each host-tier hit reloaded: an 8,192-token prefill step
//!   from an empty context ~208 ms, a decode-only step of a few sequences ~9 ms;
//! * divided by `speedup`, multiplied by `slowdown` (8 for a CPU device) and by a lognormal
//!   factor of mean 1 and log-sd `jitter` (the worker's `--jitter`, 0 = none) from a
//!   deterministic per-engine generator seeded by `seed` (the worker's id).
//!
//! A sequence's first token is sampled by the step that finishes its prefill (a fully cached
//! prompt has no prefill: its first token comes from a decode-only step). [`Engine`] runs the core
//! on a thread in real time, streams tokens to the (async) request handlers over unbounded
//! channels, and keeps the bounded KV event log (vLLM-shaped events) and the dump.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::block_hasher::{BlockHasher, Digest};
use super::event_log::{EventLog, PageLimits, DEFAULT_PAGE};
use super::kv_cache::{BlockHash, CacheEvent, KvCache};
use super::kv_zmq::KvPublisher;
use super::openai::VOCAB;
use super::timing::{Chunk, Jitter, StepWork};
use crate::util::lock;
use crate::util::splitmix64;
use kv_router_protocol::page::{EventJson, Load, PageEvent};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    pub kv_blocks: usize,
    pub host_kv_blocks: usize,
    pub max_seqs: usize,
    pub max_batched_tokens: usize,
    /// vLLM's `--long-prefill-token-threshold`: the most prompt tokens one request computes in a
    /// step while another request runs or waits (0 = no cap), so that a long prefill leaves
    /// budget for the rest of the batch.
    pub long_prefill_token_threshold: usize,
    /// Divides every step time.
    pub speedup: f64,
    /// Multiplies every step time (1 for a GPU, 8 for a CPU device).
    pub slowdown: f64,
    /// Log-sd of the lognormal factor of mean 1 multiplying every step time (0 = none: the
    /// deterministic model; the worker's `--jitter` defaults to 0.1).
    pub jitter: f64,
    /// Seed of the jitter's generator (the worker's: from its id).
    pub seed: u64,
    /// Fraction of the KV cache kept free when admitting while others run.
    pub watermark: f64,
    /// Time of reloading a host-tier hit token, as a fraction of a new token's linear-layer
    /// time ([`super::timing`]).
    pub host_reload_weight: f64,
    pub dp_rank: u32,
    /// How blocks are named (the mock's own hash by default).
    pub block_hasher: BlockHasher,
    /// vLLM's `--scheduling-policy`: arrival order, or each request's `priority` (lowest first,
    /// then arrival), which also picks the preemption victim.
    pub policy: SchedulingPolicy,
}

/// The order in which waiting requests are admitted (vLLM's `--scheduling-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served: a request's `priority` other than 0 is refused, as vLLM does.
    #[default]
    Fcfs,
    /// Lowest `(priority, arrival)` first; a preempted request goes back by its priority, and
    /// the running request of the highest `(priority, arrival)` is the one preempted.
    Priority,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 64,
            kv_blocks: 16384,
            host_kv_blocks: 0,
            max_seqs: 256,
            max_batched_tokens: 8192,
            long_prefill_token_threshold: 0,
            speedup: 1.0,
            slowdown: 1.0,
            jitter: 0.0,
            seed: 0,
            watermark: 0.01,
            host_reload_weight: 0.25,
            dp_rank: 0,
            block_hasher: BlockHasher::Mock,
            policy: SchedulingPolicy::Fcfs,
        }
    }
}

pub type ReqId = u64;

/// What a request's handler receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// The `index`-th generated token (0-based).
    Token {
        id: ReqId,
        token: u32,
        index: usize,
    },
    Finished {
        id: ReqId,
        usage: Usage,
    },
    Failed {
        id: ReqId,
        message: String,
    },
}

impl Output {
    pub fn id(&self) -> ReqId {
        match self {
            Output::Token { id, .. } | Output::Finished { id, .. } | Output::Failed { id, .. } => {
                *id
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens found in the cache (device or host) at first admission.
    pub cached_tokens: usize,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    pub duration_ms: f64,
    /// New (uncached) tokens computed by prefill chunks.
    pub prefill_tokens: usize,
    /// Host-tier hit tokens reloaded.
    pub reload_tokens: usize,
    /// Sequences that sampled a token without prefill work.
    pub decode_seqs: usize,
    /// Active KV fraction during the step (after its allocations).
    pub kv_usage: f64,
    pub outputs: Vec<Output>,
}

impl StepOutcome {
    pub fn is_idle(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0 && self.outputs.is_empty()
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub requests_completed: u64,
    pub prefix_queries_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_host_hit_tokens: u64,
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Modelled time of the steps' prefill share (after speedup, slowdown and jitter),
    /// microseconds: a step's time minus what its decoding sequences alone would take (the
    /// whole step without them).
    pub prefill_busy_us: u64,
    /// Modelled time of all steps (after speedup, slowdown and jitter), microseconds.
    pub busy_us: u64,
    /// Sum of each step's modelled time squared, ms^2: with `busy_us`, the mean wait of a request
    /// that arrives during a step for that step to end (`sum S^2 / (2 sum S)`).
    pub busy_squared_ms2: f64,
}

#[derive(Debug, Clone)]
struct Seq {
    id: ReqId,
    /// The request's `priority` (0 unless given; read under the priority policy only).
    priority: i64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    generated: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    /// Tokens to compute before sampling (set at admission).
    target: usize,
    /// Cached blocks this sequence references, in order (its first `held.len()` full blocks).
    held: Vec<BlockHash>,
    /// vLLM digests of `held` (vLLM hashing only: a child block chains on the full digest).
    digests: Vec<Digest>,
    /// Allocated, not yet cached blocks.
    private: usize,
    cached_tokens: usize,
    admitted_before: bool,
}

impl Seq {
    fn needs_prefill(&self) -> bool {
        self.computed < self.target
    }
}

#[derive(Debug, Clone)]
pub struct EngineCore {
    cfg: EngineConfig,
    cache: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    aborted: HashSet<ReqId>,
    next_id: ReqId,
    jitter: Jitter,
    pub counters: Counters,
}

fn release_all(cache: &mut KvCache, seq: &mut Seq) {
    for h in seq.held.drain(..) {
        cache.release(h);
    }
    seq.digests.clear();
    cache.free_private(seq.private);
    seq.private = 0;
    seq.computed = 0;
    seq.target = 0;
}

/// Caches the full blocks now computed that the sequence does not hold yet.
fn commit_full_blocks(cache: &mut KvCache, hasher: &BlockHasher, seq: &mut Seq, block_size: usize) {
    let full = seq.computed / block_size;
    while seq.held.len() < full && seq.private > 0 {
        let i = seq.held.len();
        let Some(tokens) = seq.tokens.get(i * block_size..(i + 1) * block_size) else {
            return;
        };
        let parent = seq.held.last().copied();
        let parent_digest = i.checked_sub(1).and_then(|p| seq.digests.get(p));
        let (h, digest) = hasher.child(parent, parent_digest, tokens);
        cache.commit(h, parent, tokens);
        seq.private -= 1;
        seq.held.push(h);
        seq.digests.extend(digest);
    }
}

fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

impl EngineCore {
    pub fn new(cfg: EngineConfig) -> Self {
        let cache = KvCache::new(cfg.block_size, cfg.kv_blocks, cfg.host_kv_blocks);
        let jitter = Jitter::new(cfg.jitter, cfg.seed);
        EngineCore {
            jitter,
            cfg,
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborted: HashSet::new(),
            next_id: 1,
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Active KV fraction (blocks held by sequences / capacity).
    pub fn kv_usage(&self) -> f64 {
        if self.cfg.kv_blocks == 0 {
            return 0.0;
        }
        self.cache.active_blocks() as f64 / self.cfg.kv_blocks as f64
    }

    /// Queues a request. Fails if it could never fit in the KV cache, or if it has a priority
    /// other than 0 on an engine that schedules in arrival order (vLLM refuses it too).
    pub fn submit(
        &mut self,
        tokens: Vec<u32>,
        max_tokens: usize,
        priority: i64,
    ) -> Result<ReqId, String> {
        if tokens.is_empty() {
            return Err("empty prompt".into());
        }
        if priority != 0 && self.cfg.policy == SchedulingPolicy::Fcfs {
            return Err(
                "Got priority != 0 but the engine schedules in arrival order: start it with --scheduling-policy priority"
                    .into(),
            );
        }
        let max_tokens = max_tokens.max(1);
        let need = blocks_for(tokens.len() + max_tokens, self.cfg.block_size);
        if need > self.cfg.kv_blocks {
            return Err(format!(
                "prompt of {} tokens plus {max_tokens} output tokens needs {need} KV blocks; the cache has {}",
                tokens.len(),
                self.cfg.kv_blocks
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.enqueue(Seq {
            id,
            priority,
            prompt_len: tokens.len(),
            tokens,
            max_tokens,
            generated: 0,
            computed: 0,
            target: 0,
            held: Vec::new(),
            digests: Vec::new(),
            private: 0,
            cached_tokens: 0,
            admitted_before: false,
        });
        Ok(id)
    }

    /// Puts a new request in the waiting queue: last, or by `(priority, arrival)`.
    fn enqueue(&mut self, seq: Seq) {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_back(seq),
            SchedulingPolicy::Priority => self.insert_by_priority(seq),
        }
    }

    /// Ids grow with arrival, so `(priority, id)` is vLLM's `(priority, arrival_time)`.
    fn insert_by_priority(&mut self, seq: Seq) {
        let key = (seq.priority, seq.id);
        let at = self.waiting.partition_point(|s| (s.priority, s.id) < key);
        self.waiting.insert(at, seq);
    }

    /// Cancels a request (its blocks are released at the next step; no output follows).
    pub fn abort(&mut self, id: ReqId) {
        self.aborted.insert(id);
    }

    fn reap_aborted(&mut self) {
        if self.aborted.is_empty() {
            return;
        }
        let aborted = std::mem::take(&mut self.aborted);
        self.waiting.retain(|s| !aborted.contains(&s.id));
        let cache = &mut self.cache;
        self.running.retain_mut(|s| {
            if aborted.contains(&s.id) {
                release_all(cache, s);
                false
            } else {
                true
            }
        });
    }

    /// Fails every request and empties the cache (one AllBlocksCleared event).
    pub fn reset(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        for mut s in self.running.drain(..) {
            release_all(&mut self.cache, &mut s);
            out.push(Output::Failed {
                id: s.id,
                message: "engine reset".into(),
            });
        }
        for s in self.waiting.drain(..) {
            out.push(Output::Failed {
                id: s.id,
                message: "engine reset".into(),
            });
        }
        self.aborted.clear();
        self.cache.clear();
        out
    }

    /// Admits a waiting sequence: takes its cached prefix and allocates the rest of its blocks.
    fn try_admit(&mut self, seq: &mut Seq, reload_tokens: &mut usize) -> bool {
        let bs = self.cfg.block_size;
        let (hashes, digests) = self.cfg.block_hasher.prompt(&seq.tokens, bs);
        let (dev, _) = self.cache.match_prefix(&hashes);
        for h in hashes.iter().take(dev) {
            self.cache.acquire(*h);
        }
        let total = blocks_for(seq.tokens.len(), bs);
        let need = total - dev;
        let watermark = if self.running.is_empty() {
            0
        } else {
            (self.cfg.watermark * self.cfg.kv_blocks as f64).ceil() as usize
        };
        if !self.cache.make_room(need + watermark) {
            for h in hashes.iter().take(dev) {
                self.cache.release(*h);
            }
            return false;
        }
        // Evictions may have pushed some host hits out; count them again.
        let (dev2, host) = self.cache.match_prefix(&hashes);
        debug_assert_eq!(dev, dev2);
        seq.held = hashes.iter().take(dev).copied().collect();
        for h in hashes.iter().skip(dev).take(host) {
            if !self.cache.reload(*h) {
                break;
            }
            seq.held.push(*h);
        }
        seq.digests = digests.into_iter().take(seq.held.len()).collect();
        let host = seq.held.len() - dev;
        seq.private = total - seq.held.len();
        let ok = self.cache.alloc_private(seq.private);
        debug_assert!(ok);
        seq.computed = (seq.held.len() * bs).min(seq.tokens.len());
        seq.target = seq.tokens.len();
        *reload_tokens += host * bs;
        if !seq.admitted_before {
            seq.admitted_before = true;
            seq.cached_tokens = seq.computed.min(seq.prompt_len);
            self.counters.prefix_queries_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += (dev * bs).min(seq.prompt_len) as u64;
            self.counters.prefix_host_hit_tokens += (host * bs) as u64;
        }
        true
    }

    /// Preempts the newest running sequence (the lowest priority under the priority policy)
    /// and returns it to the waiting queue: first, or by its priority.
    fn preempt_last(&mut self) -> Option<ReqId> {
        let mut s = match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.running.pop()?,
            SchedulingPolicy::Priority => {
                let (at, _) = self
                    .running
                    .iter()
                    .enumerate()
                    .max_by_key(|(_, s)| (s.priority, s.id))?;
                self.running.remove(at)
            }
        };
        release_all(&mut self.cache, &mut s);
        self.counters.preemptions += 1;
        let id = s.id;
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_front(s),
            SchedulingPolicy::Priority => self.insert_by_priority(s),
        }
        Some(id)
    }

    /// The most prompt tokens one request may compute in this step: vLLM applies
    /// `--long-prefill-token-threshold` only while another request runs or waits (a lone request
    /// starves nobody).
    fn prefill_chunk_cap(&self) -> usize {
        let threshold = self.cfg.long_prefill_token_threshold;
        if threshold > 0 && self.running.len() + self.waiting.len() > 1 {
            threshold
        } else {
            usize::MAX
        }
    }

    /// Plans and applies one batch. `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<StepOutcome> {
        self.reap_aborted();
        if !self.has_work() {
            return None;
        }
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_batched_tokens.max(1);
        let chunk_cap = self.prefill_chunk_cap();
        let mut decodes: Vec<ReqId> = Vec::new();
        let mut prefills: Vec<(ReqId, usize)> = Vec::new();
        let mut reload_tokens = 0usize;

        // 1. Running sequences that decode: one token each, growing their blocks (preempting the
        //    newest sequences when the cache is full).
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let Some(seq) = self.running.get(i) else {
                break;
            };
            if seq.needs_prefill() {
                i += 1;
                continue;
            }
            let need =
                blocks_for(seq.tokens.len(), bs).saturating_sub(seq.held.len() + seq.private);
            let id = seq.id;
            let mut got = need == 0;
            while !got {
                if self.cache.make_room(need) && self.cache.alloc_private(need) {
                    if let Some(s) = self.running.get_mut(i) {
                        s.private += need;
                    }
                    got = true;
                } else if self.preempt_last() == Some(id) {
                    break;
                }
            }
            if got {
                decodes.push(id);
                budget -= 1;
                i += 1;
            }
        }
        // 2. Running sequences still in prefill, in arrival order.
        for seq in &self.running {
            if budget == 0 {
                break;
            }
            if seq.needs_prefill() {
                let chunk = (seq.target - seq.computed).min(budget).min(chunk_cap);
                prefills.push((seq.id, chunk));
                budget -= chunk;
            }
        }
        // 3. Admissions.
        while budget > 0 && self.running.len() < self.cfg.max_seqs.max(1) {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if !self.try_admit(&mut seq, &mut reload_tokens) {
                self.waiting.push_front(seq);
                break;
            }
            if seq.needs_prefill() {
                let chunk = (seq.target - seq.computed).min(budget).min(chunk_cap);
                prefills.push((seq.id, chunk));
                budget -= chunk;
            } else {
                decodes.push(seq.id);
                budget -= 1;
            }
            self.running.push(seq);
        }

        // KV fill during this step (after this step's allocations).
        let kv_usage = self.kv_usage();
        let prefill_tokens: usize = prefills.iter().map(|(_, c)| c).sum();
        let chunks: HashMap<ReqId, usize> = prefills.iter().copied().collect();
        let decoding: HashSet<ReqId> = decodes.iter().copied().collect();
        let (base_ms, decode_only_ms) = self.step_ms(&chunks, &decoding, reload_tokens);
        let scale = self.cfg.slowdown.max(1e-9) / self.cfg.speedup.max(1e-9) * self.jitter.factor();
        let duration_ms = base_ms * scale;
        self.counters.prefill_busy_us +=
            ((base_ms - decode_only_ms).max(0.0) * scale * 1000.0).round() as u64;
        self.counters.busy_us += (duration_ms * 1000.0).round() as u64;
        self.counters.busy_squared_ms2 += duration_ms * duration_ms;

        // Apply.
        let mut outputs = Vec::new();
        let mut finished: Vec<ReqId> = Vec::new();
        for seq in &mut self.running {
            let sample = if let Some(&c) = chunks.get(&seq.id) {
                seq.computed += c;
                commit_full_blocks(&mut self.cache, &self.cfg.block_hasher, seq, bs);
                !seq.needs_prefill()
            } else if decoding.contains(&seq.id) {
                seq.computed = seq.tokens.len();
                commit_full_blocks(&mut self.cache, &self.cfg.block_hasher, seq, bs);
                true
            } else {
                false
            };
            if !sample {
                continue;
            }
            let pos = seq.tokens.len() as u64;
            let token =
                (splitmix64(seq.id.wrapping_mul(0x1_0000_0001) ^ pos) % u64::from(VOCAB)) as u32;
            seq.tokens.push(token);
            outputs.push(Output::Token {
                id: seq.id,
                token,
                index: seq.generated,
            });
            seq.generated += 1;
            self.counters.generated_tokens += 1;
            if seq.generated >= seq.max_tokens {
                finished.push(seq.id);
                outputs.push(Output::Finished {
                    id: seq.id,
                    usage: Usage {
                        prompt_tokens: seq.prompt_len,
                        completion_tokens: seq.generated,
                        cached_tokens: seq.cached_tokens,
                    },
                });
            }
        }
        if !finished.is_empty() {
            let cache = &mut self.cache;
            self.running.retain_mut(|s| {
                if finished.contains(&s.id) {
                    release_all(cache, s);
                    false
                } else {
                    true
                }
            });
            self.counters.requests_completed += finished.len() as u64;
        }
        self.counters.prefill_tokens += prefill_tokens as u64;
        self.counters.steps += 1;
        Some(StepOutcome {
            duration_ms,
            prefill_tokens,
            reload_tokens,
            decode_seqs: decodes.len(),
            kv_usage,
            outputs,
        })
    }

    /// The planned step's time at speedup 1 ([`super::timing`]), and that of its decoding
    /// sequences alone (0 without any): each prefill chunk after the tokens its sequence has in
    /// the cache (a cached prefix included), each decoding sequence one token after its context,
    /// each host-tier token reloaded at `host_reload_weight` of a new token's linear-layer time.
    fn step_ms(
        &self,
        chunks: &HashMap<ReqId, usize>,
        decoding: &HashSet<ReqId>,
        reload_tokens: usize,
    ) -> (f64, f64) {
        let mut work = StepWork {
            chunks: Vec::with_capacity(chunks.len() + decoding.len()),
            reload_tokens: self.cfg.host_reload_weight.max(0.0) * reload_tokens as f64,
        };
        let mut decode_work = StepWork::default();
        for seq in &self.running {
            if let Some(&tokens) = chunks.get(&seq.id) {
                work.chunks.push(Chunk {
                    context: seq.computed,
                    tokens,
                });
            } else if decoding.contains(&seq.id) {
                let chunk = Chunk {
                    context: seq.tokens.len().saturating_sub(1),
                    tokens: 1,
                };
                work.chunks.push(chunk);
                decode_work.chunks.push(chunk);
            }
        }
        (work.ms(), decode_work.ms())
    }

    /// Takes the cache events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.cache.take_events()
    }
}

/// A cache event in the page's vLLM shape (the protocol's [`EventJson`]), without `event_id`.
pub fn event_json(ev: &CacheEvent, block_size: usize, dp_rank: u32) -> Value {
    let event = match ev {
        CacheEvent::Stored {
            tier,
            parent,
            hashes,
            token_ids,
        } => PageEvent::Stored {
            dp_rank,
            medium: tier.medium().to_owned(),
            parent: *parent,
            block_hashes: hashes.clone(),
            token_ids: token_ids.clone(),
            lora_name: None,
        },
        CacheEvent::Removed { tier, hashes } => PageEvent::Removed {
            dp_rank,
            medium: tier.medium().to_owned(),
            block_hashes: hashes.clone(),
        },
        CacheEvent::Cleared => PageEvent::Cleared { dp_rank },
    };
    let block_size = u32::try_from(block_size).unwrap_or(u32::MAX);
    serde_json::to_value(EventJson::of(&event, block_size)).unwrap_or_default()
}

/// The event page's `load` object (the shared [`Load`]).
fn load_json(num_waiting: usize, num_running: usize, kv_usage: f64) -> Value {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    serde_json::to_value(Load {
        num_waiting: count(num_waiting),
        num_running: count(num_running),
        kv_usage,
        other_routers: None,
    })
    .unwrap_or_default()
}

/// Live counters for `/metrics` and the event page's `load`.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineMetrics {
    pub counters: Counters,
    pub num_waiting: usize,
    pub num_running: usize,
    pub kv_usage: f64,
    pub device_blocks: usize,
    pub host_blocks: usize,
    pub last_event_id: u64,
    /// The device cache's size in blocks and the block size (vLLM's `cache_config_info`).
    pub capacity_blocks: usize,
    pub block_size: usize,
}

struct Inner {
    core: EngineCore,
    log: EventLog,
    subs: HashMap<ReqId, UnboundedSender<Output>>,
    publisher: Option<Arc<KvPublisher>>,
}

impl Inner {
    /// Hands the step's cache events to the HTTP page and, as one batch, to the ZMQ publisher:
    /// both paths carry the same events in the same order.
    fn publish_events(&mut self) {
        let events = self.core.take_events();
        if events.is_empty() {
            return;
        }
        let bs = self.core.cfg.block_size;
        let rank = self.core.cfg.dp_rank;
        for ev in &events {
            self.log.push(event_json(ev, bs, rank));
        }
        if let Some(publisher) = &self.publisher {
            publisher.publish(&events);
        }
    }

    fn deliver(&mut self, outputs: Vec<Output>) {
        for out in outputs {
            let id = out.id();
            let last = !matches!(out, Output::Token { .. });
            let gone = match self.subs.get(&id) {
                Some(tx) => tx.send(out).is_err(),
                None => false,
            };
            if gone {
                self.core.abort(id);
            }
            if gone || last {
                self.subs.remove(&id);
            }
        }
    }
}

/// The simulator running in real time on its own thread.
pub struct Engine {
    inner: Mutex<Inner>,
    wake: Condvar,
    block_size: usize,
    publisher: Option<Arc<KvPublisher>>,
}

impl Engine {
    /// Starts the engine thread. `event_capacity` bounds the event buffer.
    pub fn start(cfg: EngineConfig, event_capacity: usize) -> Arc<Engine> {
        Self::start_publishing(cfg, event_capacity, None)
    }

    /// Starts the engine thread; every batch of cache events also goes to `publisher` (ZMQ).
    pub fn start_publishing(
        cfg: EngineConfig,
        event_capacity: usize,
        publisher: Option<KvPublisher>,
    ) -> Arc<Engine> {
        let publisher = publisher.map(Arc::new);
        let engine = Arc::new(Engine {
            block_size: cfg.block_size,
            inner: Mutex::new(Inner {
                core: EngineCore::new(cfg),
                log: EventLog::new(event_capacity),
                subs: HashMap::new(),
                publisher: publisher.clone(),
            }),
            wake: Condvar::new(),
            publisher,
        });
        let e = Arc::clone(&engine);
        std::thread::Builder::new()
            .name("mock-engine".into())
            .spawn(move || e.run())
            .map_err(|err| eprintln!("mock-worker: cannot start the engine thread: {err}"))
            .ok();
        engine
    }

    fn run(&self) {
        loop {
            let outcome = {
                let mut g = lock(&self.inner);
                loop {
                    if let Some(o) = g.core.step() {
                        g.publish_events();
                        break o;
                    }
                    g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            };
            if outcome.is_idle() {
                // Waiting requests that cannot be admitted yet: poll gently.
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            // The step's clock starts when it is planned, not when the engine began waiting for work.
            let started = Instant::now();
            let end = started + Duration::from_secs_f64(outcome.duration_ms.max(0.0) / 1000.0);
            let now = Instant::now();
            if end > now {
                std::thread::sleep(end - now);
            }
            lock(&self.inner).deliver(outcome.outputs);
        }
    }

    /// Queues a request; its outputs arrive on the returned channel.
    pub fn submit(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
        priority: i64,
    ) -> Result<(ReqId, UnboundedReceiver<Output>), String> {
        let (tx, rx) = unbounded_channel();
        let mut g = lock(&self.inner);
        let id = g.core.submit(tokens, max_tokens, priority)?;
        g.subs.insert(id, tx);
        drop(g);
        self.wake.notify_all();
        Ok((id, rx))
    }

    pub fn abort(&self, id: ReqId) {
        let mut g = lock(&self.inner);
        g.core.abort(id);
        g.subs.remove(&id);
        drop(g);
        self.wake.notify_all();
    }

    /// Fails in-flight requests and empties the cache (AllBlocksCleared).
    pub fn reset(&self) {
        let mut g = lock(&self.inner);
        let outs = g.core.reset();
        g.publish_events();
        g.deliver(outs);
    }

    /// The ZMQ publisher, when the engine publishes its events there too.
    pub fn publisher(&self) -> Option<&KvPublisher> {
        self.publisher.as_deref()
    }

    pub fn metrics(&self) -> EngineMetrics {
        let g = lock(&self.inner);
        EngineMetrics {
            counters: g.core.counters,
            num_waiting: g.core.num_waiting(),
            num_running: g.core.num_running(),
            kv_usage: g.core.kv_usage(),
            device_blocks: g.core.cache().device_count(),
            host_blocks: g.core.cache().host_count(),
            last_event_id: g.log.last_id(),
            capacity_blocks: g.core.config().kv_blocks,
            block_size: self.block_size,
        }
    }

    /// `{"num_waiting", "num_running", "kv_usage"}`.
    pub fn load(&self) -> Value {
        let m = self.metrics();
        load_json(m.num_waiting, m.num_running, m.kv_usage)
    }

    /// The event page (DESIGN.md) including `load`.
    pub fn events_page(&self, after: u64) -> Value {
        let (mut page, events) = self.events_page_parts(after, DEFAULT_PAGE);
        page["events"] = serde_json::from_str(&events).unwrap_or_default();
        page
    }

    /// [`Self::events_page`] without `events`, and the `events` array's JSON text (see
    /// [`super::event_log::splice_events`]).
    pub fn events_page_parts(&self, after: u64, limits: PageLimits) -> (Value, String) {
        let g = lock(&self.inner);
        let (mut page, events) = g.log.page_parts(after, self.block_size, limits);
        page["load"] = load_json(
            g.core.num_waiting(),
            g.core.num_running(),
            g.core.kv_usage(),
        );
        (page, events)
    }

    /// The whole cache as BlockStored events, parents first, one block each; `event_id`s inside
    /// a dump are positional (1..) and carry no meaning.
    pub fn dump(&self) -> Value {
        let g = lock(&self.inner);
        let bs = self.block_size;
        let rank = g.core.cfg.dp_rank;
        let events: Vec<Value> = g
            .core
            .cache()
            .snapshot()
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                let mut e = event_json(
                    &CacheEvent::Stored {
                        tier: b.tier,
                        parent: b.parent,
                        hashes: vec![b.hash],
                        token_ids: b.tokens,
                    },
                    bs,
                    rank,
                );
                e["event_id"] = json!(i + 1);
                e
            })
            .collect();
        json!({"block_size": bs, "last_event_id": g.log.last_id(), "events": events})
    }
}

#[cfg(test)]
mod tests {
    use super::super::kv_cache::{block_hashes, Tier};
    use super::super::timing;
    use super::*;

    fn cfg(kv_blocks: usize) -> EngineConfig {
        EngineConfig {
            block_size: 4,
            kv_blocks,
            max_seqs: 8,
            max_batched_tokens: 64,
            ..EngineConfig::default()
        }
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 10_000 + i).collect()
    }

    fn run_to_completion(core: &mut EngineCore) -> Vec<StepOutcome> {
        let mut steps = Vec::new();
        while let Some(o) = core.step() {
            steps.push(o);
            assert!(steps.len() < 10_000);
        }
        steps
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    /// An engine of 64-token blocks taking whole 8,192-token prompts (or more) in one step.
    fn big(kv_blocks: usize, max_batched_tokens: usize) -> EngineConfig {
        EngineConfig {
            block_size: 64,
            kv_blocks,
            max_seqs: 256,
            max_batched_tokens,
            ..EngineConfig::default()
        }
    }

    #[test]
    fn step_times_at_the_calibration_points() {
        // A full 8,192-token prefill step from an empty context.
        let mut core = EngineCore::new(big(4096, 8192));
        core.submit(prompt(1, 8192), 1, 0).unwrap();
        let s = core.step().unwrap();
        assert_eq!((s.prefill_tokens, s.decode_seqs), (8192, 0));
        assert!(
            (208.0..=208.4).contains(&s.duration_ms),
            "{}",
            s.duration_ms
        );
        assert!(close(s.duration_ms, timing::prefill_ms(8192.0)));
        // Decode-only steps of 1 / 16 / 64 sequences of 1,024-token prompts, all prefilled in
        // one step: at the next, each decodes one token after 1,024.
        for (seqs, lo, hi) in [(1, 8.64, 8.66), (16, 9.39, 9.41), (64, 11.78, 11.82)] {
            let mut core = EngineCore::new(big(4096, 65_536));
            for i in 0..seqs {
                core.submit(prompt(i, 1024), 3, 0).unwrap();
            }
            let first = core.step().unwrap();
            assert_eq!(first.prefill_tokens, 1024 * seqs as usize);
            let s = core.step().unwrap();
            assert_eq!((s.prefill_tokens, s.decode_seqs), (0, seqs as usize));
            assert!(close(
                s.duration_ms,
                timing::decode_step_ms(seqs as usize, 1024)
            ));
            assert!(
                (lo..=hi).contains(&s.duration_ms),
                "{seqs}: {}",
                s.duration_ms
            );
        }
    }

    #[test]
    fn step_times_match_the_model() {
        let mut core = EngineCore::new(EngineConfig {
            speedup: 2.0,
            ..cfg(100)
        });
        core.submit(prompt(1, 40), 2, 0).unwrap();
        // Step 1: prefill of 40 new tokens, nothing decoding, cache empty: memory-bound (the
        // weights' read), 8.6 ms at speedup 1.
        let s1 = core.step().unwrap();
        assert_eq!(s1.prefill_tokens, 40);
        assert_eq!(s1.decode_seqs, 0);
        assert!(close(s1.duration_ms, timing::prefill_ms(40.0) / 2.0));
        assert!((4.3..=4.35).contains(&s1.duration_ms), "{}", s1.duration_ms);
        assert!(matches!(s1.outputs[0], Output::Token { index: 0, .. }));
        // Step 2: one sequence decodes its 41st token after 40; KV fill 11 blocks / 100.
        let s2 = core.step().unwrap();
        assert_eq!(s2.prefill_tokens, 0);
        assert_eq!(s2.decode_seqs, 1);
        assert!(close(s2.kv_usage, 11.0 / 100.0), "{}", s2.kv_usage);
        assert!(close(s2.duration_ms, timing::decode_step_ms(1, 40) / 2.0));
        // The busy counters: step 1 all prefill, step 2 all decode.
        let us = |ms: f64| (ms * 1000.0).round() as u64;
        assert_eq!(core.counters.prefill_busy_us, us(s1.duration_ms));
        assert_eq!(
            core.counters.busy_us,
            us(s1.duration_ms) + us(s2.duration_ms)
        );
        assert!(close(
            core.counters.busy_squared_ms2,
            s1.duration_ms.powi(2) + s2.duration_ms.powi(2)
        ));
        assert!(matches!(s2.outputs[1], Output::Finished { .. }));
        assert!(core.step().is_none());
    }

    #[test]
    fn a_chunk_after_a_long_cached_prefix_costs_its_attention() {
        // 512 new tokens after a cached 16,384-token prefix, against the same 512 alone: the
        // chunk attends to the prefix (4.4e12 FLOPs more, 6.9 ms at speedup 1).
        let mut warm = EngineCore::new(big(1000, 8192));
        let prefix = prompt(1, 16_384);
        warm.submit(prefix.clone(), 1, 0).unwrap();
        run_to_completion(&mut warm);
        let mut long = prefix;
        long.extend(prompt(2, 512));
        warm.submit(long, 1, 0).unwrap();
        let w = warm.step().unwrap();
        assert_eq!(w.prefill_tokens, 512);
        assert_eq!(warm.counters.prefix_hit_tokens, 16_384);
        let mut cold = EngineCore::new(big(1000, 8192));
        cold.submit(prompt(2, 512), 1, 0).unwrap();
        let c = cold.step().unwrap();
        assert_eq!(c.prefill_tokens, 512);
        assert!(close(
            w.duration_ms,
            timing::prefill_step_ms(16_384.0, 512.0)
        ));
        assert!(close(c.duration_ms, timing::prefill_ms(512.0)));
        let extra = w.duration_ms - c.duration_ms;
        assert!(
            (6.8..=7.0).contains(&extra),
            "{} vs {}",
            w.duration_ms,
            c.duration_ms
        );
    }

    /// Step times of `cfg` on a fixed workload: a few prompts, one decoding 3,000 tokens.
    fn workload_steps(cfg: EngineConfig) -> Vec<f64> {
        let mut core = EngineCore::new(cfg);
        core.submit(prompt(1, 3000), 3000, 0).unwrap();
        for i in 2..6 {
            core.submit(prompt(i, 500 * i as usize), 20, 0).unwrap();
        }
        run_to_completion(&mut core)
            .iter()
            .map(|s| s.duration_ms)
            .collect()
    }

    #[test]
    fn jitter_has_mean_one_and_zero_is_deterministic() {
        let jittered = |jitter, seed| {
            workload_steps(EngineConfig {
                jitter,
                seed,
                ..big(1000, 8192)
            })
        };
        let model = jittered(0.0, 1);
        assert!(model.len() >= 3000, "{}", model.len());
        // --jitter 0: the model's times whatever the seed, run after run.
        assert_eq!(jittered(0.0, 2), model);
        assert_eq!(jittered(0.0, 1), model);
        // --jitter 0.1: the same schedule, each step times a factor of mean 1 and log-sd 0.1.
        let noisy = jittered(0.1, timing::jitter_seed("1"));
        assert_eq!(noisy.len(), model.len());
        let factors: Vec<f64> = noisy.iter().zip(&model).map(|(n, m)| n / m).collect();
        let n = factors.len() as f64;
        let mean = factors.iter().sum::<f64>() / n;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
        let sd = (factors.iter().map(|f| f.ln().powi(2)).sum::<f64>() / n).sqrt();
        assert!((0.09..=0.11).contains(&sd), "{sd}");
        // Deterministic per seed (the worker id); another worker's steps differ.
        assert_eq!(jittered(0.1, timing::jitter_seed("1")), noisy);
        assert_ne!(jittered(0.1, timing::jitter_seed("2")), noisy);
    }

    #[test]
    fn chunked_prefill_respects_token_budget() {
        let mut core = EngineCore::new(EngineConfig {
            max_batched_tokens: 16,
            ..cfg(100)
        });
        core.submit(prompt(1, 40), 1, 0).unwrap();
        let steps = run_to_completion(&mut core);
        let chunks: Vec<usize> = steps.iter().map(|s| s.prefill_tokens).collect();
        assert_eq!(chunks, vec![16, 16, 8]);
        assert!(steps[2]
            .outputs
            .iter()
            .any(|o| matches!(o, Output::Finished { .. })));
    }

    #[test]
    fn fully_cached_prompt_skips_prefill() {
        let mut core = EngineCore::new(cfg(100));
        let p = prompt(7, 32); // 8 full blocks
        core.submit(p.clone(), 1, 0).unwrap();
        run_to_completion(&mut core);
        core.submit(p.clone(), 3, 0).unwrap();
        let s = core.step().unwrap();
        assert_eq!(s.prefill_tokens, 0);
        assert_eq!(s.decode_seqs, 1);
        // Its first token: one decoded after the 31 prompt tokens before the last.
        assert!(close(s.duration_ms, timing::decode_step_ms(1, 31)));
        let steps = run_to_completion(&mut core);
        let usage = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .find_map(|o| match o {
                Output::Finished { usage, .. } => Some(*usage),
                _ => None,
            })
            .unwrap();
        assert_eq!(usage.cached_tokens, 32);
        assert_eq!(usage.completion_tokens, 3);
        // Partially cached: only the uncached tail is prefilled.
        let mut q = p[..24].to_vec();
        q.extend(prompt(8, 10));
        core.submit(q, 1, 0).unwrap();
        assert_eq!(core.step().unwrap().prefill_tokens, 10);
        assert_eq!(core.counters.prefix_hit_tokens, 32 + 24);
    }

    #[test]
    fn events_only_for_newly_cached_full_blocks() {
        let mut core = EngineCore::new(cfg(100));
        let p = prompt(1, 10); // 2 full blocks + 2 tokens
        core.submit(p.clone(), 1, 0).unwrap();
        run_to_completion(&mut core);
        let ev = core.take_events();
        assert_eq!(ev.len(), 1);
        match &ev[0] {
            CacheEvent::Stored {
                tier,
                parent,
                hashes,
                token_ids,
            } => {
                assert_eq!(*tier, Tier::Device);
                assert_eq!(*parent, None);
                assert_eq!(hashes.len(), 2);
                assert_eq!(token_ids, &p[..8]);
            }
            other => panic!("unexpected {other:?}"),
        }
        // The same prompt again: no new full block, no event.
        core.submit(p.clone(), 1, 0).unwrap();
        run_to_completion(&mut core);
        assert!(core.take_events().is_empty());
        // Decode fills blocks with generated tokens: those are stored too, chained on the prompt.
        core.submit(prompt(2, 4), 6, 0).unwrap();
        run_to_completion(&mut core);
        let ev = core.take_events();
        let stored: usize = ev
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { hashes, .. } => hashes.len(),
                _ => 0,
            })
            .sum();
        // 4 prompt + 6 generated tokens: 9 have KV computed => 2 full blocks.
        assert_eq!(stored, 2);
    }

    #[test]
    fn vllm_hashing_stores_the_blocks_a_real_engine_published() {
        // The captured vLLM 0.32 run (shared/engines/vllm/fixtures, block size 32, default
        // sha256): a 100-token prompt stored 3 blocks; a 136-token prompt sharing its first 96
        // tokens stored one more (tokens 200..=231), chained on the third.
        let mut core = EngineCore::new(EngineConfig {
            block_size: 32,
            max_batched_tokens: 512,
            block_hasher: BlockHasher::vllm_default(),
            ..cfg(64)
        });
        let shared: Vec<u32> = (0..96u32).map(|i| 4 + (7 * i) % 500).collect();
        let mut req1 = shared.clone();
        req1.extend([7, 7, 7, 7]);
        core.submit(req1, 1, 0).unwrap();
        run_to_completion(&mut core);
        let first = core.take_events();
        let mut req2 = shared;
        req2.extend(200..240);
        core.submit(req2, 1, 0).unwrap();
        run_to_completion(&mut core);
        let second = core.take_events();
        let stored = |events: &[CacheEvent]| -> Vec<(Option<BlockHash>, Vec<BlockHash>)> {
            events
                .iter()
                .filter_map(|e| match e {
                    CacheEvent::Stored { parent, hashes, .. } => Some((*parent, hashes.clone())),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(
            stored(&first),
            [(
                None,
                vec![995114372539195884, 2422810939045071523, 6990447958680583254]
            )]
        );
        assert_eq!(
            stored(&second),
            [(Some(6990447958680583254), vec![6101281949773030706])]
        );
    }

    #[test]
    fn eviction_under_pressure_emits_removed_leaf_first() {
        let mut core = EngineCore::new(EngineConfig {
            watermark: 0.0,
            ..cfg(8)
        });
        let a = prompt(1, 16); // 4 blocks
        core.submit(a.clone(), 1, 0).unwrap();
        run_to_completion(&mut core);
        let a_hashes = block_hashes(&a, 4);
        core.take_events();
        core.submit(prompt(2, 24), 2, 0).unwrap(); // 6 blocks, then 1 for the decoded token
        run_to_completion(&mut core);
        let ev = core.take_events();
        let removed: Vec<BlockHash> = ev
            .iter()
            .flat_map(|e| match e {
                CacheEvent::Removed { hashes, .. } => hashes.clone(),
                _ => vec![],
            })
            .collect();
        // 7 slots needed, 4 free: a's last three blocks go, deepest first.
        assert_eq!(removed, vec![a_hashes[3], a_hashes[2], a_hashes[1]]);
        assert_eq!(core.cache().match_prefix(&a_hashes), (1, 0));
    }

    #[test]
    fn batching_limits_and_oversized_requests() {
        let mut core = EngineCore::new(EngineConfig {
            max_seqs: 2,
            ..cfg(100)
        });
        for i in 0..3 {
            core.submit(prompt(i, 8), 5, 0).unwrap();
        }
        core.step().unwrap();
        assert_eq!((core.num_running(), core.num_waiting()), (2, 1));
        assert!(core.submit(prompt(9, 400), 1, 0).is_err());
        assert!(core.submit(vec![], 1, 0).is_err());
        let steps = run_to_completion(&mut core);
        let finished = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|o| matches!(o, Output::Finished { .. }))
            .count();
        assert_eq!(finished, 3);
        assert_eq!(core.cache().active_blocks(), 0);
    }

    /// The ids of the outputs `pick` keeps, in the order they came out.
    fn ids_in_order(steps: &[StepOutcome], pick: fn(&Output) -> bool) -> Vec<ReqId> {
        steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|o| pick(o))
            .map(Output::id)
            .collect()
    }

    /// The ids in the order their first token came out.
    fn first_token_order(steps: &[StepOutcome]) -> Vec<ReqId> {
        ids_in_order(steps, |o| matches!(o, Output::Token { index: 0, .. }))
    }

    #[test]
    fn the_priority_policy_admits_the_lowest_priority_first() {
        let run = |policy| {
            let mut core = EngineCore::new(EngineConfig {
                max_seqs: 1,
                policy,
                ..cfg(100)
            });
            let priorities = if policy == SchedulingPolicy::Priority {
                [0, 10, 5, 5]
            } else {
                [0; 4]
            };
            let ids: Vec<ReqId> = (0..4)
                .map(|i| {
                    core.submit(prompt(i, 8), 1, priorities[i as usize])
                        .unwrap()
                })
                .collect();
            let order = first_token_order(&run_to_completion(&mut core));
            (ids, order)
        };
        let (ids, order) = run(SchedulingPolicy::Priority);
        // The first runs alone; then priority 5 in arrival order, then 10.
        assert_eq!(order, vec![ids[0], ids[2], ids[3], ids[1]]);
        let (ids, order) = run(SchedulingPolicy::Fcfs);
        assert_eq!(order, ids);
    }

    /// Steps until each of a long prompt (running alone for one step) and a short one (arriving
    /// after that step) samples its first token, at a `--long-prefill-token-threshold`.
    fn first_token_steps(threshold: usize) -> (usize, usize) {
        let mut core = EngineCore::new(EngineConfig {
            long_prefill_token_threshold: threshold,
            ..cfg(400)
        });
        let long = core.submit(prompt(1, 512), 1, 0).unwrap();
        let mut steps = vec![core.step().unwrap()];
        let short = core.submit(prompt(2, 8), 1, 0).unwrap();
        steps.extend(run_to_completion(&mut core));
        let first_step = |id| {
            1 + steps
                .iter()
                .position(|o| {
                    o.outputs
                        .iter()
                        .any(|out| matches!(out, Output::Token { id: i, index: 0, .. } if *i == id))
                })
                .unwrap()
        };
        (first_step(long), first_step(short))
    }

    #[test]
    fn a_long_prefill_threshold_lets_a_short_prompt_past_a_running_long_one() {
        // No cap: the running 512-token prefill takes all 64 tokens of every step, 8 steps.
        assert_eq!(first_token_steps(0), (8, 9));
        // Capped at 16 while the short one waits: it joins the second step; the long prompt
        // computed 64 alone, then 16 beside it, then 64 a step alone again: 1 + 1 + 432/64 steps.
        assert_eq!(first_token_steps(16), (9, 2));
    }

    #[test]
    fn an_engine_in_arrival_order_refuses_a_priority() {
        let mut core = EngineCore::new(cfg(100));
        let err = core.submit(prompt(1, 8), 1, 3).unwrap_err();
        assert!(err.contains("--scheduling-policy priority"), "{err}");
        assert!(core.submit(prompt(1, 8), 1, 0).is_ok());
    }

    #[test]
    fn the_priority_policy_preempts_the_lowest_priority() {
        let mut core = EngineCore::new(EngineConfig {
            watermark: 0.0,
            policy: SchedulingPolicy::Priority,
            ..cfg(5)
        });
        // As in the FCFS case below, but the older request has the higher priority value: it is
        // the one preempted (and recomputed), so the newer one finishes first.
        let low = core.submit(prompt(1, 8), 4, 9).unwrap();
        let high = core.submit(prompt(2, 8), 4, 1).unwrap();
        let steps = run_to_completion(&mut core);
        let finished = ids_in_order(&steps, |o| matches!(o, Output::Finished { .. }));
        assert_eq!(
            finished,
            vec![high, low],
            "preemptions {}",
            core.counters.preemptions
        );
        assert!(core.counters.preemptions >= 1);
    }

    #[test]
    fn preemption_when_decode_runs_out_of_blocks() {
        let mut core = EngineCore::new(EngineConfig {
            watermark: 0.0,
            ..cfg(6)
        });
        // Two sequences of 2 blocks each that want to grow to 3 blocks each: 6 blocks total, plus
        // the sampled tokens' blocks => someone is preempted and recomputed; all finish.
        core.submit(prompt(1, 8), 4, 0).unwrap();
        core.submit(prompt(2, 8), 4, 0).unwrap();
        let steps = run_to_completion(&mut core);
        let finished = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|o| matches!(o, Output::Finished { .. }))
            .count();
        assert_eq!(finished, 2);
        assert_eq!(core.cache().active_blocks(), 0);
    }

    #[test]
    fn abort_and_reset_release_everything() {
        let mut core = EngineCore::new(cfg(100));
        let id = core.submit(prompt(1, 8), 100, 0).unwrap();
        core.step().unwrap();
        core.abort(id);
        assert!(core.step().is_none());
        assert_eq!(core.cache().active_blocks(), 0);
        core.submit(prompt(2, 8), 100, 0).unwrap();
        core.step().unwrap();
        core.take_events();
        let outs = core.reset();
        assert!(matches!(outs[0], Output::Failed { .. }));
        assert_eq!(core.take_events(), vec![CacheEvent::Cleared]);
        assert_eq!(core.cache().device_count(), 0);
        assert_eq!(core.cache().active_blocks(), 0);
    }

    #[test]
    fn host_tier_hits_are_reloaded_at_a_cost() {
        let mut core = EngineCore::new(EngineConfig {
            host_kv_blocks: 16,
            watermark: 0.0,
            ..cfg(8)
        });
        let a = prompt(1, 16);
        core.submit(a.clone(), 1, 0).unwrap();
        run_to_completion(&mut core);
        core.submit(prompt(2, 28), 1, 0).unwrap(); // pushes a to the host
        run_to_completion(&mut core);
        let a_hashes = block_hashes(&a, 4);
        let (dev, host) = core.cache().match_prefix(&a_hashes);
        assert!(host > 0, "dev {dev} host {host}");
        core.submit(a.clone(), 1, 0).unwrap();
        let s = core.step().unwrap();
        assert_eq!(s.reload_tokens, host * 4);
        // The uncached tail attends to the reloaded (and device) blocks; each reloaded token
        // costs a quarter of a new token's linear-layer work.
        let cached = (dev + host) * 4;
        let chunk = if cached < 16 {
            Chunk {
                context: cached,
                tokens: 16 - cached,
            }
        } else {
            Chunk {
                context: 15,
                tokens: 1,
            }
        };
        let work = |reload_tokens| StepWork {
            chunks: vec![chunk],
            reload_tokens,
        };
        let reloaded = (host * 4) as f64;
        assert!(close(s.duration_ms, work(0.25 * reloaded).ms()));
        assert!(s.duration_ms > work(0.0).ms());
        assert!(s.duration_ms < work(reloaded).ms());
        assert!(core.counters.prefix_host_hit_tokens > 0);
    }

    #[test]
    fn vllm_event_json_shape() {
        let e = event_json(
            &CacheEvent::Stored {
                tier: Tier::Device,
                parent: Some(5),
                hashes: vec![u64::MAX],
                token_ids: vec![1, 2],
            },
            4,
            0,
        );
        assert_eq!(e["type"], "BlockStored");
        assert_eq!(e["block_hashes"][0].as_u64(), Some(u64::MAX));
        assert_eq!(e["parent_block_hash"], 5);
        assert_eq!(e["medium"], "GPU");
        assert_eq!(e["block_size"], 4);
        let r = event_json(
            &CacheEvent::Removed {
                tier: Tier::Host,
                hashes: vec![1],
            },
            4,
            0,
        );
        assert_eq!(r["medium"], "CPU");
    }

    #[test]
    fn engine_thread_streams_tokens_and_events() {
        let engine = Engine::start(
            EngineConfig {
                speedup: 100.0,
                ..cfg(100)
            },
            100,
        );
        let (_, mut rx) = engine.submit(prompt(1, 12), 3, 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let mut tokens = 0;
        loop {
            let next = rt
                .block_on(async { tokio::time::timeout(Duration::from_secs(5), rx.recv()).await });
            match next.unwrap().unwrap() {
                Output::Token { .. } => tokens += 1,
                Output::Finished { usage, .. } => {
                    assert_eq!(usage.completion_tokens, 3);
                    break;
                }
                Output::Failed { message, .. } => panic!("{message}"),
            }
        }
        assert_eq!(tokens, 3);
        let page = engine.events_page(0);
        assert_eq!(page["block_size"], 4);
        assert!(page["last_event_id"].as_u64().unwrap() >= 1);
        assert_eq!(page["events"][0]["type"], "BlockStored");
        let dump = engine.dump();
        assert_eq!(dump["events"].as_array().unwrap().len(), 3);
        engine.reset();
        let page = engine.events_page(0);
        let last = page["events"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(last["type"], "AllBlocksCleared");
        assert!(engine.dump()["events"].as_array().unwrap().is_empty());
    }
}
