//! A race in virtual time: the filter's own request path (kv-router-core, driven as the adapter
//! drives it, one VM per Envoy) in front of the mock's engine model ([`EngineCore`], the roofline
//! of `mock::timing` with its per-worker speed and jitter), with no Envoy, no sockets and no
//! clock. A run is deterministic: the same workload, fleet and arm give the same figures, so
//! two policies a few percent apart can be told apart, which three noisy runs of the real race
//! (`make race`) cannot. The race stays the judge; this is the tool for choosing what to race.
//!
//! What it models, and how it differs from the real race:
//! * the engines exactly as the mock worker runs them (a step's KV events leave when it is
//!   planned, its outputs when it ends; an idle engine with waiting work polls every 2 ms);
//! * the bridge: each worker's events reach every Envoy `event_delay_ms` after they were
//!   published, in one page, with the engine's load as last scraped (every
//!   `scrape_interval_ms`, phase-shifted per worker) and the other Envoys' bookings (and
//!   learned timing) as they declared them when their calls were sent (after their last page)
//!   or, with `load.unseen_traffic: relayed`, on a tick when they moved, which wakes every
//!   Envoy's poll of the worker [`DECLARE_HOP_MS`] later; a worker without events answers after
//!   the filter's `events.long_poll_ms` (else `poll_interval_ms`) with an empty page;
//! * Envoy: requests spread round-robin over `envoys` independent Envoys (one VM each), the
//!   filter's tick every `tick_ms`; no network, HTTP or Envoy time (the real race adds a few
//!   ms per request);
//! * no peers: `vllm-router`'s policies are not in it (compare with them in the race).

pub mod envoy;
pub mod host;

use crate::compare::Fleet;
use crate::loadgen::{body_for, RunOptions, Spread, Workload};
use crate::mock::engine::{EngineCore, Output, ReqId, StepOutcome};
use crate::mock::Options;
use clap::Parser;
use envoy::SimEnvoy;
use kv_router_core::request_path::RequestPath;
use kv_router_protocol::page::{page_json, Load};
use serde_json::{json, Value};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

/// From an Envoy's declaration between polls to the other Envoys' woken polls answering (ms).
const DECLARE_HOP_MS: f64 = 1.0;

/// How an arm routes.
#[derive(Clone, Debug)]
pub enum Router {
    /// The filter with this configuration (JSON), in front of `envoys` Envoys; `calibrated`:
    /// each worker entry with its own timing polynomials (`kv+calibrated`).
    Filter {
        config: Value,
        envoys: usize,
        /// How the requests are spread over the Envoys (`kv*3~client`: by client).
        spread: Spread,
        calibrated: bool,
    },
    /// Round-robin, as Envoy's own load balancer.
    RoundRobin,
    /// Each request to the worker that would give it its first token soonest if nothing else
    /// arrived (a copy of each engine run forward), that price times the filter's request-share
    /// penalty with `share_weight` (0: none): what a router that saw every engine's exact state
    /// and speed could do one request at a time. A yardstick, not a policy.
    Oracle { share_weight: f64 },
}

/// The bridge's timing.
#[derive(Clone, Copy, Debug)]
pub struct SimOptions {
    /// From an engine publishing events to every Envoy's index having them.
    pub event_delay_ms: f64,
    /// How often the bridge scrapes an engine's load (`--engine-metrics-interval-ms`).
    pub scrape_interval_ms: f64,
    /// Varies every engine's jitter (0: the mock workers' own seeds): runs of one arm under
    /// several seeds give its spread, as repeated runs of the race do.
    pub seed: u64,
    /// The Envoys of a `*N` arm share one shared data (as one Envoy's VMs do): what replicas
    /// would route like if they shared their load tables (an upper bound for replicas).
    pub replicas_share_data: bool,
    /// The bridge relays each Envoy's declared bookings to the others (`load.other_routers`),
    /// as `kv-event-bridge` does.
    pub relay_bookings: bool,
    /// Also run every engine forward at each arrival (as [`Router::Oracle`]) and record how much
    /// later the chosen worker gives the first token than the best one would
    /// ([`SimRun::regret_ms`]). Slow: a copy of every engine per request.
    pub probe_regret: bool,
    /// Every Envoy is told each worker's true speed (its learned timing factors replaced by
    /// the inverse speeds before each decision): what the learning could at best give.
    pub true_speeds: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            event_delay_ms: 3.0,
            scrape_interval_ms: 1000.0,
            seed: 0,
            replicas_share_data: false,
            relay_bookings: true,
            probe_regret: false,
            true_speeds: false,
        }
    }
}

