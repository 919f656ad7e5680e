//! Echo mode, for integration tests: completions answered at once in OpenAI's shape, shaped by
//! the request's `"mock"` field, and a KV event endpoint fed entirely by the test.
//!
//! Behaviour controls (request body field `mock`, ignored by the router):
//! `{"status": 503, "delay_ms": 0, "first_token_delay_ms": 0, "chunks": 3, "chunk_interval_ms": 10,
//!   "hang_ms": 0}`. `status` != 200 answers that status with an error JSON; `hang_ms` then
//! `delay_ms` are slept before the response head; `first_token_delay_ms` before the first chunk
//! (added to the delay for non-streamed answers); `chunks` pieces of text, `chunk_interval_ms`
//! apart when streamed. Every sleep stops early if the client disconnects.
//!
//! Test-controlled events:
//! * `POST /admin/events` with an array of events (or one event), any DESIGN.md shape, without
//!   `event_id`: appended with the next ids (from 1).
//! * `POST /admin/drop_events` `{"count": K}`: consumes K ids without buffering them and forgets
//!   the buffer, so `first_event_id` skips past them (a gap; the router must re-sync).
//! * `POST /admin/dump` with any JSON: served verbatim by `GET /kv/dump` (an object missing
//!   `block_size` / `last_event_id` gets the current values). `null` restores the default: every
//!   buffered stored event plus `last_event_id`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::event_log::{is_stored_event, EventLog};
use super::openai::{self, Shape};
use crate::http::{lock, Request, ResponseWriter};

/// Bound of the echo event buffer (tests should never reach it).
pub const ECHO_EVENT_CAPACITY: usize = 1_000_000;

/// Per-request behaviour read from the body's `mock` field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockControls {
    pub status: u16,
    pub delay_ms: u64,
    pub first_token_delay_ms: u64,
    pub chunks: usize,
    pub chunk_interval_ms: u64,
    pub hang_ms: u64,
}

impl MockControls {
    pub fn from_body(body: &Value) -> Self {
        let m = &body["mock"];
        let num = |k: &str, d: u64| m[k].as_u64().unwrap_or(d);
        MockControls {
            status: u16::try_from(num("status", 200)).unwrap_or(500),
            delay_ms: num("delay_ms", 0),
            first_token_delay_ms: num("first_token_delay_ms", 0),
            chunks: usize::try_from(num("chunks", 3)).unwrap_or(3),
            chunk_interval_ms: num("chunk_interval_ms", 10),
            hang_ms: num("hang_ms", 0),
        }
    }
}

/// Sleeps `ms`, returning false early if the client went away.
pub fn sleep_watching(w: &mut ResponseWriter, ms: u64) -> bool {
    let end = Instant::now() + Duration::from_millis(ms);
    loop {
        if w.is_client_disconnected() {
            return false;
        }
        let now = Instant::now();
        if now >= end {
            return true;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(20)));
    }
}

#[derive(Debug)]
pub struct EchoState {
    block_size: usize,
    log: Mutex<EventLog>,
    dump: Mutex<Option<Value>>,
}

impl EchoState {
    pub fn new(block_size: usize) -> Self {
        EchoState {
            block_size,
            log: Mutex::new(EventLog::new(ECHO_EVENT_CAPACITY)),
            dump: Mutex::new(None),
        }
    }

    /// Clears events (ids restart at 1) and the dump override.
    pub fn reset(&self) {
        *lock(&self.log) = EventLog::new(ECHO_EVENT_CAPACITY);
        *lock(&self.dump) = None;
    }

    pub fn events_page(&self, after: u64) -> Value {
        lock(&self.log).page(after, self.block_size)
    }

    pub fn dump(&self) -> Value {
        let log = lock(&self.log);
        match &*lock(&self.dump) {
            Some(custom) => {
                let mut d = custom.clone();
                if let Some(obj) = d.as_object_mut() {
                    obj.entry("block_size").or_insert(json!(self.block_size));
                    obj.entry("last_event_id").or_insert(json!(log.last_id()));
                }
                d
            }
            None => {
                let events: Vec<Value> =
                    log.iter().filter(|e| is_stored_event(e)).cloned().collect();
                json!({"block_size": self.block_size, "last_event_id": log.last_id(), "events": events})
            }
        }
    }

