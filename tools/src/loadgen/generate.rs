//! Generated multi-turn workloads, written as Mooncake-format JSON lines (`timestamp` ms,
//! `input_length`, `output_length`, `hash_ids`: one id per 512-token block) so that the `--trace`
//! replay path serves them unchanged (`loadgen gen-workload`, and the `race`'s `agent` and
//! `conversation` workloads).
//!
//! * [`AgentSpec`] (`agent`): tool-agent sessions. Each opens with one of a few large shared
//!   tool/system prompts (Zipf popularity) and a task; every later turn resends the whole history
//!   plus the previous reply (the tool call) and a tool result of a few hundred to a few thousand
//!   tokens, some turns citing one of a set of popular documents (shared hash ids inserted into
//!   the context at a block boundary). Sessions arrive as a Poisson process; a session's turns
//!   are separated by the time to generate the reply plus the tool's run time.
//! * [`ConversationSpec`] (`conversation`): multi-turn chat. Each conversation opens with one of
//!   a few shared system prompts; every turn appends the previous reply and the user's message.
//!   Poisson arrivals, the reply's generation time plus a think time between turns.
//!
//! Everything is drawn from one SplitMix64 stream seeded by `seed`: the same spec gives the same
//! file. Shared prompts and documents are whole 512-token blocks, so their ids are shared across
//! sessions; a session's new text first fills its context's partial last block (the same id:
//! `mooncake_tokens` derives a block's tokens from its id and position only) and then takes
//! fresh ids, so each turn's token ids extend the previous turn's exactly. Output lengths are the
//! `max_tokens` of each request (the mock generates exactly that many).
//!
//! The defaults ([`AgentSpec::default`], [`ConversationSpec::default`]) are the load documented
//! in docs/RACE.md: an 8-worker mock fleet at `--speedup 2` with 8,192 blocks of 64 tokens each,
//! at `--time-scale 1`.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use serde_json::json;

use super::MOONCAKE_BLOCK_TOKENS;
use crate::util::splitmix64;

/// One request of a generated trace (a Mooncake line plus where it came from).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Session (conversation) number, in arrival order.
    pub session: usize,
    /// Turn within the session, from 0.
    pub turn: usize,
    pub timestamp_ms: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The Mooncake JSON line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        json!({
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
            "session": self.session,
        })
        .to_string()
    }
}

/// Writes `requests` as Mooncake JSON lines.
pub fn write_trace(path: &Path, requests: &[TraceRequest]) -> io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut out = String::with_capacity(requests.len() * 256);
    for r in requests {
        out.push_str(&r.to_json_line());
        out.push('\n');
    }
    std::fs::write(path, out)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// The workload kinds of [`generate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Tool-agent sessions ([`AgentSpec`]).
    Agent,
    /// Multi-turn chat ([`ConversationSpec`]).
    Conversation,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Agent => "agent",
            WorkloadKind::Conversation => "conversation",
        }
    }
}

/// A deterministic random stream (SplitMix64).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(splitmix64(seed ^ 0x6A09_E667_F3BC_C908))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        let (lo, hi) = (lo.min(hi), lo.max(hi));
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Log-uniform in `[lo, hi]` (as many values in 100..1000 as in 1000..10000), rounded.
    fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        let (lo, hi) = (lo.min(hi).max(1) as f64, lo.max(hi).max(1) as f64);
        (lo * (hi / lo).powf(self.unit())).round() as usize
    }

    /// Exponential with `rate` per second, in ms.
    fn exp_ms(&mut self, rate: f64) -> f64 {
        -self.unit().ln() / rate * 1000.0
    }

    /// Index `k` in `0..n` with probability proportional to `1 / (k + 1)^s` (Zipf).
    fn zipf(&mut self, n: usize, s: f64) -> usize {
        let weights: Vec<f64> = (1..=n.max(1)).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = weights.iter().sum();
        let mut u = self.unit() * total;
        for (k, w) in weights.iter().enumerate() {
            if u < *w {
                return k;
            }
            u -= w;
        }
        n.max(1) - 1
    }
}

/// Hands out fresh hash ids.
#[derive(Debug, Default)]
struct Ids(u64);

impl Ids {
    fn next(&mut self) -> u64 {
        let id = self.0;
        self.0 += 1;
        id
    }