/// What one simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct SimRun {
    /// Per completed request, arrival to first token (ms).
    pub ttft_ms: Vec<f64>,
    /// Requests completed per worker (fleet order).
    pub per_worker: Vec<usize>,
    /// Each worker's `--speedup`.
    pub speedups: Vec<f64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Requests an engine refused or failed.
    pub errors: usize,
    /// The filter's counters, summed over the Envoys.
    pub counters: BTreeMap<String, u64>,
    /// Per Envoy, each worker's learned timing factor at the end.
    pub factors: Vec<Vec<f64>>,
    /// Per request (with `probe_regret` or an oracle arm), the forecast first-token delay on the
    /// chosen worker minus that on the best one, ms.
    pub regret_ms: Vec<f64>,
    /// Per request, the forecast first-token delay on the best worker, ms.
    pub oracle_best_ms: Vec<f64>,
    /// With `probe_regret`, per routed request, one JSON line: the forecast per worker, the
    /// worker chosen, and the filter's costs and load view as it decided (`--decisions`).
    pub decisions: Vec<String>,
}

impl SimRun {
    pub fn ttft_mean(&self) -> f64 {
        if self.ttft_ms.is_empty() {
            return 0.0;
        }
        self.ttft_ms.iter().sum::<f64>() / self.ttft_ms.len() as f64
    }

    /// The `q` quantile (0..=1) of TTFT, nearest rank.
    pub fn ttft_quantile(&self, q: f64) -> f64 {
        let mut v = self.ttft_ms.clone();
        v.sort_by(f64::total_cmp);
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
        v.get(rank - 1).copied().unwrap_or(0.0)
    }

    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            return 0.0;
        }
        self.cached_tokens as f64 / self.prompt_tokens as f64
    }

    /// The largest share of requests over the worker's share of the fleet's speed (max/mean
    /// requests per worker on a uniform fleet).
    pub fn balance(&self) -> f64 {
        let total: usize = self.per_worker.iter().sum();
        let speed: f64 = self.speedups.iter().sum();
        if total == 0 || speed <= 0.0 {
            return 0.0;
        }
        self.per_worker
            .iter()
            .zip(&self.speedups)
            .map(|(&n, &s)| (n as f64 / total as f64) / (s / speed))
            .fold(0.0, f64::max)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    StepStart(usize),
    StepEnd(usize),
    Deliver(usize),
    /// A long poll's wait ran out (the page is empty but for the load), if no page came since
    /// the one at the given virtual microsecond.
    PollTimeout(usize, u64),
    Scrape(usize),
    Tick(usize),
}

/// Events by virtual time (microseconds), then by the order they were scheduled.
#[derive(Default)]
struct Agenda {
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
}

impl Agenda {
    fn at(&mut self, ms: f64, event: Event) {
        let us = (ms.max(0.0) * 1000.0).round() as u64;
        self.seq += 1;
        self.heap.push(Reverse((us, self.seq, event)));
    }

    fn next(&mut self) -> Option<(f64, Event)> {
        self.heap
            .pop()
            .map(|Reverse((us, _, e))| (us as f64 / 1000.0, e))
    }
}

