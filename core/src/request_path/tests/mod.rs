//! The request path through the fake host: what a client and an operator would see (the chosen
//! host, headers, local replies, counters) and the load table back to zero at every ending.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)] // test code

mod fake;

use super::{Action, REASON_HEADER};
use fake::{FakeHost, Filter};
use serde_json::json;

const W1: &str = "10.0.0.1:8000";
const W2: &str = "10.0.0.2:8000";
const DESTINATION: &str = "x-gateway-destination-endpoint";

/// Two workers, 16-token blocks, and `extra` members on the root object.
fn config(extra: serde_json::Value) -> String {
    let mut c = json!({"mode": "kv", "block_size": 16, "workers": [
        {"id": 1, "address": W1}, {"id": 2, "address": W2}]});
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    c.to_string()
}

/// The host the request was steered to: the first of the destination list (Envoy's
/// override-host format lists the fallbacks after it).
fn chosen(host: &FakeHost) -> Option<&str> {
    host.request_header_value(DESTINATION)
        .and_then(|d| d.split(',').next())
}

fn prompt() -> Vec<u32> {
    (0..64u32).map(|i| i * 7 + 3).collect()
}

fn completion(stream: bool) -> String {
    json!({"model": "m", "prompt": prompt(), "max_tokens": 4, "stream": stream}).to_string()
}

#[test]
fn a_token_id_completion_goes_to_the_worker_holding_its_prefix() {
    for holder in [0u16, 1] {
        let mut host = FakeHost::new().post("/v1/completions", &completion(false));
        let mut filter = Filter::new(&host, &config(json!({"response_headers": true})));
        filter.holds(holder, &prompt());
        let (mut request, action) = filter.send(&mut host);
        assert_eq!(action, Action::Continue);
        let expected = [W1, W2][usize::from(holder)];
        assert_eq!(chosen(&host), Some(expected));
        assert_eq!(host.request_header_value(REASON_HEADER), Some("kv"));
        request.on_response_headers(&mut host, &mut filter.vm, false);
        assert_eq!(host.response_header_value(REASON_HEADER), Some("kv"));
        let id = (holder + 1).to_string();
        assert_eq!(host.response_header_value("x-kv-router-worker"), Some(&*id));
        assert_eq!(
            host.response_header_value("x-kv-router-overlap-blocks"),
            Some("4")
        );
        assert_eq!(host.counter("routed.kv"), 1);
    }
}

#[test]
fn a_client_destination_never_survives() {
    // Not an LLM path: goes on at once, without the client's destination.
    let mut host = FakeHost::new()
        .post("/healthz", "{}")
        .header(DESTINATION, "10.9.9.9:1");
    let mut filter = Filter::new(&host, &config(json!({})));
    let mut request = super::RequestPath::new();
    let action = request.on_request_headers(&mut host, &mut filter.vm, false);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.request_header_value(DESTINATION), None);
    // An LLM request: the filter's value replaces it.
    let mut host = FakeHost::new()
        .post("/v1/completions", &completion(false))
        .header(DESTINATION, "10.9.9.9:1");
    let (_, action) = filter.send(&mut host);
    assert_eq!(action, Action::Continue);
    assert!([Some(W1), Some(W2)].contains(&chosen(&host)));
}

