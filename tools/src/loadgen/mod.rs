//! The benchmark driver behind the `loadgen` binary: workloads (a Mooncake trace or a synthetic
//! shared-prefix mix, here), the async runner (`runner`: streamed `/v1/completions` with
//! token-id prompts, measuring TTFT, ITL, end-to-end latency, throughput, errors, achieved
//! concurrency and the client's own CPU), the measurements (`stats`) and the reports
//! (`report`: tables and a TTFT chart); generated multi-turn workloads in the Mooncake format
//! (`generate`). The repeated all-workloads, all-arms comparison built on these is
//! [`crate::race`].

mod chat;
pub mod generate;
mod replay;
mod report;
mod runner;
mod stats;

pub use chat::{chat, ChatSpec};
pub use replay::{affinity_replay, block_hashes, pooled_replay, Affinity, Why};
pub use report::{
    comparison_table, format_stats, print_comparison_table, svg_chart, write_svg_chart,
};
pub use runner::{body_for, run_workload, run_workload_on, RunOptions, Spread};
pub use stats::{
    scrape_hit_rate, scrape_workers, CacheCounters, ClientUsage, RequestResult, RunStats, Summary,
    WorkerCounters,
};

use std::io::{self, BufRead, BufReader};
use std::path::Path;

use serde_json::Value;

use crate::util::splitmix64;

/// Tokens per Mooncake hash id.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Vocabulary of generated token ids.
pub const VOCAB: u64 = 32_000;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Arrival offset from the start of the run (timed workloads).
    pub at_ms: f64,
    /// The prompt as token ids (for a chat request: the ids the mock worker's tokenizer and
    /// template give its `messages`).
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// A chat request: sent as `messages` to `/v1/chat/completions`.
    pub messages: Option<Value>,
    /// The client that sent it (a session, a conversation, the sender of a burst): a load
    /// balancer with client affinity sends its requests to the same Envoy ([`Spread::ByClient`]).
    /// `None`: each request is its own client.
    pub client: Option<u64>,
}

/// How requests are released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// At each request's `at_ms`.
    Timed,
    /// A closed loop of this many clients, each sending its next request when the last one ends.
    Concurrency(usize),
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub requests: Vec<RequestSpec>,
    pub arrival: Arrival,
}

impl Workload {
    /// Its requests are chat `messages` (sent to `/v1/chat/completions`).
    pub fn is_chat(&self) -> bool {
        self.requests.iter().any(|r| r.messages.is_some())
    }
}

/// Deterministic token `i` of Mooncake hash id `id`.
pub fn mooncake_token(id: u64, i: usize) -> u32 {
    (splitmix64(splitmix64(id) ^ i as u64) % VOCAB) as u32
}

/// A Mooncake prompt: 512 tokens per hash id, truncated to `input_length`.
pub fn mooncake_tokens(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_length);
    'outer: for &id in hash_ids {
        for i in 0..MOONCAKE_BLOCK_TOKENS {
            if out.len() >= input_length {
                break 'outer;
            }
            out.push(mooncake_token(id, i));
        }
    }
    out
}

/// Loads a Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`, `output_length`,
/// `hash_ids`). Timestamps are divided by `time_scale` and made relative to the first request.
pub fn load_mooncake(
    path: &Path,
    time_scale: f64,
    max_requests: Option<usize>,
) -> io::Result<Workload> {
    let file = std::fs::File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let scale = if time_scale > 0.0 { time_scale } else { 1.0 };
    let mut requests = Vec::new();
    let mut t0 = None;
    for (n, line) in BufReader::new(file).lines().enumerate() {
        if max_requests.is_some_and(|m| requests.len() >= m) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}:{}: {what}", path.display(), n + 1),
            )
        };
        let v: Value = serde_json::from_str(&line).map_err(|e| bad(&e.to_string()))?;
        let ts = v["timestamp"]
            .as_f64()
            .ok_or_else(|| bad("missing timestamp"))?;
        let input = v["input_length"]
            .as_u64()
            .ok_or_else(|| bad("missing input_length"))? as usize;
        let output = v["output_length"]
            .as_u64()
            .ok_or_else(|| bad("missing output_length"))? as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .ok_or_else(|| bad("missing hash_ids"))?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        let start = *t0.get_or_insert(ts);
        requests.push(RequestSpec {
            at_ms: (ts - start).max(0.0) / scale,
            tokens: mooncake_tokens(&ids, input),
            max_tokens: output.max(1),
            messages: None,
            // The generated traces name each request's session (not Mooncake's own field).
            client: v["session"].as_u64(),
        });
    }
    Ok(Workload {
        name: format!("mooncake:{}", path.display()),
        requests,
        arrival: Arrival::Timed,
    })
}

/// How to fit a workload to a small real model (`loadgen --vllm-engines`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelFit {
    /// Keep this many tokens of every 512-token Mooncake block (the first ones: prompts that
    /// shared a block still share its shortened form, others still differ).
    pub trace_block_tokens: Option<usize>,
    /// Token ids mapped into `4..vocab` (the model's specials below 4 left out).
    pub vocab: Option<u32>,
    /// Prompts cut to this many tokens.
    pub max_prompt_tokens: Option<usize>,
    /// Outputs cut to this many tokens.
    pub max_output_tokens: Option<usize>,
}

