//! The root context: one per VM (each Envoy worker thread, plus the main thread).
//!
//! It compiles the configuration once, owns the VM's state (index replica, selector, metrics) that
//! request contexts share, and on every tick: applies new log batches, and, if it holds the poller
//! lease, polls worker events, marks silent workers stale and reaps abandoned load entries. While
//! other routers share the fleet, the poller also ticks in between, only to relay (`crate::tick`).

use super::envoy_host::EnvoyHost;
use super::host::{self, HostStore};
use super::http::RequestContext;
use super::metrics::Metrics;
use super::poller::Poller;
use super::vm::{worker_id, VmState};
use crate::approx;
use crate::config::Config;
use crate::events::EventError;
use crate::load_store;
use crate::polling::{disposition, Disposition, ReplyOutcome};
use crate::replication::lease::hold_lease;
use crate::replication::log as replication;
use crate::request_path::RoutingState;
use crate::tick::{TickCadence, TickKind};
use log::{error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub struct RouterRoot {
    context_id: u32,
    state: Option<Rc<RefCell<VmState>>>,
}

impl RouterRoot {
    pub fn new(context_id: u32) -> Self {
        RouterRoot {
            context_id,
            state: None,
        }
    }
}

impl Context for RouterRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _: usize,
    ) {
        let Some(state) = &self.state else { return };
        let Ok(mut vm) = state.try_borrow_mut() else {
            return;
        };
        let now = host::now_ms();
        if vm.membership_reply(token_id, num_headers, body_size, now) {
            return;
        }
        let status = if num_headers == 0 {
            None
        } else {
            host::header(MapType::HttpCallResponseHeaders, ":status")
        };
        if vm.poller.take_declaration(token_id, status.as_deref()) {
            if !status.as_deref().is_some_and(|s| s.starts_with('2')) {
                vm.metrics.inc("events.declare_failed");
            }
            return;
        }
        let Some(call) = vm.poller.take(token_id) else {
            return;
        };
        let max_bytes = vm.path.config.events.max_response_bytes;
        // The size is known before the body is copied into the VM: an oversized page never is.
        let outcome = match disposition(status.as_deref(), body_size, max_bytes) {
            Disposition::Failed => {
                vm.metrics.inc("events.fetch_failed");
                log::debug!(
                    "kv-router: event fetch from worker {} failed: {}",
                    worker_id(&vm.path.config, call.worker),
                    status
                        .as_deref()
                        .unwrap_or("no response (connect failure or timeout)")
                );
                ReplyOutcome::Failed
            }
            Disposition::TooLarge { body_bytes } => {
                vm.reject_page(
                    call.worker,
                    &EventError::TooLarge {
                        body_bytes,
                        max_bytes,
                    },
                );
                ReplyOutcome::Rejected
            }
            Disposition::Read => {
                let body =
                    host::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default();
                vm.handle_events_reply(call, &body, now)
            }
        };
        vm.after_reply(call, outcome, now);
    }

    fn on_done(&mut self) -> bool {
        // A VM torn down (a configuration change) takes its memory out of the process-wide sum.
        if let Some(Ok(mut vm)) = self.state.as_ref().map(|s| s.try_borrow_mut()) {
            let reported = vm.linear_memory_reported as i64;
            vm.metrics.gauge_add("vm.linear_memory_bytes", -reported);
            vm.linear_memory_reported = 0;
        }
        true
    }
}

impl VmState {
    /// Applies new log batches and records what happened.
    pub fn sync_replica(&mut self) {
        let mut host = EnvoyHost {
            metrics: &mut self.metrics,
            histograms: &mut self.histogram_ids,
        };
        self.path.sync_replica(&mut host);
    }

    /// Applies the routing decisions other VMs published since the last sync.
    pub fn sync_predictions(&mut self, now: u64) {
        let mut host = EnvoyHost {
            metrics: &mut self.metrics,
            histograms: &mut self.histogram_ids,
        };
        self.path.sync_predictions(&mut host, now);
    }

