//! In-process end to end: a fake engine (zeromq PUB + ROUTER replay, speaking vLLM's protocol)
//! -> the bridge -> its HTTP page, checked with the filter's own page parser.
//!
//! The property checked after every scenario: the bridge's `/kv/dump` equals the blocks that a
//! full replay of the engine's current history gives (reference model below), and replaying
//! the page's events from the start gives the same blocks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use kv_event_bridge::config::BridgeConfig;
use kv_event_bridge::core::CoreLimits;
use kv_event_bridge::engine::{EngineSpec, EngineTiming};
use kv_event_bridge::http::HttpLimits;
use kv_event_bridge::Bridge;
use kv_router_core::events::{parse_dump, parse_event_page, IndexEvent};
use kv_router_core::index::KvIndex;
use kv_router_protocol::ring::PageLimits;
use kv_router_protocol::vllm::{decode_batch, EngineEvent};
use serde_json::Value;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, XPubSocket, ZmqMessage};

const BS: usize = 32;
const TOPIC: &str = "kv";

// ---------------------------------------------------------------------------------------------
// A fake engine: PUB for the live stream, ROUTER for replays, like vLLM's ZmqEventPublisher.
// ---------------------------------------------------------------------------------------------

type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

struct FakeEngine {
    /// XPUB rather than PUB: it shows the test when the bridge's subscription arrived, so no
    /// batch is lost to the PUB/SUB "slow joiner" race unless a test wants it lost.
    publisher: XPubSocket,
    pub_endpoint: String,
    replay_endpoint: String,
    /// The replay buffer (every batch of the current incarnation).
    buffer: Buffer,
    next_seq: u64,
    rank: u32,
    stop_replays: tokio::sync::oneshot::Sender<()>,
    replays: tokio::task::JoinHandle<()>,
}

impl FakeEngine {
    async fn start(rank: u32) -> FakeEngine {
        Self::start_at(rank, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0").await
    }

    async fn start_at(rank: u32, pub_at: &str, replay_at: &str) -> FakeEngine {
        let mut publisher = XPubSocket::new();
        let pub_endpoint = bind_retrying(&mut publisher, pub_at).await;
        let mut router = RouterSocket::new();
        let replay_endpoint = bind_retrying(&mut router, replay_at).await;
        let buffer: Buffer = Arc::default();
        let (stop_replays, stop) = tokio::sync::oneshot::channel();
        let replays = tokio::spawn(serve_replays(router, Arc::clone(&buffer), stop));
        FakeEngine {
            publisher,
            pub_endpoint,
            replay_endpoint,
            buffer,
            next_seq: 0,
            rank,
            stop_replays,
            replays,
        }
    }

    /// The process ends: both sockets close (their ports are free again).
    async fn stop(self) {
        let _ = self.stop_replays.send(());
        self.replays.await.unwrap();
        self.publisher.close().await;
    }

    /// Waits for a subscriber's subscription (XPUB delivers it as a message).
    async fn wait_subscribed(&mut self) {
        let message = tokio::time::timeout(Duration::from_secs(10), self.publisher.recv())
            .await
            .expect("no subscription within 10 s")
            .unwrap();
        let frame = message.into_vec().remove(0);
        assert_eq!(
            &frame[..],
            [&[1u8][..], TOPIC.as_bytes()].concat().as_slice()
        );
    }

    fn record(&mut self, payload: &[u8]) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer.lock().unwrap().push((seq, payload.to_vec()));
        seq
    }

