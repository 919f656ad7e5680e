//! The host as the request path sees it: one request's headers and body, the shared data, the
//! clock, callouts and metrics. `proxy::host::EnvoyHost` is the real one (proxy-wasm calls);
//! tests use a fake (in-memory maps).
//!
//! Every method is one host call in the adapter, and the request path calls them exactly where
//! it used to call the host directly: the trait adds no call and no allocation. It is used
//! through generics (`impl Host`), never as `dyn Host`, so each call is static and inlined.

use crate::store::SharedStore;
use std::time::Duration;

/// Which of a worker's histograms a value goes to (`worker.<id>.<kind>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerHistogram {
    TtftMs,
    ItlMs,
    PredictionErrorPct,
}

/// The host calls of the request path (one request's view, plus what every request shares).
pub trait Host {
    /// Envoy's shared data.
    type Store: SharedStore;
    fn store(&self) -> &Self::Store;
    /// Host wall-clock time in milliseconds.
    fn now_ms(&self) -> u64;

    /// A request header, lossily decoded (`None`: absent or unreadable).
    fn request_header(&self, name: &str) -> Option<String>;
    /// Sets (`Some`) or removes (`None`) a request header.
    fn set_request_header(&mut self, name: &str, value: Option<&str>);
    fn set_response_header(&mut self, name: &str, value: &str);
    /// The buffered request body's first `max_bytes` bytes (`None`: unreadable).
    fn request_body(&self, max_bytes: usize) -> Option<Vec<u8>>;
    /// Replaces the request body's first `drain` bytes with `insert`; false if refused.
    fn replace_request_body_start(&mut self, drain: usize, insert: &[u8]) -> bool;
    /// The current response body chunk's first `len` bytes.
    fn response_body(&self, len: usize) -> Option<Vec<u8>>;
    /// The address of the upstream host that answered (after Envoy's retries).
    fn upstream_address(&self) -> Option<String>;

    /// Ends the request with a local reply.
    fn send_local_reply(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Resumes a request paused for a callout.
    fn resume_request(&mut self);
    /// Sends a callout with a body; its token, or `None` if the host refused it.
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Option<u32>;
    /// The `:status` of the callout reply being handled.
    fn call_response_status(&self) -> Option<String>;
    /// The callout reply's body (`len` bytes).
    fn call_response_body(&self, len: usize) -> Option<Vec<u8>>;

    /// Adds to a counter now. Names are static (`request_path::counters`): a request never
    /// formats one.
    fn count(&mut self, name: &'static str, amount: u64);
    /// Adds to a counter that every request bumps: handed to the host on the next tick.
    fn count_later(&mut self, name: &'static str, amount: u64);
    fn histogram(&mut self, name: &'static str, value: u64);
    /// Records into worker entry `worker_index`'s (id `worker_id`) histogram `kind`.
    fn worker_histogram(
        &mut self,
        worker_index: usize,
        worker_id: u64,
        kind: WorkerHistogram,
        value: u64,
    );
}
