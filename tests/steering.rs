//! The filter inside a real Envoy: body-based steering, the destination header, bad bodies.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::json;
use std::collections::HashSet;

#[test]
fn body_pin_steers_each_request_and_client_destination_is_ignored() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({"mode": "direct"})));
    for (pinned, other) in [(&workers[0], &workers[1]), (&workers[1], &workers[0])] {
        let mut body = completion(&tokens(1, 40));
        body["nvext"] = json!({"backend_instance_id": pinned.id});
        // The client names the other worker: the filter must overwrite it.
        let resp = envoy
            .send(
                "/v1/completions",
                &[
                    ("content-type", "application/json"),
                    ("x-gateway-destination-endpoint", &other.addr),
                ],
                body.to_string().as_bytes(),
            )
            .expect("request");
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(served_by(&resp), Some(pinned.id));
        let seen = resp.json().expect("json");
        assert_eq!(
            seen["received_headers"]["x-gateway-destination-endpoint"].as_str(),
            Some(pinned.addr.as_str())
        );
    }
}

#[test]
fn chat_completions_are_steered_too() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({"mode": "direct"})));
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                      "nvext": {"backend_instance_id": 2}});
    let resp = envoy
        .post_json("/v1/chat/completions", &body)
        .expect("request");
    assert_eq!(resp.status, 200);
    assert_eq!(served_by(&resp), Some(2));
}

#[test]
fn original_dst_cluster_gets_a_single_address() {
    let workers = echo_workers(2, 16);
    let config = filter_config(
        &workers,
        json!({"mode": "direct", "destination_format": "original_dst"}),
    );
    let envoy = start_envoy_with(&workers, config, |o| o.steering = Steering::OriginalDst);
    let mut body = completion(&tokens(1, 40));
    body["nvext"] = json!({"backend_instance_id": 2});
    let resp = envoy.post_json("/v1/completions", &body).expect("request");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(served_by(&resp), Some(2));
    let seen = resp.json().expect("json");
    assert_eq!(
        seen["received_headers"]["x-gateway-destination-endpoint"].as_str(),
        Some(workers[1].addr.as_str())
    );
}

#[test]
fn round_robin_spreads_requests_over_workers() {
    let workers = echo_workers(3, 16);
    let envoy = start_envoy(
        &workers,
        filter_config(&workers, json!({"mode": "round-robin"})),
    );
    let mut seen = HashSet::new();
    for i in 0..12 {
        let resp = envoy
            .post_json("/v1/completions", &completion(&tokens(i, 8)))
            .expect("request");
        assert_eq!(resp.status, 200);
        assert_eq!(resp.header("x-kv-router-reason"), Some("round-robin"));
        seen.extend(served_by(&resp));
    }
    assert_eq!(seen.len(), 3, "round-robin must reach every worker");
}

#[test]
fn malformed_json_is_routed_by_the_fallback_rule_with_a_reason() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    let resp = envoy
        .send(
            "/v1/completions",
            &[("content-type", "application/json")],
            b"{\"prompt\": [1, 2,",
        )
        .expect("request");
    assert_eq!(
        resp.header("x-kv-router-reason"),
        Some("fallback:invalid_json")
    );
    assert!(served_by(&resp).is_some(), "a worker answered");
    assert!(envoy.router_stat("fallback.invalid_json") >= 1);
}

#[test]
fn empty_body_is_routed_by_the_fallback_rule_with_a_reason() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    let resp = envoy.send("/v1/completions", &[], b"").expect("request");
    assert_eq!(
        resp.header("x-kv-router-reason"),
        Some("fallback:empty_body")
    );
    assert!(served_by(&resp).is_some());
    assert!(envoy.router_stat("fallback.empty_body") >= 1);
}

#[test]
fn body_over_the_filter_limit_is_routed_by_the_fallback_rule() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(
        &workers,
        filter_config(&workers, json!({"max_body_bytes": 4096})),
    );
    let body = completion(&tokens(0, 4000));
    let resp = envoy.post_json("/v1/completions", &body).expect("request");
    assert_eq!(
        resp.header("x-kv-router-reason"),
        Some("fallback:body_too_large")
    );
    assert!(served_by(&resp).is_some());
}

#[test]
fn body_over_envoys_buffer_limit_gets_413_not_a_hang() {
    let workers = echo_workers(1, 16);
    let envoy = start_envoy_with(&workers, filter_config(&workers, json!({})), |o| {
        o.buffer_limit_bytes = 64 * 1024
    });
    let body = completion(&tokens(0, 40_000));
    let resp = envoy.post_json("/v1/completions", &body).expect("request");
    assert_eq!(resp.status, 413);
    // The filter survives: the next request is routed normally.
    let resp = envoy
        .post_json("/v1/completions", &completion(&tokens(0, 32)))
        .expect("request");
    assert_eq!(resp.status, 200);
}

#[test]
fn batched_prompt_is_a_clear_400() {
    let workers = echo_workers(1, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({})));
    let body = json!({"model": "mock", "prompt": [[1, 2, 3], [4, 5, 6]]});
    let resp = envoy.post_json("/v1/completions", &body).expect("request");
    assert_eq!(resp.status, 400);
    let error = resp.json().expect("json error body");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("batched"));
}

#[test]
fn other_paths_pass_through_without_the_client_destination() {
    let workers = echo_workers(2, 16);
    let envoy = start_envoy(&workers, filter_config(&workers, json!({"mode": "direct"})));
    let mut seen = HashSet::new();
    for _ in 0..8 {
        let resp = envoy
            .send(
                "/v1/models",
                &[("x-gateway-destination-endpoint", &workers[0].addr)],
                b"",
            )
            .expect("request");
        assert!(
            resp.header("x-kv-router-reason").is_none(),
            "not routed by the filter"
        );
        seen.extend(served_by(&resp));
    }
    assert_eq!(
        seen.len(),
        2,
        "the client's destination header was dropped: both workers served"
    );
}

#[test]
fn invalid_configuration_is_refused_with_the_field_named() {
    let workers = echo_workers(1, 16);
    let config = filter_config(&workers, json!({"cost": {"overlap_score_credit": 1.5}}));
    let opts = EnvoyOptions::new(config, vec![workers[0].addr.clone()]);
    let err = Envoy::start(&opts)
        .err()
        .expect("envoy must refuse the plugin");
    assert!(err.to_string().contains("overlap_score_credit"), "{err}");
}

#[test]
fn an_unknown_engine_preset_is_refused_with_the_field_named() {
    let workers = echo_workers(1, 16);
    let config = filter_config(&workers, json!({"engine": "tensorrt"}));
    let opts = EnvoyOptions::new(config, vec![workers[0].addr.clone()]);
    let err = Envoy::start(&opts)
        .err()
        .expect("envoy must refuse the plugin");
    assert!(
        err.to_string()
            .contains("engine: unknown engine \"tensorrt\""),
        "{err}"
    );
}

#[test]
fn shipped_envoy_configs_validate() {
    let root = envoy_kv_router_tools::harness::workspace_root();
    for file in ["envoy/envoy.yaml", "envoy/envoy-original-dst.yaml"] {
        let out = std::process::Command::new(envoy_kv_router_tools::harness::envoy_bin())
            .args(["--mode", "validate", "-c", file, "--use-dynamic-base-id"])
            .current_dir(&root)
            .output()
            .expect("run envoy");
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
