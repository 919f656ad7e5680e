//! The replication log at 8 and 1,000 workers: what the request path pays to keep its replica
//! current, and how many events per second go through the log (append + sync).
//!
//! Each simulated tick (50 ms) half the workers answer a poll (100 ms interval) with one event
//! and a changed reported load; 50 requests are spread between the replies, each doing the
//! request path's check (`Replica::is_behind`, and `Replica::sync` when behind). Two ways of
//! appending the replies, side by side in one run:
//! * `per-reply`: one `append` (one ring slot, one head edit) per reply, as the poller did before
//!   replies were coalesced;
//! * `per-tick`: one `append` with every reply of the tick;
//! * `2+tick`: what `replication::coalesce` does: the tick's first 2 replies at once, then one
//!   `append` with the rest.
//!
//! Only public APIs that predate the binary head are used, so the same file measures an older
//! build too (see the report in docs/DESIGN.md, "Replication at scale"). Prints figures; asserts
//! nothing. Usage: `cargo bench --bench log_head [-- --quick]`. Instruction counts per request:
//! run the built binary under `valgrind --tool=callgrind --toggle-collect='log_head::request_check'`
//! with `--quick` and divide the inclusive count by the calls.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use envoy_kv_router::config::Config;
use envoy_kv_router::events::{IndexEvent, LogRecord, NumberedEvent, ReportedLoad};
use envoy_kv_router::replication::log::{append, init, Replica, SyncReport};
use envoy_kv_router::store::{SharedStore, StoreError};
use envoy_kv_router::types::{ExternalBlockHash, LocalBlockHash, StorageTier};

const FP: u64 = 7;
const REQUESTS_PER_TICK: usize = 50;

/// Envoy's shared-data semantics (copy out on get, CAS on set), in memory.
#[derive(Default)]
struct MapStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next: Cell<u32>,
}

impl SharedStore for MapStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.map.borrow().get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        }
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.map.borrow_mut();
        if let (Some(want), Some((_, have))) = (cas.filter(|c| *c != 0), map.get(key)) {
            if want != *have {
                return Err(StoreError::CasMismatch);
            }
        }
        self.next.set(self.next.get().wrapping_add(1).max(1));
        map.insert(key.to_string(), (value.to_vec(), self.next.get()));
        Ok(())
    }
}

fn config(workers: usize) -> Config {
    let list: Vec<String> = (0..workers)
        .map(|i| {
            format!(
                r#"{{"id": {}, "address": "10.0.{}.{}:8000"}}"#,
                i + 1,
                i / 250,
                i % 250 + 1
            )
        })
        .collect();
    let json = format!(
        r#"{{"workers": [{}], "index": {{"max_blocks": 4000000}}}}"#,
        list.join(",")
    );
    Config::from_json(json.as_bytes()).unwrap()
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    PerReply,
    PerTick,
    /// What the filter does: the tick's first 2 replies at once, the rest in the tick's batch.
    Filter,
}

/// `replication::coalesce::EARLY_FLUSHES_PER_TICK` (not imported: older builds lack it).
const EARLY: usize = 2;

struct Reply {
    worker: u16,
    after: Option<u64>,
    record: LogRecord,
    load: ReportedLoad,
}

fn reply(worker: u16, after: Option<u64>, tick: u64) -> Reply {
    let id = after.map_or(1, |a| a + 1);
    let hash = (u64::from(worker) << 32) | id;
    Reply {
        worker,
        after,
        record: LogRecord::Events {
            worker,
            events: vec![NumberedEvent {
                event_id: id,
                event: IndexEvent::Stored {
                    dp_rank: 0,
                    tier: StorageTier::Device,
                    parent: None,
                    blocks: vec![(ExternalBlockHash(hash), LocalBlockHash(hash))],
                },
            }],
        },
        load: ReportedLoad {
            num_waiting: 0,
            num_running: (tick % 13) as u32,
            kv_usage: (tick % 100) as f64 / 100.0,
            other_routers: None,
        },
    }
}

/// Applies replies to the head: each worker's cursor must still be where the reply started.
fn edit_for<'a>(
    replies: &'a [Reply],
    now: u64,
) -> impl FnMut(&mut envoy_kv_router::replication::log::LogHead) -> bool + 'a {
    move |head| {
        for r in replies {
            let Some(w) = head.workers.get_mut(usize::from(r.worker)) else {
                return false;
            };
            if w.cursor != r.after {
                return false;
            }
            w.cursor = Some(r.after.map_or(1, |a| a + 1));
            w.last_ok_ms = now;
            w.reported = Some(r.load);
        }
        true
    }
}

/// What a request does before routing: re-read the log if the poller published since.
#[inline(never)]
fn request_check(
    replica: &mut Replica,
    store: &MapStore,
    config: &Config,
    now: u64,
) -> Option<SyncReport> {
    replica
        .is_behind(store)
        .then(|| black_box(replica.sync(store, config, now)))
}

struct Figures {
    /// Mean over requests, the syncs included.
    request_ns: f64,
    /// The typical request (no sync).
    request_p50_ns: f64,
    synced_fraction: f64,
    lost_sync: u64,
    events_per_s: f64,
}