    /// `tokens` rounded up to whole blocks of fresh ids.
    fn blocks(&mut self, tokens: usize) -> Vec<u64> {
        (0..tokens.div_ceil(MOONCAKE_BLOCK_TOKENS).max(1))
            .map(|_| self.next())
            .collect()
    }
}

/// A session's context: its blocks' ids and its length in tokens (the last block may be partial).
#[derive(Debug, Clone, Default)]
struct Context {
    ids: Vec<u64>,
    len: usize,
}

impl Context {
    /// Shared blocks (a prompt or a document), from the next block boundary: the partial last
    /// block is first filled with this turn's text.
    fn push_shared(&mut self, blocks: &[u64]) {
        self.len = self.ids.len() * MOONCAKE_BLOCK_TOKENS;
        self.ids.extend_from_slice(blocks);
        self.len += blocks.len() * MOONCAKE_BLOCK_TOKENS;
    }

    /// `tokens` of new text: the rest of the partial last block, then fresh blocks.
    fn push_unique(&mut self, mut tokens: usize, ids: &mut Ids) {
        let room = self.ids.len() * MOONCAKE_BLOCK_TOKENS - self.len;
        let fill = room.min(tokens);
        self.len += fill;
        tokens -= fill;
        while tokens > 0 {
            self.ids.push(ids.next());
            let take = tokens.min(MOONCAKE_BLOCK_TOKENS);
            self.len += take;
            tokens -= take;
        }
    }
}

/// Parses `key=value` overrides into `set(key, value)`.
fn apply_params(
    kind: &str,
    params: &[String],
    mut set: impl FnMut(&str, &str) -> Result<(), String>,
) -> Result<(), String> {
    for p in params.iter().flat_map(|p| p.split(',')) {
        let p = p.trim();
        if p.is_empty() {
            continue;
        }
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| format!("{kind}: expected key=value, got {p:?}"))?;
        set(k.trim(), v.trim())?;
    }
    Ok(())
}

fn parse_num<T: std::str::FromStr>(kind: &str, k: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{kind}: bad {k}={v}"))
}

fn positive_rate(kind: &str, k: &str, v: &str) -> Result<f64, String> {
    let r: f64 = parse_num(kind, k, v)?;
    if r.is_finite() && r > 0.0 {
        Ok(r)
    } else {
        Err(format!("{kind}: {k} must be > 0"))
    }
}

/// The tool-agent workload. Lengths in tokens, times in ms; ranges are log-uniform unless said.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSpec {
    pub seed: u64,
    /// Agent sessions.
    pub sessions: usize,
    /// Session arrivals per second (Poisson).
    pub session_rate: f64,
    /// Turns per session, uniform in `turns_min..=turns_max` (a session also ends after the
    /// turn whose context reaches `max_context`).
    pub turns_min: usize,
    pub turns_max: usize,
    /// Shared tool/system prompts: `tool_prompts` of them, sizes evenly spaced from
    /// `tool_prompt_min` to `tool_prompt_max` (rounded up to whole 512-token blocks), the k-th
    /// (from 0) picked with weight `1 / (k + 1)^tool_zipf`.
    pub tool_prompts: usize,
    pub tool_prompt_min: usize,
    pub tool_prompt_max: usize,
    pub tool_zipf: f64,
    /// The task (first user message).
    pub task_min: usize,
    pub task_max: usize,
    /// Each later turn's tool result.
    pub tool_result_min: usize,
    pub tool_result_max: usize,
    /// Popular documents: `docs` of them, sizes log-uniform in `doc_min..=doc_max` (whole
    /// blocks), cited by a turn with probability `doc_prob`, the k-th with weight
    /// `1 / (k + 1)^doc_zipf`.
    pub docs: usize,
    pub doc_min: usize,
    pub doc_max: usize,
    pub doc_prob: f64,
    pub doc_zipf: f64,
    /// Each turn's output (the tool call or answer; resent with the next turn).
    pub output_min: usize,
    pub output_max: usize,
    /// Between a turn and the next: `reply_ms_per_token` x its output (the reply streaming)
    /// plus the tool's run time, log-uniform in `tool_ms_min..=tool_ms_max`.
    pub reply_ms_per_token: f64,
    pub tool_ms_min: usize,
    pub tool_ms_max: usize,
    /// A session ends once its context reaches this many tokens.
    pub max_context: usize,
}