#[test]
fn the_fallback_rule_routes_what_the_filter_cannot_read() {
    for (body, why) in [
        ("{not json", "invalid_json"),
        ("", "empty_body"),
        (r#"{"model": "m", "prompt": [1, "x"]}"#, "invalid_field"),
    ] {
        let mut host = FakeHost::new().post("/v1/completions", body);
        let mut filter = Filter::new(&host, &config(json!({})));
        let (mut request, action) = filter.send(&mut host);
        assert_eq!(action, Action::Continue, "{why}");
        let reason = format!("fallback:{why}");
        assert_eq!(host.request_header_value(REASON_HEADER), Some(&*reason));
        assert!([Some(W1), Some(W2)].contains(&chosen(&host)));
        assert_eq!(host.counter(&format!("fallback.{why}")), 1, "{why}");
        // Nothing was booked for it.
        assert_eq!(filter.active(&host), 0);
        request.on_response_headers(&mut host, &mut filter.vm, true);
        assert_eq!(host.response_header_value(REASON_HEADER), Some(&*reason));
    }
    // Too large to buffer: decided at the first chunk over the limit.
    let mut host = FakeHost::new().post("/v1/completions", &completion(false));
    let mut filter = Filter::new(&host, &config(json!({"max_body_bytes": 100})));
    let mut request = super::RequestPath::new();
    assert_eq!(
        request.on_request_headers(&mut host, &mut filter.vm, false),
        Action::Pause
    );
    let size = host.request_body.len();
    let action = request.on_request_body(&mut host, &mut filter.vm, size, false);
    assert_eq!(action, Action::Continue);
    assert_eq!(
        host.request_header_value(REASON_HEADER),
        Some("fallback:body_too_large")
    );
    assert_eq!(host.counter("fallback.body_too_large"), 1);
    // The host cannot hand the body over.
    let mut host = FakeHost::new().post("/v1/completions", &completion(false));
    host.body_unreadable = true;
    let mut filter = Filter::new(&host, &config(json!({})));
    filter.send(&mut host);
    assert_eq!(host.counter("fallback.body_unreadable"), 1);
}

#[test]
fn a_streamed_booking_is_released_at_the_end_of_the_stream() {
    let mut host = FakeHost::new().post("/v1/completions", &completion(true));
    let mut filter = Filter::new(&host, &config(json!({})));
    let (mut request, _) = filter.send(&mut host);
    let load = filter.load(&host);
    let slot = load.iter().position(|l| l.active_requests == 1).unwrap();
    assert_eq!(filter.active(&host), 1, "booked on the chosen worker only");
    assert!(
        load[slot].prefill_tokens > 0.0,
        "nothing cached: all prefill"
    );
    host.advance(40);
    request.on_response_headers(&mut host, &mut filter.vm, false);
    for _ in 0..3 {
        host.response_chunk = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n".to_vec();
        let size = host.response_chunk.len();
        request.on_response_body(&mut host, &mut filter.vm, size, false);
        host.advance(5);
    }
    // The first token ended the prefill (and was a timing sample); the request still runs.
    assert_eq!(filter.load(&host)[slot].prefill_tokens, 0.0);
    assert_eq!(filter.active(&host), 1);
    assert!(host
        .histograms
        .iter()
        .any(|(n, v)| n == "ttft_ms" && *v == 40));
    request.on_response_body(&mut host, &mut filter.vm, 0, true);
    assert_eq!(filter.active(&host), 0);
    assert!(host.histograms.iter().any(|(n, _)| n == "itl_ms"));
    // `on_log` after the end releases nothing twice.
    request.on_log(&mut host, &mut filter.vm);
    assert_eq!(filter.active(&host), 0);
    assert_eq!(host.counter("load.release_unknown"), 0);
}

#[test]
fn a_reset_or_an_upstream_error_releases_the_booking() {
    // Reset before any response: `on_log` alone.
    let mut host = FakeHost::new().post("/v1/completions", &completion(true));
    let mut filter = Filter::new(&host, &config(json!({})));
    let (mut request, _) = filter.send(&mut host);
    assert_eq!(filter.active(&host), 1);
    request.on_log(&mut host, &mut filter.vm);
    assert_eq!(filter.active(&host), 0);

    // Reset mid-stream, after the first token.
    host.next_request("/v1/completions", &completion(true));
    let (mut request, _) = filter.send(&mut host);
    request.on_response_headers(&mut host, &mut filter.vm, false);
    host.response_chunk = b"data: {}\n\n".to_vec();
    request.on_response_body(&mut host, &mut filter.vm, 10, false);
    assert_eq!(filter.active(&host), 1);
    request.on_log(&mut host, &mut filter.vm);
    assert_eq!(filter.active(&host), 0);

    // An upstream 503 without a body (Envoy's own reply, or the engine's): its headers end it.
    host.next_request("/v1/completions", &completion(false));
    let (mut request, _) = filter.send(&mut host);
    assert_eq!(filter.active(&host), 1);
    request.on_response_headers(&mut host, &mut filter.vm, true);
    assert_eq!(filter.active(&host), 0);
    assert_eq!(host.response_header_value(REASON_HEADER), Some("kv"));

    // A 500 with an error body: released at the body's end, once.
    host.next_request("/v1/completions", &completion(false));
    let (mut request, _) = filter.send(&mut host);
    request.on_response_headers(&mut host, &mut filter.vm, false);
    request.on_response_body(&mut host, &mut filter.vm, 40, true);
    assert_eq!(filter.active(&host), 0);
    request.on_log(&mut host, &mut filter.vm);
    assert_eq!(host.counter("load.release_unknown"), 0);
}

#[test]
fn a_retry_on_another_host_moves_the_booking_there() {
    let mut host = FakeHost::new().post("/v1/completions", &completion(true));
    let mut filter = Filter::new(&host, &config(json!({"response_headers": true})));
    filter.holds(0, &prompt());
    let (mut request, _) = filter.send(&mut host);
    assert_eq!(chosen(&host), Some(W1));
    assert_eq!(filter.load(&host)[0].active_requests, 1);
    // The first host failed; Envoy's retry reached the second.
    host.upstream = Some(W2.to_string());
    request.on_response_headers(&mut host, &mut filter.vm, false);
    assert_eq!(host.counter("load.moved_on_retry"), 1);
    let load = filter.load(&host);
    assert_eq!((load[0].active_requests, load[1].active_requests), (0, 1));
    assert_eq!(host.response_header_value("x-kv-router-worker"), Some("2"));
    request.on_response_body(&mut host, &mut filter.vm, 0, true);
    assert_eq!(filter.active(&host), 0);
}

/// Chat requests rendered by a tokenizer service.
fn tokenizer_config() -> String {
    config(json!({"tokenizer": {"cluster": "tokenizer", "timeout_ms": 200}}))
}

fn chat() -> String {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}).to_string()
}

