//! The whole request path through `request_path::RequestPath` (what the adapter runs per
//! request), natively over an in-memory host, for instruction counts under callgrind: headers,
//! body, parse, lazy hashing, overlaps, load view, decision, headers written, booking, response
//! headers, a whole response's end (release) and `on_log`. `benches/request_path.rs` is the same
//! computation composed from the core's stages; the difference is what the request path adds
//! around them (host calls as trait calls, header values, outcome, release).
//!
//! Usage:
//!   cargo bench --bench request_path_host --no-run   # builds target/release/deps/request_path_host-*
//!   valgrind --tool=callgrind --callgrind-out-file=cg.out <binary> <tokens> <iters>
//! Instructions per request = (Ir at iters N) - (Ir at iters 0), divided by N. Without valgrind
//! it prints the wall time per request.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::hint::black_box;
use std::rc::Rc;
use std::time::{Duration, Instant};

use envoy_kv_router::config::Config;
use envoy_kv_router::events::IndexEvent;
use envoy_kv_router::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
use envoy_kv_router::load_store;
use envoy_kv_router::replication::log as replication;
use envoy_kv_router::request_path::{Action, Host, RequestPath, RoutingState, WorkerHistogram};
use envoy_kv_router::store::{SharedStore, StoreError};
use envoy_kv_router::types::{ExternalBlockHash, StorageTier};

const BLOCK_SIZE: u32 = 64;
const WORKERS: usize = 8;

/// Envoy's shared data, in memory.
#[derive(Default)]
struct Store(RefCell<HashMap<String, (Vec<u8>, u32)>>);

impl SharedStore for Store {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.0.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.0.borrow_mut();
        let current = map.get(key).map(|(_, c)| *c);
        if cas.is_some_and(|c| c != 0) && current.is_some() && current != cas {
            return Err(StoreError::CasMismatch);
        }
        let next = current.unwrap_or(0) + 1;
        map.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

/// One request's headers and body, as the host would hand them over (values copied out, as the
/// real host's calls do).
struct BenchHost {
    store: Store,
    now: u64,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Host for BenchHost {
    type Store = Store;
    fn store(&self) -> &Store {
        &self.store
    }
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        black_box((name, value));
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        black_box((name, value));
    }
    fn request_body(&self, max_bytes: usize) -> Option<Vec<u8>> {
        self.body
            .get(..max_bytes.min(self.body.len()))
            .map(<[u8]>::to_vec)
    }
    fn replace_request_body_start(&mut self, _: usize, _: &[u8]) -> bool {
        false
    }
    fn response_body(&self, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn upstream_address(&self) -> Option<String> {
        None
    }
    fn send_local_reply(&mut self, status: u32, _: &[(&str, &str)], _: &[u8]) {
        panic!("rejected: {status}");
    }
    fn resume_request(&mut self) {}
    fn dispatch_call(&mut self, _: &str, _: &[(&str, &str)], _: &[u8], _: Duration) -> Option<u32> {
        None
    }
    fn call_response_status(&self) -> Option<String> {
        None
    }
    fn call_response_body(&self, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn count(&mut self, name: &str, amount: u64) {
        black_box((name, amount));
    }
    fn count_later(&mut self, name: &str, amount: u64) {
        black_box((name, amount));
    }
    fn histogram(&mut self, name: &str, value: u64) {
        black_box((name, value));
    }
    fn worker_histogram(&mut self, index: usize, id: u64, kind: WorkerHistogram, value: u64) {
        black_box((index, id, kind, value));
    }
}

/// Token ids as a tokenizer with a 128k vocabulary emits them (mostly 5-6 digits).
fn tokens(n: usize) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_256) as u32
        })
        .collect()
}

#[inline(never)]
fn one_request(host: &mut BenchHost, vm: &mut RoutingState) {
    let mut request = RequestPath::new();
    assert_eq!(request.on_request_headers(host, vm, false), Action::Pause);
    let size = host.body.len();
    assert_eq!(
        request.on_request_body(host, vm, size, true),
        Action::Continue
    );
    request.on_response_headers(host, vm, false);
    request.on_response_body(host, vm, 100, true);
    request.on_log(host, vm);
}

fn main() {
    let nums: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n_tokens = nums.first().copied().unwrap_or(4096);
    let iters = nums.get(1).copied().unwrap_or(100);
    let workers: Vec<String> = (0..WORKERS)
        .map(|i| format!(r#"{{"id": {}, "address": "10.0.{i}.1:8000"}}"#, i + 1))
        .collect();
    let json = format!(
        r#"{{"mode": "kv", "block_size": {BLOCK_SIZE}, "workers": [{}]}}"#,
        workers.join(",")
    );
    let config = Rc::new(Config::from_json(json.as_bytes()).unwrap());
    let toks = tokens(n_tokens);
    let body = serde_json::json!({"model": "m", "prompt": toks, "max_tokens": 1}).to_string();
    let store = Store::default();
    load_store::init(&store, config.slots.len(), 900_000);
    replication::init(&store);
    let mut vm = RoutingState::new(Rc::clone(&config), 7, 42);
    // Every block held by slot 0: lazy hashing hashes the whole prompt (the worst case).
    let locals = local_block_hashes(&toks, BLOCK_SIZE, DYNAMO_HASH_SEED);
    let seqs = prompt_sequence_hashes(&toks, BLOCK_SIZE, None);
    let stored = IndexEvent::Stored {
        dp_rank: 0,
        tier: StorageTier::Device,
        parent: None,
        blocks: seqs
            .iter()
            .zip(&locals)
            .map(|(s, l)| (ExternalBlockHash(s.0 ^ 0x5555), *l))
            .collect(),
    };
    vm.replica.index.apply(0, &stored).unwrap();
    let mut host = BenchHost {
        store,
        now: 1_000,
        headers: vec![
            (":path".to_string(), "/v1/completions".to_string()),
            ("content-length".to_string(), body.len().to_string()),
        ],
        body: body.into_bytes(),
    };
    let start = Instant::now();
    for i in 0..iters {
        host.now = 1_000 + i as u64;
        one_request(&mut host, &mut vm);
    }
    let per = start.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64;
    println!(
        "tokens {n_tokens} body {} B blocks {} iters {iters}: {per:.1} us/request (wall)",
        host.body.len(),
        seqs.len()
    );
}
