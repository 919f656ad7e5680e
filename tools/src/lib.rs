//! Native tools for envoy-kv-router (never compiled to wasm), on tokio, axum, reqwest and clap.
//!
//! * [`client`]: a small blocking HTTP client for tests, benches and the harness.
//! * [`server`]: serving an axum router (foreground or on a background thread).
//! * [`mock`]: the mock LLM worker (echo mode for tests, a vLLM-like engine for benchmarks).
//! * [`loadgen`], [`compare`], [`race`]: the async load generator, the mode-by-mode comparison
//!   and the repeated all-workloads, all-arms race on top of it.
//! * [`calibrate`]: measures an engine's timing and fits the filter's TTFT polynomials.
//! * [`peer`]: peer routers (`vllm-router`) as arms of the comparison.
//! * [`prom`]: reading Prometheus text (`/metrics` of engines, workers, bridges, routers).
//! * [`harness`]: launches Envoy and mock workers for the integration tests and the demo.

pub mod calibrate;
pub mod client;
pub mod compare;
pub mod harness;
pub mod loadgen;
pub mod mock;
pub mod peer;
pub mod prom;
pub mod quality;
pub mod race;
pub mod server;
pub mod sse;
pub mod sys;
pub mod util;
pub mod vllm;