#[test]
fn a_rendered_chat_request_routes_by_its_ids() {
    let mut host = FakeHost::new().post("/v1/chat/completions", &chat());
    let mut filter = Filter::new(&host, &tokenizer_config());
    let (mut request, action) = filter.send(&mut host);
    assert_eq!(action, Action::Pause, "waits for the tokenizer");
    assert_eq!(host.callouts.len(), 1);
    assert_eq!(host.callouts[0].cluster, "tokenizer");
    assert_eq!(host.callouts[0].body, chat().as_bytes());
    assert_eq!(host.counter("tokenizer.calls"), 1);
    host.advance(3);
    host.call_status = Some("200".into());
    host.call_body = json!({"token_ids": prompt()}).to_string().into_bytes();
    let size = host.call_body.len();
    request.on_call_response(&mut host, &mut filter.vm, 1, 4, size);
    assert_eq!(host.resumed, 1);
    assert_eq!(host.counter("tokenizer.rendered"), 1);
    assert!(host.request_header_value(DESTINATION).is_some());
    assert_eq!(filter.active(&host), 1);
    // The same prompt again: from the render cache, no call.
    host.next_request("/v1/chat/completions", &chat());
    let (_, action) = filter.send(&mut host);
    assert_eq!(action, Action::Continue);
    assert!(host.callouts.is_empty());
    assert_eq!(host.counter("tokenizer.cache_hit"), 1);
    request.on_log(&mut host, &mut filter.vm);
}

