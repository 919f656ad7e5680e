//! Echo mode, for integration tests: completions answered at once in OpenAI's shape, shaped by
//! the request's `"mock"` field, and a KV event endpoint fed entirely by the test.
//!
//! Behaviour controls (request body field `mock`, ignored by the router):
//! `{"status": 503, "delay_ms": 0, "first_token_delay_ms": 0, "chunks": 3, "chunk_interval_ms": 10,
//!   "hang_ms": 0}`. `status` != 200 answers that status with an error JSON; `hang_ms` then
//! `delay_ms` are slept before the response head; `first_token_delay_ms` before the first chunk
//! (added to the delay for non-streamed answers); `chunks` pieces of text, `chunk_interval_ms`
//! apart when streamed. A client that disconnects ends every wait (the server drops the request).
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

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{json, Value};

use super::event_log::{is_stored_event, EventLog, PageLimits};
use super::openai::json_response;
use super::openai::{self, Shape};
use super::InFlight;
use crate::util::lock;

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

async fn sleep_ms(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
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

    /// [`Self::events_page`] without `events`, and the `events` array's JSON text.
    pub fn events_page_parts(&self, after: u64, limits: PageLimits) -> (Value, String) {
        lock(&self.log).page_parts(after, self.block_size, limits)
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

    /// `POST /admin/events`: an array of events (or one event), appended with the next ids.
    pub fn publish(&self, body: serde_json::Result<Value>) -> Response {
        let events = match body {
            Ok(Value::Array(a)) => a,
            Ok(v @ Value::Object(_)) => vec![v],
            _ => return json_response(400, &json!({"error": "expected a JSON array of events"})),
        };
        let mut log = lock(&self.log);
        let ids: Vec<u64> = events.into_iter().map(|e| log.push(e)).collect();
        let reply =
            json!({"ids": ids, "first_event_id": log.first_id(), "last_event_id": log.last_id()});
        drop(log);
        json_response(200, &reply)
    }

    /// `POST /admin/drop_events {"count": K}`: a gap of K ids.
    pub fn drop_events(&self, body: serde_json::Result<Value>) -> Response {
        let count = body.ok().and_then(|b| b["count"].as_u64()).unwrap_or(1);
        let mut log = lock(&self.log);
        log.skip(count);
        let reply = json!({"first_event_id": log.first_id(), "last_event_id": log.last_id()});
        drop(log);
        json_response(200, &reply)
    }

    /// `POST /admin/dump`: the body served by `GET /kv/dump` (`null` restores the default).
    pub fn set_dump(&self, body: serde_json::Result<Value>) -> Response {
        match body {
            Ok(v) => {
                *lock(&self.dump) = if v.is_null() { None } else { Some(v) };
                json_response(200, &json!({"ok": true}))
            }
            Err(e) => json_response(400, &json!({"error": format!("bad JSON: {e}")})),
        }
    }
}

/// Answers a completion request according to its `mock` controls. `received` is when the
/// request was complete (for the server-side time to first token).
pub async fn completion(
    shape: Shape,
    body: &Value,
    guard: InFlight,
    received: Instant,
) -> Response {
    let c = MockControls::from_body(body);
    let prompt_tokens = openai::prompt_tokens(body).len();
    sleep_ms(c.hang_ms).await;
    sleep_ms(c.delay_ms).await;
    if c.status != 200 {
        let err = openai::error_body(c.status, "mock: injected error status", &shape.worker_id);
        return json_response(c.status, &err);
    }
    if !openai::is_stream(body) {
        sleep_ms(c.first_token_delay_ms).await;
        let text: String = (0..c.chunks).map(|i| format!("chunk{i} ")).collect();
        guard.worker().record_first_token(received);
        let usage = openai::usage(prompt_tokens, c.chunks, 0);
        return json_response(200, &shape.full(&text, "length", usage));
    }
    let state = EchoStream {
        shape,
        controls: c,
        prompt_tokens,
        next: 0,
        received,
        guard,
    };
    let events = stream::unfold(state, |mut st| async move {
        let (delay_ms, data) = st.event(st.next)?;
        sleep_ms(delay_ms).await;
        if st.next == 0 {
            st.guard.worker().record_first_token(st.received);
        }
        st.next += 1;
        Some((
            Ok::<_, std::convert::Infallible>(Event::default().data(data)),
            st,
        ))
    });
    Sse::new(events).into_response()
}

/// The events of one streamed echo answer, produced one at a time: `chunks` text chunks (the
/// last with `finish_reason`), a usage chunk, `[DONE]`. The in-flight guard lives as long as the
/// stream, which the server drops when the client goes away.
struct EchoStream {
    shape: Shape,
    controls: MockControls,
    prompt_tokens: usize,
    next: usize,
    received: Instant,
    guard: InFlight,
}

impl EchoStream {
    /// Event `i`: the delay before it and its data; `None` after `[DONE]`.
    fn event(&self, i: usize) -> Option<(u64, String)> {
        let c = &self.controls;
        let texts = c.chunks.max(1);
        let delay = if i == 0 {
            c.first_token_delay_ms
        } else if i < texts {
            c.chunk_interval_ms
        } else {
            0
        };
        let data = if i < texts {
            let piece = if c.chunks == 0 {
                String::new()
            } else {
                format!("chunk{i} ")
            };
            let finish = (i + 1 == texts).then_some("length");
            self.shape.chunk(&piece, finish, i == 0).to_string()
        } else if i == texts {
            let usage = openai::usage(self.prompt_tokens, c.chunks, 0);
            self.shape.usage_chunk(usage).to_string()
        } else if i == texts + 1 {
            "[DONE]".to_string()
        } else {
            return None;
        };
        Some((delay, data))
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
