//! Completions served by the engine simulator: tokens arrive from the engine thread over a
//! channel and go out as SSE chunks (or one JSON body). A request whose client goes away is
//! aborted in the engine, freeing its KV blocks: the guard doing so lives in the handler's future
//! or the response stream, which the server drops on disconnect.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine::{Engine, Output, ReqId};
use super::openai::json_response;
use super::openai::{self, Shape};
use super::InFlight;

/// Aborts the engine request when dropped before it finished.
struct AbortOnDrop {
    engine: Arc<Engine>,
    id: ReqId,
    finished: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            self.engine.abort(self.id);
        }
    }
}

pub async fn completion(
    engine: Arc<Engine>,
    shape: Shape,
    body: &Value,
    guard: InFlight,
    received: Instant,
    stream_interval: usize,
) -> Response {
    let tokens = openai::prompt_tokens(body);
    let priority = match openai::priority(body) {
        Ok(p) => p,
        Err(msg) => return json_response(400, &openai::error_body(400, &msg, &shape.worker_id)),
    };
    let (id, rx) = match engine.submit(tokens, openai::max_tokens(body), priority) {
        Ok(x) => x,
        Err(msg) => return json_response(400, &openai::error_body(400, &msg, &shape.worker_id)),
    };
    let abort = AbortOnDrop {
        engine,
        id,
        finished: false,
    };
    if openai::is_stream(body) {
        streamed(shape, rx, abort, guard, received, stream_interval)
    } else {
        whole(shape, rx, abort, guard, received).await
    }
}

async fn whole(
    shape: Shape,
    mut rx: UnboundedReceiver<Output>,
    mut abort: AbortOnDrop,
    guard: InFlight,
    received: Instant,
) -> Response {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Output::Token { token, .. }) => {
                if text.is_empty() {
                    guard.worker().record_first_token(received);
                }
                text.push_str(&format!(" t{token}"));
            }
            Some(Output::Finished { usage, .. }) => {
                abort.finished = true;
                let u = openai::usage(
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    usage.cached_tokens,
                );
                return json_response(200, &shape.full(&text, "length", u));
            }
            Some(Output::Failed { message, .. }) => {
                abort.finished = true;
                return json_response(503, &openai::error_body(503, &message, &shape.worker_id));
            }
            None => {
                let err = openai::error_body(500, "engine dropped the request", &shape.worker_id);
                return json_response(500, &err);
            }
        }
    }
}

/// State of one streamed engine answer.
struct TokenStream {
    shape: Shape,
    rx: UnboundedReceiver<Output>,
    abort: AbortOnDrop,
    guard: InFlight,
    received: Instant,
    first: bool,
    /// Tokens per chunk after the first (`--stream-interval`).
    interval: usize,
    /// Text of the tokens not sent yet, and how many.
    pending: String,
    pending_tokens: usize,
    queued: VecDeque<String>,
    done: bool,
}

impl TokenStream {
    /// The next event's data; `None` once the answer is complete.
    async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(d) = self.queued.pop_front() {
                return Some(d);
            }
            if self.done {
                return None;
            }
            match self.rx.recv().await {
                Some(Output::Token { token, .. }) => {
                    self.pending.push_str(&format!(" t{token}"));
                    self.pending_tokens += 1;
                    let first = self.first;
                    if first {
                        self.guard.worker().record_first_token(self.received);
                    } else if self.pending_tokens < self.interval {
                        continue;
                    }
                    self.first = false;
                    self.pending_tokens = 0;
                    let text = std::mem::take(&mut self.pending);
                    return Some(self.shape.chunk(&text, None, first).to_string());
                }
                Some(Output::Finished { usage, .. }) => {
                    self.abort.finished = true;
                    self.done = true;
                    let u = openai::usage(
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        usage.cached_tokens,
                    );
                    if self.pending_tokens > 0 {
                        let text = std::mem::take(&mut self.pending);
                        self.queued
                            .push_back(self.shape.chunk(&text, None, false).to_string());
                    }
                    let first = self.first;
                    self.queued.extend([
                        self.shape.chunk("", Some("length"), first).to_string(),
                        self.shape.usage_chunk(u).to_string(),
                        "[DONE]".to_string(),
                    ]);
                }
                Some(Output::Failed { message, .. }) => {
                    self.abort.finished = true;
                    self.done = true;
                    let err = openai::error_body(503, &message, &self.shape.worker_id);
                    self.queued.push_back(err.to_string());
                }
                None => {
                    self.done = true;
                    let err = openai::error_body(
                        500,
                        "engine dropped the request",
                        &self.shape.worker_id,
                    );
                    self.queued.push_back(err.to_string());
                }
            }
        }
    }
}

fn streamed(
    shape: Shape,
    rx: UnboundedReceiver<Output>,
    abort: AbortOnDrop,
    guard: InFlight,
    received: Instant,
    interval: usize,
) -> Response {
    let state = TokenStream {
        shape,
        rx,
        abort,
        guard,
        received,
        first: true,
        interval: interval.max(1),
        pending: String::new(),
        pending_tokens: 0,
        queued: VecDeque::new(),
        done: false,
    };
    let events = stream::unfold(state, |mut st| async move {
        let data = st.next_data().await?;
        Some((Ok::<_, Infallible>(Event::default().data(data)), st))
    });
    Sse::new(events).into_response()
}
