//! The mock worker's HTTP surface on axum: one handler per endpoint, every response stamped
//! with `x-worker-id`, unknown routes (and known paths with another method) answered with a 404
//! JSON naming the mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, RawQuery, Request, State};
use axum::http::header::{CONNECTION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use super::event_log::{self, splice_events};
use super::openai::{self, json_response, ApiKind, Shape};
use super::render;
use super::{
    echo, engine_api, Backend, EventsFault, MockWorker, MAX_REQUEST_BODY_BYTES,
    OVERSIZED_PADDING_BYTES,
};

type Worker = State<Arc<MockWorker>>;

/// The routes of one worker.
pub fn router(worker: Arc<MockWorker>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completions))
        .route("/tokenize", post(tokenize))
        .route("/kv/events", get(kv_events))
        .route("/kv/dump", get(kv_dump))
        .route("/admin/stats", get(stats))
        .route("/admin/events_fault", post(events_fault))
        .route("/admin/load", post(load))
        .route("/admin/describe", post(describe))
        .route("/admin/reset", post(reset))
        .route("/admin/serve_fault", post(serve_fault))
        .route("/admin/events", post(echo_publish))
        .route("/admin/drop_events", post(echo_drop_events))
        .route("/admin/dump", post(echo_set_dump))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&worker),
            stamp_worker_id,
        ))
        .with_state(worker)
}

async fn stamp_worker_id(State(w): Worker, req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    resp.headers_mut()
        .insert("x-worker-id", w.id_header.clone());
    resp
}

fn parse_json(body: &Bytes) -> serde_json::Result<Value> {
    serde_json::from_slice(body)
}

/// A query parameter's raw value (the first occurrence).
fn query_param<'a>(query: &'a Option<String>, name: &str) -> Option<&'a str> {
    query.as_deref()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

async fn not_found(State(w): Worker, req: Request) -> Response {
    let msg = format!(
        "no route for {} {} in {} mode",
        req.method(),
        req.uri().path(),
        w.mode_name()
    );
    json_response(404, &json!({ "error": msg }))
}

async fn health(State(w): Worker) -> Response {
    let status = w.health_status();
    if status != 200 {
        return json_response(status, &json!({"status": "failing (injected)"}));
    }
    json_response(
        200,
        &json!({"status": "ok", "worker_id": w.worker_id(),
                "mode": w.mode_name(), "device": w.device_name()}),
    )
}

