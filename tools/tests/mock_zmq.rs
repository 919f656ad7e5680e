//! Engine mode's ZMQ KV event stream, decoded here independently of the mock's encoder (rmpv):
//! it is vLLM 0.32's format (frames, batch, event maps with vLLM's keys in vLLM's order), it
//! carries exactly the events of the HTTP page, and the replay socket returns the buffered
//! batches, byte for byte, then the end marker.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use envoy_kv_router_tools::client::{get, post_json};
use rmpv::Value as Mp;
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const BLOCK: usize = 4;
const DP_RANK: u64 = 2;

struct Worker {
    child: Child,
    addr: String,
    zmq: String,
    replay: String,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts an engine-mode worker publishing on ZMQ; reads its three startup lines.
fn start(extra: &[&str]) -> Worker {
    let block = BLOCK.to_string();
    let rank = DP_RANK.to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mock-worker"))
        .args(["--port", "0", "--mode", "engine", "--block-size", &block])
        .args(["--dp-rank", &rank, "--speedup", "50"])
        .args(["--kv-events-endpoint", "tcp://127.0.0.1:0"])
        .args(["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn mock-worker");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = |prefix: &str| {
        let mut l = String::new();
        out.read_line(&mut l).expect("read");
        l.trim()
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("expected `{prefix}...`, got {l:?}"))
            .to_string()
    };
    let addr = line("listening ");
    let zmq = line("zmq ");
    let replay = line("replay ");
    assert!(
        zmq.starts_with("tcp://127.0.0.1:") && !zmq.ends_with(":0"),
        "{zmq}"
    );
    assert!(replay.starts_with("tcp://127.0.0.1:") && !replay.ends_with(":0"));
    Worker {
        child,
        addr,
        zmq,
        replay,
    }
}

/// ZMQ sockets on a runtime of their own, driven from this (blocking) test thread.
struct Zmq {
    rt: tokio::runtime::Runtime,
}

impl Zmq {
    fn new() -> Zmq {
        Zmq {
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    fn subscribe(&self, endpoint: &str) -> SubSocket {
        self.rt.block_on(async {
            let mut sub = SubSocket::new();
            sub.subscribe("kv").await.unwrap();
            sub.connect(endpoint).await.unwrap();
            sub
        })
    }

    fn recv(&self, sub: &mut SubSocket, limit: Duration) -> Option<Vec<Bytes>> {
        self.rt.block_on(async {
            match tokio::time::timeout(limit, sub.recv()).await {
                Ok(Ok(m)) => Some(m.into_vec()),
                Ok(Err(e)) => panic!("SUB recv: {e}"),
                Err(_) => None,
            }
        })
    }

    /// Every reply of a replay from `start`, the end marker included.
    fn replay(&self, endpoint: &str, start: u64) -> Vec<Vec<Bytes>> {
        self.rt.block_on(async {
            let mut dealer = DealerSocket::new();
            dealer.connect(endpoint).await.unwrap();
            let request = ZmqMessage::try_from(vec![
                Bytes::new(),
                Bytes::copy_from_slice(&start.to_be_bytes()),
            ])
            .unwrap();
            dealer.send(request).await.unwrap();
            let mut replies = Vec::new();
            loop {
                let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                    .await
                    .expect("replay reply in time")
                    .unwrap()
                    .into_vec();
                let end = m.get(2).is_some_and(|s| s.as_ref() == [0xff; 8]);
                replies.push(m);
                if end {
                    return replies;
                }
            }
        })
    }
}

fn complete(w: &Worker, prompt: &[u32], max_tokens: usize) {
    let r = post_json(
        &w.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens}),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

fn metric(w: &Worker, name: &str) -> u64 {
    let text = get(&w.addr, "/metrics").unwrap().text();
    envoy_kv_router_tools::prom::sum(&text, name, &[])
        .unwrap_or_else(|| panic!("{name} not in /metrics")) as u64
}

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("8-byte sequence frame"))
}

fn str_of(v: &Mp) -> &str {
    v.as_str().unwrap_or_else(|| panic!("{v} is not a string"))
}

fn u64s(v: &Mp) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("{v} is not an array"))
        .iter()
        .map(|x| x.as_u64().unwrap_or_else(|| panic!("{x} is not a u64")))
        .collect()
}

