//! The wire types and codecs shared by the filter (envoy-kv-router), the bridge
//! (kv-event-bridge) and the mock worker (envoy-kv-router-tools), each defined once here.
//!
//! * [`worker`]: a worker's description of itself (the `worker` object of its event page);
//! * [`page`]: the event page and dump the filter polls (the vLLM-shaped events a producer
//!   writes, the `load` object, the id bound);
//! * [`ring`]: the id-numbered, bounded event buffer behind `GET /kv/events` (bridge and mock);
//! * `vllm` (feature `msgpack`): vLLM / SGLang KV-event msgpack, decoded by the bridge and
//!   encoded by the mock's engine mode from the same types;
//! * `prom` (feature `prom`): reading Prometheus text (engines' `/metrics`: the bridge's load;
//!   the tests' and tools' scrapes).
//!
//! The default features build for wasm32-unknown-unknown (the filter links this crate): no async
//! runtime, no proxy-wasm. Nothing here panics on bad input; decoders return errors.

// Production code avoids unwrap/expect/panic (lints in Cargo.toml); tests may use them.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod page;
#[cfg(feature = "prom")]
pub mod prom;
pub mod ring;
#[cfg(feature = "msgpack")]
pub mod vllm;
pub mod worker;