impl Workload {
    /// The same requests, shortened and mapped as `fit` says (arrivals unchanged).
    pub fn fit(&mut self, fit: &ModelFit) {
        for r in &mut self.requests {
            if let Some(keep) = fit
                .trace_block_tokens
                .filter(|k| *k < MOONCAKE_BLOCK_TOKENS)
            {
                r.tokens = r
                    .tokens
                    .chunks(MOONCAKE_BLOCK_TOKENS)
                    .flat_map(|block| {
                        let n = (block.len() * keep).div_ceil(MOONCAKE_BLOCK_TOKENS);
                        block.iter().take(n).copied()
                    })
                    .collect();
            }
            if let Some(vocab) = fit.vocab.filter(|v| *v > 4) {
                for t in &mut r.tokens {
                    *t = 4 + *t % (vocab - 4);
                }
            }
            if let Some(max) = fit.max_prompt_tokens {
                r.tokens.truncate(max.max(1));
            }
            if let Some(max) = fit.max_output_tokens {
                r.max_tokens = r.max_tokens.min(max.max(1));
            }
        }
    }
}

/// `groups=G,prefix=P,isl=I,osl=O,requests=N,rate=R` (Poisson arrivals, req/s) or
/// `...,concurrency=C` (closed loop); optional `seed=S`; `burst=B`: requests come in bursts of
/// B that arrive together and share a prefix no earlier request had (G is then ignored), the
/// bursts Poisson at R / B a second.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    pub groups: usize,
    pub prefix: usize,
    pub isl: usize,
    pub osl: usize,
    pub requests: usize,
    pub rate: Option<f64>,
    pub concurrency: Option<usize>,
    pub seed: u64,
    /// Requests per burst of a new prefix (0: no bursts).
    pub burst: usize,
}

impl SyntheticSpec {
    pub fn parse(s: &str) -> Result<SyntheticSpec, String> {
        let mut spec = SyntheticSpec {
            groups: 4,
            prefix: 2048,
            isl: 4096,
            osl: 64,
            requests: 200,
            rate: None,
            concurrency: None,
            seed: 42,
            burst: 0,
        };
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("synthetic: expected key=value, got {part:?}"))?;
            let num = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("synthetic: bad {k}={v}"))
            };
            match k.trim() {
                "groups" => spec.groups = num(v)?.max(1),
                "prefix" => spec.prefix = num(v)?,
                "isl" => spec.isl = num(v)?,
                "osl" => spec.osl = num(v)?.max(1),
                "requests" => spec.requests = num(v)?,
                "concurrency" => spec.concurrency = Some(num(v)?.max(1)),
                "seed" => spec.seed = num(v)? as u64,
                "burst" => spec.burst = num(v)?,
                "rate" => {
                    let r: f64 = v
                        .trim()
                        .parse()
                        .map_err(|_| format!("synthetic: bad rate={v}"))?;
                    if !(r.is_finite() && r > 0.0) {
                        return Err("synthetic: rate must be > 0".into());
                    }
                    spec.rate = Some(r);
                }
                other => return Err(format!("synthetic: unknown key {other:?}")),
            }
        }
        if spec.prefix > spec.isl {
            return Err("synthetic: prefix must be <= isl".into());
        }
        if spec.rate.is_none() && spec.concurrency.is_none() {
            spec.concurrency = Some(8);
        }
        Ok(spec)
    }
}

