//! One simulated Envoy: its shared data, one VM's routing state, and what the adapter does around
//! the request path (`src/proxy`): the configuration's set-up, event pages applied through the
//! shared log (coalesced as the poller does), and the tick. Everything it decides is the core's.

use super::host::SimHost;
use kv_router_core::approx;
use kv_router_core::config::{Config, UnseenTraffic};
use kv_router_core::events::{parse_event_page, Booked, LogRecord};
use kv_router_core::learn;
use kv_router_core::load_store;
use kv_router_core::polling::Declarations;
use kv_router_core::replication::coalesce::{Coalescer, QueuedReply, ReplyKind};
use kv_router_core::replication::log as replication;
use kv_router_core::request_path::{Action, RequestPath, RoutingState};
use kv_router_core::store::fake::MemStore;
use kv_router_core::tick::{TickCadence, TickKind};
use std::collections::HashMap;
use std::rc::Rc;

pub struct SimEnvoy {
    store: Rc<MemStore>,
    pub vm: RoutingState,
    coalescer: Coalescer,
    cadence: TickCadence,
    fingerprint: u64,
    /// Per worker, the newest event id this Envoy has applied.
    cursors: Vec<u64>,
    /// What each worker's bridge last heard from this Envoy.
    declarations: Declarations,
    pub counters: HashMap<&'static str, u64>,
}

impl SimEnvoy {
    /// An Envoy configured with `config` (JSON), as `on_configure` sets it up, that has taken
    /// every worker's (empty) dump. `shared`: the shared data of an Envoy already simulated
    /// (this one is then another VM of that Envoy), else its own.
    pub fn new(
        config: &str,
        nonce: u64,
        now_ms: u64,
        shared: Option<Rc<MemStore>>,
    ) -> Result<SimEnvoy, String> {
        let parsed = Config::from_json(config.as_bytes()).map_err(|e| e.to_string())?;
        let config = Rc::new(parsed);
        let store = shared.unwrap_or_else(|| Rc::new(MemStore::new()));
        load_store::init(&*store, config.slots.len(), config.load.request_timeout_ms);
        replication::init(&*store);
        if config.approximate.is_some() {
            approx::init(&*store);
        }
        let fingerprint = 0x5151_0000;
        let workers = config.workers.len();
        let mut vm = RoutingState::new(Rc::clone(&config), fingerprint, nonce);
        vm.replica.full_head = true;
        let mut envoy = SimEnvoy {
            store,
            vm,
            coalescer: Coalescer::default(),
            cadence: TickCadence::new(config.tick_ms),
            fingerprint,
            cursors: vec![0; workers],
            declarations: Declarations::default(),
            counters: HashMap::new(),
        };
        for worker in 0..workers {
            let reply = QueuedReply {
                worker: u16::try_from(worker).map_err(|e| e.to_string())?,
                generation: 0,
                kind: ReplyKind::Dump { last: 0 },
                at_ms: now_ms,
                reported: None,
                described: None,
                record: None,
            };
            envoy.coalescer.push(reply, 0);
        }
        envoy.flush(now_ms);
        Ok(envoy)
    }

    /// What this Envoy has booked on worker entry `worker`, and what it learned of its timing:
    /// what its events call declares now (as `src/proxy/poller.rs` does).
    pub fn declaration(&mut self, worker: usize, now_ms: u64) -> Booked {
        let booked = self.declared_with_poll(worker, now_ms);
        if let Ok(w) = u16::try_from(worker) {
            self.declarations.sent(w, booked, false);
        }
        booked
    }

    fn declared_with_poll(&self, worker: usize, now_ms: u64) -> Booked {
        let config = &self.vm.config;
        let view = load_store::view(&*self.store, config.slots.len(), now_ms);
        let slots = config.worker_slots(u16::try_from(worker).unwrap_or(u16::MAX));
        let mut booked = load_store::booked_on(&view, slots);
        if config.ttft.as_ref().is_some_and(|t| t.learn) {
            let record = learn::read_record(&*self.store, worker);
            booked.timing = (record.samples > 0).then(|| record.sums_at(now_ms));
        }
        booked
    }

    /// The tick's declarations between polls (`load.unseen_traffic: relayed`): per worker whose
    /// bookings moved since this Envoy last declared them, what it declares now. The simulated
    /// bridge answers at once.
    pub fn declare_moved(&mut self, workers: usize, now_ms: u64) -> Vec<(usize, Booked)> {
        let config = Rc::clone(&self.vm.config);
        if config.load.unseen_traffic != UnseenTraffic::Relayed
            || config.events.declare_path.is_empty()
        {
            return Vec::new();
        }
        let mut out = Vec::new();
        for worker in 0..workers {
            let Ok(w) = u16::try_from(worker) else { break };
            let booked = self.declared_with_poll(worker, now_ms);
            if self.declarations.due(w, &booked) {
                self.declarations.sent(w, booked, true);
                self.declarations.answered(w, Some("204"));
                out.push((worker, booked));
            }
        }
        out
    }

