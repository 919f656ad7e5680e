//! The virtual-time simulator (`loadgen sim`): deterministic, and it routes through the filter's
//! real request path (a KV-aware arm beats round-robin on a workload with shared prefixes, and
//! its index is fed by the engines' events).

use envoy_kv_router_tools::compare::Fleet;
use envoy_kv_router_tools::loadgen::generate::{self, AgentSpec};
use envoy_kv_router_tools::loadgen::{load_mooncake, synthetic, Spread, SyntheticSpec, Workload};
use envoy_kv_router_tools::sim::{arm_router, simulate, Router, SimOptions, SimRun};

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
    let three = run("kv*3", &workload, &fleet);
    assert_eq!(three.errors, 0);
    // Every request routed by one of the three filters, each by its own index copy.
    assert_eq!(three.counters.get("routed.kv").copied(), Some(n));
    assert!(three.counters.get("events.applied").copied().unwrap_or(0) > 3 * 100);
    // At the defaults (`relayed`) each Envoy tells the bridges between polls when its bookings
    // moved, and hears the others'; with `off` it declares only with its polls and adds none.
    let declared = three.counters.get("events.declared").copied().unwrap_or(0);
    assert!(declared > n / 2, "{declared} declarations for {n} requests");
    let blind = run("kv+set:load.unseen_traffic=off*3", &workload, &fleet);
    assert_eq!(blind.counters.get("routed.kv").copied(), Some(n));
    assert_eq!(blind.counters.get("events.declared"), None);
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
fn replicas_hit_by_a_burst_at_once_spread_it_as_one_envoy_does() {
    // Bursts of 16 requests at one instant, each burst with a prefix of its own: three Envoys
    // decide on the same view before any hears the others (one declaration window). Each
    // counts what it just placed from scratch as many times over as the others route for each
    // of its requests (`load::recent`); before, they piled each burst on the same few workers
    // (TTFT 1.149x one Envoy's at this seed; now 1.055x).
    let spec = "burst=16,prefix=8192,isl=9216,osl=64,requests=320,rate=12,seed=7";
    let workload = synthetic(&SyntheticSpec::parse(spec).unwrap());
    let fleet = Fleet::new(8, 64, &["--kv-blocks", "8192", "--speedup", "2"]);
    let one = run("kv", &workload, &fleet);
    let three = run("kv*3", &workload, &fleet);
    assert_eq!((one.errors, three.errors), (0, 0));
    let ratio = three.ttft_mean() / one.ttft_mean();
    assert!(ratio < 1.07, "three Envoys {ratio:.3}x one's TTFT");
    assert!(
        (1.0..1.1).contains(&three.balance()),
        "{:?}",
        three.per_worker
    );
}

#[test]
fn replicas_that_relay_between_ticks_route_nearly_as_one_envoy() {
    // Three Envoys hear of each other's bookings one declaration and one applied page later.
    // With both on the 50 ms tick they decide on stale views for up to 100 ms; relay ticks
    // (`load.relay_interval_ms`, 10 ms) on the poller of an Envoy that hears of other routers
    // cut that to a few tens of ms (1.045x one Envoy's TTFT at this seed, against 1.190x). One
    // Envoy alone never relay-ticks: it routes the same.
    let workload = agent_workload("seed=11,sessions=150");
    let fleet = Fleet::new(8, 64, &["--kv-blocks", "8192", "--speedup", "2"]);
    let one = run("kv", &workload, &fleet);
    let one_off = run("kv+set:load.relay_interval_ms=0", &workload, &fleet);
    assert_eq!(
        one.ttft_ms, one_off.ttft_ms,
        "one Envoy: the same to the bit"
    );
    assert_eq!(one.counters.get("events.relay_ticks"), None);
    let relaying = run("kv*3", &workload, &fleet);
    let ticking = run("kv+set:load.relay_interval_ms=0*3", &workload, &fleet);
    assert_eq!((relaying.errors, ticking.errors), (0, 0));
    assert!(
        relaying
            .counters
            .get("events.relay_ticks")
            .copied()
            .unwrap_or(0)
            > 1000
    );
    assert_eq!(ticking.counters.get("events.relay_ticks"), None);
    let ratio = |r: &SimRun| r.ttft_mean() / one.ttft_mean();
    let (now, before) = (ratio(&relaying), ratio(&ticking));
    assert!(
        now < 1.08 && before - now > 0.04,
        "three Envoys {now:.3}x one's TTFT relaying, {before:.3}x on ticks alone"
    );
    assert!((relaying.hit_rate() - one.hit_rate()).abs() < 0.01);
}

