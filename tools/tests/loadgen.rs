//! `run_workload` against in-process engine-mode mock workers (no Envoy): the measurements and
//! the cache hit rate make sense.

use std::time::Duration;

use envoy_kv_router_tools::loadgen::{
    comparison_table, run_workload, run_workload_on, scrape_hit_rate, svg_chart, synthetic,
    RunOptions, Spread, SyntheticSpec,
};
use envoy_kv_router_tools::mock::{self, Mode, Options};
use serde_json::json;

fn engine_worker(id: &str) -> (envoy_kv_router_tools::server::Server, String) {
    let (server, _) = mock::spawn(Options {
        id: id.into(),
        mode: Mode::Engine,
        block_size: 16,
        kv_blocks: 4096,
        speedup: 10.0,
        ..Options::default()
    })
    .unwrap();
    let addr = server.addr_string();
    (server, addr)
}

/// Mock workers at their default options, with their addresses.
fn default_workers(ids: &[&str]) -> (Vec<envoy_kv_router_tools::server::Server>, Vec<String>) {
    let workers: Vec<_> = ids
        .iter()
        .map(|id| {
            mock::spawn(Options {
                id: (*id).into(),
                ..Options::default()
            })
            .unwrap()
            .0
        })
        .collect();
    let addrs = workers.iter().map(|s| s.addr_string()).collect();
    (workers, addrs)
}

#[test]
fn shared_prefix_workload_hits_the_cache() {
    let (_s, addr) = engine_worker("5");
    let spec = SyntheticSpec::parse("groups=2,prefix=256,isl=320,osl=4,requests=24,concurrency=4")
        .unwrap();
    let opts = RunOptions {
        worker_addrs: vec![addr.clone()],
        progress_every: None,
        timeout: Duration::from_secs(20),
        ..RunOptions::default()
    };
    let stats = run_workload(&addr, &synthetic(&spec), &opts);
    assert_eq!(stats.errors(), 0, "{:?}", stats.error_summary());
    assert_eq!(stats.completed(), 24);
    assert!(stats
        .results
        .iter()
        .all(|r| r.output_tokens == 4 && r.itl_ms.len() == 3));
    assert!(stats.ttft().p50 > 0.0 && stats.e2e().p50 >= stats.ttft().p50);
    assert_eq!(stats.per_worker(), vec![("5".to_string(), 24)]);
    // 2 prefixes of 256 tokens among 24 requests: most prompt tokens are hits.
    let hit = stats.hit_rate().unwrap();
    assert!(hit > 0.5, "hit rate {hit}");
    let counters = scrape_hit_rate(std::slice::from_ref(&addr)).unwrap();
    assert_eq!(counters.query_tokens, 24.0 * 320.0);
    let reported = stats.reported_cache_fraction().unwrap();
    assert!((reported - hit).abs() < 0.05, "{reported} vs {hit}");

    // Timed arrivals and a second "mode" for the comparison outputs.
    let spec =
        SyntheticSpec::parse("groups=4,prefix=64,isl=128,osl=2,requests=10,rate=50").unwrap();
    let timed = run_workload(&addr, &synthetic(&spec), &opts);
    assert_eq!(timed.completed(), 10);
    let rows = [("kv", stats), ("timed", timed)];
    assert!(comparison_table(&rows).lines().count() >= 3);
    assert_eq!(svg_chart(&rows).matches("stroke-width=\"2\"").count(), 2);
}

#[test]
fn errors_are_counted_not_fatal() {
    let opts = RunOptions {
        progress_every: None,
        timeout: Duration::from_secs(2),
        ..RunOptions::default()
    };
    // Nothing listens there.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = listener.local_addr().unwrap().to_string();
    drop(listener);
    let spec = SyntheticSpec::parse("requests=3,concurrency=2,isl=8,prefix=4").unwrap();
    let stats = run_workload(&dead, &synthetic(&spec), &opts);
    assert_eq!(stats.errors(), 3);
    assert_eq!(stats.completed(), 0);
    // An echo worker answering 503 through the request body is not possible here (the loadgen
    // body has no `mock` field), so an echo worker in engine-less mode just works:
    let (s, _) = mock::spawn(Options::default()).unwrap();
    let stats = run_workload(&s.addr_string(), &synthetic(&spec), &opts);
    assert_eq!(stats.completed(), 3, "{:?}", stats.error_summary());
}