    /// Publishes a batch (and buffers it for replay).
    async fn publish(&mut self, payload: &[u8]) -> u64 {
        let seq = self.record(payload);
        let message = ZmqMessage::try_from(vec![
            Bytes::from_static(TOPIC.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .unwrap();
        self.publisher.send(message).await.unwrap();
        seq
    }

    /// A batch the subscriber never receives (dropped on the way), still in the replay buffer.
    fn publish_lost(&mut self, payload: &[u8]) -> u64 {
        self.record(payload)
    }

    /// A restarted engine: empty buffer, sequence from 0 (same addresses).
    fn restart(&mut self) {
        self.buffer.lock().unwrap().clear();
        self.next_seq = 0;
    }

    /// Payloads of the current incarnation, in order.
    fn history(&self) -> Vec<Vec<u8>> {
        self.buffer
            .lock()
            .unwrap()
            .iter()
            .map(|(_, p)| p.clone())
            .collect()
    }
}

/// Binds, retrying while a just-closed socket still holds the port (a restart on one address).
async fn bind_retrying(socket: &mut impl Socket, endpoint: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match socket.bind(endpoint).await {
            Ok(bound) => return bound.to_string(),
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot bind {endpoint}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn serve_replays(
    mut router: RouterSocket,
    buffer: Buffer,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    loop {
        let request = tokio::select! {
            r = router.recv() => match r {
                Ok(r) => r,
                Err(_) => break,
            },
            _ = &mut stop => break,
        };
        let frames = request.into_vec();
        let identity = frames[0].clone();
        let start = u64::from_be_bytes(frames.last().unwrap()[..8].try_into().unwrap());
        let items: Vec<(u64, Vec<u8>)> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in items {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ];
            if router
                .send(ZmqMessage::try_from(reply).unwrap())
                .await
                .is_err()
            {
                break;
            }
        }
        let end = vec![
            identity,
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        let _ = router.send(ZmqMessage::try_from(end).unwrap()).await;
    }
    router.close().await;
}

// ---------------------------------------------------------------------------------------------
// The bridge and its HTTP side
// ---------------------------------------------------------------------------------------------

fn config(engines: &[(&FakeEngine, bool)], idle: Duration) -> BridgeConfig {
    BridgeConfig {
        worker: Default::default(),
        engine_models_url: None,
        listen: "127.0.0.1:0".parse().unwrap(),
        engines: engines
            .iter()
            .enumerate()
            .map(|(index, (e, replay))| EngineSpec {
                index,
                endpoint: e.pub_endpoint.clone(),
                replay: replay.then(|| e.replay_endpoint.clone()),
                topic: TOPIC.into(),
                dp_rank: Some(e.rank),
            })
            .collect(),
        core: CoreLimits {
            block_size: BS as u32,
            first_event_id: 1,
            max_blocks: 100_000,
            max_events: 100_000,
            max_ring_bytes: 64 << 20,
        },
        http: HttpLimits {
            page: PageLimits {
                max_events: 7, // small pages: the page walk below must follow `after`
                max_bytes: 1 << 20,
            },
            max_wait: Duration::from_secs(30),
        },
        timing: EngineTiming {
            connect_timeout: Duration::from_secs(2),
            idle_probe: idle,
            replay_timeout: Duration::from_secs(2),
            replay_max_batches: 100_000,
            max_payload_bytes: 1 << 20,
            reconnect_backoff_max: Duration::from_millis(200),
        },
        engine_metrics_urls: vec![],
        engine_metrics_interval: Duration::from_secs(1),
    }
}

async fn start_bridge(engines: &mut [(&mut FakeEngine, bool)]) -> Bridge {
    start_bridge_idle(engines, Duration::from_secs(60)).await
}

async fn start_bridge_idle(engines: &mut [(&mut FakeEngine, bool)], idle: Duration) -> Bridge {
    let specs: Vec<(&FakeEngine, bool)> = engines.iter().map(|(e, r)| (&**e, *r)).collect();
    let bridge = Bridge::start(config(&specs, idle)).await.unwrap();
    for (engine, _) in engines.iter_mut() {
        engine.wait_subscribed().await;
    }
    wait_for(&bridge, "every engine connected", |h| h["status"] == "ok").await;
    bridge
}

async fn get(bridge: &Bridge, path: &str) -> (u16, String) {
    let response = reqwest::get(format!("http://{}{path}", bridge.addr))
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

async fn get_json(bridge: &Bridge, path: &str) -> Value {
    serde_json::from_str(&get(bridge, path).await.1).unwrap()
}

async fn health(bridge: &Bridge) -> Value {
    get_json(bridge, "/health").await
}

/// Polls `/health` until `cond` holds (10 s deadline).
async fn wait_for(bridge: &Bridge, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(bridge).await;
        if cond(&h) {
            return h;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; health: {h:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_for_seq(bridge: &Bridge, engine: usize, seq: u64) -> Value {
    wait_for(bridge, &format!("engine {engine} at seq {seq}"), |h| {
        h["engines"][engine]["last_seq"] == seq && h["engines"][engine]["state"] == "connected"
    })
    .await
}

/// The sum of the samples of `name` with `labels` (0 when there is none).
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> u64 {
    kv_router_testkit::prom::sum(text, name, labels).unwrap_or(0.0) as u64
}

async fn metrics(bridge: &Bridge) -> String {
    get(bridge, "/metrics").await.1
}

// ---------------------------------------------------------------------------------------------
// Block sets: the reference (full replay of the engine's history), the dump, the page replay
// ---------------------------------------------------------------------------------------------

/// (rank, medium, hash, parent, tokens of the block)
type Block = (u32, String, u64, Option<u64>, Vec<u32>);
type BlockSet = BTreeSet<Block>;
/// (refs, parent, tokens) by (rank, medium, hash)
type Held = BTreeMap<(u32, String, u64), (u32, Option<u64>, Vec<u32>)>;

/// What the engine holds after its whole history: reference counts per (rank, medium, hash).
fn reference(histories: &[(u32, Vec<Vec<u8>>)]) -> BlockSet {
    let mut held = Held::new();
    for (rank, history) in histories {
        for payload in history {
            for event in decode_batch(payload, 1 << 20).unwrap().events {
                match event {
                    EngineEvent::Stored(s) => {
                        let medium = s.medium.unwrap_or_else(|| "GPU".into()).to_uppercase();
                        let mut parent = s.parent;
                        for (hash, tokens) in s.block_hashes.iter().zip(s.token_ids.chunks(BS)) {
                            held.entry((*rank, medium.clone(), *hash))
                                .and_modify(|b| b.0 += 1)
                                .or_insert((1, parent, tokens.to_vec()));
                            parent = Some(*hash);
                        }
                    }
                    EngineEvent::Removed {
                        block_hashes,
                        medium,
                    } => {
                        let medium = medium.unwrap_or_else(|| "GPU".into()).to_uppercase();
                        for hash in block_hashes {
                            let key = (*rank, medium.clone(), hash);
                            if let Some(b) = held.get_mut(&key) {
                                b.0 -= 1;
                                if b.0 == 0 {
                                    held.remove(&key);
                                }
                            }
                        }
                    }
                    EngineEvent::AllCleared => held.retain(|(r, _, _), _| r != rank),
                }
            }
        }
    }
    held.into_iter()
        .map(|((r, m, h), (_, p, t))| (r, m, h, p, t))
        .collect()
}

fn stored_blocks(event: &Value) -> Vec<Block> {
    let rank = event["dp_rank"].as_u64().unwrap() as u32;
    let medium = event["medium"].as_str().unwrap().to_owned();
    let tokens: Vec<u32> = event["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let mut parent = event["parent_block_hash"].as_u64();
    let mut out = Vec::new();
    for (hash, chunk) in event["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .zip(tokens.chunks(BS))
    {
        let hash = hash.as_u64().unwrap();
        out.push((rank, medium.clone(), hash, parent, chunk.to_vec()));
        parent = Some(hash);
    }
    out
}

/// The dump, checked by the filter's own parser, as a block set; and its last_event_id.
async fn dump(bridge: &Bridge) -> (BlockSet, u64) {
    let (status, body) = get(bridge, "/kv/dump").await;
    assert_eq!(status, 200);
    kv_router_core::events::parse_dump(body.as_bytes(), BS as u32, 64 << 20)
        .unwrap_or_else(|e| panic!("the filter rejects the dump: {e}\n{body}"));
    let v: Value = serde_json::from_str(&body).unwrap();
    let mut set = BlockSet::new();
    let mut seen = BTreeSet::new();
    for e in v["events"].as_array().unwrap() {
        assert_eq!(e["type"], "BlockStored");
        for block in stored_blocks(e) {
            // Parents come first (the filter rejects a child whose parent it does not hold).
            if let Some(p) = block.3 {
                let parent_held = v["events"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| stored_blocks(x).iter().any(|b| b.0 == block.0 && b.2 == p));
                assert!(
                    !parent_held || seen.contains(&(block.0, p)),
                    "child {} before its parent {p}",
                    block.2
                );
            }
            seen.insert((block.0, block.2));
            set.insert(block);
        }
    }
    (set, v["last_event_id"].as_u64().unwrap())
}

/// Walks the page from the start like the filter's poller (checking each page with the
/// filter's parser) and applies it with set semantics. Returns the blocks and every event.
async fn replay_page(bridge: &Bridge) -> (BlockSet, Vec<Value>) {
    let mut after = 0u64;
    let mut events = Vec::new();
    loop {
        let (status, body) = get(bridge, &format!("/kv/events?after={after}")).await;
        assert_eq!(status, 200);
        let parsed = kv_router_core::events::parse_event_page(body.as_bytes(), BS as u32, 64 << 20)
            .unwrap_or_else(|e| panic!("the filter rejects the page: {e}\n{body}"));
        assert_eq!(
            parsed.first_event_id,
            Some(1),
            "nothing was pushed out of the ring"
        );
        let page: Value = serde_json::from_str(&body).unwrap();
        let batch = page["events"].as_array().unwrap().clone();
        assert!(batch.len() <= 7);
        for (i, e) in batch.iter().enumerate() {
            assert_eq!(
                e["event_id"].as_u64().unwrap(),
                after + 1 + i as u64,
                "consecutive ids"
            );
        }
        after += batch.len() as u64;
        events.extend(batch);
        if after >= page["last_event_id"].as_u64().unwrap() {
            break;
        }
    }
    let mut set = BlockSet::new();
    for e in &events {
        match e["type"].as_str().unwrap() {
            "BlockStored" => set.extend(stored_blocks(e)),
            "BlockRemoved" => {
                let rank = e["dp_rank"].as_u64().unwrap() as u32;
                let medium = e["medium"].as_str().unwrap();
                let gone: BTreeSet<u64> = e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect();
                set.retain(|b| !(b.0 == rank && b.1 == medium && gone.contains(&b.2)));
            }
            "AllBlocksCleared" => {
                let rank = e["dp_rank"].as_u64().expect("clears name their rank") as u32;
                set.retain(|b| b.0 != rank);
            }
            other => panic!("unexpected event type {other}"),
        }
    }
    (set, events)
}

const SLOTS: usize = 4;

/// Applies events the way the filter does (slot = dp_rank; a clear with a rank clears that slot
/// only, without one every slot).
fn apply_to_filter_index(index: &mut KvIndex, events: &[IndexEvent]) {
    for event in events {
        let slots: Vec<u16> = match event {
            IndexEvent::Cleared { dp_rank: None } => (0..SLOTS as u16).collect(),
            IndexEvent::Cleared { dp_rank: Some(r) }
            | IndexEvent::Stored { dp_rank: r, .. }
            | IndexEvent::Removed { dp_rank: r, .. } => vec![*r as u16],
        };
        for slot in slots {
            // Unknown parents are rejected here as in the filter; both paths must agree.
            let _ = index.apply(slot, event);
        }
    }
}

/// The filter's own index, fed once from the page (from id 1) and once from the dump, holds
/// the same blocks per rank.
async fn assert_filter_index_agrees(bridge: &Bridge) -> Vec<usize> {
    let parse = |body: &str| parse_event_page(body.as_bytes(), BS as u32, 64 << 20).unwrap();
    let mut from_page = KvIndex::new(SLOTS, 1 << 20);
    let mut after = 0;
    loop {
        let page = parse(&get(bridge, &format!("/kv/events?after={after}")).await.1);
        let events: Vec<IndexEvent> = page.events.iter().map(|e| e.event.clone()).collect();
        apply_to_filter_index(&mut from_page, &events);
        after = page.events.last().map_or(after, |e| e.event_id);
        if after >= page.last_event_id {
            break;
        }
    }
    let dump = parse_dump(
        get(bridge, "/kv/dump").await.1.as_bytes(),
        BS as u32,
        64 << 20,
    )
    .unwrap();
    let mut from_dump = KvIndex::new(SLOTS, 1 << 20);
    let events: Vec<IndexEvent> = dump.events.iter().map(|e| e.event.clone()).collect();
    apply_to_filter_index(&mut from_dump, &events);
    let per_slot = |i: &KvIndex| {
        (0..SLOTS as u16)
            .map(|s| i.slot_blocks(s))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        per_slot(&from_page),
        per_slot(&from_dump),
        "filter index: page replay vs dump"
    );
    per_slot(&from_dump)
}

/// The property: dump == reference == page replay (and the filter's index agrees).
async fn assert_consistent(bridge: &Bridge, engines: &[&FakeEngine]) -> BlockSet {
    let histories: Vec<(u32, Vec<Vec<u8>>)> =
        engines.iter().map(|e| (e.rank, e.history())).collect();
    let want = reference(&histories);
    let (dumped, last_id) = dump(bridge).await;
    assert_eq!(dumped, want, "dump != full replay of the engine's history");
    let (paged, events) = replay_page(bridge).await;
    assert_eq!(
        paged, want,
        "page replay != full replay of the engine's history"
    );
    assert_eq!(last_id, events.len() as u64);
    let per_slot = assert_filter_index_agrees(bridge).await;
    for rank in 0..SLOTS as u32 {
        // Every block the engine holds reaches the filter's index (no orphans in these runs).
        let held = want
            .iter()
            .filter(|b| b.0 == rank)
            .map(|b| b.2)
            .collect::<BTreeSet<_>>()
            .len();
        assert_eq!(per_slot[rank as usize], held, "filter index, rank {rank}");
    }
    want
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

// Synthetic batches (block size 32, rank from the batch).

fn store_batch(rank: u64, chain: &[u64], parent: Option<u64>) -> Vec<u8> {
    let tokens: Vec<u32> = chain.iter().flat_map(|&h| block_tokens(h, BS)).collect();
    batch(1, Some(rank), |mp| {
        stored_map(mp, chain, parent, &tokens, BS as u64, Some("GPU"))
    })
}

fn remove_batch(rank: u64, hashes: &[u64]) -> Vec<u8> {
    batch(1, Some(rank), |mp| removed_map(mp, hashes, "GPU"))
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_payloads_flow_to_the_page() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    for payload in fixtures() {
        engine.publish(&payload).await;
    }
    wait_for_seq(&bridge, 0, 17).await;
    let blocks = assert_consistent(&bridge, &[&engine]).await;
    // The last batch cleared the cache and stored one block (hash from DECODED.txt).
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks.iter().next().unwrap().2, 1267335617115042266);

    let (_, events) = replay_page(&bridge).await;
    let k = kinds(&events);
    assert_eq!(k.iter().filter(|t| *t == "AllBlocksCleared").count(), 1);
    assert_eq!(k.last().map(String::as_str), Some("BlockStored"));
    // 18 batches carry 16 + 1 stores (fixture 17 has one) ... every engine store is forwarded.
    let engine_stores: usize = fixtures()
        .iter()
        .map(|p| {
            decode_batch(p, 1 << 20)
                .unwrap()
                .events
                .iter()
                .filter(|e| matches!(e, EngineEvent::Stored(_)))
                .count()
        })
        .sum();
    assert_eq!(
        k.iter().filter(|t| *t == "BlockStored").count(),
        engine_stores
    );
    let m = metrics(&bridge).await;
    assert_eq!(metric(&m, "kv_bridge_resets_total", &[]), 0);
    assert_eq!(metric(&m, "kv_bridge_bad_frames_total", &[]), 0);
    assert_eq!(metric(&m, "kv_bridge_refused_events_total", &[]), 0);
    assert_eq!(metric(&m, "kv_bridge_batches_total", &[]), 18);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_stores_are_refcounted_through_the_page() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    engine.publish(&store_batch(0, &[10, 11], None)).await;
    engine.publish(&store_batch(0, &[10], None)).await; // a second physical copy of block 10
    engine.publish(&remove_batch(0, &[10, 11])).await; // one copy of 10 and the only 11
    let seq = engine.publish(&remove_batch(0, &[99])).await; // unknown: not forwarded
    wait_for_seq(&bridge, 0, seq).await;
    let blocks = assert_consistent(&bridge, &[&engine]).await;
    assert_eq!(blocks.iter().map(|b| b.2).collect::<Vec<_>>(), vec![10]);
    let (_, events) = replay_page(&bridge).await;
    assert_eq!(
        kinds(&events),
        vec!["BlockStored", "BlockStored", "BlockRemoved"]
    );
    assert_eq!(events[2]["block_hashes"], serde_json::json!([11]));
    let seq = engine.publish(&remove_batch(0, &[10])).await;
    wait_for_seq(&bridge, 0, seq).await;
    assert!(assert_consistent(&bridge, &[&engine]).await.is_empty());
    let m = metrics(&bridge).await;
    assert_eq!(metric(&m, "kv_bridge_removed_still_held_total", &[]), 1);
    assert_eq!(metric(&m, "kv_bridge_removed_unknown_blocks_total", &[]), 1);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_by_replay() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    let f = fixtures();
    for payload in &f[..5] {
        engine.publish(payload).await;
    }
    wait_for_seq(&bridge, 0, 4).await;
    // Batches 5..=10 never reach the subscriber (the eviction batches 9 and 10 remove blocks
    // stored before: missing them would leave stale blocks).
    for payload in &f[5..11] {
        engine.publish_lost(payload);
    }
    let seq = engine.publish(&f[11]).await;
    wait_for_seq(&bridge, 0, seq).await;
    assert_consistent(&bridge, &[&engine]).await;
    let m = metrics(&bridge).await;
    assert!(metric(&m, "kv_bridge_seq_gaps_total", &[]) >= 1, "{m}");
    assert_eq!(
        metric(&m, "kv_bridge_resets_total", &[]),
        0,
        "a replayable gap clears nothing"
    );
    assert!(metric(&m, "kv_bridge_replayed_batches_total", &[]) >= 6);
    let h = health(&bridge).await;
    assert_eq!(h["engines"][0]["partial_history"], false);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_clears_the_rank_and_rebuilds() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    let f = fixtures();
    for payload in &f[..9] {
        engine.publish(payload).await;
    }
    wait_for_seq(&bridge, 0, 8).await;
    let (before, _) = dump(&bridge).await;
    assert!(!before.is_empty());

    // The engine restarts: empty cache, sequence from 0. Its first batches stores new blocks.
    engine.restart();
    engine.publish(&store_batch(0, &[500, 501], None)).await;
    let seq = engine.publish(&store_batch(0, &[502], Some(501))).await;
    wait_for_seq(&bridge, 0, seq).await;
    let blocks = assert_consistent(&bridge, &[&engine]).await;
    assert_eq!(
        blocks.iter().map(|b| b.2).collect::<Vec<_>>(),
        vec![500, 501, 502]
    );
    let (_, events) = replay_page(&bridge).await;
    let k = kinds(&events);
    let clear = k
        .iter()
        .position(|t| t == "AllBlocksCleared")
        .expect("the page tells the filter");
    assert_eq!(events[clear]["dp_rank"], 0);
    assert!(k[clear + 1..].iter().all(|t| t == "BlockStored"));
    let m = metrics(&bridge).await;
    assert_eq!(metric(&m, "kv_bridge_resets_total", &[]), 1, "{m}");
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_whose_sequence_passed_ours_is_caught_by_the_digest() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    engine.publish(&store_batch(0, &[1, 2], None)).await;
    let seq = engine.publish(&store_batch(0, &[3], Some(2))).await;
    wait_for_seq(&bridge, 0, seq).await;

    // The new engine published 4 batches we never saw; its seq 4 looks like a plain gap
    // (we expect 2). Sequence numbers alone would "fill" 2..3 from the new engine and keep
    // the old blocks 1, 2, 3.
    engine.restart();
    engine.publish_lost(&store_batch(0, &[7], None));
    engine.publish_lost(&store_batch(0, &[8], Some(7)));
    engine.publish_lost(&remove_batch(0, &[8]));
    engine.publish_lost(&store_batch(0, &[9], None));
    let seq = engine.publish(&store_batch(0, &[10], Some(9))).await;
    wait_for_seq(&bridge, 0, seq).await;
    let blocks = assert_consistent(&bridge, &[&engine]).await;
    assert_eq!(
        blocks.iter().map(|b| b.2).collect::<Vec<_>>(),
        vec![7, 9, 10]
    );
    let m = metrics(&bridge).await;
    assert_eq!(
        metric(
            &m,
            "kv_bridge_resets_total",
            &[("engine", "0"), ("cause", "restart")]
        ),
        1,
        "{m}"
    );
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_bridge_catches_up_from_the_replay_buffer() {
    let mut engine = FakeEngine::start(0).await;
    for payload in &fixtures()[..12] {
        engine.publish(payload).await; // nobody listens yet
    }
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    wait_for_seq(&bridge, 0, 11).await;
    assert_consistent(&bridge, &[&engine]).await;
    assert_eq!(
        health(&bridge).await["engines"][0]["partial_history"],
        false
    );
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_gap_clears_the_rank() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, false)]).await;
    let first = engine.publish(&store_batch(0, &[1, 2], None)).await;
    wait_for_seq(&bridge, 0, first).await;
    engine.publish_lost(&remove_batch(0, &[2]));
    let seq = engine.publish(&store_batch(0, &[3], None)).await;
    wait_for_seq(&bridge, 0, seq).await;
    // Block 1 may still be cached, but the bridge cannot know: it keeps only what it saw after
    // the gap (never the removed block 2).
    let (dumped, _) = dump(&bridge).await;
    assert_eq!(dumped.iter().map(|b| b.2).collect::<Vec<_>>(), vec![3]);
    let (paged, events) = replay_page(&bridge).await;
    assert_eq!(paged, dumped);
    assert_eq!(
        kinds(&events),
        vec!["BlockStored", "AllBlocksCleared", "BlockStored"]
    );
    assert_eq!(health(&bridge).await["engines"][0]["partial_history"], true);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_are_cleared_independently() {
    let mut rank0 = FakeEngine::start(0).await;
    let mut rank1 = FakeEngine::start(1).await;
    let bridge = start_bridge(&mut [(&mut rank0, true), (&mut rank1, true)]).await;
    rank0.publish(&store_batch(0, &[1, 2], None)).await;
    let s1 = rank1.publish(&store_batch(1, &[1, 5], None)).await;
    wait_for_seq(&bridge, 1, s1).await;
    rank0.restart();
    // The new incarnation numbers its batches from 0 again, which the old one also reached: wait
    // for its second batch (seq 1), which only the new incarnation has.
    rank0.publish(&store_batch(0, &[3], None)).await;
    let s0 = rank0.publish(&store_batch(0, &[4], Some(3))).await;
    assert_eq!(s0, 1);
    wait_for_seq(&bridge, 0, s0).await;
    let blocks = assert_consistent(&bridge, &[&rank0, &rank1]).await;
    let by_rank: Vec<(u32, u64)> = blocks.iter().map(|b| (b.0, b.2)).collect();
    assert_eq!(by_rank, vec![(0, 3), (0, 4), (1, 1), (1, 5)]);
    // As the filter reads it: a clear of rank 0 only (no rank would mean every rank).
    let page = parse_event_page(
        get(&bridge, "/kv/events?after=0").await.1.as_bytes(),
        BS as u32,
        1 << 20,
    )
    .unwrap();
    let clears: Vec<&IndexEvent> = page
        .events
        .iter()
        .map(|e| &e.event)
        .filter(|e| matches!(e, IndexEvent::Cleared { .. }))
        .collect();
    assert_eq!(clears, vec![&IndexEvent::Cleared { dp_rank: Some(0) }]);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_answers_when_an_event_arrives() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    let seq = engine.publish(&store_batch(0, &[1], None)).await;
    wait_for_seq(&bridge, 0, seq).await;
    let last = health(&bridge).await["last_event_id"].as_u64().unwrap();
    assert_eq!(last, 1);

    // Without wait_ms: an immediate, empty answer.
    let page = get_json(&bridge, "/kv/events?after=1").await;
    assert_eq!(page["events"].as_array().unwrap().len(), 0);

    // Publish once the poll is in (its request is counted before it waits; either way it must
    // come back with the event, long before its 10 s).
    let before = metric(
        &metrics(&bridge).await,
        "kv_bridge_page_requests_total",
        &[("path", "/kv/events")],
    );
    let url = format!(
        "http://{}/kv/events?after={last}&wait_ms=10000",
        bridge.addr
    );
    let poll = tokio::spawn(async move { reqwest::get(url).await.unwrap().text().await.unwrap() });
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(
        &metrics(&bridge).await,
        "kv_bridge_page_requests_total",
        &[("path", "/kv/events")],
    ) == before
    {
        assert!(Instant::now() < deadline, "the long poll never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    engine.publish(&store_batch(0, &[2], Some(1))).await;
    let body = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the long poll waited although an event arrived")
        .unwrap();
    let page: Value = serde_json::from_str(&body).unwrap();
    let events = page["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{page}");
    assert_eq!(events[0]["event_id"], 2);
    assert_eq!(events[0]["block_hashes"], serde_json::json!([2]));
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_are_counted_not_fatal_and_block_size_is_checked() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge(&mut [(&mut engine, true)]).await;
    engine.publish(&store_batch(0, &[1], None)).await;
    // Wrong block size (16-token blocks): refused loudly, not forwarded.
    let tokens: Vec<u32> = (0..16).collect();
    engine
        .publish(&batch(1, Some(0), |mp| {
            stored_map(mp, &[2], None, &tokens, 16, None)
        }))
        .await;
    // A frame of garbage: counted; the rank is cleared (its state is unknown).
    engine.publish(b"\xc1\xc1 not msgpack").await;
    let seq = engine.publish(&store_batch(0, &[3], None)).await;
    wait_for_seq(&bridge, 0, seq).await;
    let m = metrics(&bridge).await;
    assert_eq!(
        metric(&m, "kv_bridge_block_size_mismatch_total", &[]),
        1,
        "{m}"
    );
    assert_eq!(metric(&m, "kv_bridge_bad_frames_total", &[]), 1, "{m}");
    let (dumped, _) = dump(&bridge).await;
    assert_eq!(dumped.iter().map(|b| b.2).collect::<Vec<_>>(), vec![3]);
    let (paged, _) = replay_page(&bridge).await;
    assert_eq!(paged, dumped);
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_publisher_is_noticed_and_its_successor_rebuilt() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge_idle(&mut [(&mut engine, true)], Duration::from_millis(300)).await;
    engine.publish(&store_batch(0, &[1, 2], None)).await;
    let seq = engine.publish(&store_batch(0, &[3], Some(2))).await;
    wait_for_seq(&bridge, 0, seq).await;

    // A real restart: the process (its sockets) goes away and a new one binds the same
    // addresses. The old TCP connection just ends; the zeromq crate does not report it, so the
    // bridge notices through its idle probe, reconnects and checks the anchor.
    let (pub_at, replay_at) = (engine.pub_endpoint.clone(), engine.replay_endpoint.clone());
    engine.stop().await;
    let mut engine = FakeEngine::start_at(0, &pub_at, &replay_at).await;
    engine.wait_subscribed().await;
    engine.publish(&store_batch(0, &[40], None)).await;
    let seq = engine.publish(&store_batch(0, &[41], Some(40))).await;
    wait_for_seq(&bridge, 0, seq).await;
    let blocks = assert_consistent(&bridge, &[&engine]).await;
    assert_eq!(blocks.iter().map(|b| b.2).collect::<Vec<_>>(), vec![40, 41]);
    let m = metrics(&bridge).await;
    assert!(metric(&m, "kv_bridge_resubscribes_total", &[]) >= 1, "{m}");
    assert_eq!(metric(&m, "kv_bridge_resets_total", &[]), 1, "{m}");
    bridge.shutdown(Duration::from_secs(5)).await;
}

/// Established TCP connections to `port` on this host (the bridge's side of its SUB sockets).
fn connections_to(port: u16) -> usize {
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields
                .get(2)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if remote_port == Some(port) && fields.get(3) == Some(&"01") {
                n += 1;
            }
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_probes_keep_one_connection() {
    let mut engine = FakeEngine::start(0).await;
    let bridge = start_bridge_idle(&mut [(&mut engine, true)], Duration::from_millis(20)).await;
    let seq = engine.publish(&store_batch(0, &[1], None)).await;
    wait_for_seq(&bridge, 0, seq).await;
    let port: u16 = engine
        .pub_endpoint
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let probes = |m: &str| {
        metric(
            m,
            "kv_bridge_idle_probes_total",
            &[("engine", "0"), ("result", "alive")],
        )
    };
    let probes_before = probes(&metrics(&bridge).await);
    let deadline = Instant::now() + Duration::from_secs(10);
    while probes(&metrics(&bridge).await) < probes_before + 30 {
        assert!(Instant::now() < deadline, "the idle stream was not probed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 30 silent periods: the stream was probed, never replaced (a replaced zeromq SUB socket
    // whose receive was pending stays open: one leaked connection per period).
    let m = metrics(&bridge).await;
    assert_eq!(metric(&m, "kv_bridge_resubscribes_total", &[]), 0, "{m}");
    assert_eq!(
        connections_to(port),
        1,
        "the bridge holds one connection to the publisher"
    );
    // And the stream still works.
    let seq = engine.publish(&store_batch(0, &[2], Some(1))).await;
    wait_for_seq(&bridge, 0, seq).await;
    assert_consistent(&bridge, &[&engine]).await;
    bridge.shutdown(Duration::from_secs(5)).await;
}

/// Serves `body` to every connection (a vLLM `/metrics` or `/v1/models` stand-in).
async fn serve_metrics(body: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(reply.as_bytes()).await;
        }
    });
    format!("http://{addr}/metrics")
}

#[tokio::test]
async fn the_page_describes_the_worker_from_flags_and_engine_metrics() {
    let metrics = serve_metrics(
        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"3055\"} 1.0\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n",
    )
    .await;
    let mut engine = FakeEngine::start(0).await;
    let mut config = config(&[(&engine, true)], Duration::from_secs(60));
    config.engine_metrics_urls = vec![metrics];
    config.engine_metrics_interval = Duration::from_millis(50);
    config.worker.dp_size = Some(1);
    // Models from the engine's /v1/models (no --worker-model flag).
    config.engine_models_url =
        Some(serve_metrics(r#"{"object":"list","data":[{"id":"llama","object":"model"}]}"#).await);
    let block_size = config.core.block_size;
    config.worker.block_size = Some(block_size); // as `into_config` sets it
    let bridge = Bridge::start(config).await.unwrap();
    engine.wait_subscribed().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let page = loop {
        let page = get_json(&bridge, "/kv/events?after=0").await;
        if page["worker"]["kv_capacity_blocks"] == 3055 && page["worker"]["models"][0] == "llama" {
            break page;
        }
        assert!(Instant::now() < deadline, "no learned capacity: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        page["worker"],
        serde_json::json!({"block_size": block_size, "dp_size": 1, "kv_capacity_blocks": 3055, "models": ["llama"]})
    );
    // The filter reads it from the page and from the dump.
    let (_, body) = get(&bridge, "/kv/events?after=0").await;
    let parsed = parse_event_page(body.as_bytes(), block_size, 1 << 20).unwrap();
    let described = parsed.worker.unwrap();
    assert_eq!(described.kv_capacity_blocks, Some(3055));
    assert_eq!(described.models, Some(vec!["llama".to_string()]));
    let (_, dump) = get(&bridge, "/kv/dump").await;
    let parsed = parse_dump(dump.as_bytes(), block_size, 1 << 20).unwrap();
    assert_eq!(parsed.worker.unwrap().dp_size, Some(1));
}

#[tokio::test]
async fn each_router_sees_what_the_others_declared_on_their_polls() {
    let metrics = serve_metrics("vllm:num_requests_running 5\nvllm:num_requests_waiting 1\n").await;
    let mut engine = FakeEngine::start(0).await;
    let mut config = config(&[(&engine, true)], Duration::from_secs(60));
    config.engine_metrics_urls = vec![metrics];
    config.engine_metrics_interval = Duration::from_millis(50);
    let block_size = config.core.block_size;
    let bridge = Bridge::start(config).await.unwrap();
    engine.wait_subscribed().await;
    // Router a declares 2 requests, router b 3; neither sees its own.
    let page_for =
        |router: &str, booked: &str| format!("/kv/events?after=0&router={router}&booked={booked}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = get_json(&bridge, &page_for("a", "2,4096,10")).await;
        if page["load"]["num_running"] == 5 {
            assert!(page["load"].get("other_routers").is_none(), "{page}");
            break;
        }
        assert!(Instant::now() < deadline, "no engine load: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, body) = get(&bridge, &page_for("b", "3,1000,5.5")).await;
    let parsed = parse_event_page(body.as_bytes(), block_size, 1 << 20).unwrap();
    let others = parsed.load.unwrap().other_routers.unwrap();
    assert_eq!(
        (others.requests, others.prefill_tokens, others.decode_blocks),
        (2, 4096.0, 10.0)
    );
    let page = get_json(&bridge, &page_for("a", "1,0,3")).await;
    assert_eq!(
        page["load"]["other_routers"],
        serde_json::json!({"requests": 3, "prefill_tokens": 1000.0, "decode_blocks": 5.5})
    );
    // A poll that does not say who it is sees everyone; a malformed declaration is ignored.
    let page = get_json(&bridge, "/kv/events?after=0&router=c&booked=x").await;
    assert_eq!(page["load"]["other_routers"]["requests"], 4, "{page}");
    bridge.shutdown(Duration::from_secs(5)).await;
}

/// A bridge over one fake engine whose scraped load (`running` requests) is on the page, so
/// that pages carry `load.other_routers`.
async fn start_bridge_with_load(running: u32) -> (FakeEngine, Bridge) {
    let body: &'static str =
        format!("vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n").leak();
    let metrics = serve_metrics(body).await;
    let mut engine = FakeEngine::start(0).await;
    let mut config = config(&[(&engine, true)], Duration::from_secs(60));
    config.engine_metrics_urls = vec![metrics];
    config.engine_metrics_interval = Duration::from_millis(50);
    let bridge = Bridge::start(config).await.unwrap();
    engine.wait_subscribed().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let page = get_json(&bridge, "/kv/events?after=0").await;
        if page["load"]["num_running"] == running {
            break;
        }
        assert!(Instant::now() < deadline, "no engine load: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (engine, bridge)
}

async fn post(bridge: &Bridge, path: &str) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("http://{}{path}", bridge.addr))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// Starts `GET /kv/events?<query>` and returns once the bridge has it (counted as it arrives,
/// before it waits): its answer and how long it took.
async fn start_long_poll(
    bridge: &Bridge,
    query: &str,
) -> tokio::task::JoinHandle<(Duration, Value)> {
    let count = |text: &str| {
        metric(
            text,
            "kv_bridge_page_requests_total",
            &[("path", "/kv/events")],
        )
    };
    let before = count(&metrics(bridge).await);
    let url = format!("http://{}/kv/events?{query}", bridge.addr);
    let poll = tokio::spawn(async move {
        let started = Instant::now();
        let body = reqwest::get(url).await.unwrap().text().await.unwrap();
        (started.elapsed(), serde_json::from_str(&body).unwrap())
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while count(&metrics(bridge).await) == before {
        assert!(Instant::now() < deadline, "the long poll never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    poll
}

fn wakeups(text: &str, cause: &str) -> u64 {
    metric(
        text,
        "kv_bridge_long_poll_wakeups_total",
        &[("cause", cause)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_routers_moved_booking_wakes_a_long_poll_at_once() {
    let (_engine, bridge) = start_bridge_with_load(5).await;
    let last = health(&bridge).await["last_event_id"].as_u64().unwrap();
    // Router a waits (no event will come); router b declares between its polls.
    let poll = start_long_poll(
        &bridge,
        &format!("after={last}&wait_ms=5000&router=a&booked=1,100,1"),
    )
    .await;
    let (status, body) = post(
        &bridge,
        "/kv/declare?router=b&booked=3,5000,7&timing=10,0.5,0.25,100,2,4,1.5",
    )
    .await;
    assert_eq!((status, body.as_str()), (204, ""));
    let (elapsed, page) = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the long poll waited although another router's bookings moved")
        .unwrap();
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    assert_eq!(page["events"].as_array().unwrap().len(), 0, "{page}");
    assert_eq!(
        page["load"]["other_routers"],
        serde_json::json!({
            "requests": 3, "prefill_tokens": 5000.0, "decode_blocks": 7.0,
            "timing": [10.0, 0.5, 0.25, 100.0, 2.0, 4.0, 1.5],
        }),
        "{page}"
    );
    let text = metrics(&bridge).await;
    assert_eq!(wakeups(&text, "declared"), 1, "{text}");
    assert_eq!(wakeups(&text, "events"), 0, "{text}");
    let declarations = |path: &str, moved: &str| {
        metric(
            &text,
            "kv_bridge_declarations_total",
            &[("path", path), ("moved", moved)],
        )
    };
    assert_eq!(declarations("/kv/declare", "true"), 1, "{text}");
    assert_eq!(declarations("/kv/events", "true"), 1, "{text}");
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declarations_that_did_not_move_or_are_the_callers_own_do_not_wake_it() {
    let (_engine, bridge) = start_bridge_with_load(5).await;
    let last = health(&bridge).await["last_event_id"].as_u64().unwrap();
    let (status, _) = post(&bridge, "/kv/declare?router=b&booked=3,5000,7").await;
    assert_eq!(status, 204);
    let a_polls = format!("after={last}&wait_ms=600&router=a&booked=1,100,1");

    // b declares the same bookings, then only more decode blocks, a little prefill drift and
    // learned timing: nothing a waits for.
    let poll = start_long_poll(&bridge, &a_polls).await;
    for declaration in [
        "booked=3,5000,7",
        "booked=3,5100,60&timing=10,0.5,0.25,100,2,4,1.5",
    ] {
        let (status, _) = post(&bridge, &format!("/kv/declare?router=b&{declaration}")).await;
        assert_eq!(status, 204);
    }
    let (elapsed, page) = poll.await.unwrap();
    assert!(elapsed >= Duration::from_millis(500), "woken: {elapsed:?}");
    // The latest declaration still rides with the page.
    assert_eq!(
        page["load"]["other_routers"]["decode_blocks"], 60.0,
        "{page}"
    );
    assert_eq!(page["load"]["other_routers"]["timing"][0], 10.0, "{page}");

    // a's own moves (between its polls, or with another poll of its own) never wake it.
    let poll = start_long_poll(&bridge, &a_polls).await;
    let (status, _) = post(&bridge, "/kv/declare?router=a&booked=9,9000,9").await;
    assert_eq!(status, 204);
    let (_, page) = get(&bridge, "/kv/events?after=0&router=a&booked=2,100,1").await;
    assert!(page.contains("other_routers"), "{page}");
    let (elapsed, _) = poll.await.unwrap();
    assert!(elapsed >= Duration::from_millis(500), "woken: {elapsed:?}");

    // A poll that does not say who it is waits as before, whoever moves.
    let poll = start_long_poll(&bridge, &format!("after={last}&wait_ms=600")).await;
    let (status, _) = post(&bridge, "/kv/declare?router=b&booked=8,20000,7").await;
    assert_eq!(status, 204);
    let (elapsed, page) = poll.await.unwrap();
    assert!(elapsed >= Duration::from_millis(500), "woken: {elapsed:?}");
    assert_eq!(page["load"]["other_routers"]["requests"], 10, "{page}");

    let text = metrics(&bridge).await;
    assert_eq!(wakeups(&text, "declared"), 0, "{text}");
    assert_eq!(
        metric(
            &text,
            "kv_bridge_declarations_total",
            &[("path", "/kv/declare"), ("moved", "false")]
        ),
        2,
        "{text}"
    );
    bridge.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declaration_needs_a_router_and_its_bookings() {
    let (_engine, bridge) = start_bridge_with_load(5).await;
    for bad in [
        "/kv/declare?booked=3,5000,7",
        "/kv/declare?router=zz&booked=3,5000,7",
        "/kv/declare?router=b",
        "/kv/declare?router=b&booked=x",
        "/kv/declare?router=b&booked=3,5000",
        "/kv/declare?router=b&booked=-1,5000,7",
    ] {
        let (status, body) = post(&bridge, bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert!(error["error"].is_string(), "{bad}: {body}");
    }
    assert_eq!(
        get(&bridge, "/kv/declare?router=b&booked=3,5000,7").await.0,
        405
    );
    let page = get_json(&bridge, "/kv/events?after=0&router=a").await;
    assert!(page["load"].get("other_routers").is_none(), "{page}");
    // Invalid timing is left out; the bookings count (on either path).
    let (status, _) = post(&bridge, "/kv/declare?router=b&booked=3,5000,7&timing=1,2,3").await;
    assert_eq!(status, 204);
    let page = get_json(
        &bridge,
        "/kv/events?after=0&router=c&booked=1,0,0&timing=-1,0,0,0,0,0,0",
    )
    .await;
    assert_eq!(
        page["load"]["other_routers"],
        serde_json::json!({"requests": 3, "prefill_tokens": 5000.0, "decode_blocks": 7.0}),
        "{page}"
    );
    let page = get_json(&bridge, "/kv/events?after=0&router=a").await;
    assert_eq!(page["load"]["other_routers"]["requests"], 4, "{page}");
    assert!(
        page["load"]["other_routers"].get("timing").is_none(),
        "{page}"
    );
    bridge.shutdown(Duration::from_secs(5)).await;
}