    fn tick(&mut self) {
        let now = host::now_ms();
        let config = Rc::clone(&self.path.config);
        if self.cadence.kind(config.tick_ms, now) == TickKind::Relay {
            self.relay_tick(&config, now);
            return;
        }
        self.metrics.flush();
        if !self.path.releases.is_empty() {
            self.path.releases.flush(&HostStore, config.slots.len());
        }
        let dropped = std::mem::take(&mut self.path.releases.dropped);
        self.metrics.add("load.release_dropped", dropped);
        let lease_ms = (config.events.poll_interval_ms * 5)
            .max(config.tick_ms * 10)
            .max(1000);
        let leader = hold_lease(&HostStore, self.path.nonce, now, lease_ms);
        // The poller reads cursors from its replica's head: it decodes the whole head.
        self.path.replica.full_head = leader;
        // Replies queued since the last tick, as one batch (also after losing the lease: their
        // preconditions keep a late append from undoing the new poller's work).
        self.flush_replies(now);
        self.poller.queued.new_tick();
        self.sync_replica();
        self.sync_predictions(now);
        self.path.refresh_learned(&HostStore, now);
        self.path.sample_traffic_on_tick(&HostStore, now);
        self.path.share_placements(&HostStore);
        // Every VM adds its own share; the other gauges are the leader's alone.
        self.publish_linear_memory();
        let others = self.path.hears_other_routers();
        if let Some(ms) = self.cadence.period_change(&config, leader, others) {
            let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
        }
        if !leader {
            // Another VM records the gauges meanwhile: on taking the lease back, record all.
            self.slot_gauges.clear();
            return;
        }
        self.fill_orphaned_batch(now);
        self.poll_membership(now);
        self.mark_stale_workers(now);
        let head = self.path.replica.head.clone();
        // The membership may have moved during this tick: poll with the configuration as it is.
        let config = Rc::clone(&self.path.config);
        self.poller.dispatch_due(&config, &head, now);
        self.declare_moved(&config, now);
        self.path.replica.maybe_write_snapshot(&HostStore);
        self.publish_gauges(now);
    }

    /// Between full ticks, on the poller while other routers share the fleet (`crate::tick`):
    /// the replies that came in, applied (their relayed bookings), and this Envoy's bookings
    /// that moved, declared, so that replicas hear of each other's within a few ms.
    fn relay_tick(&mut self, config: &Config, now: u64) {
        self.metrics.add_later("events.relay_ticks", 1);
        self.flush_replies(now);
        self.declare_moved(config, now);
    }

    fn declare_moved(&mut self, config: &Config, now: u64) {
        let (declared, refused) = self.poller.declare_moved(config, now);
        self.metrics.add("events.declared", declared);
        self.metrics.add("events.declare_failed", refused);
    }
}

impl RootContext for RouterRoot {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, plugin_configuration_size)
            .unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(config) => Rc::new(config),
            Err(err) => {
                error!("kv-router: invalid configuration: {err}");
                return false;
            }
        };
        let fingerprint = xxh3_64_with_seed(&bytes, 0);
        let nonce = xxh3_64_with_seed(
            &[
                host::now_nanos().to_le_bytes(),
                u64::from(self.context_id).to_le_bytes(),
            ]
            .concat(),
            fingerprint,
        );
        let workers = config.workers.len();
        let state = VmState {
            path: RoutingState::new(Rc::clone(&config), fingerprint, nonce),
            metrics: Metrics::default(),
            poller: Poller::new(workers, nonce),
            cadence: TickCadence::new(config.tick_ms),
            slot_gauges: Vec::new(),
            block_size_warned: vec![false; workers],
            fingerprint,
            members_call: None,
            next_members_poll_ms: 0,
            linear_memory_reported: 0,
            timing_published: Vec::new(),
            histogram_ids: Vec::new(),
        };
        load_store::init(
            &HostStore,
            config.slots.len(),
            config.load.request_timeout_ms,
        );
        replication::init(&HostStore);
        if config.approximate.is_some() {
            approx::init(&HostStore);
        }
        let _ = hostcalls::set_tick_period(Duration::from_millis(config.tick_ms));
        info!(
            "kv-router: configured: engine {}, mode {:?}, {} workers ({} slots), block size {}",
            config.engine.map_or("(none)", |e| e.as_str()),
            config.mode,
            workers,
            config.slots.len(),
            config.block_size
        );
        for note in config.advisories() {
            warn!("kv-router: {note}");
        }
        self.state = Some(Rc::new(RefCell::new(state)));
        true
    }

    fn on_tick(&mut self) {
        let Some(state) = &self.state else { return };
        if let Ok(mut vm) = state.try_borrow_mut() {
            vm.tick();
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let state = self.state.as_ref()?;
        Some(Box::new(RequestContext::new(Rc::clone(state))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