    /// Handles `/admin/events`, `/admin/drop_events`, `/admin/dump`. False if not one of them.
    pub fn admin(&self, req: &Request, w: &mut ResponseWriter) -> bool {
        if req.method != "POST" {
            return false;
        }
        let body = req.json();
        match req.path.as_str() {
            "/admin/events" => {
                let events = match body {
                    Ok(Value::Array(a)) => a,
                    Ok(v @ Value::Object(_)) => vec![v],
                    _ => {
                        let _ =
                            w.send_json(400, &json!({"error": "expected a JSON array of events"}));
                        return true;
                    }
                };
                let mut log = lock(&self.log);
                let ids: Vec<u64> = events.into_iter().map(|e| log.push(e)).collect();
                let reply = json!({"ids": ids, "first_event_id": log.first_id(), "last_event_id": log.last_id()});
                drop(log);
                let _ = w.send_json(200, &reply);
            }
            "/admin/drop_events" => {
                let count = body.ok().and_then(|b| b["count"].as_u64()).unwrap_or(1);
                let mut log = lock(&self.log);
                log.skip(count);
                let reply =
                    json!({"first_event_id": log.first_id(), "last_event_id": log.last_id()});
                drop(log);
                let _ = w.send_json(200, &reply);
            }
            "/admin/dump" => match body {
                Ok(v) => {
                    *lock(&self.dump) = if v.is_null() { None } else { Some(v) };
                    let _ = w.send_json(200, &json!({"ok": true}));
                }
                Err(e) => {
                    let _ = w.send_json(400, &json!({"error": format!("bad JSON: {e}")}));
                }
            },
            _ => return false,
        }
        true
    }

    /// Answers a completion request according to its `mock` controls.
    pub fn completion(&self, shape: &Shape, body: &Value, w: &mut ResponseWriter) {
        let c = MockControls::from_body(body);
        let prompt_tokens = openai::prompt_tokens(body).len();
        if c.hang_ms > 0 && !sleep_watching(w, c.hang_ms) {
            return;
        }
        if c.delay_ms > 0 && !sleep_watching(w, c.delay_ms) {
            return;
        }
        if c.status != 200 {
            let err = openai::error_body(c.status, "mock: injected error status", &shape.worker_id);
            let _ = w.send_json(c.status, &err);
            return;
        }
        let pieces: Vec<String> = (0..c.chunks).map(|i| format!("chunk{i} ")).collect();
        let usage = openai::usage(prompt_tokens, c.chunks, 0);
        if !openai::is_stream(body) {
            if c.first_token_delay_ms > 0 && !sleep_watching(w, c.first_token_delay_ms) {
                return;
            }
            let _ = w.send_json(200, &shape.full(&pieces.concat(), "length", usage));
            return;
        }
        if w.start_sse().is_err() {
            return;
        }
        if c.first_token_delay_ms > 0 && !sleep_watching(w, c.first_token_delay_ms) {
            return;
        }
        let last = pieces.len().saturating_sub(1);
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 && c.chunk_interval_ms > 0 && !sleep_watching(w, c.chunk_interval_ms) {
                return;
            }
            let finish = (i == last).then_some("length");
            if w.write_sse_data(&shape.chunk(piece, finish, i == 0).to_string())
                .is_err()
            {
                return;
            }
        }
        if pieces.is_empty()
            && w.write_sse_data(&shape.chunk("", Some("length"), true).to_string())
                .is_err()
        {
            return;
        }
        let _ = w.write_sse_data(&shape.usage_chunk(usage).to_string());
        let _ = w.write_sse_data("[DONE]");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_defaults_and_overrides() {
        let d = MockControls::from_body(&json!({}));
        assert_eq!(d.status, 200);
        assert_eq!(d.chunks, 3);
        assert_eq!(d.chunk_interval_ms, 10);
        let c =
            MockControls::from_body(&json!({"mock": {"status": 503, "chunks": 1, "hang_ms": 5}}));
        assert_eq!((c.status, c.chunks, c.hang_ms), (503, 1, 5));
    }

    #[test]
    fn dump_defaults_to_stored_events_and_can_be_overridden() {
        let s = EchoState::new(16);
        {
            let mut log = lock(&s.log);
            log.push(json!({"type": "BlockStored", "block_hashes": [1]}));
            log.push(json!({"type": "BlockRemoved", "block_hashes": [1]}));
        }
        let d = s.dump();
        assert_eq!(d["events"].as_array().unwrap().len(), 1);
        assert_eq!(d["last_event_id"], 2);
        assert_eq!(d["block_size"], 16);
        *lock(&s.dump) = Some(json!({"events": []}));
        let d = s.dump();
        assert_eq!(d["last_event_id"], 2);
        assert!(d["events"].as_array().unwrap().is_empty());
        s.reset();
        assert_eq!(s.events_page(0)["last_event_id"], 0);
    }
}
