//! Untrusted and hostile clients through a real Envoy: one knob for every client routing hint
//! (`client_routing_hints`), capped hint lists, error bodies that never echo a large input, and
//! what the response headers tell a client by default.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::Duration;

const BLOCK: u32 = 16;

/// The filter's own defaults for the trust knobs (the shared test config switches them on), plus
/// `extra`.
fn default_trust(workers: &[Worker], extra: Value) -> Value {
    let mut config = filter_config(workers, json!({"block_size": BLOCK}));
    let map = config.as_object_mut().unwrap();
    map.remove("response_headers");
    map.remove("client_routing_hints");
    for (k, v) in extra.as_object().unwrap() {
        map.insert(k.clone(), v.clone());
    }
    config
}

fn post(envoy: &Envoy, headers: &[(&str, &str)], body: &Value) -> http::Response {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    http::request(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &all,
        body.to_string().as_bytes(),
        Duration::from_secs(30),
    )
    .expect("request")
}

fn with_nvext(nvext: Value) -> Value {
    let mut body = completion(&tokens(1, 40));
    body["nvext"] = nvext;
    body
}

fn ids(count: u64) -> Value {
    Value::Array((1000..1000 + count).map(Value::from).collect())
}

/// A short JSON error of the given type (what a client sees instead of its input echoed back).
fn assert_short_error(resp: &http::Response, status: u16, kind: &str) {
    assert_eq!(resp.status, status, "{}", resp.text());
    assert!(
        resp.text().len() < 512,
        "error body of {} bytes",
        resp.text().len()
    );
    let body = resp.json().expect("a JSON error body");
    assert_eq!(body["error"]["type"].as_str(), Some(kind), "{body}");
}

#[test]
fn hints_are_ignored_by_default_counted_and_never_reach_the_worker() {
    let workers = echo_workers(2, BLOCK);
    let envoy = start_envoy(
        &workers,
        default_trust(&workers, json!({"mode": "round-robin"})),
    );
    let hinted = [
        (vec![], json!({"backend_instance_id": 2})),
        (vec![], json!({"backend_instance_id": 1, "dp_rank": 0})),
        (vec![], json!({"allowed_worker_ids": [2]})),
        (vec![], json!({"allowed_worker_ids": ids(200_000)})),
        (vec![], json!({"required_taints": ["h100"]})),
        (vec![], json!({"preferred_taints": {"h100": 5.0}})),
        (vec![("x-worker-instance-id", "2")], json!(null)),
        (vec![("x-dp-rank", "0")], json!(null)),
    ];
    let mut served = HashSet::new();
    for round in 0..2 {
        for (headers, nvext) in &hinted {
            let resp = post(&envoy, headers, &with_nvext(nvext.clone()));
            assert_eq!(resp.status, 200, "{nvext} {headers:?}: {}", resp.text());
            assert_eq!(resp.header("x-kv-router-reason"), Some("round-robin"));
            served.extend(served_by(&resp));
            let seen = resp.json().expect("echo");
            for name in ["x-worker-instance-id", "x-dp-rank"] {
                assert!(
                    seen["received_headers"][name].is_null(),
                    "round {round}: the client's {name} must not reach the worker: {seen}"
                );
            }
        }
    }
    assert_eq!(served.len(), 2, "pins and allow-lists were not obeyed");
    let hinted_requests = 2 * hinted.len() as u64;
    assert!(envoy.wait_for(Duration::from_secs(5), |e| e
        .router_stat("client_hints.ignored")
        == hinted_requests));
    // A request without hints is not counted.
    assert_eq!(post(&envoy, &[], &completion(&tokens(1, 40))).status, 200);
    assert_eq!(envoy.router_stat("client_hints.ignored"), hinted_requests);
}

#[test]
fn the_reject_policy_refuses_any_hint_with_a_403() {
    let workers = echo_workers(2, BLOCK);
    let envoy = start_envoy(
        &workers,
        default_trust(&workers, json!({"client_routing_hints": "reject"})),
    );
    let refused = [
        (vec![], json!({"backend_instance_id": 2})),
        (vec![], json!({"allowed_worker_ids": ids(200_000)})),
        (vec![], json!({"required_taints": ["x"]})),
        (vec![("x-worker-instance-id", "2")], json!(null)),
    ];
    for (headers, nvext) in &refused {
        let resp = post(&envoy, headers, &with_nvext(nvext.clone()));
        assert_short_error(&resp, 403, "client_routing_hints_refused");
    }
    // Not routing hints: the model, the LoRA adapter, the output-length hint.
    let plain = with_nvext(
        json!({"lora_name": "a", "agent_hints": {"osl": 4}, "backend_instance_id": null}),
    );
    assert_eq!(post(&envoy, &[], &plain).status, 200);
    assert_eq!(
        envoy.router_stat("rejected.client_routing_hints"),
        refused.len() as u64
    );
}

