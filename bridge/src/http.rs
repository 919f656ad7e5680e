//! The HTTP side: `/kv/events` (with long poll), `POST /kv/declare`, `/kv/dump`, `/health`,
//! `/metrics`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;

use crate::metrics::Gauges;
use crate::state::Shared;
use kv_router_protocol::page::{Booked, TimingSums};
use kv_router_protocol::ring::PageLimits;

/// Limits of the HTTP side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    pub page: PageLimits,
    /// Cap on a long poll's `wait_ms`.
    pub max_wait: Duration,
}

#[derive(Clone)]
struct AppState {
    shared: Arc<Shared>,
    limits: HttpLimits,
}

pub fn router(shared: Arc<Shared>, limits: HttpLimits) -> Router {
    Router::new()
        .route("/kv/events", get(events))
        .route("/kv/declare", post(declare))
        .route("/kv/dump", get(dump))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(AppState { shared, limits })
}

#[derive(Deserialize)]
struct EventsQuery {
    after: Option<u64>,
    wait_ms: Option<u64>,
    /// The poller's page bounds (the filter's `events.page_events` and 7/8 of its
    /// `max_response_bytes`): a page is the smaller of these and the bridge's own caps.
    limit: Option<usize>,
    max_bytes: Option<usize>,
    /// The polling router's id (hex) and what it has booked on this worker
    /// (`<requests>,<prefill tokens>,<decode blocks>`), relayed to the other routers.
    router: Option<String>,
    booked: Option<String>,
    /// What it learned of the worker's timing (seven sums), relayed with the bookings.
    timing: Option<String>,
}

/// `POST /kv/declare`: a declaration between polls.
#[derive(Deserialize)]
struct DeclareQuery {
    router: Option<String>,
    booked: Option<String>,
    timing: Option<String>,
}

/// A router id (hex), when valid.
fn router_id(router: Option<&str>) -> Option<u64> {
    router.and_then(|r| u64::from_str_radix(r, 16).ok())
}

/// A declaration's bookings, with its timing when valid (invalid timing is left out; the
/// bookings still count).
fn declared(booked: Option<&str>, timing: Option<&str>) -> Option<Booked> {
    let mut booked = Booked::parse(booked?)?;
    booked.timing = timing.and_then(TimingSums::parse);
    Some(booked)
}

/// Records router `id`'s declaration (counted by `path` and whether it moved).
fn record_declaration(shared: &Shared, path: &str, id: u64, booked: Booked) {
    let moved = shared.routers.declare(id, booked, Instant::now());
    shared.metrics.inc(
        "kv_bridge_declarations_total",
        &[
            ("path", path),
            ("moved", if moved { "true" } else { "false" }),
        ],
    );
}

impl HttpLimits {
    /// The page bounds for one call: the bridge's caps, lowered to what the caller asked for.
    pub fn page_for(&self, limit: Option<usize>, max_bytes: Option<usize>) -> PageLimits {
        PageLimits::asked(self.page, self.page, limit, max_bytes)
    }
}

