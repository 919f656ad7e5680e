//! Native tools for envoy-kv-router (never compiled to wasm), on tokio, axum, reqwest and clap.
//!
//! * [`server`]: serving an axum router (foreground or on a background thread).
//! * [`mock`]: the mock LLM worker (echo mode for tests, a vLLM-like engine for benchmarks).
//! * [`loadgen`], [`compare`], [`race`]: the async load generator, the mode-by-mode comparison
//!   and the repeated all-workloads, all-arms race on top of it.
//! * [`sim`]: the filter's request path in front of the mock's engine model in virtual time.
//! * [`calibrate`]: measures an engine's timing and fits the filter's TTFT polynomials.
//! * [`peer`]: peer routers (`vllm-router`) as arms of the comparison.
//! * [`harness`], [`client`], [`sse`], [`prom`], [`sys`], [`util`]: the test kit
//!   (`kv-router-testkit`: Envoy launcher, fleets, waits, HTTP/SSE client, Prometheus text),
//!   re-exported here under their old paths.

pub mod calibrate;
pub mod compare;
pub mod loadgen;
pub mod mock;
pub mod peer;
pub mod quality;
pub mod race;
pub mod server;
pub mod sim;
pub mod vllm;

pub use kv_router_testkit::{client, harness, prom, sse, sys, util};