/// The amplifier: a 1.4 MB allow-list used to come back whole in a 503 body. Honoured hint lists
/// are capped (400), and every error quotes client input only in part.
#[test]
fn honoured_hint_lists_are_capped_and_errors_stay_short() {
    let workers = echo_workers(2, BLOCK);
    let list = json!([{"id": 1, "address": workers[0].addr, "models": ["m"]},
                      {"id": 2, "address": workers[1].addr, "models": ["m"]}]);
    let envoy = start_envoy(
        &workers,
        default_trust(
            &workers,
            json!({"client_routing_hints": "honor", "workers": list}),
        ),
    );
    let over_cap = [
        (
            "nvext.allowed_worker_ids",
            json!({"allowed_worker_ids": ids(200_000)}),
        ),
        (
            "nvext.allowed_worker_ids",
            json!({"allowed_worker_ids": ids(65)}),
        ),
        (
            "nvext.required_taints",
            json!({"required_taints": vec!["t"; 65]}),
        ),
        (
            "nvext.preferred_taints",
            Value::Object(
                [(
                    "preferred_taints".to_string(),
                    (0..65).map(|i| (format!("t{i}"), json!(1.0))).collect(),
                )]
                .into_iter()
                .collect(),
            ),
        ),
    ];
    for (field, nvext) in &over_cap {
        let mut body = with_nvext(nvext.clone());
        body["model"] = json!("m");
        let resp = post(&envoy, &[], &body);
        assert_short_error(&resp, 400, "invalid_request_error");
        assert!(resp.text().contains(field), "{}", resp.text());
    }
    // At the cap the list is read; none of its ids is configured: a short 503.
    let mut body = with_nvext(json!({"allowed_worker_ids": ids(64)}));
    body["model"] = json!("m");
    let resp = post(&envoy, &[], &body);
    assert_short_error(&resp, 503, "no_compatible_worker");
    assert!(resp.text().contains("64 in all"), "{}", resp.text());
    // A megabyte model name nobody serves.
    let mut body = completion(&tokens(1, 40));
    body["model"] = json!("x".repeat(1 << 20));
    assert_short_error(&post(&envoy, &[], &body), 404, "no_compatible_worker");
    // A long garbage pin header.
    let garbage = "9".repeat(4000);
    let mut body = completion(&tokens(1, 40));
    body["model"] = json!("m");
    let resp = post(&envoy, &[("x-worker-instance-id", &garbage)], &body);
    assert_short_error(&resp, 400, "invalid_request_error");
    assert!(envoy.router_stat("rejected.too_many_items") >= over_cap.len() as u64);
    // Honoured hints still work.
    let mut body = with_nvext(json!({"backend_instance_id": 2}));
    body["model"] = json!("m");
    assert_eq!(served_by(&post(&envoy, &[], &body)), Some(2));
}

