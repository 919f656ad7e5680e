//! The virtual-time simulator (`loadgen sim`): deterministic, and it routes through the filter's
//! real request path (a KV-aware arm beats round-robin on a workload with shared prefixes, and
//! its index is fed by the engines' events).

use envoy_kv_router_tools::compare::Fleet;
use envoy_kv_router_tools::loadgen::generate::{self, AgentSpec};
use envoy_kv_router_tools::loadgen::{load_mooncake, Workload};
use envoy_kv_router_tools::sim::{arm_router, simulate, SimOptions, SimRun};

fn agent_workload(params: &str) -> Workload {
    let spec = AgentSpec::parse(&[params.to_string()]).unwrap();
    let trace = generate::agent(&spec);
    let dir =
        std::env::temp_dir().join(format!("sim-test-{}-{}", std::process::id(), params.len()));
    let path = dir.join("agent.jsonl");
    generate::write_trace(&path, &trace).unwrap();
    let w = load_mooncake(&path, 1.0, None).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    w
}

fn run(arm: &str, workload: &Workload, fleet: &Fleet) -> SimRun {
    simulate(
        workload,
        fleet,
        &arm_router(arm).unwrap(),
        &SimOptions::default(),
    )
    .unwrap()
}

#[test]
fn the_filter_beats_round_robin_and_runs_repeat_exactly() {
    let workload = agent_workload("seed=5,sessions=24");
    let fleet = Fleet::new(4, 64, &["--kv-blocks", "8192", "--speedup", "2"]);
    let kv = run("kv", &workload, &fleet);
    let again = run("kv", &workload, &fleet);
    let rr = run("round-robin", &workload, &fleet);
    let n = workload.requests.len();
    for r in [&kv, &rr] {
        assert_eq!(r.errors, 0);
        assert_eq!(r.ttft_ms.len(), n, "every request got a first token");
        assert_eq!(r.per_worker.iter().sum::<usize>(), n);
    }
    // Deterministic: the same figures to the bit.
    assert_eq!(kv.ttft_ms, again.ttft_ms);
    assert_eq!(kv.per_worker, again.per_worker);
    // The index is fed by the engines' events, and the filter routed every request by it.
    assert!(kv.counters.get("events.applied").copied().unwrap_or(0) > 100);
    assert_eq!(kv.counters.get("routed.kv").copied(), Some(n as u64));
    // Sessions kept on the worker holding their context: far more reuse, far less waiting.
    assert!(
        kv.hit_rate() > rr.hit_rate() + 0.15,
        "hit {} vs {}",
        kv.hit_rate(),
        rr.hit_rate()
    );
    assert!(
        kv.ttft_mean() < 0.7 * rr.ttft_mean(),
        "TTFT {} vs {}",
        kv.ttft_mean(),
        rr.ttft_mean()
    );
}

#[test]
fn replicas_split_the_traffic_and_shared_data_makes_them_one_envoy() {
    // A busy fleet (prefill load ~85%), where replicas that see only their own bookings queue
    // requests behind each other's.
    let workload = agent_workload("seed=5,sessions=50,session_rate=4");
    let fleet = Fleet::new(4, 64, &["--kv-blocks", "8192", "--speedup", "2"]);
    let n = workload.requests.len() as u64;
    let one = run("kv", &workload, &fleet);
    let three = run("kv+set:load.unseen_traffic=relayed*3", &workload, &fleet);
    assert_eq!(three.errors, 0);
    // Every request routed by one of the three filters, each by its own index copy.
    assert_eq!(three.counters.get("routed.kv").copied(), Some(n));
    assert!(three.counters.get("events.applied").copied().unwrap_or(0) > 3 * 100);
    // At the defaults each Envoy is blind to what the others booked (the bridge relays it, the
    // filter does not add it); with `relayed` the others' bookings reach its decisions.
    let blind = run("kv*3", &workload, &fleet);
    assert_eq!(blind.counters.get("routed.kv").copied(), Some(n));
    assert_ne!(
        three.ttft_ms, blind.ttft_ms,
        "the relay changed no decision"
    );
    // Three VMs on one shared data route as one Envoy does (its load table is theirs).
    let opts = SimOptions {
        replicas_share_data: true,
        ..SimOptions::default()
    };
    let shared = simulate(&workload, &fleet, &arm_router("kv*3").unwrap(), &opts).unwrap();
    assert_eq!(shared.counters.get("routed.kv").copied(), Some(n));
    let ratio = shared.ttft_mean() / one.ttft_mean();
    assert!((0.9..1.1).contains(&ratio), "shared {ratio}");
    assert!((shared.hit_rate() - one.hit_rate()).abs() < 0.02);
}

#[test]
fn arms_are_parsed_as_the_race_names_them() {
    assert!(arm_router("kv*3").is_ok());
    assert!(arm_router("kv+set:ttft.share_weight=3").is_ok());
    assert!(arm_router("round-robin").is_ok());
    let err = arm_router("vllm-router:kv_aware").unwrap_err();
    assert!(err.contains("peers run in the race"), "{err}");
    assert!(arm_router("kv*0").is_err());
}
