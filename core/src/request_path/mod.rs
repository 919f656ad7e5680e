//! The request path, host-independent: what the filter does with one HTTP request, from its
//! headers to the end of its response, written against the small [`Host`] trait.
//!
//! * `context`: the per-request state ([`RequestPath`]) and the callbacks the adapter forwards.
//! * `route`: parse, hash, look up overlaps, read the load, decide (or reject, or fall back).
//! * `text`: a text prompt: the render cache, the tokenizer callout, or text prefix hashes.
//! * `steer`: the destination and reason headers, booking the load, the fallback rule.
//! * `body_priority`: `engine_priority` written into the body; the client's own priority.
//! * `response`: first token, output tracking, a retry's host, the release.
//! * `state`: what every request of a VM shares ([`RoutingState`]).
//! * `host`: the [`Host`] trait (`proxy::envoy_host` is the real one; tests have a fake).
//!
//! Nothing here imports `proxy_wasm` or `crate::proxy`. See `docs/DESIGN.md`.

mod body_priority;
mod context;
mod counters;
mod host;
mod response;
mod route;
mod state;
mod steer;
#[cfg(test)]
mod tests;
mod text;

pub use context::{Action, RequestPath};
pub use host::{Host, WorkerHistogram};
pub use state::{worker_id, RoutingState, Sample, SlotReports};

/// The header naming why the request went where it went (`kv`, `fallback:invalid_json`...).
pub const REASON_HEADER: &str = "x-kv-router-reason";