struct SimWorker {
    core: EngineCore,
    address: String,
    /// The step under way (its outputs are delivered when it ends) and when it ends.
    stepping: Option<StepOutcome>,
    step_end_ms: f64,
    /// A step is planned (`StepStart` is on the agenda).
    step_planned: bool,
    /// Events published and not yet delivered, as page texts with their ids.
    unsent: Vec<String>,
    first_unsent: u64,
    last_event_id: u64,
    delivery_planned: bool,
    /// When the Envoys last got a page from this worker (virtual microseconds).
    last_page_us: u64,
    scraped: Load,
    requests: HashMap<ReqId, usize>,
    /// What each Envoy declared on its last poll (the bridge's relay).
    declared: Vec<Option<kv_router_core::events::Booked>>,
}

struct SimRequest {
    path: RequestPath,
    envoy: usize,
    arrived_ms: f64,
    first_token: bool,
}

/// One SSE token event, as the mock streams it.
const TOKEN_CHUNK: &[u8] = b"data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n";

/// The engine configuration mock worker `id` of `fleet` runs (its real command line, parsed).
fn engine_of(fleet: &Fleet, id: u64) -> Result<crate::mock::engine::EngineConfig, String> {
    let mut args = vec![
        "mock-worker".to_string(),
        "--id".to_string(),
        id.to_string(),
    ];
    args.extend(fleet.mock_args(id));
    let options = Options::try_parse_from(&args).map_err(|e| e.to_string())?;
    Ok(options.engine_config())
}

/// How long after `now` a request would get its first token on `worker` if nothing else
/// arrived: a copy of the engine (its jitter included) run forward from the end of its current
/// step. Infinite when it would be refused.
fn first_token_if_alone(worker: &SimWorker, tokens: &[u32], max_tokens: usize, now: f64) -> f64 {
    let mut core = worker.core.clone();
    let mut t = if worker.stepping.is_some() {
        worker.step_end_ms.max(now)
    } else {
        now
    };
    let Ok(id) = core.submit(tokens.to_vec(), max_tokens, 0) else {
        return f64::INFINITY;
    };
    while let Some(outcome) = core.step() {
        // An engine with work but nothing it can schedule polls every 2 ms, as in `simulate`.
        t += if outcome.is_idle() {
            2.0
        } else {
            outcome.duration_ms.max(0.0)
        };
        let first = outcome
            .outputs
            .iter()
            .any(|o| o.id() == id && matches!(o, Output::Token { .. } | Output::Failed { .. }));
        if first {
            return t - now;
        }
    }
    f64::INFINITY
}

/// The oracle's memory of where it sent requests: the filter's request-share term
/// (`ttft.share_weight`, [`kv_router_core::router`]) with each worker's true speed.
struct Shares {
    recent: Vec<f64>,
}

impl Shares {
    /// As the filter: about the last 16 requests per worker, starting from fair shares.
    const PER_WORKER: f64 = 16.0;

    fn new(workers: usize) -> Shares {
        Shares {
            recent: vec![0.0; workers],
        }
    }

    fn record(&mut self, worker: usize) {
        let keep = 1.0 - 1.0 / (Self::PER_WORKER * self.recent.len() as f64);
        self.recent.iter_mut().for_each(|r| *r *= keep);
        if let Some(r) = self.recent.get_mut(worker) {
            *r += 1.0;
        }
    }

    /// The worker whose forecast times `1 + weight * excess` is lowest, `excess` being how far
    /// its share of the recent requests is above its share of the fleet's speed.
    fn cheapest(&self, forecast: &[f64], speeds: &[f64], weight: f64) -> Option<usize> {
        let speed: f64 = speeds.iter().sum();
        let total: f64 = self.recent.iter().sum();
        let prior = Self::PER_WORKER / 2.0 * self.recent.len() as f64;
        let price = |i: usize| {
            let fair = speeds.get(i).copied().unwrap_or(0.0) / speed;
            let share =
                (self.recent.get(i).copied().unwrap_or(0.0) + prior * fair) / (total + prior);
            let excess = (share / fair - 1.0).max(0.0);
            forecast.get(i).copied().unwrap_or(f64::INFINITY) * (1.0 + weight * excess)
        };
        (0..forecast.len()).min_by(|&a, &b| price(a).total_cmp(&price(b)))
    }
}

