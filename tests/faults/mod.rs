//! Shared by the fault matrix (`tests/fault_matrix.rs`) and the soak (`tests/soak.rs`): engine
//! workers, their filter configuration, clients that go away half-way, and the after-fault checks.
#![allow(
    dead_code,
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing
)]

use super::common::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const BLOCK: u32 = 16;

/// Engine-mode flags: a bounded prefix cache (it evicts, so the index churns), fast steps.
pub const ENGINE_ARGS: [&str; 8] = [
    "--mode",
    "engine",
    "--block-size",
    "16",
    "--speedup",
    "20",
    "--kv-blocks",
    "512",
];

/// `count` engine-mode workers (ids 1..=count) serving their own event pages.
pub fn engine_workers(count: u64) -> Vec<Worker> {
    Worker::spawn_many(count, &ENGINE_ARGS).expect("start engine workers")
}

/// The filter configuration the fault tests run: the workers, a fast poll.
pub fn fault_config(workers: &[Worker]) -> Value {
    filter_config(
        workers,
        // A reply limit below the mock's `oversized` fault (8 MiB of padding), so that fault is
        // a refused page (the default limit, 64 MiB, takes full dumps).
        json!({"block_size": BLOCK, "events": {"poll_interval_ms": 100, "max_response_bytes": 4_194_304}}),
    )
}

/// Sends the head of a POST with `content-length` of the whole body and half the body, then
/// closes the connection: a client gone during the body.
pub fn disconnect_during_body(envoy_addr: &str, body: &Value) {
    let bytes = body.to_string().into_bytes();
    let Ok(mut conn) = TcpStream::connect(envoy_addr) else {
        return;
    };
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        bytes.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(&bytes[..bytes.len() / 2]);
    let _ = conn.flush();
    // Let Envoy read what was sent before the close, so the filter sees a partial body.
    let _ = conn.set_read_timeout(Some(Duration::from_millis(50)));
    let _ = conn.read(&mut [0u8; 16]);
}

/// Starts a streamed completion, reads its first piece and closes the connection.
pub fn disconnect_mid_stream(envoy_addr: &str, body: &Value) {
    let bytes = body.to_string();
    if let Ok(mut resp) = http::request_streaming(
        envoy_addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        bytes.as_bytes(),
        Duration::from_secs(30),
    ) {
        let _ = resp.next_chunk();
        resp.abort();
    }
}

/// Every load gauge of the filter: the shared table's entries and each rank's active requests.
pub fn load_gauges(envoy: &Envoy) -> u64 {
    envoy
        .stats()
        .iter()
        .filter(|(k, _)| {
            k.as_str() == "wasmcustom.kv_router.load.active_entries"
                || (k.starts_with("wasmcustom.kv_router.worker.")
                    && (k.ends_with(".active_requests")
                        || k.ends_with(".prefill_tokens")
                        || k.ends_with(".decode_blocks")))
        })
        .map(|(_, v)| *v)
        .sum()
}

/// Blocks the workers' dumps hold, which the index must equal once events are quiet.
pub fn dump_blocks(workers: &[Worker]) -> u64 {
    workers
        .iter()
        .map(|w| {
            let dump = http::get(&w.addr, "/kv/dump")
                .ok()
                .and_then(|r| r.json().ok())
                .unwrap_or(Value::Null);
            dump["events"].as_array().map_or(0, |events| {
                events
                    .iter()
                    .map(|e| e["block_hashes"].as_array().map_or(0, Vec::len) as u64)
                    .sum::<u64>()
            })
        })
        .sum()
}
