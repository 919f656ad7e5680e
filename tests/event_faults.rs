//! Workers whose event replies keep being refused, through a real Envoy: the poller backs off
//! instead of re-fetching every interval, and an absurd cursor is a counted protocol error, not a
//! re-dump on every poll.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

fn admin(worker: &Worker, path: &str, body: &Value) {
    let resp = http::post_json(&worker.addr, path, body).expect("admin call");
    assert_eq!(resp.status, 200, "{path}: {}", resp.text());
}

fn envoy(workers: &[Worker]) -> Envoy {
    // Events only: an overlap must come from the workers' events, not the probes' predictions.
    let config = events_only(filter_config(
        workers,
        // A reply limit below the mock's `oversized` fault (8 MiB of padding).
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100, "stale_after_ms": 60000,
                                                "max_response_bytes": 4_194_304}}),
    ));
    start_envoy(workers, config)
}

/// Rejections in a row make the poller wait 200, 400, 800, 1600 ms...: however fast the machine,
/// a window of `window` after the n-th rejection holds at most one more.
fn rejections_within(envoy: &Envoy, window: Duration) -> (u64, u64) {
    let before = envoy.router_stat("events.pages_rejected");
    let end = Instant::now() + window;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    (before, envoy.router_stat("events.pages_rejected"))
}

#[test]
fn an_oversized_dump_is_refused_and_fetched_again_only_after_a_growing_backoff() {
    let workers = echo_workers(1, BLOCK);
    // Oversized from the very first call, which is the dump (the filter has no cursor yet).
    admin(
        &workers[0],
        "/admin/events_fault",
        &json!({"mode": "oversized"}),
    );
    let envoy = envoy(&workers);
    assert!(
        envoy.wait_for(Duration::from_secs(20), |e| e.router_stat("events.backoff")
            >= 4)
    );
    assert!(envoy.router_stat("events.pages_too_large") >= 4);
    assert_eq!(envoy.router_stat("events.resyncs"), 0);
    // The 4th rejection schedules the next fetch 1.6 s later (at the 100 ms interval there would
    // be about 10 fetches in a second).
    let (before, after) = rejections_within(&envoy, Duration::from_millis(1000));
    assert!(
        after <= before + 1,
        "rejections {before} -> {after} within 1 s"
    );
    assert!(
        envoy.log().contains("next fetch in"),
        "the backoff is logged"
    );
    // Fixed: the next fetch applies the dump and the backoff is over.
    admin(&workers[0], "/admin/events_fault", &json!({"mode": "none"}));
    assert!(
        envoy.wait_for(Duration::from_secs(40), |e| e.router_stat("events.resyncs")
            >= 1)
    );
    let prompt = tokens(300, 3 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(
        wait_for_overlap(&envoy, &completion(&prompt), 3, Duration::from_secs(5)),
        "events flow at the plain interval again"
    );
}

#[test]
fn an_absurd_cursor_is_a_protocol_error_not_a_dump_on_every_poll() {
    let workers = echo_workers(1, BLOCK);
    // The dump claims the largest u64 as its last event id: `after + 1` would overflow.
    admin(
        &workers[0],
        "/admin/dump",
        &json!({"block_size": BLOCK, "last_event_id": u64::MAX, "events": []}),
    );
    let envoy = envoy(&workers);
    assert!(envoy.wait_for(Duration::from_secs(20), |e| e
        .router_stat("events.protocol_errors")
        >= 3));
    assert_eq!(envoy.router_stat("events.resyncs"), 0, "never accepted");
    let (before, after) = rejections_within(&envoy, Duration::from_millis(500));
    assert!(
        after <= before + 1,
        "rejections {before} -> {after} within 0.5 s"
    );
    // A sane dump is taken at the next fetch.
    admin(&workers[0], "/admin/dump", &Value::Null);
    assert!(
        envoy.wait_for(Duration::from_secs(40), |e| e.router_stat("events.resyncs")
            >= 1)
    );
}