impl Default for AgentSpec {
    /// ~2,300 requests over ~115 s (~20 req/s, ~28 req/s at the peak), prompts of 4-12k-token
    /// tool prompts growing to ~15-40k tokens.
    fn default() -> Self {
        AgentSpec {
            seed: 1,
            sessions: 300,
            session_rate: 5.0,
            turns_min: 3,
            turns_max: 12,
            tool_prompts: 4,
            tool_prompt_min: 4096,
            tool_prompt_max: 12288,
            tool_zipf: 1.0,
            task_min: 128,
            task_max: 1024,
            tool_result_min: 200,
            tool_result_max: 4000,
            docs: 8,
            doc_min: 2048,
            doc_max: 8192,
            doc_prob: 0.2,
            doc_zipf: 1.0,
            output_min: 32,
            output_max: 400,
            reply_ms_per_token: 5.0,
            tool_ms_min: 200,
            tool_ms_max: 2000,
            max_context: 48 * 1024,
        }
    }
}

impl AgentSpec {
    /// The defaults with `key=value` overrides (comma-separated or separate).
    pub fn parse(params: &[String]) -> Result<AgentSpec, String> {
        let mut s = AgentSpec::default();
        apply_params("agent", params, |k, v| {
            let n = || parse_num::<usize>("agent", k, v);
            let f = || parse_num::<f64>("agent", k, v);
            match k {
                "seed" => s.seed = parse_num("agent", k, v)?,
                "sessions" => s.sessions = n()?,
                "session_rate" => s.session_rate = positive_rate("agent", k, v)?,
                "turns_min" => s.turns_min = n()?.max(1),
                "turns_max" => s.turns_max = n()?.max(1),
                "tool_prompts" => s.tool_prompts = n()?.max(1),
                "tool_prompt_min" => s.tool_prompt_min = n()?.max(1),
                "tool_prompt_max" => s.tool_prompt_max = n()?.max(1),
                "tool_zipf" => s.tool_zipf = f()?,
                "task_min" => s.task_min = n()?.max(1),
                "task_max" => s.task_max = n()?.max(1),
                "tool_result_min" => s.tool_result_min = n()?.max(1),
                "tool_result_max" => s.tool_result_max = n()?.max(1),
                "docs" => s.docs = n()?,
                "doc_min" => s.doc_min = n()?.max(1),
                "doc_max" => s.doc_max = n()?.max(1),
                "doc_prob" => s.doc_prob = f()?.clamp(0.0, 1.0),
                "doc_zipf" => s.doc_zipf = f()?,
                "output_min" => s.output_min = n()?.max(1),
                "output_max" => s.output_max = n()?.max(1),
                "reply_ms_per_token" => s.reply_ms_per_token = f()?.max(0.0),
                "tool_ms_min" => s.tool_ms_min = n()?,
                "tool_ms_max" => s.tool_ms_max = n()?,
                "max_context" => s.max_context = n()?.max(1),
                other => return Err(format!("agent: unknown key {other:?}")),
            }
            Ok(())
        })?;
        Ok(s)
    }

    /// The parameters as `key=value` pairs (every one, defaults included).
    pub fn describe(&self) -> String {
        format!(
            "seed={},sessions={},session_rate={},turns_min={},turns_max={},tool_prompts={},\
             tool_prompt_min={},tool_prompt_max={},tool_zipf={},task_min={},task_max={},\
             tool_result_min={},tool_result_max={},docs={},doc_min={},doc_max={},doc_prob={},\
             doc_zipf={},output_min={},output_max={},reply_ms_per_token={},tool_ms_min={},\
             tool_ms_max={},max_context={}",
            self.seed,
            self.sessions,
            self.session_rate,
            self.turns_min,
            self.turns_max,
            self.tool_prompts,
            self.tool_prompt_min,
            self.tool_prompt_max,
            self.tool_zipf,
            self.task_min,
            self.task_max,
            self.tool_result_min,
            self.tool_result_max,
            self.docs,
            self.doc_min,
            self.doc_max,
            self.doc_prob,
            self.doc_zipf,
            self.output_min,
            self.output_max,
            self.reply_ms_per_token,
            self.tool_ms_min,
            self.tool_ms_max,
            self.max_context
        )
    }
}