/// Builds a shared-prefix workload: each request picks a group at random, sends that group's
/// `prefix` tokens followed by `isl - prefix` unique tokens, and asks for `osl` tokens.
pub fn synthetic(spec: &SyntheticSpec) -> Workload {
    let mut state = spec.seed;
    let mut next = move || {
        state = splitmix64(state);
        state
    };
    let mut t = 0.0;
    let requests = (0..spec.requests)
        .map(|n| {
            let burst = spec.burst.max(1);
            let group = if spec.burst > 0 {
                // A fresh prefix per burst: no earlier group's (nor another seed's).
                (spec.seed << 24) ^ (n / burst) as u64 ^ (1 << 31)
            } else {
                next() % spec.groups as u64
            };
            let mut tokens: Vec<u32> = (0..spec.prefix)
                .map(|i| (splitmix64(0xC0FFEE ^ (group << 32) ^ i as u64) % VOCAB) as u32)
                .collect();
            let unique = spec.seed.wrapping_mul(1_000_003) ^ ((n as u64) << 20);
            tokens.extend(
                (spec.prefix..spec.isl).map(|i| (splitmix64(unique ^ i as u64) % VOCAB) as u32),
            );
            if let Some(rate) = spec.rate.filter(|_| n % burst == 0) {
                let rate = rate / burst as f64;
                // Exponential inter-arrival times (of bursts, when bursty).
                let u = ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                t += -u.ln() / rate * 1000.0;
            }
            RequestSpec {
                at_ms: if spec.rate.is_some() { t } else { 0.0 },
                tokens,
                max_tokens: spec.osl,
                messages: None,
                // A burst is one client's (an agent's fan-out of calls sharing a prompt).
                client: (spec.burst > 0).then_some((n / burst) as u64),
            }
        })
        .collect();
    Workload {
        name: format!(
            "synthetic:groups={},prefix={},isl={},osl={},requests={}",
            spec.groups, spec.prefix, spec.isl, spec.osl, spec.requests
        ),
        requests,
        arrival: match (spec.rate, spec.concurrency) {
            (Some(_), _) => Arrival::Timed,
            (None, c) => Arrival::Concurrency(c.unwrap_or(8)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitting_keeps_the_shared_prefixes() {
        // Two prompts sharing their first 512-token block, then differing.
        let a = mooncake_tokens(&[1, 2], 1024);
        let b = mooncake_tokens(&[1, 3], 700);
        let mut w = Workload {
            name: "t".into(),
            requests: [a, b]
                .map(|tokens| RequestSpec {
                    at_ms: 0.0,
                    tokens,
                    max_tokens: 300,
                    messages: None,
                    client: None,
                })
                .to_vec(),
            arrival: Arrival::Timed,
        };
        w.fit(&ModelFit {
            trace_block_tokens: Some(32),
            vocab: Some(512),
            max_prompt_tokens: Some(60),
            max_output_tokens: Some(16),
        });
        let (a, b) = (&w.requests[0].tokens, &w.requests[1].tokens);
        // 32 + 32 tokens cut to 60; 32 + ceil(188 * 32 / 512) = 32 + 12.
        assert_eq!((a.len(), b.len()), (60, 44));
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32..44], b[32..44]);
        assert!(a.iter().chain(b).all(|t| (4..512).contains(t)));
        assert_eq!(w.requests[1].max_tokens, 16);
    }

    #[test]
    fn mooncake_prompts_share_prefixes() {
        let a = mooncake_tokens(&[1, 2, 3], 1100);
        let b = mooncake_tokens(&[1, 2, 4], 1500);
        assert_eq!(a.len(), 1100);
        assert_eq!(b.len(), 1500);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert!(a.iter().all(|&t| u64::from(t) < VOCAB));
        assert_eq!(mooncake_tokens(&[1], 10), mooncake_tokens(&[1], 10));
    }

    #[test]
    fn loads_the_trace_format() {
        let dir = std::env::temp_dir().join(format!("loadgen-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
             {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 0, \"hash_ids\": [0]}\n\
             {\"timestamp\": 4000, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [9]}\n",
        )
        .unwrap();
        let w = load_mooncake(&p, 2.0, Some(2)).unwrap();
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].at_ms, 0.0);
        assert_eq!(w.requests[1].at_ms, 1000.0);
        assert_eq!(w.requests[0].tokens.len(), 600);
        assert_eq!(w.requests[1].max_tokens, 1);
        assert_eq!(w.requests[0].tokens[..100], w.requests[1].tokens[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn synthetic_workloads() {
        let spec =
            SyntheticSpec::parse("groups=3,prefix=100,isl=150,osl=4,requests=30,rate=10").unwrap();
        let w = synthetic(&spec);
        assert_eq!(w.requests.len(), 30);
        assert_eq!(w.arrival, Arrival::Timed);
        assert!(w.requests.windows(2).all(|p| p[0].at_ms <= p[1].at_ms));
        let prefixes: std::collections::HashSet<Vec<u32>> = w
            .requests
            .iter()
            .map(|r| r.tokens[..100].to_vec())
            .collect();
        assert!(prefixes.len() <= 3 && prefixes.len() >= 2);
        let suffixes: std::collections::HashSet<Vec<u32>> = w
            .requests
            .iter()
            .map(|r| r.tokens[100..].to_vec())
            .collect();
        assert_eq!(suffixes.len(), 30);
        let mean_gap = w.requests.last().unwrap().at_ms / 30.0;
        assert!(mean_gap > 30.0 && mean_gap < 300.0, "{mean_gap}");
        let c =
            synthetic(&SyntheticSpec::parse("requests=5,concurrency=2,isl=10,prefix=5").unwrap());
        assert_eq!(c.arrival, Arrival::Concurrency(2));
        assert!(SyntheticSpec::parse("prefix=10,isl=5").is_err());
        assert!(SyntheticSpec::parse("bogus=1").is_err());
        // Bursts: 4 of 5 requests each, every burst at one instant with a prefix of its own.
        let b = synthetic(
            &SyntheticSpec::parse("burst=5,prefix=8,isl=12,requests=20,rate=10").unwrap(),
        );
        for burst in b.requests.chunks(5) {
            assert!(burst.iter().all(|r| r.at_ms == burst[0].at_ms));
            assert!(burst.iter().all(|r| r.tokens[..8] == burst[0].tokens[..8]));
        }
        let firsts: std::collections::HashSet<&[u32]> =
            b.requests.iter().map(|r| &r.tokens[..8]).collect();
        assert_eq!(firsts.len(), 4);
        assert!(b.requests[5].at_ms > b.requests[4].at_ms);
    }
}