/// Runs `workload` on a fresh simulated `fleet` routed by `router`.
pub fn simulate(
    workload: &Workload,
    fleet: &Fleet,
    router: &Router,
    opts: &SimOptions,
) -> Result<SimRun, String> {
    let n = usize::try_from(fleet.workers).map_err(|e| e.to_string())?;
    let mut workers = Vec::with_capacity(n);
    for id in 1..=fleet.workers {
        let mut cfg = engine_of(fleet, id)?;
        if opts.seed != 0 {
            cfg.seed = crate::util::splitmix64(cfg.seed ^ opts.seed);
        }
        workers.push(SimWorker {
            core: EngineCore::new(cfg),
            address: format!("10.0.{}.{}:8000", id / 256, id % 256),
            stepping: None,
            step_end_ms: 0.0,
            step_planned: false,
            unsent: Vec::new(),
            first_unsent: 1,
            last_event_id: 0,
            delivery_planned: false,
            last_page_us: 0,
            scraped: Load::default(),
            requests: HashMap::new(),
            declared: Vec::new(),
        });
    }
    let by_address: HashMap<String, usize> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (w.address.clone(), i))
        .collect();
    let mut envoys = Vec::new();
    let spread = match router {
        Router::Filter { spread, .. } => *spread,
        _ => Spread::RoundRobin,
    };
    if let Router::Filter {
        config,
        envoys: count,
        calibrated,
        ..
    } = router
    {
        let entries: Vec<Value> = workers
            .iter()
            .zip(1..)
            .map(|(w, id): (&SimWorker, u64)| json!({"id": id, "address": w.address}))
            .collect();
        let mut config_json = fleet.filter_config_for("kv", entries);
        if *calibrated {
            fleet.give_each_worker_its_timing(&mut config_json);
        }
        if let (Some(target), Some(extra)) = (config_json.as_object_mut(), config.as_object()) {
            for (k, v) in extra {
                target.insert(k.clone(), v.clone());
            }
        }
        let text = config_json.to_string();
        for e in 0..(*count).max(1) {
            let shared = envoys
                .first()
                .filter(|_| opts.replicas_share_data)
                .map(SimEnvoy::store);
            envoys.push(SimEnvoy::new(&text, 0x9E37_79B9 + e as u64, 0, shared)?);
        }
    }
    let block_size = fleet.block_size;
    let mut agenda = Agenda::default();
    for (i, r) in workload.requests.iter().enumerate() {
        agenda.at(r.at_ms, Event::Arrive(i));
    }
    for w in 0..n {
        // Scrapes spread over the interval, as independent bridges would be.
        let phase = opts.scrape_interval_ms * (w as f64 + 0.5) / n as f64;
        agenda.at(phase, Event::Scrape(w));
    }
    for (e, envoy) in envoys.iter().enumerate() {
        agenda.at(envoy.vm.config.tick_ms.max(1) as f64, Event::Tick(e));
    }
    // A worker without events answers each call after the filter's long-poll wait.
    let idle_page_ms = envoys.first().map_or(1.0, |e| {
        let events = &e.vm.config.events;
        let ms = if events.long_poll_ms > 0 {
            events.long_poll_ms
        } else {
            events.poll_interval_ms
        };
        ms.max(1) as f64
    });
    if !envoys.is_empty() {
        for w in 0..n {
            agenda.at(idle_page_ms, Event::PollTimeout(w, 0));
        }
    }
    let mut run = SimRun {
        per_worker: vec![0; n],
        speedups: workers
            .iter()
            .map(|w| w.core.config().speedup / w.core.config().slowdown)
            .collect(),
        ..SimRun::default()
    };
    let mut requests: Vec<Option<SimRequest>> = Vec::new();
    requests.resize_with(workload.requests.len(), || None);
    let run_opts = RunOptions::default();
    let mut shares = Shares::new(n);
    let mut outstanding = workload.requests.len();
    while outstanding > 0 {
        let Some((now, event)) = agenda.next() else {
            break;
        };
        let now_ms = now as u64;
        match event {
            Event::Arrive(i) => {
                let Some(spec) = workload.requests.get(i) else {
                    continue;
                };
                let mut path = RequestPath::new();
                let envoy = if envoys.is_empty() {
                    0
                } else {
                    spread.target(i, spec.client, envoys.len())
                };
                let chosen = match envoys.get_mut(envoy) {
                    Some(e) => {
                        if opts.true_speeds {
                            let learned = &mut e.vm.learned;
                            learned.factors = run.speedups.iter().map(|s| 1.0 / s).collect();
                            let logs: f64 = learned.factors.iter().map(|f| f.ln()).sum();
                            learned.fleet = (logs / n as f64).exp();
                        }
                        let url = if spec.messages.is_some() {
                            "/v1/chat/completions"
                        } else {
                            "/v1/completions"
                        };
                        let body = body_for(spec, &run_opts);
                        e.route(&mut path, url, &body, now_ms)
                            .and_then(|a| by_address.get(&a).copied())
                    }
                    None => None,
                };
                let oracle_share = match router {
                    Router::Oracle { share_weight } => Some(*share_weight),
                    _ => None,
                };
                // The oracle's forecast for every worker (the oracle arm, or the regret probe).
                let forecast: Vec<f64> = if oracle_share.is_some() || opts.probe_regret {
                    workers
                        .iter()
                        .map(|w| first_token_if_alone(w, &spec.tokens, spec.max_tokens, now))
                        .collect()
                } else {
                    Vec::new()
                };
                let chosen = match oracle_share {
                    Some(weight) => shares.cheapest(&forecast, &run.speedups, weight),
                    None => chosen,
                };
                let w = chosen.unwrap_or(i % n);
                shares.record(w);
                let best = forecast.iter().copied().fold(f64::INFINITY, f64::min);
                if let Some(&own) = forecast.get(w).filter(|f| f.is_finite()) {
                    run.regret_ms.push(own - best);
                    run.oracle_best_ms.push(best);
                }
                if opts.probe_regret {
                    let view = envoys.get(envoy).map(|e| {
                        let vm = &e.vm;
                        let reports = &vm.slot_reports.reported;
                        json!({
                            "costs": path.decision_costs(),
                            "prefill_tokens": vm.load_view.iter().map(|l| l.prefill_tokens).collect::<Vec<_>>(),
                            "decode_blocks": vm.load_view.iter().map(|l| l.decode_blocks).collect::<Vec<_>>(),
                            "active": vm.load_view.iter().map(|l| l.active_requests).collect::<Vec<_>>(),
                            "overlap": vm.overlaps.iter().map(|o| o.device_blocks).collect::<Vec<_>>(),
                            "factors": (0..n).map(|k| vm.learned.factor(k)).collect::<Vec<_>>(),
                            "fleet": vm.learned.fleet,
                            "kv_usage": vm.slot_reports.kv_usage,
                            "reported": reports.iter()
                                .map(|r| r.map(|r| (r.num_running, r.num_waiting)))
                                .collect::<Vec<_>>(),
                            "others": reports.iter()
                                .map(|r| r.and_then(|r| r.other_routers))
                                .map(|o| o.map(|o| (o.requests, o.prefill_tokens.round())))
                                .collect::<Vec<_>>(),
                            "relayed_ratio": vm.traffic_share.relayed_ratio(),
                        })
                    });
                    run.decisions.push(
                        json!({"i": i, "t": now, "envoy": envoy, "chosen": w,
                               "tokens": spec.tokens.len(), "forecast": forecast, "filter": view})
                        .to_string(),
                    );
                }
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                match worker.core.submit(spec.tokens.clone(), spec.max_tokens, 0) {
                    Ok(id) => {
                        worker.requests.insert(id, i);
                        if let Some(slot) = requests.get_mut(i) {
                            *slot = Some(SimRequest {
                                path,
                                envoy,
                                arrived_ms: now,
                                first_token: false,
                            });
                        }
                        if worker.stepping.is_none() && !worker.step_planned {
                            worker.step_planned = true;
                            agenda.at(now, Event::StepStart(w));
                        }
                    }
                    Err(_) => {
                        run.errors += 1;
                        outstanding -= 1;
                        if let Some(e) = envoys.get_mut(envoy) {
                            e.response(&mut path, true, &[], true, now_ms);
                        }
                    }
                }
            }
            Event::StepStart(w) => {
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                worker.step_planned = false;
                let Some(outcome) = worker.core.step() else {
                    continue;
                };
                for ev in worker.core.take_events() {
                    worker.last_event_id += 1;
                    let mut v = crate::mock::engine::event_json(
                        &ev,
                        block_size as usize,
                        worker.core.config().dp_rank,
                    );
                    v["event_id"] = json!(worker.last_event_id);
                    worker.unsent.push(v.to_string());
                }
                if !worker.unsent.is_empty() && !worker.delivery_planned {
                    worker.delivery_planned = true;
                    agenda.at(now + opts.event_delay_ms, Event::Deliver(w));
                }
                if outcome.is_idle() {
                    worker.step_planned = true;
                    agenda.at(now + 2.0, Event::StepStart(w));
                } else {
                    worker.step_end_ms = now + outcome.duration_ms.max(0.0);
                    agenda.at(worker.step_end_ms, Event::StepEnd(w));
                    worker.stepping = Some(outcome);
                }
            }
            Event::StepEnd(w) => {
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                let outputs = worker
                    .stepping
                    .take()
                    .map(|o| o.outputs)
                    .unwrap_or_default();
                for output in outputs {
                    let Some(&i) = worker.requests.get(&output.id()) else {
                        continue;
                    };
                    let Some(Some(req)) = requests.get_mut(i) else {
                        continue;
                    };
                    let envoy = envoys.get_mut(req.envoy);
                    match output {
                        Output::Token { .. } => {
                            let first = !req.first_token;
                            if first {
                                req.first_token = true;
                                run.ttft_ms.push(now - req.arrived_ms);
                            }
                            if let Some(e) = envoy {
                                e.response(&mut req.path, first, TOKEN_CHUNK, false, now_ms);
                            }
                        }
                        Output::Finished { id, usage } => {
                            run.prompt_tokens += usage.prompt_tokens as u64;
                            run.cached_tokens += usage.cached_tokens as u64;
                            if let Some(c) = run.per_worker.get_mut(w) {
                                *c += 1;
                            }
                            if let Some(e) = envoy {
                                e.response(&mut req.path, false, &[], true, now_ms);
                            }
                            worker.requests.remove(&id);
                            outstanding -= 1;
                        }
                        Output::Failed { id, .. } => {
                            run.errors += 1;
                            if let Some(e) = envoy {
                                e.response(&mut req.path, false, &[], true, now_ms);
                            }
                            worker.requests.remove(&id);
                            outstanding -= 1;
                        }
                    }
                }
                if !worker.step_planned {
                    worker.step_planned = true;
                    agenda.at(now, Event::StepStart(w));
                }
            }
            Event::Deliver(w) => {
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                worker.delivery_planned = false;
                if envoys.is_empty() {
                    // Round-robin: nobody polls; the events go nowhere.
                    worker.unsent.clear();
                    continue;
                }
                worker.last_page_us = (now * 1000.0).round() as u64;
                agenda.at(
                    now + idle_page_ms,
                    Event::PollTimeout(w, worker.last_page_us),
                );
                let texts = std::mem::take(&mut worker.unsent);
                let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
                let first = worker.first_unsent.min(worker.last_event_id.max(1));
                worker.first_unsent = worker.last_event_id + 1;
                worker.declared.resize(envoys.len(), None);
                let relay = opts.relay_bookings && !opts.replicas_share_data;
                for (e, envoy) in envoys.iter_mut().enumerate() {
                    // The bridge's page for this Envoy: the other Envoys' last declarations.
                    let mut load = worker.scraped;
                    if relay {
                        load.other_routers = worker
                            .declared
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| *i != e)
                            .filter_map(|(_, b)| *b)
                            .reduce(kv_router_core::events::Booked::plus);
                    }
                    let body =
                        page_json(block_size, first, worker.last_event_id, &refs, Some(load));
                    envoy.apply_page(w, body.as_bytes(), now_ms)?;
                    // Its next call, sent at once, declares what it has booked there now.
                    if let Some(d) = worker.declared.get_mut(e) {
                        *d = Some(envoy.declaration(w, now_ms));
                    }
                }
            }
            Event::Scrape(w) => {
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
                worker.scraped = Load {
                    num_waiting: count(worker.core.num_waiting()),
                    num_running: count(worker.core.num_running()),
                    kv_usage: worker.core.kv_usage(),
                    other_routers: None,
                };
                agenda.at(now + opts.scrape_interval_ms, Event::Scrape(w));
            }
            Event::PollTimeout(w, since_us) => {
                let Some(worker) = workers.get_mut(w) else {
                    continue;
                };
                if worker.last_page_us == since_us && !worker.delivery_planned {
                    worker.delivery_planned = true;
                    agenda.at(now, Event::Deliver(w));
                }
            }
            Event::Tick(e) => {
                let replicas = envoys.len();
                if let Some(envoy) = envoys.get_mut(e) {
                    let next_ms = envoy.on_tick(now_ms);
                    agenda.at(next_ms as f64, Event::Tick(e));
                    // Declarations between polls: the bridge records each and, when it moved,
                    // wakes the other Envoys' polls of the worker (a page a network hop later).
                    let relay = opts.relay_bookings && !opts.replicas_share_data;
                    let declared = envoy.declare_moved(workers.len(), now_ms);
                    if !declared.is_empty() {
                        *envoy.counters.entry("events.declared").or_default() +=
                            declared.len() as u64;
                    }
                    for (w, booked) in declared {
                        let Some(worker) = workers.get_mut(w).filter(|_| relay) else {
                            continue;
                        };
                        worker.declared.resize(replicas, None);
                        let before = worker.declared.get(e).copied().flatten();
                        if let Some(d) = worker.declared.get_mut(e) {
                            *d = Some(booked);
                        }
                        let moved = before.is_none_or(|b| booked.moved_from(&b));
                        if moved && replicas > 1 && !worker.delivery_planned {
                            worker.delivery_planned = true;
                            agenda.at(now + DECLARE_HOP_MS, Event::Deliver(w));
                        }
                    }
                }
            }
        }
    }
    for envoy in &envoys {
        for (k, v) in &envoy.counters {
            *run.counters.entry((*k).to_string()).or_default() += v;
        }
        run.factors.push(envoy.vm.learned.factors.clone());
    }
    Ok(run)
}