/// Costs and worker ids are operator data: off by default. The reason (a short word such as
/// `kv` or `fallback:invalid_json`) is always there, so a client can tell a fallback.
#[test]
fn response_headers_reveal_only_the_reason_by_default() {
    let workers = echo_workers(2, BLOCK);
    let envoy = start_envoy(&workers, default_trust(&workers, json!({})));
    let resp = post(&envoy, &[], &completion(&tokens(1, 40)));
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-kv-router-reason"), Some("kv"));
    for hidden in [
        "x-kv-router-costs",
        "x-kv-router-worker",
        "x-kv-router-overlap-blocks",
        "x-kv-router-max-overlap-blocks",
        "x-kv-router-loads",
    ] {
        assert_eq!(
            resp.header(hidden),
            None,
            "{hidden} must not be sent by default"
        );
    }
    let resp = http::request(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        b"{\"prompt\": [1, 2,",
        Duration::from_secs(30),
    )
    .expect("request");
    assert_eq!(
        resp.header("x-kv-router-reason"),
        Some("fallback:invalid_json")
    );
    assert_eq!(resp.header("x-kv-router-worker"), None);

    // Switched on, the operator gets every candidate's cost.
    let on = start_envoy(
        &workers,
        default_trust(&workers, json!({"response_headers": true})),
    );
    let resp = post(&on, &[], &completion(&tokens(1, 40)));
    assert_eq!(
        costs(&resp).len(),
        2,
        "{:?}",
        resp.header("x-kv-router-costs")
    );
    assert!(resp.header("x-kv-router-worker").is_some());
    // And every candidate's inputs: `worker/rank=prefill_tokens:active:overlap_blocks`.
    let loads = resp.header("x-kv-router-loads").unwrap_or_default();
    let entries: Vec<&str> = loads.split(',').collect();
    assert_eq!(entries.len(), 2, "{loads}");
    for entry in entries {
        let (_, values) = entry.split_once('=').unwrap_or_default();
        let fields: Vec<&str> = values.split(':').collect();
        assert_eq!(fields.len(), 3, "{loads}");
        assert!(fields.iter().all(|f| f.parse::<f64>().is_ok()), "{loads}");
    }
}

/// The client's own `priority` (vLLM's scheduling priority) is a routing hint too. The witness
/// is an engine in arrival order: it answers 400 to any priority other than 0, quoting a value
/// that is not an integer, so the client's `"from-client"` shows that it arrived, and a bare
/// "priority != 0" that the filter's (an integer) did.
fn fcfs_engine() -> Worker {
    Worker::spawn(
        1,
        &[
            "--mode",
            "engine",
            "--block-size",
            "16",
            "--scheduling-policy",
            "fcfs",
        ],
    )
    .expect("start the engine-mode worker")
}

