//! State shared by the engine tasks, the load scraper and the HTTP server.

use kv_router_protocol::worker::WorkerDescription;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::core::{ApplyOutcome, Core, CoreLimits};
use crate::metrics::Metrics;
use kv_router_protocol::page::Load;

/// What `/health` reports about one engine endpoint.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStatus {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    /// `connecting`, `connected` or `catching_up`.
    pub state: &'static str,
    pub connected: bool,
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    pub batches: u64,
    /// Milliseconds since the last batch, when one arrived.
    pub last_batch_age_ms: Option<u64>,
    pub dp_ranks: Vec<u32>,
    pub resets: u64,
    /// The mirror may lack blocks stored before the history the bridge could see (it joined
    /// late, or a gap could not be replayed); it never holds blocks the engine dropped.
    pub partial_history: bool,
    pub last_error: Option<String>,
    #[serde(skip)]
    pub last_batch_at: Option<Instant>,
}

#[derive(Debug)]
pub struct Shared {
    core: Mutex<Core>,
    /// The newest event id, for long polls.
    last_id: watch::Sender<u64>,
    pub metrics: Metrics,
    engines: Vec<Mutex<EngineStatus>>,
    load: Mutex<Option<(Load, Instant)>>,
    /// The `--worker-*` flags, and what the engine metrics said (`describe`).
    worker_flags: Mutex<WorkerDescription>,
    worker_learned: Mutex<WorkerDescription>,
    /// A scraped load older than this is not reported.
    pub load_max_age: Duration,
    /// What the routers polling the page have booked on the worker.
    pub routers: crate::routers::RouterBookings,
    shutdown: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves consistent data here (plain updates), so a poisoned
    // lock is still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub fn new(limits: CoreLimits, engines: Vec<EngineStatus>, load_max_age: Duration) -> Self {
        Shared {
            core: Mutex::new(Core::new(limits)),
            last_id: watch::Sender::new(0),
            metrics: Metrics::default(),
            engines: engines.into_iter().map(Mutex::new).collect(),
            load: Mutex::new(None),
            load_max_age,
            routers: crate::routers::RouterBookings::default(),
            worker_flags: Mutex::default(),
            worker_learned: Mutex::default(),
            shutdown: watch::Sender::new(false),
        }
    }

    /// Runs `f` on the core; wakes long polls when it added events.
    pub fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let (result, last) = {
            let mut core = lock(&self.core);
            let result = f(&mut core);
            (result, core.last_event_id())
        };
        self.last_id.send_if_modified(|id| {
            let changed = *id != last;
            *id = last;
            changed
        });
        result
    }

    /// Counts what an apply did.
    pub fn record(&self, outcome: &ApplyOutcome) {
        let m = &self.metrics;
        for (kind, n) in ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
            .iter()
            .zip(outcome.forwarded)
        {
            m.add("kv_bridge_forwarded_events_total", &[("type", kind)], n);
        }
        for refusal in &outcome.refused {
            m.inc(
                "kv_bridge_refused_events_total",
                &[("reason", refusal.label())],
            );
            if refusal.label() == "block_size_mismatch" {
                m.inc("kv_bridge_block_size_mismatch_total", &[]);
            }
        }
        m.add(
            "kv_bridge_removed_unknown_blocks_total",
            &[],
            outcome.removed_unknown,
        );
        m.add(
            "kv_bridge_removed_still_held_total",
            &[],
            outcome.removed_still_held,
        );
    }

    pub fn last_id_watch(&self) -> watch::Receiver<u64> {
        self.last_id.subscribe()
    }

    pub fn engine_count(&self) -> usize {
        self.engines.len()
    }

    pub fn update_engine(&self, index: usize, f: impl FnOnce(&mut EngineStatus)) {
        if let Some(status) = self.engines.get(index) {
            f(&mut lock(status));
        }
    }

    pub fn engine_statuses(&self) -> Vec<EngineStatus> {
        let now = Instant::now();
        self.engines
            .iter()
            .map(|s| {
                let mut status = lock(s).clone();
                status.last_batch_age_ms = status
                    .last_batch_at
                    .map(|t| now.saturating_duration_since(t).as_millis() as u64);
                status
            })
            .collect()
    }

    pub fn set_worker_flags(&self, flags: WorkerDescription) {
        *lock(&self.worker_flags) = flags;
    }

    /// What the engine metrics said (block size, capacity); models are kept.
    pub fn set_worker_learned(&self, learned: WorkerDescription) {
        let mut current = lock(&self.worker_learned);
        current.block_size = learned.block_size;
        current.kv_capacity_blocks = learned.kv_capacity_blocks;
    }

    /// What the engine's `/v1/models` said.
    pub fn set_worker_models(&self, models: Vec<String>) {
        lock(&self.worker_learned).models = Some(models);
    }

    /// The page's `worker` object (flags over what was learned), if anything is known.
    pub fn worker_json(&self) -> Option<String> {
        let flags = lock(&self.worker_flags).clone();
        let learned = lock(&self.worker_learned).clone();
        flags.over(&learned).to_json()
    }

    pub fn set_load(&self, load: Option<Load>) {
        *lock(&self.load) = load.map(|l| (l, Instant::now()));
    }

    /// The latest scraped load, if fresh.
    pub fn load(&self) -> Option<Load> {
        lock(&self.load)
            .filter(|(_, at)| at.elapsed() <= self.load_max_age)
            .map(|(l, _)| l)
    }

    pub fn shutdown_watch(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    pub fn shut_down(&self) {
        self.shutdown.send_replace(true);
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }
}