/// The router of arm `arm`: `round-robin`, `kv`, `kv+set:<a.b>=<v>[+set:...]` (the race's
/// arms), each optionally on `*N` Envoys (`kv*3`; `kv*3~client`: spread by client), or the
/// yardsticks `oracle` and `oracle+share:<weight>` ([`Router::Oracle`]).
pub fn arm_router(arm: &str) -> Result<Router, String> {
    let (base, envoys, spread) = crate::compare::split_replicas(arm).map_err(|e| e.to_string())?;
    // `kv+calibrated[+set:...]`: each worker with its own timing polynomials.
    let (base, calibrated) = match base.strip_prefix("kv+calibrated") {
        Some(rest) if rest.is_empty() || rest.starts_with("+set:") => (format!("kv{rest}"), true),
        _ => (base.to_string(), false),
    };
    match base.as_str() {
        "round-robin" => Ok(Router::RoundRobin),
        "oracle" => Ok(Router::Oracle { share_weight: 0.0 }),
        b if b.starts_with("oracle+share:") => b
            .trim_start_matches("oracle+share:")
            .parse::<f64>()
            .ok()
            .filter(|w| w.is_finite() && *w >= 0.0)
            .map(|share_weight| Router::Oracle { share_weight })
            .ok_or_else(|| format!("{b}: expected oracle+share:<weight>, a number >= 0")),
        "kv" => Ok(Router::Filter {
            config: json!({}),
            envoys,
            spread,
            calibrated,
        }),
        b if b.starts_with("kv+set:") => Ok(Router::Filter {
            config: crate::compare::set_fields(b).map_err(|e| e.to_string())?,
            envoys,
            spread,
            calibrated,
        }),
        other => Err(format!(
            "{other}: the simulator runs round-robin, oracle, oracle+share:<w>, kv, kv+set:... and kv+calibrated[+set:...] arms (peers run in the race)"
        )),
    }
}