    /// This Envoy's shared data.
    pub fn store(&self) -> Rc<MemStore> {
        Rc::clone(&self.store)
    }

    fn host(&mut self, now_ms: u64) -> (SimHost<'_>, &mut RoutingState) {
        let host = SimHost::idle(&self.store, &mut self.counters, now_ms);
        (host, &mut self.vm)
    }

    /// Appends the queued replies to the shared log and applies it to the VM's index.
    fn flush(&mut self, now_ms: u64) {
        let workers = self.vm.config.workers.len();
        let flushed = self
            .coalescer
            .flush(&*self.store, self.fingerprint, workers, now_ms);
        *self.counters.entry("sim.replies_dropped").or_default() += flushed.dropped as u64;
        let (mut host, vm) = self.host(now_ms);
        vm.sync_replica(&mut host);
    }

    /// Worker `worker`'s event page (the bridge's `/kv/events` body after this Envoy's cursor).
    pub fn apply_page(&mut self, worker: usize, body: &[u8], now_ms: u64) -> Result<(), String> {
        let config = Rc::clone(&self.vm.config);
        let page = parse_event_page(body, config.block_size, config.events.max_response_bytes)
            .map_err(|e| format!("worker {worker}: page rejected: {e}"))?;
        let after = self.cursors.get(worker).copied().unwrap_or(0);
        let events: Vec<_> = page
            .events
            .into_iter()
            .filter(|e| e.event_id > after)
            .collect();
        let cursor = events.last().map_or(after, |e| e.event_id);
        let worker16 = u16::try_from(worker).map_err(|e| e.to_string())?;
        let reply = QueuedReply {
            worker: worker16,
            generation: 0,
            kind: ReplyKind::Page { after, cursor },
            at_ms: now_ms,
            reported: page.load,
            described: None,
            record: (!events.is_empty()).then_some(LogRecord::Events {
                worker: worker16,
                events,
            }),
        };
        if let Some(c) = self.cursors.get_mut(worker) {
            *c = cursor;
        }
        if self.coalescer.push(reply, body.len()) {
            self.flush(now_ms);
        }
        Ok(())
    }

    /// The tick at `now_ms`, full or relay only ([`kv_router_core::tick`]), as the adapter's
    /// `on_tick`; the declarations are the caller's ([`Self::declare_moved`]). Returns when the
    /// next tick is due.
    pub fn on_tick(&mut self, now_ms: u64) -> u64 {
        let config = Rc::clone(&self.vm.config);
        match self.cadence.kind(config.tick_ms, now_ms) {
            TickKind::Full => self.tick(now_ms),
            // The replies that came in since, applied; the caller declares what moved.
            TickKind::Relay => {
                *self.counters.entry("events.relay_ticks").or_default() += 1;
                self.flush(now_ms);
            }
        }
        let others = self.vm.hears_other_routers();
        self.cadence.period_change(&config, true, others);
        now_ms + self.cadence.period_ms()
    }

    /// The VM's tick: deferred releases, the tick's batch of replies, the shared log, the
    /// predictions of other VMs and the learned timings.
    fn tick(&mut self, now_ms: u64) {
        let slots = self.vm.config.slots.len();
        if !self.vm.releases.is_empty() {
            self.vm.releases.flush(&*self.store, slots);
        }
        self.flush(now_ms);
        self.coalescer.new_tick();
        let mut host = SimHost::idle(&self.store, &mut self.counters, now_ms);
        self.vm.sync_predictions(&mut host, now_ms);
        self.vm.refresh_learned(&*self.store, now_ms);
        self.vm.sample_traffic_on_tick(&*self.store, now_ms);
        self.vm.share_placements(&*self.store);
    }

    /// Routes a request (headers, then the whole body): the chosen worker's address, or `None`
    /// when the filter set no destination.
    pub fn route(
        &mut self,
        request: &mut RequestPath,
        path: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Option<String> {
        let header = self.vm.config.destination_header.clone();
        let mut host = SimHost::idle(&self.store, &mut self.counters, now_ms);
        host.request_headers = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            ("content-length".into(), body.len().to_string()),
            ("content-type".into(), "application/json".into()),
        ];
        host.request_body = body;
        let first = request.on_request_headers(&mut host, &mut self.vm, false);
        if first == Action::Pause {
            request.on_request_body(&mut host, &mut self.vm, body.len(), true);
        }
        host.header(&header)
            .and_then(|d| d.split(',').next())
            .map(str::to_string)
    }

    /// A streamed response's chunk (the first one also brings the headers); `end` ends it.
    pub fn response(
        &mut self,
        request: &mut RequestPath,
        first: bool,
        chunk: &[u8],
        end: bool,
        now_ms: u64,
    ) {
        let mut host = SimHost::idle(&self.store, &mut self.counters, now_ms);
        host.response_chunk = chunk;
        if first {
            request.on_response_headers(&mut host, &mut self.vm, false);
        }
        request.on_response_body(&mut host, &mut self.vm, chunk.len(), end);
        if end {
            request.on_log(&mut host, &mut self.vm);
        }
    }
}
