//! `run_workload` against in-process engine-mode mock workers (no Envoy): the measurements and
//! the cache hit rate make sense.

use std::time::Duration;

use envoy_kv_router_tools::loadgen::{
    comparison_table, run_workload, scrape_hit_rate, svg_chart, synthetic, RunOptions,
    SyntheticSpec,
};
use envoy_kv_router_tools::mock::{self, Mode, Options};

fn engine_worker(id: &str) -> (envoy_kv_router_tools::http::Server, String) {
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
    assert_eq!(svg_chart(&rows).matches("<polyline").count(), 2);
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
