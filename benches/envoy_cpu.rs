//! Envoy CPU per request, measured inside the real Envoy (V8) with the built .wasm files, and
//! event application rates. Prints four markdown tables; asserts nothing.
//!
//! 1. **CPU per request by prompt size**: three Envoys side by side (plain, no Wasm filter; the
//!    floor filter `benches/floor-filter`, which buffers the body, copies it into the VM once,
//!    scans it once and sets a fixed destination; this filter in `kv` mode with the prompt's
//!    blocks in its index), each with one worker thread (`--concurrency 1`) in front of the same
//!    echo mock. Rounds interleave the Envoys (A, B, C, A, B, C, ...) so machine noise hits all
//!    three; each round is a closed loop of 4 keep-alive clients. CPU = the Envoy process's
//!    on-CPU time (sum of `/proc/<pid>/task/*/schedstat`, ns; the same quantity as utime+stime
//!    of `/proc/<pid>/stat` at a finer grain) over the round, per request; medians over rounds.
//! 2. **Request-path CPU at fleet scale**: this filter with 8 / 64 / 256 / 1,000 `workers`
//!    entries (spread over 4 echo mock processes; entries may share an address) and 100 / 2,000 /
//!    10,000 requests held in flight (streams the mocks hold open before answering; Envoy speaks
//!    HTTP/2 to the mocks so that 10,000 fit its descriptor limit, `--fleet-http1` for the
//!    shipped HTTP/1.1, capped by that limit), while 4 clients send 4k-token requests. Envoy's idle CPU (event polls of the 1,000 entries and
//!    the tick), measured over an idle window just before, is subtracted.
//! 3. **Events applied per second**: natively (`KvIndex::apply` of 1-block BlockStored /
//!    BlockRemoved events) and inside Envoy (one event page burst published to a mock; time from
//!    the publish until `events.applied` shows every replica applied them).
//!
//! Usage: `cargo bench --bench envoy_cpu [-- --quick]` (needs `make build`: the Envoy in .venv,
//! target/envoy_kv_router.wasm, target/floor_filter.wasm, the mock worker).
//! `-- --only size,fleet,events` picks sections. Before/after runs, side by side:
//! * table 1: `ENVOY_CPU_SIZE_WASM=before=target/ab/before.wasm` adds Envoys running other builds
//!   of this filter to the same interleaved rounds (`KV_ROUTER_WASM` picks the `kv` column's);
//!   `ENVOY_CPU_SIZE_ROUNDS=60` more rounds (the machine is noisy), `ENVOY_CPU_TOKENS=4096,65536`
//!   a subset of the prompt sizes, `ENVOY_CPU_SIZE_HELD=1` only the prompt's first block(s) in
//!   the index (a low overlap; default: every block);
//! * table 2: `ENVOY_CPU_FLEET_WASM=before=a.wasm,after=b.wasm` (`plain=none`: no filter),
//!   `ENVOY_CPU_REPEAT`,
//!   `ENVOY_CPU_FLEET=8,1000`, `ENVOY_CPU_HELD=100,10000` (see `fleet_scale`);
//! * `-- --only hostcalls`: host calls per request of `count-host-calls` builds
//!   (`scripts/build-wasm.sh --count-host-calls`; `ENVOY_CPU_COUNT_WASM=before=a.wasm,after=b.wasm`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::types::{ExternalBlockHash, StorageTier};
use envoy_kv_router_tools::harness::{workspace_root, Envoy, EnvoyOptions, Worker};
use kv_router_testkit::kv_events::{self, removed_event, GPU};
use serde_json::{json, Value};
use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const BLOCK_SIZE: u32 = 64;
const CLIENTS: usize = 4;
const DEST_HEADER: &str = "x-gateway-destination-endpoint";

// ---------------------------------------------------------------------------------------------
// Measuring
// ---------------------------------------------------------------------------------------------

