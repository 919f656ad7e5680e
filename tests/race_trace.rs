//! `loadgen race --trace-workload`: a trace of the user's own goes through the race's arms on
//! the fleet its spec names (real Envoy, mock engines, events through `kv-event-bridge`), and
//! the race judges the filter on it as on its own workloads.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

use envoy_kv_router_tools::loadgen::generate::{self, ConversationSpec};
use envoy_kv_router_tools::race::{race, RaceOptions, TraceWorkload};

#[test]
fn a_trace_of_ones_own_races_on_the_fleet_it_names() {
    let dir = std::env::temp_dir().join(format!("race-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Multi-turn chat: each turn resends its conversation's history, so a router that keeps a
    // conversation on one worker hits far more than one that deals turns round.
    let spec = ConversationSpec::parse(&[
        "seed=5,conversations=12,conversation_rate=4,turns_min=3,turns_max=4,system_prompts=2,\
         system_min=1024,system_max=2048,user_min=256,user_max=1024,output_min=8,output_max=32,\
         think_ms_min=100,think_ms_max=300"
            .to_string(),
    ])
    .unwrap();
    let trace = generate::conversation(&spec);
    let path = dir.join("mine.jsonl");
    generate::write_trace(&path, &trace).unwrap();
    let workload =
        TraceWorkload::parse(&format!("mine={};workers=3;speedups=1,3", path.display())).unwrap();
    let opts = RaceOptions {
        runs: 1,
        workloads: vec!["mine".into()],
        arms: vec!["kv".into(), "round-robin".into()],
        out: dir.join("out"),
        quiet: true,
        trace_workloads: vec![workload],
        ..RaceOptions::default()
    };
    let report = race(&opts).expect("the race runs");

    let w = &report.workloads[0];
    assert_eq!((w.name.as_str(), &w.skipped), ("mine", &None));
    assert!(
        w.mixed,
        "speedups make a mixed fleet, judged by share over speed"
    );
    assert_eq!(w.fleet["workers"], 3);
    assert_eq!(report.runs.len(), 2);
    for run in &report.runs {
        assert_eq!(
            (run.completed, run.errors, run.failure.as_deref()),
            (trace.len(), 0, None),
            "{}: {:?}",
            run.arm,
            run.error_kinds
        );
        // Every request reached one of the three workers the spec asked for.
        assert!(
            run.per_worker
                .iter()
                .all(|(id, _)| ["1", "2", "3"].contains(&id.as_str())),
            "{}: {:?}",
            run.arm,
            run.per_worker
        );
        // Each of the three judged by its share of the fleet's speed, an idle one included.
        assert_eq!(run.share_over_speed.len(), 3, "{:?}", run.share_over_speed);
    }
    let hit = |arm: &str| {
        w.arms
            .iter()
            .find(|a| a.arm == arm)
            .and_then(|a| a.hit_rate)
            .unwrap()
    };
    assert!(
        hit("kv") > hit("round-robin") + 0.1,
        "kv {} round-robin {}",
        hit("kv"),
        hit("round-robin")
    );
    let summary = std::fs::read_to_string(dir.join("out/summary.md")).unwrap();
    assert!(summary.contains("## mine"), "{summary}");
    assert!(
        summary.contains("worker i at `--speedup` [1.0, 3.0]"),
        "{summary}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