#[test]
fn replicas_behind_client_affinity_route_a_burst_as_one_envoy() {
    // Eight requests sharing a new 4,096-token prefix arrive at once. One Envoy spreads them
    // over the eight workers. Sprayed round-robin over three Envoys, each decides on the same
    // view in the same instant and the three pile theirs on the same few workers (no relay is
    // fast enough within one instant). A load balancer with client affinity sends a client's
    // burst to one Envoy, which spreads it as one Envoy does.
    let spec =
        SyntheticSpec::parse("burst=8,prefix=4096,isl=6144,osl=128,rate=16,seed=11").unwrap();
    let workload = synthetic(&spec);
    assert!(workload.requests.iter().all(|r| r.client.is_some()));
    let fleet = Fleet::new(8, 64, &["--kv-blocks", "8192", "--speedup", "2"]);
    let one = run("kv", &workload, &fleet);
    let sprayed = run("kv*3", &workload, &fleet);
    let by_client = run("kv*3~client", &workload, &fleet);
    for r in [&one, &sprayed, &by_client] {
        assert_eq!(r.errors, 0);
        assert_eq!(r.ttft_ms.len(), workload.requests.len());
    }
    let ratio = |r: &SimRun| r.ttft_mean() / one.ttft_mean();
    let (rr, affine) = (ratio(&sprayed), ratio(&by_client));
    assert!(
        affine < 1.05 && rr > 1.3,
        "three Envoys {affine:.3}x one's TTFT by client, {rr:.3}x round-robin"
    );
    assert!(
        by_client.balance() < sprayed.balance() + 1e-9 && by_client.balance() < 1.1,
        "balance {:.2} by client, {:.2} round-robin",
        by_client.balance(),
        sprayed.balance()
    );
}

#[test]
fn arms_are_parsed_as_the_race_names_them() {
    assert!(arm_router("kv*3").is_ok());
    assert!(arm_router("kv+set:ttft.share_weight=3").is_ok());
    assert!(arm_router("round-robin").is_ok());
    let err = arm_router("vllm-router:kv_aware").unwrap_err();
    assert!(err.contains("peers run in the race"), "{err}");
    assert!(arm_router("kv*0").is_err());
    assert!(matches!(
        arm_router("kv*3~client"),
        Ok(Router::Filter {
            envoys: 3,
            spread: Spread::ByClient,
            ..
        })
    ));
    assert!(arm_router("kv~client").is_err());
    assert!(matches!(
        arm_router("oracle+share:2"),
        Ok(Router::Oracle { share_weight }) if share_weight == 2.0
    ));
    assert!(arm_router("oracle+share:-1").is_err());
    let calibrated = arm_router("kv+calibrated+set:ttft.share_weight=3*2").unwrap();
    assert!(matches!(
        calibrated,
        Router::Filter { calibrated: true, envoys: 2, ref config, .. } if config["ttft"]["share_weight"] == 3
    ));
    assert!(matches!(
        arm_router("kv").unwrap(),
        Router::Filter {
            calibrated: false,
            ..
        }
    ));
    assert!(arm_router("kv+calibratedx").is_err());
}

/// Agent requests 5 s apart (each finds the engines as the previous one left them, and nothing
/// arrives while it waits) on a fleet of speeds 1, 1, 4, 4.
fn spaced_on_a_mixed_fleet() -> (Workload, Fleet) {
    let mut workload = agent_workload("seed=9,sessions=6");
    for (i, r) in workload.requests.iter_mut().enumerate() {
        r.at_ms = i as f64 * 5_000.0;
    }
    let mut fleet = Fleet::new(4, 64, &["--kv-blocks", "8192"]);
    fleet.speedups = vec![1.0, 1.0, 4.0, 4.0];
    (workload, fleet)
}