/// The mean of several runs' figures (each run's mean TTFT, p50, p99, hit rate, balance), as
/// one [`SimRun`]-like line of [`table`].
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub ttft_mean: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub hit_rate: f64,
    pub balance: f64,
    pub errors: usize,
    /// The smallest and largest run's TTFT mean.
    pub ttft_mean_range: (f64, f64),
}

impl Summary {
    pub fn of(runs: &[SimRun]) -> Summary {
        let n = runs.len().max(1) as f64;
        let mean = |f: &dyn Fn(&SimRun) -> f64| runs.iter().map(f).sum::<f64>() / n;
        let means: Vec<f64> = runs.iter().map(SimRun::ttft_mean).collect();
        Summary {
            ttft_mean: mean(&SimRun::ttft_mean),
            ttft_p50: mean(&|r| r.ttft_quantile(0.5)),
            ttft_p99: mean(&|r| r.ttft_quantile(0.99)),
            hit_rate: mean(&SimRun::hit_rate),
            balance: mean(&SimRun::balance),
            errors: runs.iter().map(|r| r.errors).sum(),
            ttft_mean_range: (
                means.iter().copied().fold(f64::INFINITY, f64::min),
                means.iter().copied().fold(0.0, f64::max),
            ),
        }
    }
}

/// One line per arm: TTFT mean / p50 / p99 (ms), hit rate, balance (max share over speed
/// share), errors, and the TTFT mean against the first arm's.
pub fn table(rows: &[(String, Summary)]) -> String {
    let mut out = format!(
        "{:<48} {:>9} {:>13} {:>9} {:>9} {:>7} {:>8} {:>6} {:>8}\n",
        "arm", "TTFT mean", "(runs)", "TTFT p50", "TTFT p99", "hit", "balance", "err", "vs first"
    );
    let first = rows.first().map(|(_, r)| r.ttft_mean).unwrap_or(0.0);
    for (arm, r) in rows {
        let ratio = if r.ttft_mean > 0.0 {
            first / r.ttft_mean
        } else {
            0.0
        };
        let range = format!("{:.1}-{:.1}", r.ttft_mean_range.0, r.ttft_mean_range.1);
        out.push_str(&format!(
            "{:<48} {:>9.1} {:>13} {:>9.1} {:>9.1} {:>6.1}% {:>8.2} {:>6} {:>7.3}x\n",
            arm,
            r.ttft_mean,
            range,
            r.ttft_p50,
            r.ttft_p99,
            100.0 * r.hit_rate,
            r.balance,
            r.errors,
            ratio
        ));
    }
    out
}