fn run(workers: usize, mode: Mode, ticks: u64) -> Figures {
    let config = config(workers);
    let store = MapStore::default();
    init(&store);
    let mut replica = Replica::new(&config, FP);
    let mut poller = Replica::new(&config, FP);
    let mut cursors = vec![None::<u64>; workers];
    let (mut request_time, mut requests, mut synced) = (Duration::ZERO, 0u64, 0u64);
    let mut each = Vec::new();
    let (mut log_time, mut events, mut lost) = (Duration::ZERO, 0u64, 0u64);
    for tick in 0..ticks {
        let now = tick * 50;
        let replies: Vec<Reply> = (0..workers)
            .filter(|w| (*w as u64 + tick) % 2 == 0)
            .map(|w| reply(w as u16, cursors[w], tick))
            .collect();
        for r in &replies {
            cursors[usize::from(r.worker)] = Some(r.after.map_or(1, |a| a + 1));
        }
        let every = (replies.len() / REQUESTS_PER_TICK).max(1);
        let mut done = 0;
        for (i, r) in replies.iter().enumerate() {
            if mode == Mode::PerReply || (mode == Mode::Filter && i < EARLY) {
                let t = Instant::now();
                let ok = append(
                    &store,
                    FP,
                    workers,
                    now,
                    std::slice::from_ref(&r.record),
                    edit_for(std::slice::from_ref(r), now),
                );
                // The poller VM applies what it appended (as the filter does after each append).
                let report = poller.sync(&store, &config, now);
                log_time += t.elapsed();
                assert!(ok);
                events += report.events_applied;
                lost += u64::from(report.lost_sync);
            }
            if i % every == 0 && done < REQUESTS_PER_TICK {
                let t = Instant::now();
                let report = request_check(&mut replica, &store, &config, now);
                each.push(t.elapsed().as_nanos() as f64);
                request_time += t.elapsed();
                synced += u64::from(report.is_some());
                lost += u64::from(report.is_some_and(|r| r.lost_sync));
                requests += 1;
                done += 1;
            }
        }
        let rest = match mode {
            Mode::PerReply => &replies[replies.len()..],
            Mode::PerTick => &replies[..],
            Mode::Filter => &replies[EARLY.min(replies.len())..],
        };
        if !rest.is_empty() {
            let t = Instant::now();
            let records: Vec<LogRecord> = rest.iter().map(|r| r.record.clone()).collect();
            assert!(append(
                &store,
                FP,
                workers,
                now,
                &records,
                edit_for(rest, now)
            ));
            let report = poller.sync(&store, &config, now);
            log_time += t.elapsed();
            events += report.events_applied;
            lost += u64::from(report.lost_sync);
        }
        while done < REQUESTS_PER_TICK {
            let t = Instant::now();
            let report = request_check(&mut replica, &store, &config, now);
            each.push(t.elapsed().as_nanos() as f64);
            request_time += t.elapsed();
            synced += u64::from(report.is_some());
            lost += u64::from(report.is_some_and(|r| r.lost_sync));
            requests += 1;
            done += 1;
        }
    }
    Figures {
        request_ns: request_time.as_nanos() as f64 / requests as f64,
        request_p50_ns: median(each),
        synced_fraction: synced as f64 / requests as f64,
        lost_sync: lost,
        events_per_s: events as f64 / log_time.as_secs_f64(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--only 1000:per-tick`: one scenario (for callgrind, which counts per process).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let (ticks, rounds) = if quick { (8, 1) } else { (40, 5) };
    println!(
        "log_head: {REQUESTS_PER_TICK} requests and workers/2 poll replies (1 event each) per 50 ms tick, {ticks} ticks, median of {rounds} interleaved rounds"
    );
    println!(
        "{:>8} {:>10} {:>16} {:>15} {:>16} {:>10} {:>14}",
        "workers",
        "appends",
        "ns/request mean",
        "ns/request p50",
        "requests synced",
        "lost sync",
        "events/s (log)"
    );
    for workers in [8usize, 1000] {
        let mut figures: Vec<(Mode, Vec<Figures>)> = vec![
            (Mode::PerReply, Vec::new()),
            (Mode::PerTick, Vec::new()),
            (Mode::Filter, Vec::new()),
        ];
        let name = |mode: Mode| match mode {
            Mode::PerReply => "per-reply",
            Mode::PerTick => "per-tick",
            Mode::Filter => "2+tick",
        };
        figures.retain(|(mode, _)| {
            only.as_ref()
                .is_none_or(|o| *o == format!("{workers}:{}", name(*mode)))
        });
        for _ in 0..rounds {
            for (mode, runs) in &mut figures {
                runs.push(run(workers, *mode, ticks));
            }
        }
        for (mode, runs) in figures {
            let name = name(mode);
            println!(
                "{:>8} {:>10} {:>16.0} {:>15.0} {:>15.0}% {:>10} {:>14.0}",
                workers,
                name,
                median(runs.iter().map(|f| f.request_ns).collect()),
                median(runs.iter().map(|f| f.request_p50_ns).collect()),
                100.0 * median(runs.iter().map(|f| f.synced_fraction).collect()),
                runs.iter().map(|f| f.lost_sync).max().unwrap_or(0),
                median(runs.iter().map(|f| f.events_per_s).collect()),
            );
        }
    }
}