/// On-CPU nanoseconds of every thread of `pid` so far.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn us(ns: f64) -> String {
    if ns >= 10_000_000.0 {
        format!("{:.1} ms", ns / 1e6)
    } else if ns >= 1_000_000.0 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.0} µs", ns / 1e3)
    }
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A keep-alive HTTP/1.1 client (the closed loop's; the shared test client opens a connection per
// request, which would add connection set-up to every measured request)
// ---------------------------------------------------------------------------------------------

struct Conn {
    addr: String,
    stream: Option<BufReader<TcpStream>>,
}

/// What the closed loop needs of an answer.
struct Answer {
    status: u16,
}

impl Conn {
    fn new(addr: &str) -> Conn {
        Conn {
            addr: addr.to_string(),
            stream: None,
        }
    }

    fn post(&mut self, body: &[u8]) -> std::io::Result<Answer> {
        match self.try_post(body) {
            Ok(a) => Ok(a),
            // Envoy closed the idle connection: once more on a fresh one.
            Err(_) => {
                self.stream = None;
                self.try_post(body)
            }
        }
    }

    fn try_post(&mut self, body: &[u8]) -> std::io::Result<Answer> {
        if self.stream.is_none() {
            let s = TcpStream::connect(&self.addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(60)))?;
            self.stream = Some(BufReader::with_capacity(64 * 1024, s));
        }
        let r = self.stream.as_mut().unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let w = r.get_mut();
        w.write_all(head.as_bytes())?;
        w.write_all(body)?;
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err(std::io::Error::other("closed"));
        }
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let (mut length, mut chunked, mut close) = (0usize, false, false);
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let Some((k, v)) = l.split_once(':') else {
                continue;
            };
            let (k, v) = (k.to_ascii_lowercase(), v.trim());
            match k.as_str() {
                "content-length" => length = v.parse().unwrap_or(0),
                "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                "connection" => close = v.eq_ignore_ascii_case("close"),
                _ => {}
            }
        }
        if chunked {
            loop {
                line.clear();
                r.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
                let mut chunk = vec![0; size + 2];
                r.read_exact(&mut chunk)?;
                if size == 0 {
                    break;
                }
            }
        } else {
            let mut rest = vec![0; length];
            r.read_exact(&mut rest)?;
        }
        if close {
            self.stream = None;
        }
        Ok(Answer { status })
    }
}

