//! The filter's stats as Prometheus sees them, through a real Envoy: the bootstrap's
//! `stats_config.stats_tags` (the harness's, the same as every shipped configuration) turn the
//! worker, DP rank, routing reason, fallback cause and rejection kind into labels
//! (docs/METRICS.md, "Tags"), while `/stats` keeps the full names the other tests read.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use envoy_kv_router_tools::harness::{workspace_root, STATS_TAGS};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One sample of `/stats/prometheus`: metric name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of Envoy's Prometheus text (`name{a="x",b="y"} value`; `# ...` lines skipped).
fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|kv| !kv.is_empty())
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.to_string(), v.trim_end_matches('"').to_string()))
                })
                .collect();
            Some(Sample {
                name: name.to_string(),
                labels,
                value: value.parse().ok()?,
            })
        })
        .collect()
}

/// The value of the series `name` with exactly `labels`, if Envoy exports it.
fn value(all: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    all.iter()
        .find(|s| s.name == name && s.labels == want)
        .map(|s| s.value)
}

fn prometheus(envoy: &Envoy) -> String {
    http::get(&envoy.admin, "/stats/prometheus")
        .expect("/stats/prometheus")
        .text()
}

/// A streamed completion of a fresh ~2k-token prompt (the filter predicts its first token, then
/// learns from it), read to its end.
fn stream_one(envoy: &Envoy, n: u32) {
    let body = json!({"model": "mock", "prompt": tokens(1_000_000 + n * 10_000, 2048),
                      "stream": true, "max_tokens": 4});
    let resp = http::request(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    )
    .expect("streamed request");
    assert_eq!(resp.status, 200, "{}", resp.text());
}

