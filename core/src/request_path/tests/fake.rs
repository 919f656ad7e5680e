//! The test double: a request's headers and bodies, shared data ([`MemStore`]), a clock,
//! callouts and counters, all in memory, with builder-style setters; and [`Filter`], one VM's
//! routing state configured as `on_configure` does it.

use crate::config::Config;
use crate::events::IndexEvent;
use crate::hashing::{local_block_hashes, prompt_sequence_hashes, DYNAMO_HASH_SEED};
use crate::load::SlotLoad;
use crate::load_store;
use crate::replication::log as replication;
use crate::request_path::{Action, Host, RequestPath, RoutingState, WorkerHistogram};
use crate::store::fake::MemStore;
use crate::types::{ExternalBlockHash, StorageTier};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

/// The engine's "stored" event for `tokens`' full blocks on the device tier (engine block
/// hashes derived from the prefix hashes).
pub fn stored_event(tokens: &[u32], block_size: u32) -> IndexEvent {
    let locals = local_block_hashes(tokens, block_size, DYNAMO_HASH_SEED);
    let seqs = prompt_sequence_hashes(tokens, block_size, None);
    IndexEvent::Stored {
        dp_rank: 0,
        tier: StorageTier::Device,
        parent: None,
        blocks: seqs
            .iter()
            .zip(&locals)
            .map(|(s, l)| (ExternalBlockHash(s.0 ^ 0x5555), *l))
            .collect(),
    }
}

/// The engine's "removed" event for the blocks of a [`stored_event`].
pub fn removed_event(stored: &IndexEvent) -> IndexEvent {
    let IndexEvent::Stored { blocks, .. } = stored else {
        unreachable!("a stored event")
    };
    IndexEvent::Removed {
        dp_rank: 0,
        tier: StorageTier::Device,
        blocks: blocks.iter().map(|(ext, _)| *ext).collect(),
    }
}

/// A callout the request path sent.
#[allow(dead_code)] // every field recorded, not every one asserted
#[derive(Debug, Clone)]
pub struct Callout {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

/// A local reply the request path sent.
#[allow(dead_code)] // every field recorded, not every one asserted
#[derive(Debug, Clone)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

#[derive(Default)]
pub struct FakeHost {
    pub store: MemStore,
    pub now_ms: u64,
    pub request_headers: Vec<(String, String)>,
    pub response_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    /// Refuse to hand out the request body (a host error).
    pub body_unreadable: bool,
    pub response_chunk: Vec<u8>,
    pub upstream: Option<String>,
    pub callouts: Vec<Callout>,
    pub refuse_callouts: bool,
    pub call_status: Option<String>,
    pub call_body: Vec<u8>,
    pub local_reply: Option<LocalReply>,
    pub resumed: u32,
    pub counters: HashMap<&'static str, u64>,
    pub histograms: Vec<(String, u64)>,
}

impl FakeHost {
    pub fn new() -> Self {
        FakeHost {
            now_ms: 1_000_000,
            ..FakeHost::default()
        }
    }

    /// A POST to `path` with `body` (JSON) and its `content-length`.
    pub fn post(mut self, path: &str, body: &str) -> Self {
        self.request_headers = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            ("content-length".into(), body.len().to_string()),
        ];
        self.request_body = body.as_bytes().to_vec();
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.request_headers.push((name.into(), value.into()));
        self
    }

    pub fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
    }

    pub fn request_header_value(&self, name: &str) -> Option<&str> {
        find(&self.request_headers, name)
    }

    pub fn response_header_value(&self, name: &str) -> Option<&str> {
        find(&self.response_headers, name)
    }

    pub fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    /// A new request on the same VM: the shared data, clock and counters carry over.
    pub fn next_request(&mut self, path: &str, body: &str) {
        let store = std::mem::take(&mut self.store);
        let counters = std::mem::take(&mut self.counters);
        *self = FakeHost {
            store,
            counters,
            now_ms: self.now_ms,
            ..FakeHost::default()
        }
        .post(path, body);
    }
}

fn find<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn set(headers: &mut Vec<(String, String)>, name: &str, value: Option<&str>) {
    headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    if let Some(value) = value {
        headers.push((name.to_string(), value.to_string()));
    }
}

