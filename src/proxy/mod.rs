//! The proxy-wasm adapter: the only code that talks to the host (Envoy).
//!
//! * `root`: per-VM state, configuration, the tick (log sync, event polling, load reaping).
//! * `http`: one context per request: buffer the body, decide, steer, book and release load.
//! * `replication`: the shared-data event log that keeps every VM's KV index identical.
//! * `poller`: fetches worker KV events through the event cluster (one poller per process).
//! * `load_store`: the load table in one CAS-updated shared-data key.
//! * `metrics`, `host`: Envoy stats and thin, non-panicking host-call wrappers.

pub mod host;
pub mod http;
pub mod load_store;
pub mod metrics;
pub mod poller;
pub mod replication;
pub mod root;

#[cfg(all(target_arch = "wasm32", feature = "filter"))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(root::RouterRoot::new(context_id)));
}}