#[test]
fn a_tokenizer_failure_or_timeout_still_routes_the_request() {
    // (failure set-up, expected failure name)
    type Failure = fn(&mut FakeHost);
    let cases: [(Failure, &str); 3] = [
        (
            |h| {
                h.call_status = Some("500".into());
                h.call_body = b"oops".to_vec();
            },
            "render_error",
        ),
        // No reply at all once the timeout has passed: Envoy timed the call out.
        (|h| h.advance(250), "render_timeout"),
        (
            |h| {
                h.call_status = Some("200".into());
                h.call_body = b"{\"nope\": 1}".to_vec();
            },
            "render_bad_reply",
        ),
    ];
    for (fail, name) in cases {
        let mut host = FakeHost::new().post("/v1/chat/completions", &chat());
        let mut filter = Filter::new(&host, &tokenizer_config());
        let (mut request, action) = filter.send(&mut host);
        assert_eq!(action, Action::Pause);
        fail(&mut host);
        let headers = usize::from(host.call_status.is_some());
        let size = host.call_body.len();
        request.on_call_response(&mut host, &mut filter.vm, 1, headers, size);
        assert_eq!(host.resumed, 1, "{name}");
        assert_eq!(host.counter(&format!("tokenizer.fallback.{name}")), 1);
        let reason = host.request_header_value(REASON_HEADER).unwrap();
        assert!(reason.ends_with(&format!(":{name}")), "{reason}");
        assert!(host.request_header_value(DESTINATION).is_some());
        request.on_log(&mut host, &mut filter.vm);
        assert_eq!(filter.active(&host), 0);
    }
    // The host refuses the call: routed at once.
    let mut host = FakeHost::new().post("/v1/chat/completions", &chat());
    host.refuse_callouts = true;
    let mut filter = Filter::new(&host, &tokenizer_config());
    let (_, action) = filter.send(&mut host);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.counter("tokenizer.fallback.render_unavailable"), 1);
    // A reply to another call is not this request's.
    let mut host = FakeHost::new().post("/v1/chat/completions", &chat());
    let (mut request, _) = filter.send(&mut host);
    request.on_call_response(&mut host, &mut filter.vm, 99, 0, 0);
    assert_eq!(host.resumed, 0);
}

fn with_client_priority() -> String {
    json!({"model": "m", "priority": 5, "prompt": prompt(), "max_tokens": 4}).to_string()
}

#[test]
fn engine_priority_is_written_first_and_replaces_the_clients() {
    let mut host = FakeHost::new().post("/v1/completions", &with_client_priority());
    let mut filter = Filter::new(&host, &config(json!({"engine_priority": {}})));
    filter.send(&mut host);
    let body: serde_json::Value = serde_json::from_slice(&host.request_body).unwrap();
    let text = String::from_utf8(host.request_body.clone()).unwrap();
    assert!(text.starts_with("{\"priority\":"), "{text}");
    assert_eq!(text.matches("\"priority\"").count(), 1, "{text}");
    assert_ne!(body["priority"], json!(5));
    assert_eq!(body["prompt"], json!(prompt()));
    let length: usize = host
        .request_header_value("content-length")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(length, host.request_body.len());
    assert_eq!(host.counter("priority.client_replaced"), 1);
    assert_eq!(host.counter("engine_priority.written"), 1);
}

#[test]
fn a_client_priority_is_trusted_only_when_hints_are_honored() {
    // Ignored hints (the default), no engine_priority: the client's priority is dropped.
    let mut host = FakeHost::new().post("/v1/completions", &with_client_priority());
    let mut filter = Filter::new(&host, &config(json!({})));
    filter.send(&mut host);
    let body: serde_json::Value = serde_json::from_slice(&host.request_body).unwrap();
    assert_eq!(body.get("priority"), None);
    assert_eq!(host.counter("priority.client_dropped"), 1);
    // Honored: it stays as sent, and the filter writes none over it.
    let mut host = FakeHost::new().post("/v1/completions", &with_client_priority());
    let honor = json!({"client_routing_hints": "honor", "engine_priority": {}});
    let mut filter = Filter::new(&host, &config(honor));
    filter.send(&mut host);
    assert_eq!(host.request_body, with_client_priority().as_bytes());
    assert_eq!(host.counter("priority.client_honored"), 1);
    assert_eq!(host.counter("engine_priority.written"), 0);
    // Refused hints: a pin header is answered 403 before anything is booked.
    let mut host = FakeHost::new()
        .post("/v1/completions", &completion(false))
        .header("x-worker-instance-id", "2");
    let mut filter = Filter::new(&host, &config(json!({"client_routing_hints": "reject"})));
    let (_, action) = filter.send(&mut host);
    assert_eq!(action, Action::Pause);
    let reply = host.local_reply.clone().unwrap();
    assert_eq!(reply.status, 403);
    assert!(reply
        .headers
        .contains(&(REASON_HEADER.into(), "client_routing_hints_refused".into())));
    assert_eq!(host.counter("rejected.client_routing_hints"), 1);
    assert_eq!(filter.active(&host), 0);
    // Honored: the pin header steers, and is not passed on.
    let mut host = FakeHost::new()
        .post("/v1/completions", &completion(false))
        .header("x-worker-instance-id", "2");
    let mut filter = Filter::new(&host, &config(json!({"client_routing_hints": "honor"})));
    filter.holds(0, &prompt());
    filter.send(&mut host);
    assert_eq!(chosen(&host), Some(W2));
    assert_eq!(host.request_header_value("x-worker-instance-id"), None);
}