fn json(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn events(State(app): State<AppState>, query: Query<EventsQuery>) -> Response {
    let shared = &app.shared;
    // The declarations' version as the poll arrives (before it is counted): the other routers'
    // moves from here on wake it, never the caller's own.
    let versions = shared.routers.subscribe();
    shared
        .metrics
        .inc("kv_bridge_page_requests_total", &[("path", "/kv/events")]);
    let after = query.after.unwrap_or(0);
    let router = router_id(query.router.as_deref());
    let booked = declared(query.booked.as_deref(), query.timing.as_deref());
    if let (Some(id), Some(booked)) = (router, booked) {
        record_declaration(shared, "/kv/events", id, booked);
    }
    if let Some(wait_ms) = query.wait_ms.filter(|&w| w > 0) {
        let wait = Duration::from_millis(wait_ms).min(app.limits.max_wait);
        let mut last_id = shared.last_id_watch();
        let mut shutdown = shared.shutdown_watch();
        // Wait only when nothing newer exists; a cursor ahead of us (a restarted bridge)
        // gets its answer at once, so the poller notices and re-syncs.
        if *last_id.borrow() == after {
            // A poll that says who it is also returns when another router's bookings moved,
            // so that it hears of them at once.
            let others_moved = async {
                match router {
                    Some(id) => shared.routers.others_moved(id, versions).await,
                    None => std::future::pending().await,
                }
            };
            let cause = tokio::select! {
                r = last_id.wait_for(|&id| id > after) => r.ok().map(|_| "events"),
                () = others_moved => Some("declared"),
                () = tokio::time::sleep(wait) => None,
                _ = shutdown.wait_for(|&s| s) => None,
            };
            if let Some(cause) = cause {
                shared
                    .metrics
                    .inc("kv_bridge_long_poll_wakeups_total", &[("cause", cause)]);
            }
        }
    }
    // The other routers' bookings go with a fresh engine load only: without one the page
    // reports no load at all, rather than zeros beside them.
    let load = shared.load().map(|mut load| {
        load.other_routers = shared.routers.others(router, Instant::now());
        load
    });
    let limits = app.limits.page_for(query.limit, query.max_bytes);
    let body = shared.with_core(|core| core.page(after, limits, load));
    let body = kv_router_protocol::worker::splice(body, shared.worker_json().as_deref());
    json(StatusCode::OK, body)
}

/// `POST /kv/declare?router=<hex>&booked=<requests>,<tokens>,<blocks>[&timing=<sums>]`: records
/// the declaration as a poll would (waking the other routers' polls when it moved); 204, or 400
/// when `router` or `booked` is missing or invalid.
async fn declare(State(app): State<AppState>, query: Query<DeclareQuery>) -> Response {
    let shared = &app.shared;
    shared
        .metrics
        .inc("kv_bridge_page_requests_total", &[("path", "/kv/declare")]);
    let Some(id) = router_id(query.router.as_deref()) else {
        return bad_request("router: missing or not a hex id");
    };
    let Some(booked) = declared(query.booked.as_deref(), query.timing.as_deref()) else {
        return bad_request("booked: missing or not <requests>,<prefill tokens>,<decode blocks>");
    };
    record_declaration(shared, "/kv/declare", id, booked);
    StatusCode::NO_CONTENT.into_response()
}

fn bad_request(error: &str) -> Response {
    json(
        StatusCode::BAD_REQUEST,
        serde_json::json!({ "error": error }).to_string(),
    )
}

async fn dump(State(app): State<AppState>) -> Response {
    app.shared
        .metrics
        .inc("kv_bridge_page_requests_total", &[("path", "/kv/dump")]);
    let body = app.shared.with_core(|core| core.dump());
    let body = kv_router_protocol::worker::splice(body, app.shared.worker_json().as_deref());
    json(StatusCode::OK, body)
}

async fn health(State(app): State<AppState>) -> Response {
    let shared = &app.shared;
    shared
        .metrics
        .inc("kv_bridge_page_requests_total", &[("path", "/health")]);
    let engines = shared.engine_statuses();
    let connected = engines.iter().filter(|e| e.connected).count();
    let all_connected = connected == engines.len();
    let (last_event_id, blocks) = shared.with_core(|c| (c.last_event_id(), c.mirror().entries()));
    let body = serde_json::json!({
        "status": if all_connected { "ok" } else { "connecting" },
        "engines_connected": connected,
        "last_event_id": last_event_id,
        "mirror_blocks": blocks,
        "load": shared.load(),
        "engines": engines,
    });
    let status = if all_connected {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(status, body.to_string())
}

async fn metrics(State(app): State<AppState>) -> Response {
    let shared = &app.shared;
    shared
        .metrics
        .inc("kv_bridge_page_requests_total", &[("path", "/metrics")]);
    let gauges = Gauges::default();
    let (blocks, max_blocks, ring_len, ring_bytes, ring_dropped, first, last) =
        shared.with_core(|c| {
            (
                c.mirror().entries(),
                c.mirror().max_blocks(),
                c.ring().len(),
                c.ring().bytes(),
                c.ring().dropped(),
                c.ring().first_id(),
                c.ring().last_id(),
            )
        });
    gauges.set(
        "kv_bridge_mirror_blocks",
        "Blocks in the mirror (rank, medium, hash entries).",
        blocks as f64,
    );
    gauges.set(
        "kv_bridge_mirror_max_blocks",
        "The mirror's bound (--max-blocks).",
        max_blocks as f64,
    );
    gauges.set(
        "kv_bridge_page_events",
        "Events buffered for the page.",
        ring_len as f64,
    );
    gauges.set(
        "kv_bridge_page_bytes",
        "Bytes of buffered page events.",
        ring_bytes as f64,
    );
    gauges.set(
        "kv_bridge_page_events_dropped",
        "Events pushed out of the page buffer by its bounds.",
        ring_dropped as f64,
    );
    gauges.set(
        "kv_bridge_first_event_id",
        "Oldest buffered event id.",
        first as f64,
    );
    gauges.set("kv_bridge_last_event_id", "Newest event id.", last as f64);
    let engines = shared.engine_statuses();
    let per_engine = |f: &dyn Fn(&crate::state::EngineStatus) -> f64| -> Vec<f64> {
        engines.iter().map(f).collect()
    };
    gauges.set_per_engine(
        "kv_bridge_engine_connected",
        "1 when the engine's live stream is connected.",
        &per_engine(&|e| f64::from(u8::from(e.connected))),
    );
    gauges.set_per_engine(
        "kv_bridge_engine_last_seq",
        "Last sequence number applied (-1: none).",
        &per_engine(&|e| e.last_seq.map_or(-1.0, |s| s as f64)),
    );
    gauges.set_per_engine(
        "kv_bridge_engine_partial_history",
        "1 when the engine's blocks may be incomplete (late join or unrecoverable gap).",
        &per_engine(&|e| f64::from(u8::from(e.partial_history))),
    );
    let out = shared.metrics.render(&gauges);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        out,
    )
        .into_response()
}

#[cfg(test)]
mod page_limit_tests {
    use super::*;

    #[test]
    fn a_poller_may_ask_for_smaller_pages_never_larger_ones() {
        let limits = HttpLimits {
            page: PageLimits {
                max_events: 10_000,
                max_bytes: 2 << 20,
            },
            max_wait: Duration::from_secs(1),
        };
        assert_eq!(limits.page_for(None, None), limits.page);
        let asked = limits.page_for(Some(500), Some(1 << 20));
        assert_eq!((asked.max_events, asked.max_bytes), (500, 1 << 20));
        let asked = limits.page_for(Some(1 << 30), Some(1 << 40));
        assert_eq!(asked, limits.page);
        assert_eq!(limits.page_for(Some(0), Some(0)).max_events, 1);
    }
}
