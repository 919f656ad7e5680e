//! The test kit of envoy-kv-router (native only, never compiled to wasm): what the integration
//! tests, the tools (`envoy-kv-router-tools`) and the benches share to run Envoy and fleets.
//!
//! * [`harness`]: launches Envoy (bootstrap, the built filter), mock workers and
//!   `kv-event-bridge` processes, and waits on them.
//! * [`client`]: a small blocking HTTP client for tests, benches and the harness.
//! * [`sse`]: reading server-sent event streams (chat completions with `stream: true`).
//! * [`prom`]: reading Prometheus text (`/metrics` of engines, workers, bridges, routers):
//!   `kv_router_protocol::prom`, which the bridge reads engines' load with too.
//! * [`kv_events`]: vLLM-shaped KV events (`BlockStored`, `BlockRemoved`) for fixtures, written
//!   by `kv_router_protocol::page::EventJson`.
//! * [`sys`]: process limits and resource usage (open-file limit, CPU time, peak memory).
//! * [`util`]: small shared helpers (deterministic mixing, HDR percentiles, poison-tolerant
//!   locking, `reqwest` errors as `io::Error`).
//!
//! Of the workspace it depends on `kv-router-protocol` alone; `envoy-kv-router-tools` depends on it and re-exports
//! these modules under their old paths (`envoy_kv_router_tools::harness`, ...).

pub mod client;
pub mod harness;
pub mod kv_events;
pub use kv_router_protocol::prom;
pub mod sse;
pub mod sys;
pub mod util;