/// Decodes a batch payload, checking vLLM 0.32's exact shape, into page-shaped JSON events.
fn decode_batch(payload: &[u8]) -> Vec<Value> {
    let mut rest = payload;
    let batch = rmpv::decode::read_value(&mut rest).expect("msgpack");
    assert!(rest.is_empty(), "bytes after the batch");
    let items = batch.as_array().expect("batch is an array");
    assert_eq!(items.len(), 3, "[ts, events, dp_rank]");
    let Mp::F64(ts) = items[0] else {
        panic!("ts is not a float64: {}", items[0]);
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!((now - 120.0..=now + 1.0).contains(&ts), "ts {ts}");
    assert_eq!(items[2].as_u64(), Some(DP_RANK));
    let events = items[1].as_array().expect("events array");
    assert!(
        !events.is_empty(),
        "a batch is published only for a step with events"
    );
    events
        .iter()
        .map(|e| {
            let map = e.as_map().expect("event is a map");
            let keys: Vec<&str> = map.iter().map(|(k, _)| str_of(k)).collect();
            let get = |key: &str| &map.iter().find(|(k, _)| str_of(k) == key).unwrap().1;
            let kind = str_of(get("type"));
            match kind {
                "BlockStored" => {
                    assert_eq!(
                        keys,
                        [
                            "type",
                            "block_hashes",
                            "parent_block_hash",
                            "token_ids",
                            "block_size",
                            "lora_id",
                            "medium",
                            "lora_name",
                            "extra_keys",
                            "group_idx",
                            "kv_cache_spec_kind"
                        ]
                    );
                    let hashes = u64s(get("block_hashes"));
                    assert!(get("lora_id").is_nil() && get("lora_name").is_nil());
                    assert_eq!(get("extra_keys").as_array().unwrap().len(), hashes.len());
                    assert_eq!(get("group_idx").as_u64(), Some(0));
                    assert_eq!(str_of(get("kv_cache_spec_kind")), "full_attention");
                    json!({
                        "type": kind,
                        "block_hashes": hashes,
                        "parent_block_hash": get("parent_block_hash").as_u64(),
                        "token_ids": u64s(get("token_ids")),
                        "block_size": get("block_size").as_u64().unwrap(),
                        "medium": str_of(get("medium")),
                    })
                }
                "BlockRemoved" => {
                    assert_eq!(keys, ["type", "block_hashes", "medium", "group_idx"]);
                    json!({
                        "type": kind,
                        "block_hashes": u64s(get("block_hashes")),
                        "medium": str_of(get("medium")),
                    })
                }
                "AllBlocksCleared" => {
                    assert_eq!(keys, ["type"]);
                    json!({"type": kind})
                }
                other => panic!("unknown event type {other}"),
            }
        })
        .collect()
}

/// The HTTP page's events with the fields the ZMQ stream also carries.
fn page_events(w: &Worker) -> Vec<Value> {
    let page = get(&w.addr, "/kv/events?after=0").unwrap().json().unwrap();
    assert_eq!(
        page["first_event_id"], 1,
        "the page still holds every event"
    );
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert_eq!(e["dp_rank"], DP_RANK);
            let mut out = json!({"type": e["type"]});
            let keys: &[&str] = match e["type"].as_str() {
                Some("BlockStored") => &[
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "medium",
                ],
                Some("BlockRemoved") => &["block_hashes", "medium"],
                _ => &[],
            };
            for k in keys {
                out[*k] = e[*k].clone();
            }
            out
        })
        .collect()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