/// `requests` requests shared by `conns.len()` clients in a closed loop; returns each request's
/// latency (µs) and the Envoy's on-CPU ns over the loop.
fn closed_loop(conns: &mut [Conn], body: &[u8], requests: usize, pid: u32) -> (Vec<f64>, u64) {
    let left = AtomicUsize::new(requests);
    let cpu0 = cpu_ns(pid);
    let latencies: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter_mut()
            .map(|c| {
                let left = &left;
                s.spawn(move || {
                    let mut lat = Vec::new();
                    while left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_ok()
                    {
                        let t = Instant::now();
                        let a = c.post(body).expect("request");
                        assert_eq!(a.status, 200, "request failed");
                        lat.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    lat
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    (latencies, cpu_ns(pid) - cpu0)
}

// ---------------------------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------------------------

fn prompt(tokens: u32, salt: u32) -> Vec<u32> {
    (0..tokens)
        .map(|i| (i ^ salt).wrapping_mul(2_654_435_761) % 50_000)
        .collect()
}

fn completion_body(prompt: &[u32]) -> Vec<u8> {
    json!({"model": "m", "prompt": prompt, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

/// A vLLM-shaped BlockStored event of every block of `prompt` (engine hashes from `base`).
fn stored_event(prompt: &[u32], base: u64) -> Value {
    let blocks = prompt.len() as u64 / u64::from(BLOCK_SIZE);
    let hashes: Vec<u64> = (0..blocks).map(|h| base + h).collect();
    let tokens = &prompt[..(blocks * u64::from(BLOCK_SIZE)) as usize];
    kv_events::stored_event(&hashes, None, tokens, BLOCK_SIZE, GPU)
}

/// Publishes `events` to `worker` and waits until `envoy`'s replicas (`--concurrency 1`: the
/// main thread's VM and the worker thread's) applied them all.
fn feed(envoy: &Envoy, worker: &Worker, events: &Value) {
    let before = envoy.router_stat("events.applied");
    let n = events.as_array().map_or(1, Vec::len) as u64;
    worker.admin("/admin/events", events).expect("publish");
    let ok = envoy.wait_for(Duration::from_secs(60), |e| {
        e.router_stat("events.applied") >= before + 2 * n
    });
    assert!(ok, "the filter did not apply the published events");
}

fn kv_config(workers: Value, events: Value) -> Value {
    // `ENVOY_CPU_MODE=round-robin`: another routing mode, to tell the decision's cost from the rest.
    let mode = std::env::var("ENVOY_CPU_MODE").unwrap_or_else(|_| "kv".to_string());
    json!({"mode": mode, "block_size": BLOCK_SIZE, "events": events, "workers": workers})
}

fn start_envoy(config: Value, addrs: Vec<String>, wasm: Option<&str>, filter: bool) -> Envoy {
    start_envoy_with(config, addrs, wasm, filter, false)
}

fn start_envoy_with(
    config: Value,
    addrs: Vec<String>,
    wasm: Option<&str>,
    filter: bool,
    upstream_http2: bool,
) -> Envoy {
    let mut opts = EnvoyOptions::new(config, addrs);
    opts.upstream_http2 = upstream_http2;
    opts.concurrency = 1;
    opts.with_filter = filter;
    opts.log_level = "warning";
    // Held streams stay open until the bench closes them.
    opts.route_timeout = Duration::ZERO;
    opts.wasm = wasm.map(|w| workspace_root().join(w));
    Envoy::start(&opts).expect("envoy")
}

// ---------------------------------------------------------------------------------------------
// 1. CPU per request by prompt size
// ---------------------------------------------------------------------------------------------

/// `ENVOY_CPU_SIZE_WASM=before=target/ab/before.wasm,...`: more builds of this filter in the
/// prompt-size table, each its own Envoy in the same interleaved rounds (columns after `kv`).
fn extra_size_builds() -> Vec<(String, String)> {
    named_builds("ENVOY_CPU_SIZE_WASM").unwrap_or_default()
}

/// `name=path,name=path` from the environment variable `var` (builds run side by side); `None`
/// when it is not set.
fn named_builds(var: &str) -> Option<Vec<(String, String)>> {
    let v = std::env::var(var).ok()?;
    Some(
        v.split(',')
            .filter_map(|b| b.split_once('='))
            .map(|(n, p)| (n.to_string(), p.to_string()))
            .collect(),
    )
}

/// [`named_builds`] of `ENVOY_CPU_FLEET_WASM`, or the current build under `default_name`.
fn fleet_builds(default_name: &str) -> Vec<(String, Option<String>)> {
    named_builds("ENVOY_CPU_FLEET_WASM").map_or_else(
        || vec![(default_name.to_string(), None)],
        |builds| builds.into_iter().map(|(n, p)| (n, Some(p))).collect(),
    )
}

fn cpu_by_prompt_size(quick: bool) {
    let worker = Worker::spawn(1, &["--mode", "echo", "--block-size", "64"]).expect("echo worker");
    let workers = json!([{"id": 1, "address": worker.addr}]);
    let floor_config = Value::String(format!("{DEST_HEADER} {}", worker.addr));
    let addrs = vec![worker.addr.clone()];
    let mut envoys = vec![
        (
            "plain".to_string(),
            start_envoy(Value::Null, addrs.clone(), None, false),
        ),
        (
            "floor".to_string(),
            start_envoy(
                floor_config,
                addrs.clone(),
                Some("target/floor_filter.wasm"),
                true,
            ),
        ),
        (
            "kv".to_string(),
            start_envoy(
                kv_config(workers.clone(), json!({})),
                addrs.clone(),
                None,
                true,
            ),
        ),
    ];
    for (name, wasm) in extra_size_builds() {
        let envoy = start_envoy(
            kv_config(workers.clone(), json!({})),
            addrs.clone(),
            Some(&wasm),
            true,
        );
        envoys.push((name, envoy));
    }
    // Envoys 2.. run this filter (the current build, then the extra ones).
    let kv_builds = 2..envoys.len();
    // The floor filter did steer: the echo mock shows the destination header it received.
    let probe = completion_body(&prompt(64, 0));
    let resp = envoy_kv_router_tools::client::request(
        &envoys[1].1.listener,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        &probe,
        Duration::from_secs(30),
    )
    .expect("floor request");
    let seen = resp.json().expect("echo body")["received_headers"][DEST_HEADER].clone();
    assert_eq!(
        seen,
        json!(worker.addr),
        "floor filter did not set {DEST_HEADER}"
    );
    let rounds: usize = std::env::var("ENVOY_CPU_SIZE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 5 } else { 15 });
    // `ENVOY_CPU_SIZE_HELD=1`: only the prompt's first blocks in the index (a low overlap).
    let held: Option<usize> = std::env::var("ENVOY_CPU_SIZE_HELD")
        .ok()
        .and_then(|v| v.parse().ok());
    // `ENVOY_CPU_TOKENS=4096,65536`: a subset of the prompt sizes.
    let sizes: Vec<u32> = std::env::var("ENVOY_CPU_TOKENS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1024, 4096, 16_384, 65_536, 131_072]);
    println!("### 1. Envoy CPU per request by prompt size");
    println!();
    println!(
        "Envoy `--concurrency 1`, echo mock, closed loop of {CLIENTS} keep-alive clients, {rounds} rounds \
         interleaving the Envoys; CPU = Envoy process on-CPU time per request, median over \
         rounds; latency p50 / p99 over all rounds' requests. `kv`: this filter, the prompt's \
         blocks held by the worker in its index."
    );
    println!();
    let extra: Vec<&str> = envoys[3..].iter().map(|(n, _)| n.as_str()).collect();
    let mut head = String::from("| prompt tokens | body | plain | floor filter | kv filter |");
    let mut rule = String::from("|---|---|---|---|---|");
    for n in &extra {
        head.push_str(&format!(" {n} | {n} / floor |"));
        rule.push_str("---|---|");
    }
    head.push_str(" kv / floor | kv − floor | p50 / p99 plain | p50 / p99 floor | p50 / p99 kv | kv overlap blocks |");
    rule.push_str("---|---|---|---|---|---|");
    println!("{head}");
    println!("{rule}");
    for (i, tokens) in sizes.into_iter().enumerate() {
        let prompt = prompt(tokens, i as u32 + 1);
        let body = completion_body(&prompt);
        for k in kv_builds.clone() {
            feed(
                &envoys[k].1,
                &worker,
                &json!([stored_event(
                    prompt
                        .get(..held.map_or(prompt.len(), |b| b * BLOCK_SIZE as usize))
                        .unwrap_or(&prompt),
                    (i as u64 + 1) << 32
                )]),
            );
        }
        // ~0.1-0.3 s of Envoy time per Envoy and round.
        let per_round = ((if quick { 200_000 } else { 400_000 }) / tokens as usize).clamp(12, 400);
        let mut conns: Vec<Vec<Conn>> = envoys
            .iter()
            .map(|(_, e)| (0..CLIENTS).map(|_| Conn::new(&e.listener)).collect())
            .collect();
        // The chosen worker's cached prefix as the filter counts it (its `overlap_blocks`).
        let kv = &envoys[2].1;
        let before = kv.router_stat("overlap_blocks");
        conns[2][0].post(&body).expect("kv request");
        // The counter reaches the host on the VM's next tick.
        kv.wait_for(Duration::from_secs(5), |e| {
            e.router_stat("overlap_blocks") > before
        });
        let overlap = kv.router_stat("overlap_blocks") - before;
        // Warm-up: connections, upstream pools, the VMs' buffers.
        for (k, (_, e)) in envoys.iter().enumerate() {
            closed_loop(&mut conns[k], &body, 2 * CLIENTS, e.pid());
        }
        let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
        let mut lat: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
        for _ in 0..rounds {
            for (k, (_, e)) in envoys.iter().enumerate() {
                let (l, ns) = closed_loop(&mut conns[k], &body, per_round, e.pid());
                cpu[k].push(ns as f64 / per_round as f64);
                lat[k].extend(l);
            }
        }
        let m: Vec<f64> = cpu.iter().map(|c| median(c)).collect();
        let pl = |k: usize| {
            format!(
                "{} / {}",
                us(quantile(&lat[k], 0.5) * 1e3),
                us(quantile(&lat[k], 0.99) * 1e3)
            )
        };
        let mut row = format!(
            "| {} | {} KB | {} | {} | {} |",
            thousands(tokens as usize),
            body.len() / 1024,
            us(m[0]),
            us(m[1]),
            us(m[2]),
        );
        for k in 3..envoys.len() {
            row.push_str(&format!(" {} | {:.2}x |", us(m[k]), m[k] / m[1]));
        }
        row.push_str(&format!(
            " {:.2}x | {} | {} | {} | {} | {}/{} |",
            m[2] / m[1],
            us(m[2] - m[1]),
            pl(0),
            pl(1),
            pl(2),
            overlap,
            tokens / BLOCK_SIZE
        ));
        println!("{row}");
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// 1b. Host calls per request
// ---------------------------------------------------------------------------------------------

/// Host calls per request of the `count-host-calls` builds (`scripts/build-wasm.sh
/// --count-host-calls`): `ENVOY_CPU_COUNT_WASM=before=a.wasm,after=b.wasm`, default
/// target/envoy_kv_router_count.wasm. A 4k-token request, non-streamed and streamed, through
/// the echo mock; every callback of the request's context counted (ticks are not).
fn host_calls() {
    let builds = named_builds("ENVOY_CPU_COUNT_WASM").unwrap_or_else(|| {
        vec![(
            "current".to_string(),
            "target/envoy_kv_router_count.wasm".to_string(),
        )]
    });
    let worker = Worker::spawn(1, &["--mode", "echo", "--block-size", "64"]).expect("echo worker");
    let workers = json!([{"id": 1, "address": worker.addr}]);
    let prompt = prompt(4096, 5);
    worker
        .admin("/admin/events", &json!([stored_event(&prompt, 5 << 32)]))
        .expect("publish");
    println!("### Host calls per request");
    println!();
    println!("| build | request | host calls per request |");
    println!("|---|---|---|");
    for (name, wasm) in builds {
        let envoy = start_envoy(
            kv_config(workers.clone(), json!({})),
            vec![worker.addr.clone()],
            Some(&wasm),
            true,
        );
        let ok = envoy.wait_for(Duration::from_secs(60), |e| {
            e.router_stat("events.applied") > 0
        });
        assert!(ok, "the filter did not apply the worker's events");
        for stream in [false, true] {
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream})
                .to_string()
                .into_bytes();
            let mut conns = vec![Conn::new(&envoy.listener)];
            closed_loop(&mut conns, &body, 4, envoy.pid());
            let (calls0, reqs0) = (
                envoy.router_stat("debug.host_calls"),
                envoy.router_stat("debug.requests"),
            );
            closed_loop(&mut conns, &body, 20, envoy.pid());
            // on_log (which publishes the count) may run just after the response is read.
            let done = envoy.wait_for(Duration::from_secs(10), |e| {
                e.router_stat("debug.requests") >= reqs0 + 20
            });
            assert!(
                done,
                "{name}: no host-call counts (not a count-host-calls build?)"
            );
            let calls = envoy.router_stat("debug.host_calls") - calls0;
            let reqs = envoy.router_stat("debug.requests") - reqs0;
            println!(
                "| {name} | 4,096 tokens, {} | {:.1} |",
                if stream { "streamed" } else { "not streamed" },
                calls as f64 / reqs as f64
            );
        }
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// 2. Request-path CPU at fleet scale
// ---------------------------------------------------------------------------------------------

/// Opens held requests through `envoy` until `held` has `n`: small prompts the echo mock holds
/// for an hour before answering (the client closing the socket ends them).
fn hold(envoy: &Envoy, held: &mut Vec<TcpStream>, n: usize) {
    let body = json!({"model": "m", "prompt": prompt(64, 7), "max_tokens": 1,
        "mock": {"delay_ms": 3_600_000}})
    .to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let key = "cluster.llm_workers.upstream_rq_active";
    let mut ok = true;
    // In batches of 250, each held upstream before the next: a burst of thousands of upstream
    // connects overflows the mocks' accept queues (connect timeouts, 503s).
    while ok && held.len() < n {
        let target = (held.len() + 250).min(n);
        while held.len() < target {
            let mut s = TcpStream::connect(&envoy.listener).expect("connect (held)");
            s.write_all(req.as_bytes()).expect("send (held)");
            held.push(s);
        }
        ok = envoy.wait_for(Duration::from_secs(30), |e| {
            e.stats().get(key).copied().unwrap_or(0) >= target as u64
        });
    }
    if !ok {
        let stats = envoy.stats();
        let mut related: Vec<String> = stats
            .iter()
            .filter(|(k, v)| {
                **v > 0
                    && (k.contains("_active")
                        || k.contains("overflow")
                        || k.contains("fail")
                        || k.contains("reset")
                        || k.contains("timeout")
                        || k.contains("5xx"))
            })
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        related.sort();
        panic!(
            "Envoy does not hold {n} requests upstream:\n{}\n{}",
            related.join("\n"),
            envoy.log_tail(20)
        );
    }
}

/// Target (b) of issue 14 measured robustly on a shared machine: per build, two Envoys at once
/// (8 `workers` entries with 100 requests held, 1,000 entries with 10,000 held), their rounds
/// interleaved, so that load swings of the machine hit both sides of the ratio alike
/// (`ENVOY_CPU_FLEET_PAIRED=1`, builds from `ENVOY_CPU_FLEET_WASM`, `ENVOY_CPU_REPEAT` passes).
fn fleet_paired(max_held: usize, http2: bool) {
    let mocks: Vec<Worker> = (1..=4)
        .map(|id| Worker::spawn(id, &["--mode", "echo", "--block-size", "64"]).expect("mock"))
        .collect();
    let addrs: Vec<String> = mocks.iter().map(|m| m.addr.clone()).collect();
    let builds = fleet_builds("current");
    let repeat: usize = std::env::var("ENVOY_CPU_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rounds: usize = std::env::var("ENVOY_CPU_PAIRED_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let per_round = 100;
    let prompt = prompt(4096, 99);
    let body = completion_body(&prompt);
    mocks[0]
        .admin("/admin/events", &json!([stored_event(&prompt, 1 << 40)]))
        .expect("publish");
    let sides = [(8usize, 100usize), (1000, 10_000usize.min(max_held))];
    println!("### 2b. 1,000 workers x 10,000 in flight vs 8 workers x 100, interleaved");
    println!();
    println!(
        "Per build, both Envoys run at once and their rounds alternate ({rounds} rounds of \
         {per_round} 4,096-token requests each, {CLIENTS} clients; CPU per request minus the idle \
         rate measured just before each round, median over rounds)."
    );
    println!();
    println!(
        "| build | pass | 8 x 100 | 1,000 x {} | ratio |",
        thousands(sides[1].1)
    );
    println!("|---|---|---|---|---|");
    for rep in 0..repeat {
        for (build, wasm) in &builds {
            // `plain=none`: Envoy without the filter, for what holding the streams costs Envoy.
            let plain = wasm.as_deref() == Some("none");
            let envoys: Vec<Envoy> = sides
                .iter()
                .map(|&(n, _)| {
                    let workers: Vec<Value> = (0..n)
                        .map(|i| json!({"id": i + 1, "address": addrs[i % addrs.len()]}))
                        .collect();
                    let events = json!({"poll_interval_ms": 10_000, "stale_after_ms": 3_600_000});
                    let config = kv_config(json!(workers), events);
                    if plain {
                        return start_envoy_with(Value::Null, addrs.clone(), None, false, http2);
                    }
                    start_envoy_with(config, addrs.clone(), wasm.as_deref(), true, http2)
                })
                .collect();
            for e in envoys.iter().filter(|_| !plain) {
                // Mock 1's one event, applied by both replicas (the main thread's VM and the
                // worker thread's).
                let ok = e.wait_for(Duration::from_secs(60), |e| {
                    e.router_stat("events.applied") >= 2
                });
                assert!(ok, "the filter did not apply mock 1's events");
            }
            let mut conns: Vec<Vec<Conn>> = envoys
                .iter()
                .map(|e| (0..CLIENTS).map(|_| Conn::new(&e.listener)).collect())
                .collect();
            let mut held = Vec::new();
            for (k, e) in envoys.iter().enumerate() {
                // Long enough for V8 to have tiered the hot wasm functions up (its baseline
                // compiler is several times slower): else a pass measures partly Liftoff code.
                closed_loop(&mut conns[k], &body, 500, e.pid());
                let mut h = Vec::new();
                hold(e, &mut h, sides[k].1);
                held.push(h);
            }
            let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); envoys.len()];
            for _ in 0..rounds {
                for (k, e) in envoys.iter().enumerate() {
                    let (c0, t0) = (cpu_ns(e.pid()), Instant::now());
                    std::thread::sleep(Duration::from_millis(200));
                    let idle = (cpu_ns(e.pid()) - c0) as f64 / t0.elapsed().as_secs_f64();
                    let t = Instant::now();
                    let (_, ns) = closed_loop(&mut conns[k], &body, per_round, e.pid());
                    let net = ns as f64 - idle * t.elapsed().as_secs_f64();
                    cpu[k].push(net / per_round as f64);
                }
            }
            let m: Vec<f64> = cpu.iter().map(|c| median(c)).collect();
            println!(
                "| {build} | {} | {} | {} | {:.2}x |",
                rep + 1,
                us(m[0]),
                us(m[1]),
                m[1] / m[0]
            );
            drop(held);
            drop(envoys);
        }
    }
    println!();
}

fn fleet_scale(quick: bool, max_held: usize, http2: bool) {
    let mocks: Vec<Worker> = (1..=4)
        .map(|id| Worker::spawn(id, &["--mode", "echo", "--block-size", "64"]).expect("mock"))
        .collect();
    let addrs: Vec<String> = mocks.iter().map(|m| m.addr.clone()).collect();
    let fleet: Vec<usize> = match std::env::var("ENVOY_CPU_FLEET") {
        // A subset, e.g. `ENVOY_CPU_FLEET=1000`.
        Ok(v) => v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
        Err(_) if quick => vec![8, 1000],
        Err(_) => vec![8, 64, 256, 1000],
    };
    // `ENVOY_CPU_HELD=100,10000`: a subset of the in-flight levels.
    let held_levels: Vec<usize> = std::env::var("ENVOY_CPU_HELD")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![100, 2000, 10_000]);
    // `ENVOY_CPU_FLEET_WASM=base=/tmp/a.wasm,new=target/envoy_kv_router.wasm`: builds side by
    // side, alternated per fleet size, `ENVOY_CPU_REPEAT` times (each row: its build's ratio to
    // that build's first row of the same repetition).
    let builds = fleet_builds("");
    let repeat: usize = std::env::var("ENVOY_CPU_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let levels: Vec<usize> = held_levels
        .into_iter()
        .map(|n| n.min(max_held))
        .filter(|&n| !quick || n <= 2000)
        .collect();
    let rounds = if quick { 5 } else { 9 };
    let per_round = 100;
    let prompt = prompt(4096, 99);
    let body = completion_body(&prompt);
    // Every entry on mock 1 holds the 4k prompt's blocks (the mock's event page is shared by the
    // entries pointing at it).
    mocks[0]
        .admin("/admin/events", &json!([stored_event(&prompt, 1 << 40)]))
        .expect("publish");
    println!("### 2. Request-path CPU per request at fleet scale");
    println!();
    println!(
        "This filter (`kv`), Envoy `--concurrency 1`; N `workers` entries spread over 4 echo mock \
         processes (entries share addresses); H requests held open upstream (the mock holds them \
         before answering; Envoy speaks HTTP/{} to them) while {CLIENTS} keep-alive clients send 4,096-token requests \
         ({rounds} rounds of {per_round}); CPU = Envoy on-CPU time per request minus its idle rate \
         over a window just before (event polls every 10 s per entry, the tick), median over \
         rounds; idle = that rate.",
        if http2 { "2" } else { "1.1" }
    );
    println!();
    println!("| build | workers | in flight | CPU / request | vs first row | p50 / p99 latency | idle CPU |");
    println!("|---|---|---|---|---|---|---|");
    for rep in 0..repeat {
        let mut reference: Vec<Option<f64>> = vec![None; builds.len()];
        for &n in &fleet {
            for (b, (build, wasm)) in builds.iter().enumerate() {
                let workers: Vec<Value> = (0..n)
                    .map(|i| json!({"id": i + 1, "address": addrs[i % addrs.len()]}))
                    .collect();
                let events = json!({"poll_interval_ms": 10_000, "stale_after_ms": 3_600_000});
                let config = kv_config(json!(workers), events);
                let envoy = start_envoy_with(config, addrs.clone(), wasm.as_deref(), true, http2);
                // Mock 1's one event, applied by both replicas.
                let ok = envoy.wait_for(Duration::from_secs(60), |e| {
                    e.router_stat("events.applied") >= 2
                });
                assert!(ok, "the filter did not apply mock 1's events");
                let mut conns: Vec<Conn> =
                    (0..CLIENTS).map(|_| Conn::new(&envoy.listener)).collect();
                closed_loop(&mut conns, &body, 4 * CLIENTS, envoy.pid());
                let mut held = Vec::new();
                for &h in &levels {
                    hold(&envoy, &mut held, h);
                    let mut cpu = Vec::new();
                    let mut lat = Vec::new();
                    let mut idle_rates = Vec::new();
                    for _ in 0..rounds {
                        let (c0, t0) = (cpu_ns(envoy.pid()), Instant::now());
                        std::thread::sleep(Duration::from_millis(200));
                        let idle = (cpu_ns(envoy.pid()) - c0) as f64 / t0.elapsed().as_secs_f64();
                        let t = Instant::now();
                        let (l, ns) = closed_loop(&mut conns, &body, per_round, envoy.pid());
                        let net = ns as f64 - idle * t.elapsed().as_secs_f64();
                        cpu.push(net / per_round as f64);
                        idle_rates.push(idle);
                        lat.extend(l);
                    }
                    let m = median(&cpu);
                    let base = *reference[b].get_or_insert(m);
                    println!(
                        "| {}{} | {} | {} | {} | {:.2}x | {} / {} | {:.1}% of a core |",
                        build,
                        if repeat > 1 {
                            format!(" #{}", rep + 1)
                        } else {
                            String::new()
                        },
                        thousands(n),
                        thousands(h),
                        us(m),
                        m / base,
                        us(quantile(&lat, 0.5) * 1e3),
                        us(quantile(&lat, 0.99) * 1e3),
                        median(&idle_rates) / 1e7
                    );
                }
                drop(held);
                drop(envoy);
            }
        }
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// 3. Events applied per second
// ---------------------------------------------------------------------------------------------

/// `n` 1-block events: BlockStored of a fresh block, then (every other event) BlockRemoved of
/// the block stored 500 stored events earlier; 64 small token ids per stored block, the first
/// one the block's number, so that every block is a distinct prefix (as in real traffic: an
/// index holding many engine blocks under one prefix hash is the rare, slower case).
fn event_stream(n: usize) -> (Vec<IndexEvent>, Vec<Value>) {
    let mut tokens: Vec<u32> = (0..BLOCK_SIZE).collect();
    let (mut native, mut wire) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut next = 1u64;
    for i in 0..n {
        if i % 2 == 1 && next > 500 {
            let h = next - 500;
            native.push(IndexEvent::Removed {
                dp_rank: 0,
                tier: StorageTier::Device,
                blocks: vec![ExternalBlockHash(h)],
            });
            wire.push(removed_event(&[h], GPU));
        } else {
            tokens[0] = next as u32;
            let local = local_block_hashes(&tokens, BLOCK_SIZE, DYNAMO_HASH_SEED)[0];
            native.push(IndexEvent::Stored {
                dp_rank: 0,
                tier: StorageTier::Device,
                parent: None,
                blocks: vec![(ExternalBlockHash(next), local)],
            });
            let stored = kv_events::stored_event(&[next], None, &tokens, BLOCK_SIZE, GPU);
            wire.push(stored);
            next += 1;
        }
    }
    (native, wire)
}

fn events_per_second(quick: bool) {
    println!("### 3. Events applied per second per index replica");
    println!();
    println!(
        "1-block events, half BlockStored (64 token ids), half BlockRemoved. Native: \
         `KvIndex::apply` (one worker, bound 200k entries), release build. Envoy: one burst \
         published to an echo mock's event page (pages as the filter asks, `events.page_events` \
         10,000 by default, 1,000 for a filter that does not ask; the filter re-polls at once \
         after a full page; `poll_interval_ms` 10, `tick_ms` 10), time from \
         the publish until `events.applied` shows every replica applied the burst \
         (`--concurrency 1`: 2 replicas, the main thread's VM and the worker thread's)."
    );
    println!();
    println!("| where | events | wall time | events / s per replica (wall) | CPU time | events per CPU-second |");
    println!("|---|---|---|---|---|---|");
    let n = if quick { 1_000_000 } else { 4_000_000 };
    let (native, _) = event_stream(n);
    let mut rates = Vec::new();
    let mut last = Duration::ZERO;
    for _ in 0..5 {
        let mut index = KvIndex::new(1, 200_000);
        let t = Instant::now();
        for e in &native {
            let _ = black_box(index.apply(0, e));
        }
        last = t.elapsed();
        rates.push(n as f64 / last.as_secs_f64());
        black_box(index.entries());
    }
    println!(
        "| native, 1 thread | {} | {:.0} ms | {:.2} M (median of 5) | = wall | = wall |",
        thousands(n),
        last.as_secs_f64() * 1e3,
        median(&rates) / 1e6
    );
    drop(native);

    let n = if quick { 50_000 } else { 200_000 };
    let (_, wire) = event_stream(n);
    let worker = Worker::spawn(
        1,
        &[
            "--mode",
            "echo",
            "--block-size",
            "64",
            "--event-capacity",
            &(2 * n).to_string(),
        ],
    )
    .expect("worker");
    let mut config = kv_config(
        json!([{"id": 1, "address": worker.addr}]),
        json!({"poll_interval_ms": 10, "max_response_bytes": 64 << 20}),
    );
    config["tick_ms"] = json!(10);
    let envoy = start_envoy(config, vec![worker.addr.clone()], None, true);
    // Settled once the first poll read the worker's dump (the start-up re-sync).
    assert!(
        envoy.wait_for(Duration::from_secs(30), |e| e.router_stat("events.resyncs")
            >= 1),
        "the filter never read the worker's dump"
    );
    let before = envoy.router_stat("events.applied");
    let received_before = envoy.router_stat("events.received");
    let body = Value::Array(wire);
    let t = Instant::now();
    worker.admin("/admin/events", &body).expect("publish");
    // The mock makes the whole burst visible at once, when it has parsed the body.
    let published = Instant::now();
    let cpu0 = cpu_ns(envoy.pid());
    let publish_ms = (published - t).as_secs_f64() * 1e3;
    let (mut received_at, mut applied_at) = (None, None);
    let deadline = published + Duration::from_secs(300);
    let mut replicas = 0;
    while applied_at.is_none() && Instant::now() < deadline {
        let stats = envoy.stats();
        let stat = |k: &str| {
            stats
                .get(&format!("wasmcustom.kv_router.{k}"))
                .copied()
                .unwrap_or(0)
        };
        if received_at.is_none() && stat("events.received") - received_before >= n as u64 {
            received_at = Some(published.elapsed());
        }
        replicas = (stat("events.applied") - before) / n as u64;
        if received_at.is_some() && replicas >= 2 {
            applied_at = Some(published.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    match (received_at, applied_at) {
        (Some(r), Some(a)) => {
            // Polls, page parsing, log appends and both replicas' application, all threads.
            let cpu = (cpu_ns(envoy.pid()) - cpu0) as f64;
            println!(
                "| Envoy (V8), 1 worker, 2 replicas | {} | {:.0} ms after the publish ({:.0} ms to take every page into the log) | {:.0} k | {:.0} ms | {:.0} k |",
                thousands(n),
                a.as_secs_f64() * 1e3,
                r.as_secs_f64() * 1e3,
                n as f64 / a.as_secs_f64() / 1e3,
                cpu / 1e6,
                n as f64 / (cpu / 1e9) / 1e3
            )
        }
        _ => println!(
            "| Envoy (V8), 1 worker | {} | not applied by 2 replicas in 300 s ({replicas} done) | - | - | - |",
            thousands(n)
        ),
    }
    println!();
    println!("(publishing the burst to the mock took {publish_ms:.0} ms, not counted)");
    println!();
}

/// Held requests need `per_request` descriptors each in Envoy (client + upstream with HTTP/1.1,
/// client only with HTTP/2 upstream); leave room for
/// the event polls of 1,000 entries (up to ~1,200 connections seen) and Envoy's own.
fn max_held(per_request: usize) -> usize {
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3)?.parse::<usize>().ok())
        })
        .unwrap_or(1024);
    (limit.saturating_sub(3000) / per_request).min(10_000)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = |name: &str| {
        let picked: Vec<&String> = args
            .iter()
            .skip_while(|a| *a != "--only")
            .skip(1)
            .take(1)
            .collect();
        picked.is_empty() || picked.iter().any(|p| p.split(',').any(|x| x == name))
    };
    println!(
        "## envoy_cpu ({}): Envoy CPU per request and event rates",
        if quick { "--quick" } else { "full" }
    );
    println!();
    if only("size") {
        cpu_by_prompt_size(quick);
    }
    if args.iter().any(|a| a == "hostcalls") {
        host_calls();
    }
    if only("fleet") {
        // HTTP/2 upstream by default: with HTTP/1.1 each held request takes 2 descriptors.
        let http2 = !args.iter().any(|a| a == "--fleet-http1");
        let held = max_held(if http2 { 1 } else { 2 });
        if held < 10_000 {
            println!(
                "(open-file limit: at most {held} requests held in flight, each needing {} descriptors in Envoy)",
                if http2 { 1 } else { 2 }
            );
            println!();
        }
        if std::env::var("ENVOY_CPU_FLEET_PAIRED").is_ok() {
            fleet_paired(held, http2);
        } else {
            fleet_scale(quick, held, http2);
        }
    }
    if only("events") {
        events_per_second(quick);
    }
}