#[test]
fn the_oracle_forecasts_exactly_what_an_engine_left_alone_does() {
    // Requests 5 s apart on a mixed fleet: each finds the engines as the previous one left them
    // and nothing arrives while it waits, so the forecast (a copy of each engine run forward)
    // must be exactly what the engine it picked then does.
    let (workload, fleet) = spaced_on_a_mixed_fleet();
    let oracle = run("oracle", &workload, &fleet);
    let n = workload.requests.len();
    assert_eq!(oracle.errors, 0);
    assert_eq!(oracle.ttft_ms.len(), n);
    assert_eq!(oracle.oracle_best_ms.len(), n);
    for (seen, forecast) in oracle.ttft_ms.iter().zip(&oracle.oracle_best_ms) {
        assert!(
            (seen - forecast).abs() < 1e-3,
            "{seen} vs forecast {forecast}"
        );
    }
    assert!(oracle.regret_ms.iter().all(|r| *r == 0.0));
    // Alone on a fleet, a request is served soonest by a fast worker, so the slow ones get none.
    assert_eq!(
        oracle.per_worker[0] + oracle.per_worker[1],
        0,
        "{:?}",
        oracle.per_worker
    );
    // The filter, probed the same way, is charged what its choices cost against the forecast:
    // it cannot know a worker's speed before its first responses, so it pays for some.
    let opts = SimOptions {
        probe_regret: true,
        ..SimOptions::default()
    };
    let kv = simulate(&workload, &fleet, &arm_router("kv").unwrap(), &opts).unwrap();
    assert_eq!(kv.regret_ms.len(), n);
    assert!(kv.regret_ms.iter().all(|r| *r >= 0.0));
    assert!(kv.ttft_mean() >= oracle.ttft_mean() - 1e-9);
    let late = kv.regret_ms.iter().filter(|r| **r > 1.0).count();
    assert!(
        late > 0,
        "the filter's first choices cannot all be the fast workers"
    );
}

#[test]
fn told_or_calibrated_the_filter_leaves_the_slow_workers_idle_and_logs_each_decision() {
    // The same spaced-out requests as above: told each worker's speed, the filter has nothing
    // to learn, so none of its first choices is a slow worker; `decisions` shows its costs.
    let (workload, fleet) = spaced_on_a_mixed_fleet();
    let n = workload.requests.len();
    let arm = arm_router("kv+set:response_headers=true").unwrap();
    let told = SimOptions {
        probe_regret: true,
        true_speeds: true,
        ..SimOptions::default()
    };
    let kv = simulate(&workload, &fleet, &arm, &told).unwrap();
    assert_eq!(kv.errors, 0);
    assert_eq!(
        kv.per_worker[0] + kv.per_worker[1],
        0,
        "{:?}",
        kv.per_worker
    );
    let learning = SimOptions {
        probe_regret: true,
        ..SimOptions::default()
    };
    let learned = simulate(&workload, &fleet, &arm, &learning).unwrap();
    let total = |r: &[f64]| r.iter().sum::<f64>();
    assert!(
        total(&kv.regret_ms) < total(&learned.regret_ms),
        "told {} ms against learning {} ms",
        total(&kv.regret_ms),
        total(&learned.regret_ms)
    );
    // Each worker's own timing polynomials configured (`kv+calibrated`, as `calibrate` measures
    // them) price it from the first request as being told does.
    let calibrated = simulate(
        &workload,
        &fleet,
        &arm_router("kv+calibrated").unwrap(),
        &learning,
    )
    .unwrap();
    assert_eq!(
        calibrated.per_worker[0] + calibrated.per_worker[1],
        0,
        "{:?}",
        calibrated.per_worker
    );
    // One line per request: the forecast for every worker, and the filter's lowest cost is the
    // worker it chose.
    assert_eq!(kv.decisions.len(), n);
    for line in &kv.decisions {
        let d: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(d["forecast"].as_array().unwrap().len(), 4, "{line}");
        let costs: Vec<f64> = d["filter"]["costs"]
            .as_str()
            .unwrap()
            .split(',')
            .map(|c| c.split('=').nth(1).unwrap().parse().unwrap())
            .collect();
        let chosen = d["chosen"].as_u64().unwrap() as usize;
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        assert_eq!(costs[chosen], min, "{line}");
    }
}