/// Appends one batch of `events` from `worker` to the shared log, as the poller does.
fn append_events(host: &FakeHost, worker: u16, events: Vec<crate::events::IndexEvent>) {
    use crate::events::{LogRecord, NumberedEvent};
    let events = events
        .into_iter()
        .map(|event| NumberedEvent { event_id: 0, event })
        .collect();
    let record = LogRecord::Events { worker, events };
    assert!(crate::replication::log::append(
        &host.store,
        7,
        2,
        host.now_ms,
        &[record],
        |_| true
    ));
}

/// VM B's overlap header when it routes the test prompt now.
fn overlap_seen_by(b: &mut Filter, host: &mut FakeHost) -> String {
    host.next_request("/v1/completions", &completion(false));
    let (mut request, action) = b.send(host);
    assert_eq!(action, Action::Continue);
    request.on_response_headers(host, &mut b.vm, false);
    host.response_header_value("x-kv-router-overlap-blocks")
        .unwrap_or_default()
        .to_string()
}

/// Two VMs on one store: A routes the test prompt (its decision published as a prediction),
/// then B reads that prediction: the whole prompt (4 blocks) counts on A's worker. Returns the
/// host, B and that worker's index.
fn prediction_read_by_a_second_vm(json: &str) -> (FakeHost, Filter, u16) {
    let mut host = FakeHost::new().post("/v1/completions", &completion(false));
    let mut a = Filter::new(&host, json);
    let mut b = Filter::new(&host, json);
    let (_, action) = a.send(&mut host);
    assert_eq!(action, Action::Continue);
    let worker = u16::from(chosen(&host) == Some(W2));
    host.advance(5);
    assert_eq!(overlap_seen_by(&mut b, &mut host), "4");
    (host, b, worker)
}

/// A prediction is a stand-in for the engine's "stored" event: once the engine reported the
/// blocks stored, the index speaks for them. Here VM B's index (bounded at 4 blocks) drops
/// them for newer ones before the engine's "removed" event comes, so that event takes nothing
/// off B's index; the prediction must not outlive it and credit the worker with the prompt.
#[test]
fn an_engine_report_of_the_stored_blocks_replaces_the_prediction() {
    let json = config(json!({"response_headers": true, "index": {"max_blocks": 4}}));
    let (mut host, mut b, worker) = prediction_read_by_a_second_vm(&json);
    // The engine stores the prompt, then another one, then evicts the prompt.
    let stored = fake::stored_event(&prompt(), 16);
    let other: Vec<u32> = (0..64u32).map(|i| i * 11 + 5).collect();
    append_events(&host, worker, vec![stored.clone()]);
    append_events(&host, worker, vec![fake::stored_event(&other, 16)]);
    append_events(&host, worker, vec![fake::removed_event(&stored)]);
    host.advance(5);
    assert_eq!(
        overlap_seen_by(&mut b, &mut host),
        "0",
        "the engine evicted the prompt: nothing credits it"
    );
}

