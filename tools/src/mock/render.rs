//! vLLM's render and tokenize endpoints on the mock: the prompt ids the worker itself would
//! cache for a request ([`openai::prompt_tokens`]: its trivial tokenizer and chat template
//! `role\ncontent\n` per message), in vLLM 0.32's reply shapes:
//! `/v1/chat/completions/render` -> `{"request_id", "token_ids", "sampling_params", "model"}`,
//! `/v1/completions/render` -> a list of those, `/tokenize` -> `{"count", "max_model_len", "tokens"}`.
//!
//! Faults for tests, read from the request's `mock` object (the filter forwards the client's
//! body): `render_delay_ms` (answer late) and `render_status` (answer with that error status).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::response::Response;
use serde_json::{json, Value};

use super::openai;
use super::openai::json_response;
use super::MockWorker;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completions,
    Tokenize,
}

static RENDERED: AtomicU64 = AtomicU64::new(0);

pub async fn reply(w: Arc<MockWorker>, kind: Kind, body: &Bytes) -> Response {
    let body: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            let err = openai::error_body(400, "request body must be a JSON object", w.worker_id());
            return json_response(400, &err);
        }
    };
    let mock = &body["mock"];
    if let Some(ms) = mock["render_delay_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = mock["render_status"].as_u64() {
        let status = u16::try_from(status).unwrap_or(500);
        let err = openai::error_body(status, "injected render fault", w.worker_id());
        return json_response(status, &err);
    }
    let ids = openai::prompt_tokens(&body);
    if ids.is_empty() {
        let err = openai::error_body(400, "empty prompt", w.worker_id());
        return json_response(400, &err);
    }
    let n = RENDERED.fetch_add(1, Ordering::Relaxed);
    let model = body["model"].as_str().unwrap_or("mock-model");
    let generate = || {
        json!({"request_id": format!("render-{n}"), "token_ids": ids, "model": model,
               "sampling_params": {"max_tokens": openai::max_tokens(&body)},
               "token_offsets": null, "features": null})
    };
    match kind {
        Kind::Chat => json_response(200, &generate()),
        Kind::Completions => json_response(200, &json!([generate()])),
        Kind::Tokenize => json_response(
            200,
            &json!({"count": ids.len(), "max_model_len": 131_072, "tokens": ids}),
        ),
    }
}
