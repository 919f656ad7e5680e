//! Native tools for envoy-kv-router (never compiled to wasm).
//!
//! * [`http`]: a small HTTP/1.1 client and server over `std::net`.
//! * [`mock`]: the mock LLM worker (echo mode for tests, a vLLM-like engine for benchmarks).
//! * `harness`: launches Envoy for the integration tests and the demo.

pub mod harness;
pub mod http;
pub mod loadgen;
pub mod mock;
pub mod util;