/// Sizes of `n` shared prompts evenly spaced from `min` to `max` tokens.
fn spaced_sizes(n: usize, min: usize, max: usize) -> Vec<usize> {
    let (min, max) = (min.min(max), min.max(max));
    (0..n)
        .map(|k| {
            if n <= 1 {
                min
            } else {
                min + (max - min) * k / (n - 1)
            }
        })
        .collect()
}

/// The tool-agent trace of `spec`, sorted by timestamp.
pub fn agent(spec: &AgentSpec) -> Vec<TraceRequest> {
    let mut rng = Rng::new(spec.seed);
    let mut ids = Ids::default();
    let prompts: Vec<Vec<u64>> = spaced_sizes(
        spec.tool_prompts,
        spec.tool_prompt_min,
        spec.tool_prompt_max,
    )
    .into_iter()
    .map(|t| ids.blocks(t))
    .collect();
    let docs: Vec<Vec<u64>> = (0..spec.docs)
        .map(|_| {
            let t = rng.log_uniform(spec.doc_min, spec.doc_max);
            ids.blocks(t)
        })
        .collect();
    let mut out = Vec::new();
    let mut arrival = 0.0;
    for session in 0..spec.sessions {
        arrival += rng.exp_ms(spec.session_rate);
        let mut t = arrival;
        let mut ctx = Context::default();
        ctx.push_shared(&prompts[rng.zipf(prompts.len(), spec.tool_zipf)]);
        ctx.push_unique(rng.log_uniform(spec.task_min, spec.task_max), &mut ids);
        let turns = rng.range(spec.turns_min, spec.turns_max);
        let mut previous_output = 0;
        for turn in 0..turns {
            if turn > 0 {
                ctx.push_unique(previous_output, &mut ids);
                if !docs.is_empty() && rng.unit() < spec.doc_prob {
                    ctx.push_shared(&docs[rng.zipf(docs.len(), spec.doc_zipf)]);
                }
                let result = rng.log_uniform(spec.tool_result_min, spec.tool_result_max);
                ctx.push_unique(result, &mut ids);
            }
            let output = rng.log_uniform(spec.output_min, spec.output_max);
            out.push(TraceRequest {
                session,
                turn,
                timestamp_ms: t.round() as u64,
                input_length: ctx.len,
                output_length: output,
                hash_ids: ctx.ids.clone(),
            });
            if ctx.len >= spec.max_context {
                break;
            }
            previous_output = output;
            t += output as f64 * spec.reply_ms_per_token
                + rng.log_uniform(spec.tool_ms_min, spec.tool_ms_max) as f64;
        }
    }
    sort_by_time(&mut out);
    out
}

/// The multi-turn chat workload. Lengths in tokens, times in ms; ranges are log-uniform unless
/// said.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationSpec {
    pub seed: u64,
    pub conversations: usize,
    /// Conversation arrivals per second (Poisson).
    pub conversation_rate: f64,
    /// Turns per conversation, uniform in `turns_min..=turns_max`.
    pub turns_min: usize,
    pub turns_max: usize,
    /// Shared system prompts: sizes evenly spaced from `system_min` to `system_max` (whole
    /// blocks), the k-th (from 0) picked with weight `1 / (k + 1)^system_zipf`.
    pub system_prompts: usize,
    pub system_min: usize,
    pub system_max: usize,
    pub system_zipf: f64,
    /// Each user message.
    pub user_min: usize,
    pub user_max: usize,
    /// Each reply (resent with the next turn).
    pub output_min: usize,
    pub output_max: usize,
    /// Between a turn and the next: `reply_ms_per_token` x its output plus a think time,
    /// log-uniform in `think_ms_min..=think_ms_max`.
    pub reply_ms_per_token: f64,
    pub think_ms_min: usize,
    pub think_ms_max: usize,
}

impl Default for ConversationSpec {
    /// ~2,100 requests over ~110 s (~19 req/s), prompts of 2-8k-token system prompts growing by
    /// ~1k tokens a turn.
    fn default() -> Self {
        ConversationSpec {
            seed: 1,
            conversations: 350,
            conversation_rate: 5.0,
            turns_min: 2,
            turns_max: 10,
            system_prompts: 3,
            system_min: 2048,
            system_max: 8192,
            system_zipf: 1.0,
            user_min: 64,
            user_max: 8192,
            output_min: 32,
            output_max: 512,
            reply_ms_per_token: 5.0,
            think_ms_min: 300,
            think_ms_max: 3000,
        }
    }
}