impl Host for FakeHost {
    type Store = MemStore;

    fn store(&self) -> &MemStore {
        &self.store
    }
    fn now_ms(&self) -> u64 {
        self.now_ms
    }
    fn request_header(&self, name: &str) -> Option<String> {
        find(&self.request_headers, name).map(str::to_string)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        set(&mut self.request_headers, name, value);
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        set(&mut self.response_headers, name, Some(value));
    }
    fn request_body(&self, max_bytes: usize) -> Option<Vec<u8>> {
        if self.body_unreadable {
            return None;
        }
        let end = max_bytes.min(self.request_body.len());
        self.request_body.get(..end).map(<[u8]>::to_vec)
    }
    fn replace_request_body_start(&mut self, drain: usize, insert: &[u8]) -> bool {
        if drain > self.request_body.len() {
            return false;
        }
        self.request_body.splice(..drain, insert.iter().copied());
        true
    }
    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        let end = len.min(self.response_chunk.len());
        self.response_chunk.get(..end).map(<[u8]>::to_vec)
    }
    fn upstream_address(&self) -> Option<String> {
        self.upstream.clone()
    }
    fn send_local_reply(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.local_reply = Some(LocalReply {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: String::from_utf8_lossy(body).into_owned(),
        });
    }
    fn resume_request(&mut self) {
        self.resumed += 1;
    }
    fn dispatch_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Option<u32> {
        if self.refuse_callouts {
            return None;
        }
        self.callouts.push(Callout {
            cluster: cluster.to_string(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.to_vec(),
            timeout,
        });
        u32::try_from(self.callouts.len()).ok()
    }
    fn call_response_status(&self) -> Option<String> {
        self.call_status.clone()
    }
    fn call_response_body(&self, len: usize) -> Option<Vec<u8>> {
        let end = len.min(self.call_body.len());
        self.call_body.get(..end).map(<[u8]>::to_vec)
    }
    fn count(&mut self, name: &'static str, amount: u64) {
        *self.counters.entry(name).or_default() += amount;
    }
    fn count_later(&mut self, name: &'static str, amount: u64) {
        self.count(name, amount);
    }
    fn histogram(&mut self, name: &'static str, value: u64) {
        self.histograms.push((name.to_string(), value));
    }
    fn worker_histogram(&mut self, _: usize, worker_id: u64, kind: WorkerHistogram, value: u64) {
        self.histograms
            .push((format!("worker.{worker_id}.{kind:?}"), value));
    }
}

/// One VM's routing state, configured as `on_configure` does it, on the host's shared data.
pub struct Filter {
    pub vm: RoutingState,
}

impl Filter {
    pub fn new(host: &FakeHost, json: &str) -> Filter {
        let config = Rc::new(Config::from_json(json.as_bytes()).unwrap());
        load_store::init(
            &host.store,
            config.slots.len(),
            config.load.request_timeout_ms,
        );
        replication::init(&host.store);
        Filter {
            vm: RoutingState::new(config, 7, 42),
        }
    }

    /// Worker slot `slot` holds `tokens`' blocks on its device (in this VM's index replica).
    pub fn holds(&mut self, slot: u16, tokens: &[u32]) {
        let stored = stored_event(tokens, self.vm.config.block_size);
        self.vm.replica.index.apply(slot, &stored).unwrap();
    }

    /// The request's headers and whole body, as Envoy delivers them.
    pub fn send(&mut self, host: &mut FakeHost) -> (RequestPath, Action) {
        let mut request = RequestPath::new();
        let first = request.on_request_headers(host, &mut self.vm, false);
        assert_eq!(first, Action::Pause, "an LLM request waits for its body");
        let size = host.request_body.len();
        let action = request.on_request_body(host, &mut self.vm, size, true);
        (request, action)
    }

    /// Every slot's load as the shared table has it now.
    pub fn load(&self, host: &FakeHost) -> Vec<SlotLoad> {
        load_store::view(&host.store, self.vm.config.slots.len(), host.now_ms)
    }

    /// Requests in flight over every slot.
    pub fn active(&self, host: &FakeHost) -> u32 {
        self.load(host).iter().map(|l| l.active_requests).sum()
    }
}
