//! The mock-worker binary over real HTTP: startup line, echo mode and its admin endpoints,
//! engine mode streaming, events, dump and metrics.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoy_kv_router_tools::client::{get, post_json, request, request_streaming};
use kv_router_testkit::kv_events::stored_event;
use serde_json::{json, Value};

struct Worker {
    child: Child,
    addr: String,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Worker {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mock-worker"))
        .args(["--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn mock-worker");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let addr = line
        .trim()
        .strip_prefix("listening ")
        .expect("listening line")
        .to_string();
    Worker { child, addr }
}

fn stream_events(addr: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Vec<Value>) {
    let bytes = serde_json::to_vec(body).unwrap();
    let mut s = request_streaming(
        addr,
        "POST",
        "/v1/completions",
        headers,
        &bytes,
        Duration::from_secs(10),
    )
    .unwrap();
    let status = s.status;
    let mut out = Vec::new();
    while let Some(ev) = s.next_event().unwrap() {
        out.push(if ev.is_done() {
            json!("[DONE]")
        } else {
            ev.json().unwrap()
        });
    }
    (status, out)
}

#[test]
fn echo_mode_completions_and_headers() {
    let w = start(&["--id", "7"]);
    let r = get(&w.addr, "/health").unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-worker-id"), Some("7"));

    let r = request(
        &w.addr,
        "POST",
        "/v1/completions",
        &[
            ("x-gateway-destination-endpoint", "1.2.3.4:5"),
            ("x-dp-rank", "2"),
            ("content-type", "application/json"),
        ],
        br#"{"model": "m", "prompt": [1, 2, 3], "mock": {"chunks": 2}}"#,
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let j = r.json().unwrap();
    assert_eq!(j["worker_id"], 7);
    assert_eq!(
        j["received_headers"]["x-gateway-destination-endpoint"],
        "1.2.3.4:5"
    );
    assert_eq!(j["received_headers"]["x-dp-rank"], "2");
    assert_eq!(j["choices"][0]["text"], "chunk0 chunk1 ");
    assert_eq!(j["usage"]["prompt_tokens"], 3);

    // Streamed: chunks, then a usage chunk, then [DONE]; chunk spacing honoured.
    let t0 = Instant::now();
    let (status, evs) = stream_events(
        &w.addr,
        &json!({"prompt": [1], "stream": true, "mock": {"chunks": 3, "chunk_interval_ms": 30, "first_token_delay_ms": 50}}),
        &[],
    );
    assert_eq!(status, 200);
    assert!(t0.elapsed() >= Duration::from_millis(110));
    assert_eq!(evs.len(), 5);
    assert_eq!(evs[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(evs[3]["usage"]["completion_tokens"], 3);
    assert_eq!(evs[4], "[DONE]");

    // Chat shape.
    let r = post_json(
        &w.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(
        r.json().unwrap()["choices"][0]["message"]["role"],
        "assistant"
    );

    // Injected status; hang beyond the client's timeout.
    let r = post_json(
        &w.addr,
        "/v1/completions",
        &json!({"prompt": "x", "mock": {"status": 503}}),
    )
    .unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json().unwrap()["worker_id"], 7);
    let err = request(
        &w.addr,
        "POST",
        "/v1/completions",
        &[],
        br#"{"prompt": "x", "mock": {"hang_ms": 3000}}"#,
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);

    let stats = get(&w.addr, "/admin/stats").unwrap().json().unwrap();
    assert_eq!(stats["requests"], 5);
    let metrics = get(&w.addr, "/metrics").unwrap().text();
    assert!(
        metrics.contains("mock_worker_requests_total{worker_id=\"7\"} 5"),
        "{metrics}"
    );
    // Server-side first tokens: the two completions, the stream and the chat answer (not the
    // 503 nor the request abandoned while hanging).
    assert!(
        metrics.contains("mock_worker_first_tokens_total{worker_id=\"7\"} 3"),
        "{metrics}"
    );
}

#[test]
fn echo_mode_notices_clients_that_go_away() {
    let w = start(&["--id", "2"]);
    // The client gives up long before a 30 s hang ends.
    let err = request(
        &w.addr,
        "POST",
        "/v1/completions",
        &[],
        br#"{"prompt": "x", "mock": {"hang_ms": 30000}}"#,
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    // A stream of 100 chunks a second apart, abandoned after its first chunk.
    let body =
        br#"{"prompt": "x", "stream": true, "mock": {"chunks": 100, "chunk_interval_ms": 1000}}"#;
    let mut s = request_streaming(
        &w.addr,
        "POST",
        "/v1/completions",
        &[],
        body,
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(s.next_event().unwrap().is_some());
    s.abort();
    // Both leave flight long before their natural ends (30 s and 99 s).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = get(&w.addr, "/admin/stats").unwrap().json().unwrap();
        if stats["in_flight"] == 0 {
            assert_eq!(stats["requests"], 2);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "requests still in flight: {stats}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn command_line_errors_exit_with_status_2() {
    for args in [
        &["--block-size", "0"][..],
        &["--mode", "bogus"],
        &["--speedup", "0"],
        &["--jitter", "nan"],
        &["--no-such-flag"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mock-worker"))
            .args(args)
            .output()
            .expect("run mock-worker");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let flag = args[0];
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let help = Command::new(env!("CARGO_BIN_EXE_mock-worker"))
        .arg("--help")
        .output()
        .expect("run mock-worker");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--host",
        "--port",
        "--id",
        "--mode",
        "--block-size",
        "--kv-blocks",
        "--host-kv-blocks",
        "--max-seqs",
        "--max-batched-tokens",
        "--speedup",
        "--device",
        "--dp-rank",
        "--event-capacity",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help");
    }
}

#[test]
fn echo_mode_event_endpoint_is_test_controlled() {
    let w = start(&["--id", "1", "--block-size", "16"]);
    let page = get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap();
    assert_eq!(page["block_size"], 16);
    assert_eq!(page["first_event_id"], 1);
    assert_eq!(page["last_event_id"], 0);
    assert!(page.get("load").is_none());

    let events = json!([
        {"dp_rank": 0, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 7, "tokens_hash": 99}]}}},
        stored_event(&[1], None, &[1, 2], 16, "GPU"),
        {"data": {"removed": {"block_hashes": [7]}}}
    ]);
    let r = post_json(&w.addr, "/admin/events", &events)
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(r["ids"], json!([1, 2, 3]));
    let page = get(&w.addr, "/kv/events?after=1").unwrap().json().unwrap();
    assert_eq!(page["events"].as_array().unwrap().len(), 2);
    assert_eq!(page["events"][0]["event_id"], 2);
    assert_eq!(page["last_event_id"], 3);

    // Default dump: the stored events.
    let dump = get(&w.addr, "/kv/dump").unwrap().json().unwrap();
    assert_eq!(dump["events"].as_array().unwrap().len(), 2);
    assert_eq!(dump["last_event_id"], 3);

    // A gap.
    post_json(&w.addr, "/admin/drop_events", &json!({"count": 5})).unwrap();
    post_json(&w.addr, "/admin/events", &json!([{"data": "cleared"}])).unwrap();
    let page = get(&w.addr, "/kv/events?after=3").unwrap().json().unwrap();
    assert_eq!(page["first_event_id"], 9);
    assert_eq!(page["last_event_id"], 9);
    assert_eq!(page["events"][0]["event_id"], 9);

    // Custom dump and load.
    post_json(
        &w.addr,
        "/admin/dump",
        &json!({"events": [], "last_event_id": 42}),
    )
    .unwrap();
    let dump = get(&w.addr, "/kv/dump").unwrap().json().unwrap();
    assert_eq!(
        (dump["last_event_id"].clone(), dump["block_size"].clone()),
        (json!(42), json!(16))
    );
    post_json(
        &w.addr,
        "/admin/load",
        &json!({"num_waiting": 1, "num_running": 2, "kv_usage": 0.5}),
    )
    .unwrap();
    let page = get(&w.addr, "/kv/events?after=9").unwrap().json().unwrap();
    assert_eq!(page["load"]["num_running"], 2);

    // Faults.
    let fault = |mode: &str| {
        post_json(&w.addr, "/admin/events_fault", &json!({"mode": mode}))
            .unwrap()
            .status
    };
    assert_eq!(fault("http_500"), 200);
    assert_eq!(get(&w.addr, "/kv/events?after=0").unwrap().status, 500);
    fault("malformed");
    assert!(get(&w.addr, "/kv/events?after=0").unwrap().json().is_err());
    fault("wrong_block_size");
    assert_eq!(
        get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap()["block_size"],
        32
    );
    fault("oversized");
    assert!(get(&w.addr, "/kv/events?after=0").unwrap().body.len() > 8 << 20);
    fault("hang");
    let err = request(
        &w.addr,
        "GET",
        "/kv/events?after=0",
        &[],
        &[],
        Duration::from_millis(300),
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    assert_eq!(fault("bogus"), 400);

    // Reset clears everything.
    post_json(&w.addr, "/admin/reset", &json!({})).unwrap();
    let page = get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap();
    assert_eq!(page["last_event_id"], 0);
    assert!(page.get("load").is_none());
    assert_eq!(get(&w.addr, "/nope").unwrap().status, 404);
}

#[test]
fn engine_mode_streams_and_caches() {
    let w = start(&[
        "--id",
        "3",
        "--mode",
        "engine",
        "--block-size",
        "16",
        "--kv-blocks",
        "256",
        "--speedup",
        "20",
    ]);
    let prompt: Vec<u32> = (0..100).collect();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 5, "stream": true});
    let (status, evs) = stream_events(&w.addr, &body, &[("x-dp-rank", "0")]);
    assert_eq!(status, 200);
    // 5 tokens, a finish chunk, a usage chunk, [DONE].
    assert_eq!(evs.len(), 8, "{evs:?}");
    assert_eq!(evs[0]["received_headers"]["x-dp-rank"], "0");
    let usage = &evs[6]["usage"];
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same prompt again: its 6 full blocks are cached.
    let r = post_json(
        &w.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json().unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );

    let page = get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap();
    assert_eq!(page["block_size"], 16);
    let first = &page["events"][0];
    assert_eq!(first["type"], "BlockStored");
    assert_eq!(
        first["token_ids"].as_array().unwrap().len(),
        16 * first["block_hashes"].as_array().unwrap().len()
    );
    assert!(page["load"]["kv_usage"].is_number());
    let dump = get(&w.addr, "/kv/dump").unwrap().json().unwrap();
    assert!(dump["events"].as_array().unwrap().len() >= 6);

    let metrics = get(&w.addr, "/metrics").unwrap().text();
    assert!(
        metrics.contains("mock_worker_prefix_cache_hits_tokens_total{worker_id=\"3\"} 96"),
        "{metrics}"
    );

    // Oversized requests are refused; reset clears the cache.
    let big: Vec<u32> = (0..10_000).collect();
    assert_eq!(
        post_json(&w.addr, "/v1/completions", &json!({"prompt": big}))
            .unwrap()
            .status,
        400
    );
    post_json(&w.addr, "/admin/reset", &json!({})).unwrap();
    let page = get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap();
    assert_eq!(
        page["events"].as_array().unwrap().last().unwrap()["type"],
        "AllBlocksCleared"
    );
    assert!(get(&w.addr, "/kv/dump").unwrap().json().unwrap()["events"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[test]
fn engine_mode_stream_interval_sends_the_first_token_alone_then_groups() {
    let w = start(&[
        "--mode",
        "engine",
        "--block-size",
        "16",
        "--speedup",
        "20",
        "--stream-interval",
        "4",
    ]);
    let prompt: Vec<u32> = (0..40).collect();
    let body = json!({"prompt": prompt, "max_tokens": 10, "stream": true});
    let (status, evs) = stream_events(&w.addr, &body, &[]);
    assert_eq!(status, 200);
    let texts: Vec<&str> = evs
        .iter()
        .filter(|e| e["choices"][0]["finish_reason"].is_null())
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    // 10 tokens: the first at once (TTFT), then 4, 4 and the last 1 when the answer ends.
    let counts: Vec<usize> = texts.iter().map(|t| t.split_whitespace().count()).collect();
    assert_eq!(counts, [1, 4, 4, 1], "{texts:?}");
    let usage = evs.iter().find(|e| e["usage"].is_object()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    assert_eq!(evs.last(), Some(&json!("[DONE]")));
}

#[test]
fn engine_mode_client_abort_frees_the_request() {
    let w = start(&[
        "--mode",
        "engine",
        "--block-size",
        "16",
        "--kv-blocks",
        "256",
        "--speedup",
        "10",
    ]);
    let body =
        serde_json::to_vec(&json!({"prompt": [1, 2, 3], "max_tokens": 100000, "stream": true}))
            .unwrap();
    // max_tokens too large for the cache: refused.
    let s = request_streaming(
        &w.addr,
        "POST",
        "/v1/completions",
        &[],
        &body,
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(s.status, 400);
    let body =
        serde_json::to_vec(&json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true}))
            .unwrap();
    let mut s = request_streaming(
        &w.addr,
        "POST",
        "/v1/completions",
        &[],
        &body,
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(s.next_event().unwrap().is_some());
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = get(&w.addr, "/admin/stats").unwrap().json().unwrap();
        let metrics = get(&w.addr, "/metrics").unwrap().text();
        if stats["in_flight"] == 0
            && metrics.contains("mock_worker_num_requests_running{worker_id=\"0\"} 0")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "request not aborted: {stats} {metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The engine really waits for its simulated step times: an idle worker without jitter must not
/// answer a cold 6,144-token prompt faster than its step-time model allows, and a fully cached
/// repeat is much faster (only a lower bound is asserted, so a slow machine cannot fail it).
#[test]
fn engine_mode_takes_the_simulated_prefill_time() {
    let w = start(&[
        "--id",
        "1",
        "--mode",
        "engine",
        "--block-size",
        "64",
        "--jitter",
        "0",
    ]);
    let body = json!({"model": "m", "prompt": (0..6144).collect::<Vec<u32>>(), "max_tokens": 1});
    let started = Instant::now();
    let resp = post_json(&w.addr, "/v1/completions", &body).expect("cold request");
    let cold = started.elapsed();
    assert_eq!(resp.status, 200);
    let prefill_ms = envoy_kv_router_tools::mock::timing::prefill_ms(6144.0);
    assert!(
        cold.as_secs_f64() * 1000.0 >= prefill_ms * 0.95,
        "cold answer after {cold:?}, prefill alone is {prefill_ms:.1} ms"
    );
    let started = Instant::now();
    let resp = post_json(&w.addr, "/v1/completions", &body).expect("cached request");
    assert_eq!(resp.status, 200);
    let cached =
        resp.json().expect("json")["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached, Some(6144), "the repeat is fully cached");
    println!("cold {cold:?}, cached {:?}", started.elapsed());
}
