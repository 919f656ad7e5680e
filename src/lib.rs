//! envoy-kv-router: a KV-cache-aware router for LLM inference, as a proxy-wasm filter for Envoy.
//!
//! This crate is the thin adapter to the proxy-wasm ABI (`proxy`), the only code that talks to the
//! host. The routing core (parsing, hashing, the KV index, load, the decision, the request path
//! over the small `Host` trait) is the `kv-router-core` crate (`core/`), which makes no host calls
//! and does not link proxy-wasm; its modules are re-exported here, so `envoy_kv_router::config`,
//! `envoy_kv_router::router`, ... (and `crate::config` inside `proxy`) name them. See
//! `docs/DESIGN.md`.

pub use kv_router_core::*;

// Test-only: the counting allocator of the unit tests that assert "no allocation" (the adapter's
// metrics test). The same file as the core's: a global allocator is per test binary.
#[cfg(test)]
#[path = "../core/src/alloc_count.rs"]
mod alloc_count;

// The adapter links proxy-wasm, whose exported `proxy_on_*` entry points import host functions
// from the `env` module. The wasm32 logic tests (`--no-default-features`, run under Node) cannot
// provide those, so the adapter is only compiled with the `filter` feature (on by default).
#[cfg(feature = "filter")]
pub mod proxy;
