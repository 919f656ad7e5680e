//! Native tools for envoy-kv-router (never compiled to wasm).
//!
//! * [`http`]: a small HTTP/1.1 client and server over `std::net`.
//! * `harness`: launches Envoy for the integration tests and the demo.

pub mod harness;
pub mod http;