impl ConversationSpec {
    /// The defaults with `key=value` overrides (comma-separated or separate).
    pub fn parse(params: &[String]) -> Result<ConversationSpec, String> {
        let mut s = ConversationSpec::default();
        apply_params("conversation", params, |k, v| {
            let n = || parse_num::<usize>("conversation", k, v);
            let f = || parse_num::<f64>("conversation", k, v);
            match k {
                "seed" => s.seed = parse_num("conversation", k, v)?,
                "conversations" => s.conversations = n()?,
                "conversation_rate" => s.conversation_rate = positive_rate("conversation", k, v)?,
                "turns_min" => s.turns_min = n()?.max(1),
                "turns_max" => s.turns_max = n()?.max(1),
                "system_prompts" => s.system_prompts = n()?.max(1),
                "system_min" => s.system_min = n()?.max(1),
                "system_max" => s.system_max = n()?.max(1),
                "system_zipf" => s.system_zipf = f()?,
                "user_min" => s.user_min = n()?.max(1),
                "user_max" => s.user_max = n()?.max(1),
                "output_min" => s.output_min = n()?.max(1),
                "output_max" => s.output_max = n()?.max(1),
                "reply_ms_per_token" => s.reply_ms_per_token = f()?.max(0.0),
                "think_ms_min" => s.think_ms_min = n()?,
                "think_ms_max" => s.think_ms_max = n()?,
                other => return Err(format!("conversation: unknown key {other:?}")),
            }
            Ok(())
        })?;
        Ok(s)
    }

    /// The parameters as `key=value` pairs (every one, defaults included).
    pub fn describe(&self) -> String {
        format!(
            "seed={},conversations={},conversation_rate={},turns_min={},turns_max={},\
             system_prompts={},system_min={},system_max={},system_zipf={},user_min={},\
             user_max={},output_min={},output_max={},reply_ms_per_token={},think_ms_min={},\
             think_ms_max={}",
            self.seed,
            self.conversations,
            self.conversation_rate,
            self.turns_min,
            self.turns_max,
            self.system_prompts,
            self.system_min,
            self.system_max,
            self.system_zipf,
            self.user_min,
            self.user_max,
            self.output_min,
            self.output_max,
            self.reply_ms_per_token,
            self.think_ms_min,
            self.think_ms_max
        )
    }
}

/// The conversation trace of `spec`, sorted by timestamp.
pub fn conversation(spec: &ConversationSpec) -> Vec<TraceRequest> {
    let mut rng = Rng::new(spec.seed ^ 0xC0_4E75);
    let mut ids = Ids::default();
    let systems: Vec<Vec<u64>> =
        spaced_sizes(spec.system_prompts, spec.system_min, spec.system_max)
            .into_iter()
            .map(|t| ids.blocks(t))
            .collect();
    let mut out = Vec::new();
    let mut arrival = 0.0;
    for session in 0..spec.conversations {
        arrival += rng.exp_ms(spec.conversation_rate);
        let mut t = arrival;
        let mut ctx = Context::default();
        ctx.push_shared(&systems[rng.zipf(systems.len(), spec.system_zipf)]);
        let turns = rng.range(spec.turns_min, spec.turns_max);
        let mut previous_output = 0;
        for turn in 0..turns {
            ctx.push_unique(previous_output, &mut ids);
            ctx.push_unique(rng.log_uniform(spec.user_min, spec.user_max), &mut ids);
            let output = rng.log_uniform(spec.output_min, spec.output_max);
            out.push(TraceRequest {
                session,
                turn,
                timestamp_ms: t.round() as u64,
                input_length: ctx.len,
                output_length: output,
                hash_ids: ctx.ids.clone(),
            });
            previous_output = output;
            t += output as f64 * spec.reply_ms_per_token
                + rng.log_uniform(spec.think_ms_min, spec.think_ms_max) as f64;
        }
    }
    sort_by_time(&mut out);
    out
}

fn sort_by_time(out: &mut [TraceRequest]) {
    out.sort_by_key(|r| (r.timestamp_ms, r.session, r.turn));
}