/// A VM that fell more than the log's ring behind skips batches it can no longer read: the
/// removals in them are unknown to it, so its predictions on workers with events go too.
#[test]
fn a_vm_that_skipped_log_batches_drops_its_predictions_on_workers_with_events() {
    use crate::events::IndexEvent;
    let json = config(json!({"response_headers": true}));
    let (mut host, mut b, worker) = prediction_read_by_a_second_vm(&json);
    // The engine clears its cache; then more batches than the ring holds pass by B.
    append_events(&host, worker, vec![IndexEvent::Cleared { dp_rank: None }]);
    let ring = crate::replication::log::LOG_SLOTS;
    for i in 0..ring + 4 {
        let tokens: Vec<u32> = (0..16u32).map(|t| t + 1000 * i as u32).collect();
        append_events(&host, 1 - worker, vec![fake::stored_event(&tokens, 16)]);
    }
    host.advance(5);
    assert_eq!(
        overlap_seen_by(&mut b, &mut host),
        "0",
        "the clear B never read must not leave it crediting the worker"
    );
    assert!(host.counter("log.lost_sync") + host.counter("log.snapshot_loaded") >= 1);
}

/// One Envoy of three in front of a fleet: the workers report three times the requests it has
/// in flight. Weighed at its own third, the prefix holder's queue looks short and the request
/// goes there (the default); with the reports' unseen requests added (`load.unseen_traffic:
/// per_worker`), the holder's queue outweighs the 4-block prefix and it goes to the idle worker.
#[test]
fn a_replica_weighs_load_at_the_fleets_scale_from_the_workers_reports() {
    use crate::events::ReportedLoad;
    for (mode, expected) in [("off", W1), ("per_worker", W2)] {
        let json = config(json!({"policy": "dynamo", "response_headers": true,
            "load": {"unseen_traffic": mode}}));
        let mut host = FakeHost::new().post("/v1/completions", &completion(false));
        let mut filter = Filter::new(&host, &json);
        filter.holds(0, &prompt());
        // This Envoy's own: two 16-token requests in flight on worker 1.
        for key in [1u64, 2] {
            let now = host.now_ms;
            let booked = crate::load_store::update_slot(&host.store, 2, 0, now, |t| {
                t.admit(key, 0, 16, 1, None, now)
            });
            assert!(booked.is_ok());
        }
        // Worker 1 says it runs six, worker 2 none.
        let report = |n| {
            Some(ReportedLoad {
                num_waiting: 0,
                num_running: n,
                kv_usage: 0.0,
                other_routers: None,
            })
        };
        assert!(crate::replication::log::update_head(
            &host.store,
            7,
            2,
            host.now_ms,
            |head| {
                head.workers[0].reported = report(6);
                head.workers[1].reported = report(0);
                true
            }
        ));
        let (mut request, action) = filter.send(&mut host);
        assert_eq!(action, Action::Continue);
        assert_eq!(chosen(&host), Some(expected), "unseen_traffic {mode}");
        request.on_response_headers(&mut host, &mut filter.vm, false);
        // The inferred scale, 6 reported over 2 own, is recorded once a second whatever the mode.
        let (_, again) = filter.send(&mut host);
        assert_eq!(again, Action::Continue);
        let scales = recorded(&host, "load.traffic_scale_pct");
        assert_eq!(scales, [300], "unseen_traffic {mode}");
    }
}

/// A worker's engine cleared its cache after another VM routed a prompt there: that VM's
/// prediction, still unread in the shared ring when this VM takes in the clear, goes with the
/// clear. Read after it, it would credit the worker with blocks its engine no longer holds.
#[test]
fn a_clear_forgets_the_predictions_other_vms_published_before_it() {
    use crate::events::{IndexEvent, LogRecord, NumberedEvent};
    let json = config(json!({"response_headers": true}));
    let mut host = FakeHost::new().post("/v1/completions", &completion(false));
    let mut a = Filter::new(&host, &json);
    let mut b = Filter::new(&host, &json);
    // VM A routes the prompt: its decision is published as a prediction.
    let (_, action) = a.send(&mut host);
    assert_eq!(action, Action::Continue);
    let worker = usize::from(chosen(&host) == Some(W2));
    assert_eq!(host.counter("approx.published"), 1);
    // The engine clears its cache; the poller appends the clear to the shared log.
    let clear = LogRecord::Events {
        worker: worker as u16,
        events: vec![NumberedEvent {
            event_id: 1,
            event: IndexEvent::Cleared { dp_rank: None },
        }],
    };
    assert!(crate::replication::log::append(
        &host.store,
        7,
        2,
        host.now_ms,
        &[clear],
        |_| true
    ));
    // VM B routes the same prompt: it reads the clear and A's prediction in one request.
    host.advance(5);
    host.next_request("/v1/completions", &completion(false));
    let (mut request, action) = b.send(&mut host);
    assert_eq!(action, Action::Continue);
    request.on_response_headers(&mut host, &mut b.vm, false);
    assert_eq!(
        host.response_header_value("x-kv-router-overlap-blocks"),
        Some("0"),
        "no worker holds the prompt after the clear"
    );
}

