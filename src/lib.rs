//! envoy-kv-router: a KV-cache-aware router for LLM inference, as a proxy-wasm filter for Envoy.
//!
//! The routing core (every module but `proxy`) makes no host calls; `proxy` is the thin adapter
//! to the proxy-wasm ABI. See `docs/DESIGN.md`.

pub mod config;
pub mod cost;
pub mod events;
pub mod filters;
pub mod hashing;
pub mod index;
pub mod load;
pub mod request;
pub mod rng;
pub mod router;
pub mod select;
pub mod types;

pub mod proxy;
