//! The proxy-wasm adapter: the only code that talks to the host (Envoy).
//!
//! * `root`: the root context: configuration, the tick (log sync, event polling, load reaping).
//! * `vm`: the per-VM state the root context owns and request contexts share.
//! * `http`: one context per request, forwarding its callbacks to the host-independent request
//!   path ([`crate::request_path`]) with `envoy_host::EnvoyHost`, the real request-path `Host`.
//! * `members`: follows the routed cluster's hosts and health (admin `/clusters`).
//! * `poller`: sends worker event calls through the event cluster (one poller per process);
//!   `event_replies` applies their replies to the shared log, marks silent workers stale.
//! * `gauges`: the tick's gauges (per-slot load, timing factors, linear memory).
//! * `metrics`, `host`: Envoy stats, thin non-panicking host-call wrappers, and the shared-data
//!   store the core's replication log, lease and load table run on.

#[cfg(feature = "test-crash-trigger")]
pub mod crash_trigger;
pub mod envoy_host;
pub mod event_replies;
pub mod gauges;
pub mod host;
pub mod http;
pub mod members;
pub mod metrics;
pub mod poller;
pub mod root;
pub mod vm;

#[cfg(all(target_arch = "wasm32", feature = "filter"))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(root::RouterRoot::new(context_id)));
}}