/// Bodies with the client's priority: first, in the middle, last, in odd whitespace, twice,
/// under an escaped key, with a text prompt (the parser's other path); and last, one the filter
/// routes by the fallback rule (a field it cannot read, which the engine ignores).
fn client_priority_bodies() -> Vec<String> {
    let ids = serde_json::to_string(&tokens(1, 40)).unwrap();
    let client = r#""priority": "from-client""#;
    vec![
        format!(r#"{{{client}, "model": "mock", "prompt": {ids}, "max_tokens": 2}}"#),
        format!(r#"{{"model": "mock", {client}, "prompt": {ids}, "max_tokens": 2}}"#),
        format!(r#"{{"model": "mock", "prompt": {ids}, "max_tokens": 2, {client}}}"#),
        format!(
            "{{ \"model\" : \"mock\" ,\n  \"priority\" :\t\"from-client\"  ,\n \"prompt\" : {ids} , \"max_tokens\": 2 }}\n"
        ),
        format!(
            r#"{{{client}, "model": "mock", "prompt": {ids}, "max_tokens": 2, "priority": "again"}}"#
        ),
        format!(
            r#"{{"model": "mock", "pr\u0069ority": "from-client", "prompt": {ids}, "max_tokens": 2}}"#
        ),
        format!(r#"{{"model": "mock", {client}, "prompt": "a few words of text", "max_tokens": 2}}"#),
        format!(
            r#"{{{client}, "model": "mock", "prompt": {ids}, "max_tokens": 2, "nvext": {{"agent_hints": {{"osl": -1}}}}}}"#
        ),
    ]
}

fn post_raw(envoy: &Envoy, body: &str) -> http::Response {
    http::request(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
        Duration::from_secs(30),
    )
    .expect("request")
}

/// What reached the engine: `None` (no priority), `Some("filter")` (an integer other than 0),
/// or the client's value, as its answer says.
fn priority_seen(resp: &http::Response) -> Option<String> {
    let text = resp.text();
    if resp.status == 200 {
        return None;
    }
    assert_eq!(resp.status, 400, "{text}");
    if text.contains("priority != 0") {
        return Some("filter".into());
    }
    let value = ["from-client", "again"]
        .into_iter()
        .find(|v| text.contains(v));
    assert!(
        value.is_some(),
        "an engine answer naming no priority: {text}"
    );
    value.map(String::from)
}

#[test]
fn a_clients_priority_is_replaced_or_dropped_by_default() {
    let workers = [fcfs_engine()];
    let bodies = client_priority_bodies();
    let all = bodies.len() as u64;
    let plain = completion(&tokens(1, 40)).to_string();
    // More whitespace ahead of the object than the filter reads at first.
    let padded = format!("{}{plain}", " ".repeat(100));
    for engine_priority in [true, false] {
        let mut extra = json!({"mode": "kv"});
        if engine_priority {
            extra["engine_priority"] = json!({});
        }
        let envoy = start_envoy(&workers, default_trust(&workers, extra));
        for body in &bodies {
            let resp = post_raw(&envoy, body);
            // The filter's priority with engine_priority, none without: never the client's.
            let want = engine_priority.then(|| "filter".to_string());
            assert_eq!(priority_seen(&resp), want, "{engine_priority}: {body}");
        }
        for body in [&plain, &padded] {
            let want = engine_priority.then(|| "filter".to_string());
            assert_eq!(priority_seen(&post_raw(&envoy, body)), want, "{body}");
        }
        let (counter, other) = if engine_priority {
            ("priority.client_replaced", "priority.client_dropped")
        } else {
            ("priority.client_dropped", "priority.client_replaced")
        };
        assert!(
            envoy.wait_for(Duration::from_secs(5), |e| e.router_stat(counter) == all
                && e.router_stat("fallback.invalid_field") == 1),
            "{counter}: {}",
            envoy.router_stat(counter)
        );
        let written = if engine_priority { all + 2 } else { 0 };
        assert!(envoy.wait_for(Duration::from_secs(5), |e| e
            .router_stat("engine_priority.written")
            == written));
        for none in [
            other,
            "priority.client_honored",
            "priority.client_unremoved",
            "priority.unchecked",
            "engine_priority.unwritten",
        ] {
            assert_eq!(envoy.router_stat(none), 0, "{none}");
        }
    }
}

#[test]
fn an_honoured_client_keeps_its_priority() {
    let workers = [fcfs_engine()];
    let bodies = client_priority_bodies();
    let parsed = bodies.len() as u64 - 1;
    for engine_priority in [true, false] {
        let mut extra = json!({"mode": "kv", "client_routing_hints": "honor"});
        if engine_priority {
            extra["engine_priority"] = json!({});
        }
        let envoy = start_envoy(&workers, default_trust(&workers, extra));
        for body in &bodies {
            let resp = post_raw(&envoy, body);
            // The last of the client's members (a JSON object's last duplicate wins).
            let want = if body.contains("again") {
                "again"
            } else {
                "from-client"
            };
            assert_eq!(
                priority_seen(&resp).as_deref(),
                Some(want),
                "{engine_priority}: {body}"
            );
        }
        assert!(
            envoy.wait_for(Duration::from_secs(5), |e| e
                .router_stat("priority.client_honored")
                == parsed),
            "{}",
            envoy.router_stat("priority.client_honored")
        );
        // Not written over a parsed one; the fallback's goes first and the client's still wins.
        let written = u64::from(engine_priority);
        assert!(envoy.wait_for(Duration::from_secs(5), |e| e
            .router_stat("engine_priority.written")
            == written));
        for none in [
            "priority.client_replaced",
            "priority.client_dropped",
            "priority.client_unremoved",
            "priority.unchecked",
        ] {
            assert_eq!(envoy.router_stat(none), 0, "{none}");
        }
    }
}

#[test]
fn a_clients_priority_is_replaced_in_a_body_held_for_the_tokenizer() {
    // A text prompt waits for the tokenizer callout's ids; its body is edited in the answer.
    let workers = [fcfs_engine()];
    let tokenizer = json!({"cluster": "kv_events", "address": workers[0].addr, "timeout_ms": 5000});
    let envoy = start_envoy(
        &workers,
        default_trust(
            &workers,
            json!({"mode": "kv", "tokenizer": tokenizer, "engine_priority": {}}),
        ),
    );
    let text = "a prompt long enough for several blocks ".repeat(20);
    let chat = json!({"model": "mock", "max_tokens": 2, "priority": "from-client",
                      "messages": [{"role": "user", "content": text}]});
    let resp = envoy
        .post_json("/v1/chat/completions", &chat)
        .expect("request");
    assert_eq!(resp.header("x-kv-router-reason"), Some("kv-render"));
    assert_eq!(priority_seen(&resp).as_deref(), Some("filter"));
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("priority.client_replaced") == 1
            && e.router_stat("engine_priority.written") == 1
    }));
}
