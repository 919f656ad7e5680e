//! kv-router-core: the routing core of envoy-kv-router, a KV-cache-aware router for LLM inference.
//!
//! Everything but the proxy-wasm adapter: parsing a request, hashing its blocks, the KV index,
//! load, the decision, and the request path over the small [`request_path::Host`] trait. It makes
//! no host calls and does not link proxy-wasm; the filter crate (`envoy-kv-router`, the top-level
//! `src/`) is the thin adapter to the proxy-wasm ABI and re-exports these modules. See
//! `docs/DESIGN.md`.

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
pub mod prefill_work;
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
pub mod tick;
pub mod ttft;
pub mod types;
pub mod worker_description;

// Test-only: the counting allocator of the unit tests that assert "no allocation".
#[cfg(test)]
mod alloc_count;
// Test-only: a warm kv decision allocates nothing (counted by `alloc_count`).
#[cfg(test)]
mod decision_allocations;