/// A closed loop over two echo workers addressed directly: requests alternate between the
/// targets, the loop holds its concurrency, and the report carries the client's CPU and the
/// workers' server-side TTFT, which the client-side TTFT can only exceed.
#[test]
fn closed_loop_over_a_fleet_reports_concurrency_and_server_ttft() {
    let (_workers, addrs) = default_workers(&["1", "2"]);
    let spec = SyntheticSpec::parse("groups=2,prefix=8,isl=16,osl=3,requests=40,rate=1").unwrap();
    let opts = RunOptions {
        worker_addrs: addrs.clone(),
        progress_every: None,
        timeout: Duration::from_secs(20),
        concurrency: Some(8),
        extra_body: Some(json!({"mock": {"chunks": 3, "chunk_interval_ms": 20}})),
        ..RunOptions::default()
    };
    let stats = run_workload_on(&addrs, &synthetic(&spec), &opts);
    assert_eq!(stats.completed(), 40, "{:?}", stats.error_summary());
    assert_eq!(
        stats.per_worker(),
        vec![("1".to_string(), 20), ("2".to_string(), 20)]
    );
    assert!(stats.results.iter().all(|r| r.itl_ms.len() == 2));
    assert_eq!(stats.client.peak_in_flight, 8);
    assert!(stats.client.peak_open_streams <= 8);
    let mean = stats.mean_in_flight();
    assert!(mean > 1.0 && mean <= 8.0, "{mean}");
    assert!(stats.client.cpu_s > 0.0);
    assert!(stats.client.runtime_lag_ms.count > 0);
    let workers_seen = stats.workers.clone().expect("worker counters");
    assert_eq!(workers_seen.first_tokens, 40.0);
    let server = stats.server_ttft_mean_ms().expect("server-side TTFT");
    assert!(
        server >= 0.0 && server < stats.ttft().mean,
        "{server} vs {}",
        stats.ttft().mean
    );
    assert!(stats.ttft_overhead_ms().unwrap() > 0.0);
}

/// Spread by client over three targets (as `kv*3~client` spreads over three Envoys): every
/// request of a burst reaches the same target over real HTTP, the target its client hashes to,
/// and the bursts are not all on one target.
#[test]
fn by_client_every_request_of_a_burst_reaches_one_target() {
    let (_workers, addrs) = default_workers(&["1", "2", "3"]);
    let spec =
        SyntheticSpec::parse("burst=4,prefix=8,isl=16,osl=2,requests=48,rate=200,seed=3").unwrap();
    let workload = synthetic(&spec);
    let opts = RunOptions {
        progress_every: None,
        timeout: Duration::from_secs(20),
        spread: Spread::ByClient,
        ..RunOptions::default()
    };
    let stats = run_workload_on(&addrs, &workload, &opts);
    assert_eq!(stats.completed(), 48, "{:?}", stats.error_summary());
    let mut targets_used = std::collections::BTreeSet::new();
    for r in &stats.results {
        let client = workload.requests[r.index]
            .client
            .expect("a burst names its client");
        assert_eq!(client, (r.index / 4) as u64);
        let expected = Spread::ByClient.target(r.index, Some(client), 3);
        let worker = r.worker_id.as_deref().expect("x-worker-id");
        assert_eq!(worker, ["1", "2", "3"][expected], "request {}", r.index);
        targets_used.insert(expected);
    }
    assert!(targets_used.len() > 1, "{targets_used:?}");
}

/// `loadgen --report-from` re-reads a saved `--requests-jsonl` of `--modes` and prints the
/// affinity replay per arm, without running anything.
#[test]
fn report_from_replays_a_saved_comparison() {
    let dir = std::env::temp_dir().join(format!("loadgen-report-from-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Two requests sharing their first 512-token block (8 blocks of 64), then one more like them.
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 10, \"input_length\": 1024, \"output_length\": 4, \"hash_ids\": [1, 3]}\n",
    )
    .unwrap();
    let line = |arm: &str, index: usize, at: f64, worker: &str| {
        json!({"arm": arm, "index": index, "ok": true, "sent_at_ms": at, "e2e_ms": 1.0,
               "worker_id": worker})
        .to_string()
    };
    let saved = dir.join("requests.jsonl");
    let lines = [
        line("sticky", 0, 0.0, "1"),
        line("sticky", 1, 10.0, "1"),
        line("spread", 0, 0.0, "1"),
        line("spread", 1, 10.0, "2"),
    ];
    std::fs::write(&saved, lines.join("\n") + "\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["--report-from", saved.to_str().unwrap()])
        .args(["--trace", trace.to_str().unwrap()])
        .args(["--worker-args", "--kv-blocks 64"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let row = |arm: &str| -> Vec<String> {
        text.lines()
            .find(|l| l.starts_with(arm))
            .unwrap_or_else(|| panic!("no row for {arm} in\n{text}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    // arm, requests, with prefix, to max-overlap, given up: the second request shared 8 blocks.
    assert_eq!(row("sticky")[1..5], ["2", "1", "100.0%", "0.0%"]);
    assert_eq!(row("spread")[1..5], ["2", "1", "0.0%", "100.0%"]);

    // A file that is not a --modes file is refused, naming the line.
    std::fs::write(&saved, "{\"index\": 0}\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_loadgen"))
        .args(["--report-from", saved.to_str().unwrap()])
        .args(["--trace", trace.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("requests.jsonl:1: no \"arm\""));
    let _ = std::fs::remove_dir_all(&dir);
}