/// `kind`'s trace with `seed` and `key=value` overrides (a `seed=` among them wins).
pub fn generate(
    kind: WorkloadKind,
    seed: u64,
    params: &[String],
) -> Result<(Vec<TraceRequest>, String), String> {
    let seeded: Vec<String> = std::iter::once(format!("seed={seed}"))
        .chain(params.iter().cloned())
        .collect();
    Ok(match kind {
        WorkloadKind::Agent => {
            let spec = AgentSpec::parse(&seeded)?;
            (agent(&spec), spec.describe())
        }
        WorkloadKind::Conversation => {
            let spec = ConversationSpec::parse(&seeded)?;
            (conversation(&spec), spec.describe())
        }
    })
}

/// What a trace offers a fleet: its size and pace, and its prefill load priced with the mock
/// engine's timing ([`crate::mock::timing::prefill_in_steps_ms`]: each prompt alone on an engine,
/// in 8,192-token chunks).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TraceLoad {
    pub requests: usize,
    pub sessions: usize,
    /// First to last arrival, s.
    pub span_s: f64,
    pub mean_input: f64,
    pub max_input: usize,
    pub mean_output: f64,
    /// Prompt tokens some earlier request had already sent (the same prefix of ids), over all
    /// prompt tokens: the hit rate of one unbounded cache shared by the whole fleet.
    pub reusable_fraction: f64,
    /// Prefill time of every prompt priced with nothing cached, over workers x span.
    pub offered_prefill_uncached: f64,
    /// The same with every reusable prefix cached (the unbounded pooled cache).
    pub offered_prefill_pooled: f64,
}

impl TraceLoad {
    /// `requests` on `workers` engines at `speedup`, timestamps divided by `time_scale`.
    pub fn of(requests: &[TraceRequest], workers: usize, speedup: f64, time_scale: f64) -> Self {
        use std::collections::HashSet;
        // Alone on an engine, in 8,192-token chunks, each attending to the context before it.
        let price = |context: usize, tokens: usize| {
            crate::mock::timing::prefill_in_steps_ms(context as f64, tokens as f64, 8192.0)
                / speedup.max(1e-9)
        };
        let mut seen: HashSet<u64> = HashSet::new();
        let (mut prompt, mut reusable, mut uncached_ms, mut pooled_ms) = (0usize, 0usize, 0.0, 0.0);
        let mut max_input = 0;
        for r in requests {
            // Chained keys: a block counts as held only under the same prefix.
            let mut key = 0u64;
            let mut held_blocks = 0usize;
            let mut still_held = true;
            for id in &r.hash_ids {
                key = splitmix64(key ^ splitmix64(*id));
                if still_held && seen.contains(&key) {
                    held_blocks += 1;
                } else {
                    still_held = false;
                    seen.insert(key);
                }
            }
            let held = (held_blocks * MOONCAKE_BLOCK_TOKENS).min(r.input_length);
            prompt += r.input_length;
            reusable += held;
            max_input = max_input.max(r.input_length);
            uncached_ms += price(0, r.input_length);
            pooled_ms += price(held, r.input_length - held);
        }
        let first = requests.iter().map(|r| r.timestamp_ms).min().unwrap_or(0);
        let last = requests.iter().map(|r| r.timestamp_ms).max().unwrap_or(0);
        let span_s = (last - first) as f64 / 1000.0 / time_scale.max(1e-9);
        let n = requests.len().max(1) as f64;
        let capacity_ms = workers.max(1) as f64 * span_s.max(1e-9) * 1000.0;
        TraceLoad {
            requests: requests.len(),
            sessions: requests
                .iter()
                .map(|r| r.session)
                .collect::<HashSet<_>>()
                .len(),
            span_s,
            mean_input: prompt as f64 / n,
            max_input,
            mean_output: requests.iter().map(|r| r.output_length).sum::<usize>() as f64 / n,
            reusable_fraction: if prompt > 0 {
                reusable as f64 / prompt as f64
            } else {
                0.0
            },
            offered_prefill_uncached: uncached_ms / capacity_ms,
            offered_prefill_pooled: pooled_ms / capacity_ms,
        }
    }