#[test]
fn per_worker_and_per_reason_stats_are_labelled_in_prometheus() {
    let workers = echo_workers(2, 64);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));

    // Routed by the cost model (token ids: reason `kv`), one pinned to worker 2 (`pinned`).
    for n in 0..4u32 {
        route(&envoy, &completion(&tokens(n * 1_000, 64)));
    }
    let pinned = envoy
        .send(
            "/v1/completions",
            &[
                ("content-type", "application/json"),
                ("x-worker-instance-id", "2"),
            ],
            completion(&tokens(50_000, 64)).to_string().as_bytes(),
        )
        .expect("pinned request");
    assert_eq!(pinned.status, 200, "{}", pinned.text());
    // Sent on by the fallback rule (`fallback.invalid_json`) and refused (`rejected.batched_prompt`).
    let bad = envoy
        .send(
            "/v1/completions",
            &[("content-type", "application/json")],
            b"{not json",
        )
        .expect("invalid json");
    assert_eq!(
        bad.header("x-kv-router-reason"),
        Some("fallback:invalid_json")
    );
    let batched = envoy
        .post_json(
            "/v1/completions",
            &json!({"model": "mock", "prompt": [[1, 2], [3, 4]]}),
        )
        .expect("batched prompt");
    assert_eq!(batched.status, 400, "{}", batched.text());
    // Streamed: each first token is a TTFT sample and, against the prediction, an error sample.
    for n in 0..6u32 {
        stream_one(&envoy, n);
    }

    // Counters reach Envoy on the filter's tick, gauges on the lease holder's tick, histograms
    // at Envoy's stats flush (5 s by default): poll until every expected series is there.
    let expected_counters: [(&str, &[(&str, &str)]); 4] = [
        ("kv_router_routed", &[("reason", "kv")]),
        ("kv_router_routed", &[("reason", "pinned")]),
        ("kv_router_fallback", &[("why", "invalid_json")]),
        ("kv_router_rejected", &[("kind", "batched_prompt")]),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let (text, all) = loop {
        let text = prometheus(&envoy);
        let all = samples(&text);
        let counters_in = expected_counters
            .iter()
            .all(|(name, labels)| value(&all, name, labels).is_some_and(|v| v >= 1.0));
        let gauges_in = ["1", "2"].iter().all(|w| {
            value(
                &all,
                "kv_router_worker_active_requests",
                &[("worker", w), ("rank", "0")],
            )
            .is_some()
                && value(&all, "kv_router_worker_timing_samples", &[("worker", w)]).is_some()
        });
        let histograms_in = value(&all, "kv_router_ttft_ms_count", &[]).is_some_and(|c| c >= 6.0)
            && value(&all, "kv_router_prediction_error_pct_count", &[]).is_some_and(|c| c >= 1.0);
        if counters_in && gauges_in && histograms_in {
            break (text, all);
        }
        assert!(
            Instant::now() < deadline,
            "tagged series missing after 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };

    // What an operator's scrape sees, kept for the docs when asked (`METRICS_TAGS_DUMP=path`).
    if let Ok(path) = std::env::var("METRICS_TAGS_DUMP") {
        std::fs::write(&path, &text).expect("write METRICS_TAGS_DUMP");
    }
    // Worker and rank are labels of one metric per quantity, summable across workers.
    let total_routed: f64 = all
        .iter()
        .filter(|s| s.name == "kv_router_routed")
        .map(|s| s.value)
        .sum();
    assert!(total_routed >= 5.0, "routed: {total_routed}\n{text}");
    for quantity in ["active_requests", "prefill_tokens", "decode_blocks"] {
        for w in ["1", "2"] {
            let name = format!("kv_router_worker_{quantity}");
            assert!(
                value(&all, &name, &[("worker", w), ("rank", "0")]).is_some(),
                "{name}{{worker=\"{w}\",rank=\"0\"}} missing:\n{text}"
            );
        }
    }
    for w in ["1", "2"] {
        let factor = value(
            &all,
            "kv_router_worker_timing_factor_milli",
            &[("worker", w)],
        );
        assert!(
            factor.is_some(),
            "timing_factor_milli of worker {w} missing:\n{text}"
        );
    }
    // No per-worker or per-reason name is left untagged.
    for s in &all {
        assert!(
            !s.name.starts_with("kv_router_worker_1_")
                && !s.name.starts_with("kv_router_worker_2_")
                && !s.name.starts_with("kv_router_routed_")
                && !s.name.starts_with("kv_router_fallback_")
                && !s.name.starts_with("kv_router_rejected_"),
            "untagged series {s:?}"
        );
    }
    // The learning histograms are Prometheus histograms: typed, cumulative buckets ending in +Inf.
    for h in ["kv_router_ttft_ms", "kv_router_prediction_error_pct"] {
        assert!(
            text.contains(&format!("# TYPE {h} histogram\n")),
            "{h} not a histogram:\n{text}"
        );
        let buckets: Vec<&Sample> = all
            .iter()
            .filter(|s| s.name == format!("{h}_bucket"))
            .collect();
        assert!(
            buckets.len() > 2 && buckets.iter().all(|b| b.labels.contains_key("le")),
            "{h}_bucket:\n{text}"
        );
        let inf = value(&all, &format!("{h}_bucket"), &[("le", "+Inf")]).expect("+Inf bucket");
        assert_eq!(
            Some(inf),
            value(&all, &format!("{h}_count"), &[]),
            "{h}: +Inf bucket is the count"
        );
        assert!(
            value(&all, &format!("{h}_sum"), &[]).is_some(),
            "{h}_sum missing"
        );
    }

    // `/stats` keeps the full names (with the tag values in them): what `router_stat` reads.
    assert!(envoy.router_stat("routed.kv") >= 4);
    assert!(envoy.router_stat("routed.pinned") >= 1);
    assert!(envoy.router_stat("fallback.invalid_json") >= 1);
    assert!(envoy.router_stat("rejected.batched_prompt") >= 1);
    let stats = envoy.stats();
    for w in [1, 2] {
        for name in [
            format!("worker.{w}.rank.0.active_requests"),
            format!("worker.{w}.timing_samples"),
        ] {
            assert!(
                stats.contains_key(&format!("wasmcustom.kv_router.{name}")),
                "/stats lacks {name}"
            );
        }
    }
}

/// Every Envoy configuration the project ships carries the harness's tag specifiers, so what
/// the test above shows is what users see. `scripts/check_deploy.py` compares the parsed
/// `stats_config` of each (deploy/ rendered as each mesh would) and has Envoy validate them;
/// this pins the harness to the same text.
#[test]
fn shipped_configurations_carry_the_same_stats_tags() {
    let root = workspace_root();
    let files = [
        "envoy/envoy.yaml",
        "envoy/envoy-original-dst.yaml",
        "envoy/envoy-compose.yaml",
        "deploy/kubernetes/20-envoy.yaml",
        "deploy/istio/gateway.yaml",
        "deploy/envoy-gateway/gateway.yaml",
    ];
    for file in files {
        let text = std::fs::read_to_string(root.join(file)).expect(file);
        for (tag, regex) in STATS_TAGS {
            let entry = format!("- tag_name: {tag}\n");
            let quoted = format!("regex: '{regex}'");
            assert!(
                text.contains(&entry) && text.contains(&quoted),
                "{file} lacks the stats tag {tag} ({quoted})"
            );
        }
    }
}