async fn metrics(State(w): Worker) -> Response {
    (
        [(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        w.metrics_text(),
    )
        .into_response()
}

async fn stats(State(w): Worker) -> Response {
    json_response(
        200,
        &json!({"requests": w.requests(), "in_flight": w.in_flight(), "worker_id": w.worker_id()}),
    )
}

async fn events_fault(State(w): Worker, body: Bytes) -> Response {
    let mode = parse_json(&body)
        .ok()
        .and_then(|b| b["mode"].as_str().map(str::to_string));
    match mode.as_deref().and_then(EventsFault::parse) {
        Some(f) => {
            w.set_fault(f);
            json_response(200, &json!({"ok": true}))
        }
        None => json_response(
            400,
            &json!({"error": "mode must be none|http_500|malformed|hang|wrong_block_size|oversized"}),
        ),
    }
}

/// The `worker` description (JSON object, `null` = none) its event pages and dumps carry.
async fn describe(State(w): Worker, body: Bytes) -> Response {
    match parse_json(&body) {
        Ok(v) => {
            w.set_description(if v.is_null() { None } else { Some(v) });
            json_response(200, &json!({"ok": true}))
        }
        Err(e) => json_response(400, &json!({"error": format!("bad JSON: {e}")})),
    }
}

async fn load(State(w): Worker, body: Bytes) -> Response {
    match parse_json(&body) {
        Ok(v) => {
            w.set_load_override(if v.is_null() { None } else { Some(v) });
            json_response(200, &json!({"ok": true}))
        }
        Err(e) => json_response(400, &json!({"error": format!("bad JSON: {e}")})),
    }
}

/// `{"health": 503, "completions": 500}`: status codes `/health` and the completion endpoints
/// answer with (200 = normal), for Envoy's health checks and outlier detection.
async fn serve_fault(State(w): Worker, body: Bytes) -> Response {
    let v = parse_json(&body).unwrap_or_default();
    let code = |key: &str| v[key].as_u64().and_then(|c| u16::try_from(c).ok());
    w.set_serve_faults(code("health"), code("completions"));
    json_response(200, &json!({"ok": true}))
}

async fn reset(State(w): Worker) -> Response {
    w.reset();
    json_response(200, &json!({"ok": true}))
}

async fn kv_events(State(w): Worker, RawQuery(query): RawQuery) -> Response {
    let after = query_param(&query, "after")
        .and_then(|a| a.parse::<u64>().ok())
        .unwrap_or(0);
    let number = |name: &str| query_param(&query, name).and_then(|v| v.parse::<usize>().ok());
    let limits = event_log::asked(number("limit"), number("max_bytes"));
    let (mut page, events) = match &w.backend {
        Backend::Echo(e) => e.events_page_parts(after, limits),
        Backend::Engine(e) => e.events_page_parts(after, limits),
    };
    if let Some(load) = w.load_override() {
        page["load"] = load;
    }
    event_body(&w, page, Some(&events)).await
}

async fn kv_dump(State(w): Worker) -> Response {
    let dump = match &w.backend {
        Backend::Echo(e) => e.dump(),
        Backend::Engine(e) => e.dump(),
    };
    event_body(&w, dump, None).await
}

/// An event page or dump, as the injected fault (if any) would have it.
/// An event page or dump; `events`: the page's `events` array as JSON text, spliced into `body`
/// as served (a page is never re-serialized event by event).
async fn event_body(w: &MockWorker, mut body: Value, events: Option<&str>) -> Response {
    let respond = |body: &Value| match events {
        Some(events) => (
            StatusCode::OK,
            [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            splice_events(body, events),
        )
            .into_response(),
        None => json_response(200, body),
    };
    if let Some(d) = w.description() {
        body["worker"] = d;
    }
    match w.fault() {
        EventsFault::None => respond(&body),
        EventsFault::Http500 => json_response(500, &json!({"error": "injected fault"})),
        EventsFault::Malformed => (
            [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            Body::from(r#"{"block_size": 64, "first_event_id": 1, "events": [{"event_id": "#),
        )
            .into_response(),
        EventsFault::Hang => {
            // Ends early when the client gives up (the server drops this future).
            tokio::time::sleep(Duration::from_secs(60)).await;
            let mut resp = json_response(504, &json!({"error": "hung"}));
            resp.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            resp
        }
        EventsFault::WrongBlockSize => {
            body["block_size"] = json!(w.options().block_size * 2);
            respond(&body)
        }
        EventsFault::Oversized => {
            body["padding"] = json!("x".repeat(OVERSIZED_PADDING_BYTES));
            respond(&body)
        }
    }
}

fn echo_only(w: &MockWorker, path: &str, f: impl FnOnce(&echo::EchoState) -> Response) -> Response {
    match &w.backend {
        Backend::Echo(e) => f(e),
        Backend::Engine(_) => json_response(
            404,
            &json!({"error": format!("no route for POST {path} in {} mode", w.mode_name())}),
        ),
    }
}

async fn echo_publish(State(w): Worker, body: Bytes) -> Response {
    echo_only(&w, "/admin/events", |e| e.publish(parse_json(&body)))
}

async fn echo_drop_events(State(w): Worker, body: Bytes) -> Response {
    echo_only(&w, "/admin/drop_events", |e| {
        e.drop_events(parse_json(&body))
    })
}

async fn echo_set_dump(State(w): Worker, body: Bytes) -> Response {
    echo_only(&w, "/admin/dump", |e| e.set_dump(parse_json(&body)))
}

/// The request headers a worker echoes back in `received_headers`.
pub const ECHOED_HEADERS: [&str; 3] = [
    "x-gateway-destination-endpoint",
    "x-dp-rank",
    "x-worker-instance-id",
];

fn received_headers(headers: &HeaderMap) -> Value {
    let mut m = serde_json::Map::new();
    for name in ECHOED_HEADERS {
        if let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) {
            m.insert(name.to_string(), json!(v));
        }
    }
    Value::Object(m)
}

async fn render_chat(state: Worker, body: Bytes) -> Response {
    render::reply(state.0, render::Kind::Chat, &body).await
}

async fn render_completions(state: Worker, body: Bytes) -> Response {
    render::reply(state.0, render::Kind::Completions, &body).await
}

async fn tokenize(state: Worker, body: Bytes) -> Response {
    render::reply(state.0, render::Kind::Tokenize, &body).await
}

async fn completions(state: Worker, headers: HeaderMap, body: Bytes) -> Response {
    completion(state, ApiKind::Completions, &headers, &body).await
}

async fn chat_completions(state: Worker, headers: HeaderMap, body: Bytes) -> Response {
    completion(state, ApiKind::Chat, &headers, &body).await
}

async fn completion(
    State(w): Worker,
    kind: ApiKind,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let status = w.completion_status();
    if status != 200 {
        w.count_request();
        return json_response(status, &json!({"error": "injected completion fault"}));
    }
    let received = Instant::now();
    let (seq, guard) = w.begin_completion();
    let body = match parse_json(body) {
        Ok(v) if v.is_object() => v,
        _ => {
            let err = openai::error_body(400, "request body must be a JSON object", w.worker_id());
            return json_response(400, &err);
        }
    };
    let shape = Shape::new(kind, seq, &body, w.worker_id(), received_headers(headers));
    match &w.backend {
        Backend::Echo(_) => echo::completion(shape, &body, guard, received).await,
        Backend::Engine(e) => {
            let interval = w.opts.stream_interval;
            engine_api::completion(Arc::clone(e), shape, &body, guard, received, interval).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params() {
        let q = Some("after=41&x=1&flag".to_string());
        assert_eq!(query_param(&q, "after"), Some("41"));
        assert_eq!(query_param(&q, "flag"), Some(""));
        assert_eq!(query_param(&q, "nope"), None);
        assert_eq!(query_param(&None, "after"), None);
    }
}
