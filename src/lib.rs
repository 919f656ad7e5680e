//! envoy-kv-router: a KV-cache-aware router for LLM inference, as a proxy-wasm filter for Envoy.
//!
//! The routing core (every module but `proxy`) makes no host calls; `proxy` is the thin adapter
//! to the proxy-wasm ABI. See `docs/DESIGN.md`.

pub mod affinity;
pub mod approx;
pub mod config;
pub mod cost;
pub mod events;
pub mod filters;
pub mod hashing;
pub mod index;
pub mod lazy_hash;
pub mod learn;
pub mod load;
pub mod load_store;
pub mod membership;
pub mod polling;
pub mod priority;
pub mod prompt_text;
pub mod render;
pub mod replication;
pub mod request;
pub mod request_path;
pub mod rng;
pub mod route_error;
pub mod router;
pub mod select;
pub mod store;
pub mod text;
pub mod ttft;
pub mod types;
pub mod worker_description;

// Test-only: the counting allocator of the unit tests that assert "no allocation".
#[cfg(test)]
mod alloc_count;
// Test-only: a warm kv decision allocates nothing (counted by `alloc_count`).
#[cfg(test)]
mod decision_allocations;

// The adapter links proxy-wasm, whose exported `proxy_on_*` entry points import host functions
// from the `env` module. The wasm32 logic tests (`--no-default-features`, run under Node) cannot
// provide those, so the adapter is only compiled with the `filter` feature (on by default).
#[cfg(feature = "filter")]
pub mod proxy;