#[test]
fn zmq_stream_and_replay_carry_the_http_page_events() {
    // 8 device blocks and a 4-block host tier: the workload stores, offloads to the host (CPU),
    // evicts (GPU and CPU removals) and clears.
    let w = start(&["--kv-blocks", "8", "--host-kv-blocks", "4"]);
    let zmq = Zmq::new();
    let mut sub = zmq.subscribe(&w.zmq);

    complete(&w, &prompt(1, 12), 1); // 3 blocks
    complete(&w, &[prompt(1, 12), prompt(2, 4)].concat(), 1); // shares them, adds one
    complete(&w, &prompt(3, 20), 2); // 5 blocks + decode: pushes the first prompt to the host
    complete(&w, &prompt(4, 24), 2); // more pressure: host evictions
    post_json(&w.addr, "/admin/reset", &json!({})).unwrap();
    complete(&w, &prompt(5, 8), 1);

    let total = metric(&w, "mock_worker_kv_zmq_batches_total");
    assert!(total >= 5, "{total} batches");
    // Collect the live stream up to the last batch. A SUB socket may miss what was published
    // before its subscription reached the publisher; those batches come from the replay.
    let mut live: Vec<(u64, Bytes)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(15);
    while live.last().map(|(s, _)| *s + 1) != Some(total) {
        assert!(Instant::now() < deadline, "live stream stalled: {live:?}");
        let Some(frames) = zmq.recv(&mut sub, Duration::from_secs(1)) else {
            continue;
        };
        assert_eq!(frames.len(), 3, "[topic, seq, payload]");
        assert_eq!(frames[0].as_ref(), b"kv");
        let seq = seq_of(&frames[1]);
        if let Some((prev, _)) = live.last() {
            assert_eq!(seq, prev + 1, "live sequence numbers are consecutive");
        }
        live.push((seq, frames[2].clone()));
    }
    let first_live = live[0].0;
    assert!(first_live < total);

    // A replay from 0 returns every batch (all fit the buffer) as [b"", topic, seq, payload],
    // then the end marker [b"", b"", ff x 8, b""].
    let replies = zmq.replay(&w.replay, 0);
    assert_eq!(replies.len() as u64, total + 1);
    let (end, batches) = replies.split_last().unwrap();
    assert_eq!(
        end.iter().map(|f| f.to_vec()).collect::<Vec<_>>(),
        vec![vec![], vec![], vec![0xff; 8], vec![]]
    );
    let mut replayed = Vec::new();
    for (i, m) in batches.iter().enumerate() {
        assert_eq!(m.len(), 4, "[b\"\", topic, seq, payload]");
        assert!(m[0].is_empty());
        assert_eq!(m[1].as_ref(), b"kv");
        assert_eq!(
            seq_of(&m[2]),
            i as u64,
            "replay starts at 0 and is in order"
        );
        replayed.push(m[3].clone());
    }
    for (seq, payload) in &live {
        assert_eq!(
            &replayed[*seq as usize], payload,
            "batch {seq}: live == replayed"
        );
    }

    // Decoded, the stream is the page: same events, same order, batch by batch.
    let from_zmq: Vec<Value> = replayed.iter().flat_map(|p| decode_batch(p)).collect();
    let from_http = page_events(&w);
    assert_eq!(from_zmq.len(), from_http.len());
    for (i, (z, h)) in from_zmq.iter().zip(&from_http).enumerate() {
        assert_eq!(z, h, "event {i}");
    }
    // The workload exercised every kind of event and both media.
    let has = |kind: &str, medium: Option<&str>| {
        from_zmq
            .iter()
            .any(|e| e["type"] == kind && medium.is_none_or(|m| e["medium"] == m))
    };
    assert!(has("BlockStored", Some("GPU")) && has("BlockStored", Some("CPU")));
    assert!(has("BlockRemoved", Some("GPU")) && has("BlockRemoved", Some("CPU")));
    assert!(has("AllBlocksCleared", None));

    // A replay from the middle starts there; one past the end returns only the end marker.
    let mid = total / 2;
    let replies = zmq.replay(&w.replay, mid);
    let seqs: Vec<u64> = replies[..replies.len() - 1]
        .iter()
        .map(|m| seq_of(&m[2]))
        .collect();
    assert_eq!(seqs, (mid..total).collect::<Vec<_>>());
    assert_eq!(zmq.replay(&w.replay, total).len(), 1);
    assert!(metric(&w, "mock_worker_kv_zmq_replays_total") >= 3);
    assert_eq!(metric(&w, "mock_worker_kv_zmq_live_dropped_total"), 0);
}

#[test]
fn replay_buffer_keeps_the_newest_batches() {
    let w = start(&["--kv-events-replay-batches", "3"]);
    for seed in 1..=5 {
        complete(&w, &prompt(seed, 8), 1);
    }
    let total = metric(&w, "mock_worker_kv_zmq_batches_total");
    assert!(total >= 5, "{total}");
    let zmq = Zmq::new();
    let replies = zmq.replay(&w.replay, 0);
    let seqs: Vec<u64> = replies[..replies.len() - 1]
        .iter()
        .map(|m| seq_of(&m[2]))
        .collect();
    assert_eq!(seqs, (total - 3..total).collect::<Vec<_>>());
    assert_eq!(replies.last().unwrap()[2].as_ref(), [0xff; 8]);
}

#[test]
fn zmq_flags_need_engine_mode() {
    let bin = env!("CARGO_BIN_EXE_mock-worker");
    for args in [
        &["--kv-events-endpoint", "tcp://127.0.0.1:0"][..],
        &[
            "--mode",
            "engine",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
        ][..],
    ] {
        let out = Command::new(bin)
            .args(["--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--kv-events"));
    }
}