/// The values recorded into histogram `name`, in order.
fn recorded(host: &FakeHost, name: &str) -> Vec<u64> {
    let named = host.histograms.iter().filter(|(n, _)| n == name);
    named.map(|(_, v)| *v).collect()
}

/// Three Envoys in front of the same two workers: the other two route twice this one's traffic
/// (`load.other_routers` on the workers' pages). Until their declarations arrive they likely
/// placed what this one did, so a request this Envoy just placed from scratch on worker 1
/// weighs there three times over, and the next fresh request goes to worker 2, whose queued
/// prefill (224 tokens, its own and the others') outweighs one such request but not three
/// (`load::recent`). Each replica on its own bookings (`off`) sends both to worker 1.
#[test]
fn a_replica_counts_what_the_others_likely_just_placed_as_it_did() {
    use crate::events::{Booked, ReportedLoad};
    for (mode, second) in [("relayed", W2), ("off", W1)] {
        let json = config(json!({"policy": "dynamo", "load": {"unseen_traffic": mode}}));
        let body = |first: u32| {
            let tokens: Vec<u32> = (first..first + 64).collect();
            json!({"model": "m", "prompt": tokens, "max_tokens": 4}).to_string()
        };
        let mut host = FakeHost::new().post("/v1/completions", &body(1000));
        let mut filter = Filter::new(&host, &json);
        // One own request in flight on each worker, 160 tokens to prefill on worker 2 ...
        for (key, slot, tokens) in [(1u64, 0u16, 0), (2, 1, 160)] {
            let now = host.now_ms;
            let booked = crate::load_store::update_slot(&host.store, 2, slot, now, |t| {
                t.admit(key, slot, tokens, 0, None, now)
            });
            assert!(booked.is_ok());
        }
        // ... and the other routers' two on each, with 64 more tokens queued on worker 2.
        let others = |prefill_tokens| ReportedLoad {
            num_waiting: 0,
            num_running: 3,
            kv_usage: 0.0,
            other_routers: Some(Booked {
                requests: 2,
                prefill_tokens,
                decode_blocks: 0.0,
                timing: None,
            }),
        };
        assert!(crate::replication::log::update_head(
            &host.store,
            7,
            2,
            host.now_ms,
            |head| {
                head.workers[0].reported = Some(others(0.0));
                head.workers[1].reported = Some(others(64.0));
                true
            }
        ));
        filter.vm.sync_replica(&mut host);
        for _ in 0..10 {
            host.now_ms += 50;
            filter.vm.sample_traffic_on_tick(&host.store, host.now_ms);
        }
        let ratio = filter.vm.traffic_share.relayed_ratio();
        let expected = if mode == "relayed" { 2.0 } else { 0.0 };
        assert!((ratio - expected).abs() < 1e-9, "{mode}: ratio {ratio}");
        let (_, action) = filter.send(&mut host);
        assert_eq!(action, Action::Continue);
        assert_eq!(chosen(&host), Some(W1), "{mode}: first");
        host = host.post("/v1/completions", &body(5000));
        let (_, action) = filter.send(&mut host);
        assert_eq!(action, Action::Continue);
        assert_eq!(chosen(&host), Some(second), "{mode}: second");
        // Recorded once a second while routing, with `relayed` only.
        let ratios = recorded(&host, "load.relayed_ratio_pct");
        let expected: &[u64] = if mode == "relayed" { &[200] } else { &[] };
        assert_eq!(ratios, expected, "{mode}");
    }
}
