//! The request path's [`Host`] over the real host calls ([`super::host`]): headers, bodies and
//! properties of the current stream, shared data, the clock, callouts, and the VM's metrics.
//! Built per callback from two fields of the VM state (no allocation); every method is the one
//! host call it names.

use super::host::{self, HostStore};
use super::metrics::Metrics;
use super::vm::WorkerHistograms;
use crate::request_path::{Host, WorkerHistogram};
use proxy_wasm::types::{BufferType, MapType};
use std::time::Duration;

pub struct EnvoyHost<'a> {
    pub metrics: &'a mut Metrics,
    /// Per worker entry, its histograms' ids, named on first use.
    pub histograms: &'a mut Vec<Option<WorkerHistograms>>,
}

impl EnvoyHost<'_> {
    /// Worker entry `index`'s histogram ids (`worker.<id>.ttft_ms`, `.itl_ms`,
    /// `.prediction_error_pct`), named on first use and again when the entry's worker changes.
    fn worker_histograms(&mut self, index: usize, worker_id: u64) -> Option<WorkerHistograms> {
        if self.histograms.len() <= index {
            self.histograms.resize(index + 1, None);
        }
        if let Some(Some(h)) = self.histograms.get(index) {
            if h.worker_id == worker_id {
                return Some(*h);
            }
        }
        let h = WorkerHistograms {
            worker_id,
            ttft: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.ttft_ms")),
            itl: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.itl_ms")),
            error: self
                .metrics
                .histogram_id(&format!("worker.{worker_id}.prediction_error_pct")),
        };
        if let Some(slot) = self.histograms.get_mut(index) {
            *slot = Some(h);
        }
        Some(h)
    }
}

impl Host for EnvoyHost<'_> {
    type Store = HostStore;

    #[inline]
    fn store(&self) -> &HostStore {
        &HostStore
    }

    #[inline]
    fn now_ms(&self) -> u64 {
        host::now_ms()
    }

    #[inline]
    fn request_header(&self, name: &str) -> Option<String> {
        host::header(MapType::HttpRequestHeaders, name)
    }

    #[inline]
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        host::set_header(MapType::HttpRequestHeaders, name, value);
    }

    #[inline]
    fn set_response_header(&mut self, name: &str, value: &str) {
        host::set_header(MapType::HttpResponseHeaders, name, Some(value));
    }

    #[inline]
    fn request_body(&self, max_bytes: usize) -> Option<Vec<u8>> {
        host::buffer(BufferType::HttpRequestBody, max_bytes)
    }

    #[inline]
    fn replace_request_body_start(&mut self, drain: usize, insert: &[u8]) -> bool {
        host::replace_buffer_start(BufferType::HttpRequestBody, drain, insert)
    }

    #[inline]
    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        host::buffer(BufferType::HttpResponseBody, len)
    }

    #[inline]
    fn upstream_address(&self) -> Option<String> {
        host::property(&["upstream", "address"])
    }

    fn send_local_reply(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        host::local_reply(status, headers.to_vec(), body);
    }

    #[inline]
    fn resume_request(&mut self) {
        let _ = host::resume_request();
    }

    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Option<u32> {
        host::http_call_with_body(cluster, headers.to_vec(), body, timeout).ok()
    }

    #[inline]
    fn call_response_status(&self) -> Option<String> {
        host::header(MapType::HttpCallResponseHeaders, ":status")
    }

    #[inline]
    fn call_response_body(&self, len: usize) -> Option<Vec<u8>> {
        host::buffer(BufferType::HttpCallResponseBody, len)
    }

    #[inline]
    fn count(&mut self, name: &'static str, amount: u64) {
        self.metrics.add(name, amount);
    }

    #[inline]
    fn count_later(&mut self, name: &'static str, amount: u64) {
        self.metrics.add_later(name, amount);
    }

    #[inline]
    fn histogram(&mut self, name: &'static str, value: u64) {
        self.metrics.histogram(name, value);
    }

    fn worker_histogram(
        &mut self,
        worker_index: usize,
        worker_id: u64,
        kind: WorkerHistogram,
        value: u64,
    ) {
        let ids = self.worker_histograms(worker_index, worker_id);
        let id = ids.and_then(|h| match kind {
            WorkerHistogram::TtftMs => h.ttft,
            WorkerHistogram::ItlMs => h.itl,
            WorkerHistogram::PredictionErrorPct => h.error,
        });
        self.metrics.record(id, value);
    }
}
