//! Engine mode's KV events on ZMQ, published like vLLM 0.32's `ZmqEventPublisher`: a PUB socket
//! with one message per engine step that changed the cache (see [`super::vllm_wire`]), a
//! per-process sequence from 0, and a bounded buffer of recent batches served on a ROUTER
//! ("replay") socket. It carries exactly the events of the HTTP page: the engine hands each
//! step's events to both.
//!
//! The engine thread encodes a batch, numbers it and stores it in the replay buffer under one
//! lock, so the sequence and the buffer always agree; the live send happens on the publisher's
//! own thread (a small tokio runtime). If that thread falls behind by more than
//! [`LIVE_QUEUE_BATCHES`], live messages are dropped (counted), never buffered without bound:
//! a subscriber sees the gap in sequence numbers and recovers it from the replay socket, as it
//! would with vLLM.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::kv_cache::CacheEvent;
use super::vllm_wire::{encode_batch, END_SEQ};
use crate::util::lock;

/// Live messages queued for the PUB socket at most.
pub const LIVE_QUEUE_BATCHES: usize = 4096;
/// How long one replay reply may wait for its client before the replay is abandoned.
const REPLAY_SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where and how to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` (port 0: a free port).
    pub endpoint: String,
    /// ROUTER endpoint to bind for replays.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub replay_batches: usize,
    /// Bytes of payload kept for replay.
    pub replay_bytes: usize,
    pub block_size: usize,
    pub dp_rank: u32,
}

/// `tcp://*:PORT` (vLLM's bind syntax) as the zeromq crate spells it.
fn bind_endpoint(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct ZmqCounters {
    pub batches: AtomicU64,
    pub live_dropped: AtomicU64,
    pub replays: AtomicU64,
    pub encode_errors: AtomicU64,
    /// Connections the PUB socket accepted (subscribers that connected; a router under test
    /// waits for these before sending traffic).
    pub connections: AtomicU64,
}

#[derive(Debug, Default)]
struct ReplayBuffer {
    next_seq: u64,
    batches: VecDeque<(u64, Bytes)>,
    bytes: usize,
}

impl ReplayBuffer {
    /// Keeps `(seq, payload)`, dropping the oldest beyond the bounds (the newest always stays).
    fn push(&mut self, seq: u64, payload: Bytes, max_batches: usize, max_bytes: usize) {
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.batches.len() > max_batches.max(1)
            || (self.bytes > max_bytes && self.batches.len() > 1)
        {
            if let Some((_, old)) = self.batches.pop_front() {
                self.bytes -= old.len();
            }
        }
    }

    fn batches_from(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.batches
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect()
    }
}

/// A running publisher. Its sockets live on a thread of their own until it is dropped.
#[derive(Debug)]
pub struct KvPublisher {
    config: ZmqConfig,
    topic: Bytes,
    /// The bound PUB endpoint (the port resolved).
    pub endpoint: String,
    /// The bound ROUTER endpoint.
    pub replay_endpoint: Option<String>,
    buffer: Arc<Mutex<ReplayBuffer>>,
    live: mpsc::Sender<(u64, Bytes)>,
    pub counters: Arc<ZmqCounters>,
}

impl KvPublisher {
    /// Binds the sockets (on the publisher's thread) and returns once they accept connections.
    pub fn start(config: ZmqConfig) -> io::Result<KvPublisher> {
        let (live, live_rx) = mpsc::channel(LIVE_QUEUE_BATCHES);
        let buffer = Arc::new(Mutex::new(ReplayBuffer::default()));
        let counters = Arc::new(ZmqCounters::default());
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let thread_config = config.clone();
        let thread_buffer = Arc::clone(&buffer);
        let thread_counters = Arc::clone(&counters);
        let thread_topic = topic.clone();
        std::thread::Builder::new()
            .name("mock-kv-zmq".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = bound_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(serve(
                    thread_config,
                    thread_topic,
                    thread_buffer,
                    thread_counters,
                    live_rx,
                    bound_tx,
                ));
            })?;
        let (endpoint, replay_endpoint) = bound_rx
            .recv()
            .map_err(|_| io::Error::other("the ZMQ publisher thread ended before binding"))??;
        Ok(KvPublisher {
            config,
            topic,
            endpoint,
            replay_endpoint,
            buffer,
            live,
            counters,
        })
    }

    /// Publishes one engine step's events as one batch (nothing for no events).
    pub fn publish(&self, events: &[CacheEvent]) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = match encode_batch(ts, events, self.config.block_size, self.config.dp_rank) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                // Publish nothing rather than a batch that says less than the page.
                self.counters.encode_errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("mock-worker: cannot encode a KV event batch: {e}");
                return;
            }
        };
        let mut buffer = lock(&self.buffer);
        let seq = buffer.next_seq;
        buffer.next_seq += 1;
        buffer.push(
            seq,
            payload.clone(),
            self.config.replay_batches,
            self.config.replay_bytes,
        );
        // Sent while the buffer is locked so that live messages leave in sequence order.
        if self.live.try_send((seq, payload)).is_err() {
            self.counters.live_dropped.fetch_add(1, Ordering::Relaxed);
        }
        drop(buffer);
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// The sequence number the next batch gets (= batches published).
    pub fn next_seq(&self) -> u64 {
        lock(&self.buffer).next_seq
    }

    pub fn topic(&self) -> &[u8] {
        &self.topic
    }
}