    /// One paragraph for humans.
    pub fn report(&self, workers: usize, speedup: f64) -> String {
        let mut s = String::new();
        let rate = self.requests as f64 / self.span_s.max(1e-9);
        let _ = writeln!(
            s,
            "{} requests in {} sessions over {:.1} s ({rate:.1} req/s); prompts mean {:.0} max {} \
             tokens, outputs mean {:.0} tokens ({:.0} tokens/s)",
            self.requests,
            self.sessions,
            self.span_s,
            self.mean_input,
            self.max_input,
            self.mean_output,
            self.mean_output * rate
        );
        let _ = writeln!(
            s,
            "reusable prefix (one unbounded shared cache): {:.1}% of prompt tokens; offered \
             prefill load on {workers} mock engines at --speedup {speedup}: {:.0}% with nothing \
             cached, {:.0}% with every reusable prefix cached",
            self.reusable_fraction * 100.0,
            self.offered_prefill_uncached * 100.0,
            self.offered_prefill_pooled * 100.0
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    fn by_session(trace: &[TraceRequest]) -> HashMap<usize, Vec<&TraceRequest>> {
        let mut m: HashMap<usize, Vec<&TraceRequest>> = HashMap::new();
        for r in trace {
            m.entry(r.session).or_default().push(r);
        }
        for turns in m.values_mut() {
            turns.sort_by_key(|r| r.turn);
        }
        m
    }

    fn lines(trace: &[TraceRequest]) -> String {
        trace.iter().map(|r| r.to_json_line() + "\n").collect()
    }

    #[test]
    fn the_same_seed_writes_the_same_file() {
        for (kind, size) in [
            (WorkloadKind::Agent, "sessions=20"),
            (WorkloadKind::Conversation, "conversations=20"),
        ] {
            let params = vec![size.to_string()];
            let (a, described) = generate(kind, 7, &params).unwrap();
            assert!(described.starts_with("seed=7,"), "{described}");
            let (b, _) = generate(kind, 7, &params).unwrap();
            let (c, _) = generate(kind, 8, &params).unwrap();
            // A seed among the parameters wins over the flag.
            let (d, _) = generate(kind, 8, &[size.to_string(), "seed=7".into()]).unwrap();
            assert_eq!(lines(&a), lines(&d), "{kind:?}");
            assert_eq!(lines(&a), lines(&b), "{kind:?}");
            assert_ne!(lines(&a), lines(&c), "{kind:?}");
            let dir = std::env::temp_dir().join(format!("gen-test-{}", std::process::id()));
            let (p, q) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
            write_trace(&p, &a).unwrap();
            write_trace(&q, &b).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
            // The replay path reads it back: one request a line, times from the first.
            let w = super::super::load_mooncake(&p, 1.0, None).unwrap();
            assert_eq!(w.requests.len(), a.len());
            assert_eq!(w.requests[0].tokens.len(), a[0].input_length);
            // Each request names its session: the client a load balancer's affinity keys on.
            let sessions: Vec<Option<u64>> = a.iter().map(|r| Some(r.session as u64)).collect();
            let clients: Vec<Option<u64>> = w.requests.iter().map(|r| r.client).collect();
            assert_eq!(clients, sessions, "{kind:?}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn contexts_grow_turn_by_turn() {
        let agent_trace = agent(&AgentSpec {
            sessions: 30,
            ..AgentSpec::default()
        });
        let chat_trace = conversation(&ConversationSpec {
            conversations: 30,
            ..ConversationSpec::default()
        });
        for trace in [&agent_trace, &chat_trace] {
            assert!(trace
                .windows(2)
                .all(|p| p[0].timestamp_ms <= p[1].timestamp_ms));
            let mut multi_turn = 0;
            for turns in by_session(trace).values() {
                for pair in turns.windows(2) {
                    let (a, b) = (pair[0], pair[1]);
                    assert_eq!(b.turn, a.turn + 1);
                    assert!(b.timestamp_ms > a.timestamp_ms);
                    assert!(b.input_length > a.input_length);
                    assert!(b.hash_ids.len() >= a.hash_ids.len());
                    assert_eq!(b.hash_ids[..a.hash_ids.len()], a.hash_ids[..]);
                    // The tokens too: the earlier prompt is a prefix of the later one.
                    let ta = super::super::mooncake_tokens(&a.hash_ids, a.input_length);
                    let tb = super::super::mooncake_tokens(&b.hash_ids, b.input_length);
                    assert_eq!(tb[..ta.len()], ta[..]);
                    multi_turn += 1;
                }
                for r in turns {
                    assert_eq!(r.hash_ids.len(), r.input_length.div_ceil(512));
                    assert!(r.output_length >= 1);
                }
            }
            assert!(multi_turn > 30, "{multi_turn}");
        }
    }

    /// Shared prompts take the first ids (in order), documents the next ones.
    fn prompt_ids(sizes: &[usize]) -> Vec<Vec<u64>> {
        let mut ids = Ids::default();
        sizes.iter().map(|t| ids.blocks(*t)).collect()
    }

    #[test]
    fn shared_prompts_and_documents_are_shared_across_sessions() {
        let spec = AgentSpec {
            sessions: 60,
            ..AgentSpec::default()
        };
        let trace = agent(&spec);
        let prompts = prompt_ids(&spaced_sizes(
            spec.tool_prompts,
            spec.tool_prompt_min,
            spec.tool_prompt_max,
        ));
        let sessions = by_session(&trace);
        assert_eq!(sessions.len(), 60);
        // Every session opens with one of the tool prompts' ids, and every turn keeps it.
        let mut opened = vec![0usize; prompts.len()];
        for turns in sessions.values() {
            let k = prompts
                .iter()
                .position(|p| turns[0].hash_ids.starts_with(p))
                .expect("a session opens with a tool prompt");
            assert!(turns.iter().all(|r| r.hash_ids.starts_with(&prompts[k])));
            opened[k] += 1;
        }
        // Zipf: the first prompt is the most popular, and more than one is used.
        assert!(opened[0] == *opened.iter().max().unwrap(), "{opened:?}");
        assert!(opened.iter().filter(|n| **n > 0).count() >= 2, "{opened:?}");
        // Documents: ids after the prompts' that more than one session sends, mid-context.
        let first_doc_id = prompts.iter().map(Vec::len).sum::<usize>() as u64;
        let mut sessions_of: HashMap<u64, HashSet<usize>> = HashMap::new();
        for r in &trace {
            for (i, id) in r.hash_ids.iter().enumerate() {
                if *id >= first_doc_id {
                    assert!(i > 0);
                    sessions_of.entry(*id).or_default().insert(r.session);
                }
            }
        }
        let doc_blocks = sessions_of.values().filter(|s| s.len() > 1).count();
        assert!(doc_blocks >= 4, "{doc_blocks}");

        // Conversations: the system prompts' ids open every conversation.
        let spec = ConversationSpec {
            conversations: 40,
            ..ConversationSpec::default()
        };
        let conv = conversation(&spec);
        let systems = prompt_ids(&spaced_sizes(
            spec.system_prompts,
            spec.system_min,
            spec.system_max,
        ));
        let mut opened = vec![0usize; systems.len()];
        for turns in by_session(&conv).values() {
            let k = systems
                .iter()
                .position(|p| turns[0].hash_ids.starts_with(p))
                .expect("a conversation opens with a system prompt");
            assert!(turns.iter().all(|r| r.hash_ids.starts_with(&systems[k])));
            opened[k] += 1;
        }
        assert!(
            opened[0] > 5 && opened.iter().filter(|n| **n > 0).count() >= 2,
            "{opened:?}"
        );
    }

    #[test]
    fn overrides_and_the_offered_load() {
        let spec =
            AgentSpec::parse(&["sessions=5,turns_min=2".into(), "turns_max=2".into()]).unwrap();
        assert_eq!((spec.sessions, spec.turns_min, spec.turns_max), (5, 2, 2));
        assert!(AgentSpec::parse(&["session_rate=0".into()]).is_err());
        assert!(ConversationSpec::parse(&["nope=1".into()]).is_err());
        let trace = agent(&spec);
        assert_eq!(trace.len(), 10);
        let load = TraceLoad::of(&trace, 8, 2.0, 1.0);
        assert_eq!((load.requests, load.sessions), (10, 5));
        // The second turn of each session reuses all of its first: over half of all tokens.
        assert!(load.reusable_fraction > 0.5, "{load:?}");
        assert!(load.offered_prefill_pooled < load.offered_prefill_uncached);
        // Twice as fast a replay, twice the load.
        let fast = TraceLoad::of(&trace, 8, 2.0, 2.0);
        assert!((fast.offered_prefill_uncached / load.offered_prefill_uncached - 2.0).abs() < 1e-9);
        // Defaults: ~2,000-2,500 requests.
        let n = agent(&AgentSpec::default()).len();
        assert!((2000..=2500).contains(&n), "{n}");
        let n = conversation(&ConversationSpec::default()).len();
        assert!((1800..=2500).contains(&n), "{n}");
    }
}
