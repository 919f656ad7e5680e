//! OpenAI request fields the mock reads and the response shapes it writes (completions and chat,
//! whole or streamed as SSE), and [`json_response`] for a JSON reply.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    Chat,
}

/// Vocabulary size used for text "tokenization" and generated tokens.
pub const VOCAB: u32 = 32_000;

/// Token ids of a prompt: `nvext.token_data`, else `prompt` as ids (the first of a batch), else
/// text (`prompt` string or chat `messages`) tokenized trivially: every 4 bytes are one token.
pub fn prompt_tokens(body: &Value) -> Vec<u32> {
    if let Some(ids) = body["nvext"]["token_data"].as_array() {
        return ids_of(ids);
    }
    match &body["prompt"] {
        Value::Array(items) => match items.first() {
            Some(Value::Array(first)) => ids_of(first),
            Some(Value::String(s)) => text_tokens(s),
            _ => ids_of(items),
        },
        Value::String(s) => text_tokens(s),
        _ => {
            let mut text = String::new();
            for m in body["messages"].as_array().into_iter().flatten() {
                text.push_str(m["role"].as_str().unwrap_or(""));
                text.push('\n');
                match &m["content"] {
                    Value::String(s) => text.push_str(s),
                    Value::Array(parts) => {
                        for p in parts {
                            text.push_str(p["text"].as_str().unwrap_or(""));
                        }
                    }
                    _ => {}
                }
                text.push('\n');
            }
            text_tokens(&text)
        }
    }
}

fn ids_of(items: &[Value]) -> Vec<u32> {
    items
        .iter()
        .filter_map(Value::as_u64)
        .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
        .collect()
}

/// Every 4 bytes (little-endian) form one token id modulo [`VOCAB`]; prefix-preserving.
pub fn text_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            for (dst, src) in b.iter_mut().zip(c) {
                *dst = *src;
            }
            u32::from_le_bytes(b) % VOCAB
        })
        .collect()
}

/// `max_tokens` (or `max_completion_tokens`), default 16 as in OpenAI's completions API; at least 1.
pub fn max_tokens(body: &Value) -> usize {
    body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
        .map_or(16, |v| usize::try_from(v).unwrap_or(usize::MAX))
        .max(1)
}

/// The request's `priority` (vLLM's extension field: an int64, lower is served first; 0 when
/// absent or null).
pub fn priority(body: &Value) -> Result<i64, String> {
    match &body["priority"] {
        Value::Null => Ok(0),
        v => v
            .as_i64()
            .ok_or_else(|| format!("priority must be an integer in the int64 range, got {v}")),
    }
}

pub fn is_stream(body: &Value) -> bool {
    body["stream"].as_bool().unwrap_or(false)
}

/// The `usage` object (with `prompt_tokens_details.cached_tokens`).
pub fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// An OpenAI-style error body.
pub fn error_body(status: u16, message: &str, worker_id: &Value) -> Value {
    json!({
        "error": {"message": message, "type": "mock_error", "code": status},
        "worker_id": worker_id,
    })
}

/// Builds the response objects of one request.
#[derive(Debug, Clone)]
pub struct Shape {
    pub kind: ApiKind,
    pub id: String,
    pub model: String,
    pub created: u64,
    pub worker_id: Value,
    pub received_headers: Value,
}

impl Shape {
    pub fn new(kind: ApiKind, seq: u64, body: &Value, worker_id: &Value, received: Value) -> Self {
        let prefix = match kind {
            ApiKind::Completions => "cmpl",
            ApiKind::Chat => "chatcmpl",
        };
        Shape {
            kind,
            id: format!("{prefix}-mock-{}-{seq}", worker_id_text(worker_id)),
            model: body["model"].as_str().unwrap_or("mock-model").to_string(),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            worker_id: worker_id.clone(),
            received_headers: received,
        }
    }

    fn base(&self, object: &str) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "worker_id": self.worker_id,
            "received_headers": self.received_headers,
        })
    }

    /// One streamed chunk carrying `text` (the first chat chunk also carries the role).
    pub fn chunk(&self, text: &str, finish_reason: Option<&str>, first: bool) -> Value {
        let mut v;
        match self.kind {
            ApiKind::Completions => {
                v = self.base("text_completion");
                v["choices"] = json!([{
                    "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                }]);
            }
            ApiKind::Chat => {
                v = self.base("chat.completion.chunk");
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                v["choices"] = json!([{
                    "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason,
                }]);
            }
        }
        v
    }

    /// The final streamed chunk: no choices, only `usage`.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let object = match self.kind {
            ApiKind::Completions => "text_completion",
            ApiKind::Chat => "chat.completion.chunk",
        };
        let mut v = self.base(object);
        v["choices"] = json!([]);
        v["usage"] = usage;
        v
    }

    /// A whole (non-streamed) response.
    pub fn full(&self, text: &str, finish_reason: &str, usage: Value) -> Value {
        let mut v;
        match self.kind {
            ApiKind::Completions => {
                v = self.base("text_completion");
                v["choices"] = json!([{
                    "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                }]);
            }
            ApiKind::Chat => {
                v = self.base("chat.completion");
                v["choices"] = json!([{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }]);
            }
        }
        v["usage"] = usage;
        v
    }
}

/// The worker id as text (for headers and ids).
pub fn worker_id_text(worker_id: &Value) -> String {
    match worker_id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A JSON response with `status` (500 if `status` is not a valid code).
pub fn json_response(status: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        bytes,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_sources() {
        assert_eq!(prompt_tokens(&json!({"prompt": [1, 2, 3]})), vec![1, 2, 3]);
        assert_eq!(prompt_tokens(&json!({"prompt": [[4, 5], [6]]})), vec![4, 5]);
        assert_eq!(
            prompt_tokens(&json!({"prompt": [1], "nvext": {"token_data": [9, 8]}})),
            vec![9, 8]
        );
        assert_eq!(prompt_tokens(&json!({"prompt": "abcdefgh"})).len(), 2);
        assert_eq!(prompt_tokens(&json!({"prompt": "abcdefghi"})).len(), 3);
        let a = prompt_tokens(&json!({"prompt": "shared prefix, then A"}));
        let b = prompt_tokens(&json!({"prompt": "shared prefix, then B"}));
        assert_eq!(a[..4], b[..4]);
        let chat = json!({"messages": [{"role": "user", "content": "hello there"}]});
        assert!(!prompt_tokens(&chat).is_empty());
        assert_eq!(max_tokens(&json!({})), 16);
        assert_eq!(max_tokens(&json!({"max_tokens": 0})), 1);
        assert_eq!(max_tokens(&json!({"max_completion_tokens": 7})), 7);
    }

    #[test]
    fn shapes() {
        let s = Shape::new(
            ApiKind::Chat,
            1,
            &json!({"model": "m"}),
            &json!(3),
            json!({}),
        );
        assert_eq!(
            s.chunk("a", None, true)["choices"][0]["delta"]["role"],
            "assistant"
        );
        assert_eq!(
            s.full("x", "stop", usage(1, 2, 0))["choices"][0]["message"]["content"],
            "x"
        );
        assert_eq!(s.usage_chunk(usage(1, 2, 1))["usage"]["total_tokens"], 3);
        let c = Shape::new(ApiKind::Completions, 1, &json!({}), &json!("w"), json!({}));
        assert_eq!(
            c.chunk("t", Some("length"), false)["choices"][0]["text"],
            "t"
        );
        assert_eq!(c.model, "mock-model");
        assert!(c.id.contains("-w-"));
    }
}