type Bound = io::Result<(String, Option<String>)>;

async fn serve(
    config: ZmqConfig,
    topic: Bytes,
    buffer: Arc<Mutex<ReplayBuffer>>,
    counters: Arc<ZmqCounters>,
    live_rx: mpsc::Receiver<(u64, Bytes)>,
    bound_tx: std::sync::mpsc::Sender<Bound>,
) {
    let mut publisher = PubSocket::new();
    let mut monitor = publisher.monitor();
    let accepted = Arc::clone(&counters);
    tokio::spawn(async move {
        while let Some(event) = futures_util::StreamExt::next(&mut monitor).await {
            if let zeromq::SocketEvent::Accepted(..) = event {
                accepted.connections.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let endpoint = match publisher.bind(&bind_endpoint(&config.endpoint)).await {
        Ok(e) => e.to_string(),
        Err(e) => {
            let _ = bound_tx.send(Err(io::Error::other(format!(
                "cannot bind the KV event endpoint {}: {e}",
                config.endpoint
            ))));
            return;
        }
    };
    let mut router = None;
    let mut replay_endpoint = None;
    if let Some(wanted) = &config.replay_endpoint {
        let mut socket = RouterSocket::new();
        match socket.bind(&bind_endpoint(wanted)).await {
            Ok(e) => {
                replay_endpoint = Some(e.to_string());
                router = Some(socket);
            }
            Err(e) => {
                let _ = bound_tx.send(Err(io::Error::other(format!(
                    "cannot bind the KV event replay endpoint {wanted}: {e}"
                ))));
                return;
            }
        }
    }
    if bound_tx.send(Ok((endpoint, replay_endpoint))).is_err() {
        return;
    }
    let live = send_live(publisher, topic.clone(), live_rx);
    match router {
        // The live loop ends when the publisher is dropped; the replay loop never does.
        Some(router) => {
            tokio::select! {
                _ = live => {}
                _ = serve_replays(router, topic, buffer, counters) => {}
            }
        }
        None => live.await,
    }
}

async fn send_live(
    mut publisher: PubSocket,
    topic: Bytes,
    mut live_rx: mpsc::Receiver<(u64, Bytes)>,
) {
    while let Some((seq, payload)) = live_rx.recv().await {
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        let Ok(message) = ZmqMessage::try_from(frames) else {
            continue;
        };
        if let Err(e) = publisher.send(message).await {
            eprintln!("mock-worker: KV event publish failed: {e}");
        }
    }
}

/// Answers replay requests `[identity, b"", start_seq]` one after the other.
async fn serve_replays(
    mut router: RouterSocket,
    topic: Bytes,
    buffer: Arc<Mutex<ReplayBuffer>>,
    counters: Arc<ZmqCounters>,
) {
    loop {
        let request = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                eprintln!("mock-worker: KV replay socket failed: {e}");
                return;
            }
        };
        // vLLM ignores requests of another shape.
        let [identity, _delimiter, start] = request.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            continue;
        };
        counters.replays.fetch_add(1, Ordering::Relaxed);
        let batches = lock(&buffer).batches_from(start);
        let mut replies: Vec<Vec<Bytes>> = batches
            .into_iter()
            .map(|(seq, payload)| {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]
            })
            .collect();
        replies.push(vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_SEQ),
            Bytes::new(),
        ]);
        for frames in replies {
            let Ok(message) = ZmqMessage::try_from(frames) else {
                break;
            };
            // A client that is gone or stopped reading must not hold up the next one.
            match tokio::time::timeout(REPLAY_SEND_TIMEOUT, router.send(message)).await {
                Ok(Ok(())) => {}
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_buffer_bounds_and_start() {
        let mut b = ReplayBuffer::default();
        for seq in 0..5u64 {
            b.push(seq, Bytes::from(vec![0u8; 10]), 3, 1000);
        }
        let seqs: Vec<u64> = b.batches_from(0).iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(b.batches_from(4).len(), 1);
        assert!(b.batches_from(5).is_empty());
        // The byte bound keeps at least the newest batch.
        b.push(5, Bytes::from(vec![0u8; 5000]), 3, 1000);
        assert_eq!(b.batches_from(0).len(), 1);
        assert_eq!(b.bytes, 5000);
    }

    #[test]
    fn star_endpoints_bind_every_interface() {
        assert_eq!(bind_endpoint("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_endpoint("tcp://127.0.0.1:0"), "tcp://127.0.0.1:0");
    }
}
