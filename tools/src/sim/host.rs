//! The simulator's host: one callback's view of a request (its headers, body or response chunk)
//! over one Envoy's shared data and counters, at the virtual clock's millisecond.

use kv_router_core::request_path::{Host, WorkerHistogram};
use kv_router_core::store::fake::MemStore;
use std::collections::HashMap;
use std::time::Duration;

pub struct SimHost<'a> {
    pub store: &'a MemStore,
    pub counters: &'a mut HashMap<&'static str, u64>,
    pub now_ms: u64,
    pub request_headers: Vec<(String, String)>,
    pub request_body: &'a [u8],
    pub response_chunk: &'a [u8],
}

impl<'a> SimHost<'a> {
    /// A host for callbacks outside any request (the tick, event replies).
    pub fn idle(
        store: &'a MemStore,
        counters: &'a mut HashMap<&'static str, u64>,
        now_ms: u64,
    ) -> Self {
        SimHost {
            store,
            counters,
            now_ms,
            request_headers: Vec::new(),
            request_body: &[],
            response_chunk: &[],
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.request_headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl Host for SimHost<'_> {
    type Store = MemStore;

    fn store(&self) -> &MemStore {
        self.store
    }
    fn now_ms(&self) -> u64 {
        self.now_ms
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.header(name).map(str::to_string)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.request_headers
            .retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        if let Some(value) = value {
            self.request_headers
                .push((name.to_string(), value.to_string()));
        }
    }
    fn set_response_header(&mut self, _: &str, _: &str) {}
    fn request_body(&self, max_bytes: usize) -> Option<Vec<u8>> {
        let end = max_bytes.min(self.request_body.len());
        self.request_body.get(..end).map(<[u8]>::to_vec)
    }
    fn replace_request_body_start(&mut self, _: usize, _: &[u8]) -> bool {
        // Only `engine_priority` rewrites the body; the simulated engines read no priority.
        true
    }
    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        let end = len.min(self.response_chunk.len());
        self.response_chunk.get(..end).map(<[u8]>::to_vec)
    }
    fn upstream_address(&self) -> Option<String> {
        None
    }
    fn send_local_reply(&mut self, _: u32, _: &[(&str, &str)], _: &[u8]) {
        *self.counters.entry("sim.local_replies").or_default() += 1;
    }
    fn resume_request(&mut self) {}
    fn dispatch_call(&mut self, _: &str, _: &[(&str, &str)], _: &[u8], _: Duration) -> Option<u32> {
        // No tokenizer service: a text prompt falls back to the filter's own text hashing.
        None
    }
    fn call_response_status(&self) -> Option<String> {
        None
    }
    fn call_response_body(&self, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn count(&mut self, name: &'static str, amount: u64) {
        *self.counters.entry(name).or_default() += amount;
    }
    fn count_later(&mut self, name: &'static str, amount: u64) {
        self.count(name, amount);
    }
    fn histogram(&mut self, _: &'static str, _: u64) {}
    fn worker_histogram(&mut self, _: usize, _: u64, _: WorkerHistogram, _: u64) {}
}
