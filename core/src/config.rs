//! Filter configuration: parse the plugin's JSON, validate every field, compile into an immutable
//! [`Config`] shared by every request context.
//!
//! Invariants of a compiled `Config` (everything downstream relies on them):
//! * at least one worker, unique worker ids, `1 <= slots.len() <= u16::MAX`;
//! * `slots` lists every worker's ranks `dp_start..dp_start + dp_size` in worker order, so the slots
//!   of worker `w` are the contiguous range [`Config::worker_slots`];
//! * every numeric knob is finite and within the range documented on its field.
//!
//! Parsing is two steps: serde derive with `deny_unknown_fields` reads the JSON into typed structs
//! (the sub-objects below directly, the root and workers through [`raw`]), tracked by
//! `serde_path_to_error` so that a type error or a misspelled key names its full path
//! (`workers[1].taint: unknown field ...`); then [`compile`] checks ranges and cross-field rules
//! with the same paths (`cost.overlap_score_credit: must be within [0, 1], got 1.5`) and lays out
//! the slots. `null` is accepted only where a field is optional (no default to fall back on).
//! One leniency of derived structs remains: a sub-object may also be written as an array of its
//! field values in declaration order (the root may not).

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;

use serde::Deserialize;

use crate::types::{DpRank, SlotIdx, WorkerId};

mod affinity;
mod approximate;
mod check;
mod compile;
mod engine_priority;
mod membership;
mod preset;
mod raw;
mod tokenizer;
mod ttft;

pub use affinity::AffinityConfig;
pub use approximate::{ApproximateConfig, WorkerKvMode};
pub use engine_priority::EnginePriorityConfig;
pub use membership::{MembershipConfig, MAX_POOL_WORKERS};
pub use preset::{Engine, BRIDGE_LONG_POLL_MS, BRIDGE_PORT, VLLM_BLOCK_SIZE};
pub use tokenizer::TokenizerConfig;
pub use ttft::{TtftConfig, MAX_COMPUTE_WEIGHT};

pub use check::{is_timing_poly, MAX_POLY_COEFFICIENTS};
use compile::compile;

/// Largest accepted `block_size` in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1024;
/// Largest accepted `fallback_count`.
pub const MAX_FALLBACK_COUNT: usize = 16;
/// Largest accepted byte limits (`max_body_bytes`, `events.max_response_bytes`): 1 GiB.
pub const MAX_BYTES_LIMIT: u64 = 1 << 30;

/// How the filter picks a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingMode {
    /// Dynamo's KV cost model (overlap credit + active load).
    Kv,
    Random,
    RoundRobin,
    /// The request must pin a worker (body or, if allowed, headers).
    Direct,
    LeastLoaded,
    PowerOfTwo,
    DeviceAwareWeighted,
}

/// How `kv` mode scores a slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvPolicy {
    /// The Dynamo cost (below), each worker's scaled by how slow it is relative to the fleet,
    /// as learned online from its responses ([`crate::learn`]). The cost's decode term keeps
    /// the fleet balanced; the balance guard is `predicted`'s.
    #[default]
    Adaptive,
    /// The predicted time to first token ([`crate::ttft`], options in `ttft`), scaled by each
    /// worker's learned timing, behind the balance guard.
    Predicted,
    /// NVIDIA Dynamo's KV cost exactly as in the original design (overlap credit + active
    /// load, weights in `cost`): no learning, no guard.
    Dynamo,
}

impl RoutingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Kv => "kv",
            RoutingMode::Random => "random",
            RoutingMode::RoundRobin => "round-robin",
            RoutingMode::Direct => "direct",
            RoutingMode::LeastLoaded => "least-loaded",
            RoutingMode::PowerOfTwo => "power-of-two",
            RoutingMode::DeviceAwareWeighted => "device-aware-weighted",
        }
    }
}

/// What the filter does with a client's routing hints: header pins (`x-worker-instance-id`,
/// `x-dp-rank`), body pins (`nvext.backend_instance_id`, `nvext.dp_rank`), allow-lists
/// (`nvext.allowed_worker_ids`) and taints (`nvext.required_taints`, `nvext.preferred_taints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientHints {
    /// Route as if the client sent none (counted in `client_hints.ignored`).
    Ignore,
    /// Refuse a request that carries any (403).
    Reject,
    /// Trusted clients: hints filter and pin the choice.
    Honor,
}

impl ClientHints {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientHints::Ignore => "ignore",
            ClientHints::Reject => "reject",
            ClientHints::Honor => "honor",
        }
    }
}

/// How much of the client's routing hints to read by default (`client_routing_hints_max_items`;
/// the request parser's default too, `request::ParseOptions`).
pub const DEFAULT_MAX_HINT_ITEMS: usize = 64;

/// Largest accepted `client_routing_hints_max_items`.
pub const MAX_HINT_ITEMS_LIMIT: u64 = 65_536;

/// How the chosen address is written into `destination_header`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationFormat {
    /// `ip:port` of the choice, then up to `fallback_count` next-best, comma-separated.
    OverrideHost,
    /// A single `ip:port` (ORIGINAL_DST cluster).
    OriginalDst,
}

/// Worker device class (for `device-aware-weighted`); a wire type (workers describe themselves).
pub use kv_router_protocol::worker::Device;

/// Cost weights of Dynamo's KV router (`kv_router` config). All finite and `>= 0`; `overlap_score_credit <= 1`.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub struct CostWeights {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_multiplier: f64,
    pub decode_active_request_weight: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
            decode_active_request_weight: 0.0,
        }
    }
}

/// Busy thresholds: a slot over any configured threshold is not eligible. `None` = no threshold.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub struct BusyThresholds {
    /// Active decode blocks / the worker's `kv_capacity_blocks` (per DP rank). Finite, `> 0`.
    pub decode_blocks_fraction: Option<f64>,
    /// Active prefill tokens, absolute. `> 0`.
    pub prefill_tokens: Option<u64>,
    /// Active prefill tokens / the worker's `max_num_batched_tokens`. Finite, `> 0`.
    pub prefill_tokens_fraction: Option<f64>,
}

/// How booked prefill tokens evolve before the first token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillLoadModel {
    /// Full value until the first token.
    None,
    /// The oldest prefill per slot decays linearly over its predicted compute time:
    /// `prefill_time_ms_poly` per engine step of at most the worker's `max_num_batched_tokens`
    /// (else `ttft.chunk_tokens` when `ttft` is set; else the polynomial of the whole prompt).
    Polynomial,
}

/// What the workers' reported requests in flight add to this Envoy's own load view
/// (`load::share`): the requests other routers (Envoy replicas) sent them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnseenTraffic {
    /// The own view alone (the engine's count still floors `active_requests`).
    Off,
    /// Each worker's reported requests beyond this Envoy's own, at the size of its own
    /// requests (queued prefill tokens and blocks per request in flight): better balance
    /// across replicas, a lower hit rate.
    PerWorker,
    /// The default. What the other routers have booked on each worker and learned of its
    /// timing, as they declare it to its bridge and the bridge relays it (`load.other_routers`
    /// on the page, kv-event-bridge only): the other replicas' queued prefill tokens, decode
    /// blocks and timing samples. Each Envoy declares with every poll and, when its bookings
    /// moved, between polls; the bridge then wakes the others' polls, so a replica hears of a
    /// request another sent within a tick and a network hop. One Envoy alone routes as with
    /// `off` (docs/OPERATIONS.md, "Several Envoy replicas").
    Relayed,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub struct LoadConfig {
    pub track_output_blocks: bool,
    pub prefill_load_model: PrefillLoadModel,
    /// Prefill time in ms as a polynomial in uncached tokens, lowest degree first. 1..=8 finite
    /// coefficients.
    pub prefill_time_ms_poly: Vec<f64>,
    /// In-flight entries older than this are reaped (their VM or stream died). `> 0`.
    pub request_timeout_ms: u64,
    pub reported_load: bool,
    /// With `reported_load`: the other routers' requests the workers' reports show, added to
    /// the own view (`load::share`), so that replicas weigh load as if each saw all of it.
    pub unseen_traffic: UnseenTraffic,
    /// With `relayed`, how often (ms) the polling VM applies the pages that came in and declares
    /// the bookings that moved, between its ticks, while other routers share the fleet
    /// ([`crate::tick`]). `0`: only on ticks. At most `tick_ms` takes effect.
    pub relay_interval_ms: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            track_output_blocks: false,
            prefill_load_model: PrefillLoadModel::Polynomial,
            prefill_time_ms_poly: vec![16.5, 0.0152, 4.21e-7],
            request_timeout_ms: 900_000,
            reported_load: true,
            unseen_traffic: UnseenTraffic::Relayed,
            relay_interval_ms: 10,
        }
    }
}

/// Events per page the poller asks for by default (`events.page_events`).
pub const DEFAULT_PAGE_EVENTS: u32 = 10_000;
/// The largest `events.page_events`.
pub const MAX_PAGE_EVENTS: u32 = 100_000;

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub struct EventsConfig {
    pub cluster: String,
    pub path: String,
    pub dump_path: String,
    /// Where this Envoy tells a worker's bridge, between its polls, that its bookings there moved
    /// (`POST <declare_path>?router=..&booked=..`), so that the other Envoys' polls return with
    /// them at once. Empty: declare only with each poll.
    pub declare_path: String,
    pub poll_interval_ms: u64,
    pub timeout_ms: u64,
    /// The dump call's timeout: a dump carries the worker's whole cache (up to
    /// `max_response_bytes`), a page at most 128 KiB of events.
    pub dump_timeout_ms: u64,
    /// `>= poll_interval_ms`.
    pub stale_after_ms: u64,
    pub max_response_bytes: usize,
    /// `> 0`: each events call asks the worker to hold it up to this long until an event exists
    /// (`&wait_ms=`), and the poller re-issues it as soon as it returns. `0` = plain polling.
    /// `long_poll_ms + timeout_ms <= stale_after_ms`.
    pub long_poll_ms: u64,
    /// `1..=100000`: events a page may hold, asked of the worker with `&limit=` (and the page's
    /// event bytes with `&max_bytes=`: 128 KiB, or 7/8 of `max_response_bytes` if less; see
    /// `polling::page_max_bytes`). Fewer, larger pages mean fewer sequential round trips per event; an endpoint may
    /// serve less (its own cap) or ignore both.
    pub page_events: u32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            cluster: "kv_events".to_string(),
            path: "/kv/events".to_string(),
            dump_path: "/kv/dump".to_string(),
            declare_path: "/kv/declare".to_string(),
            poll_interval_ms: 100,
            timeout_ms: 1000,
            // A full 16k-block dump (~9 MB) can take a loaded host more than `timeout_ms` to
            // serve and copy into the VM: at 1 s, five attempts in a row timed out and the
            // re-sync took 11 s (tests/full_cache_resync.rs on 2 busy cores; 0.2-0.9 s at 10 s).
            dump_timeout_ms: 10_000,
            stale_after_ms: 5000,
            // A full dump of a 16k-block cache is ~9 MB, of 100k blocks ~56 MB: a restarted
            // worker must be able to re-sync at the defaults.
            max_response_bytes: 64 * 1024 * 1024,
            long_poll_ms: 0,
            page_events: DEFAULT_PAGE_EVENTS,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub struct IndexConfig {
    /// `1..=u32::MAX`.
    pub max_blocks: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        // About 38 bytes an entry in every VM replica (threads + 1), allocated as the index
        // fills. Enough for 16 workers with 16k-block device caches; derived from the workers'
        // `kv_capacity_blocks` when they all declare one.
        IndexConfig {
            max_blocks: 1 << 18,
        }
    }
}

/// One configured worker (an inference server address owning one or more DP ranks).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    pub id: WorkerId,
    pub address: SocketAddr,
    /// `address` formatted once (`1.2.3.4:80`, `[::1]:80`), for the destination header.
    pub address_text: String,
    /// Defaults to `address`.
    pub events_address: SocketAddr,
    pub events_address_text: String,
    pub dp_start: DpRank,
    /// `>= 1`.
    pub dp_size: u32,
    pub device: Device,
    pub taints: Vec<String>,
    /// KV capacity of ONE DP rank, in blocks. Required when `busy.decode_blocks_fraction` is set.
    pub kv_capacity_blocks: Option<u32>,
    /// Per DP rank. Required when `busy.prefill_tokens_fraction` is set.
    pub max_num_batched_tokens: Option<u32>,
    /// Empty = serves any model.
    pub models: Vec<String>,
    /// Where its cached prefixes come from (`events` by default).
    pub kv_mode: WorkerKvMode,
    /// Its own prefill-time polynomial, else `load.prefill_time_ms_poly` ([`Self::prefill_poly`]).
    pub prefill_time_ms_poly: Option<Vec<f64>>,
    /// Its own decode-step polynomial, else `ttft.decode_step_ms_poly`.
    pub decode_step_ms_poly: Option<Vec<f64>>,
    /// Index of this worker's first slot.
    pub first_slot: SlotIdx,
    /// False for a `membership` pool entry no host occupies, and for a host Envoy reports
    /// unhealthy while others are healthy. Always true without `membership`.
    pub routable: bool,
}

impl WorkerConfig {
    /// A `membership` pool entry that no host occupies now (it has no address).
    pub fn is_vacant(&self) -> bool {
        self.address_text.is_empty()
    }

    /// The prefill-time polynomial to price this worker's prompts with: its own, else the
    /// fleet's `fleet` (`load.prefill_time_ms_poly`).
    pub fn prefill_poly<'a>(&'a self, fleet: &'a [f64]) -> &'a [f64] {
        self.prefill_time_ms_poly.as_deref().unwrap_or(fleet)
    }

    /// The decode-step polynomial for this worker: its own, else the fleet's `fleet`
    /// (`ttft.decode_step_ms_poly`).
    pub fn decode_poly<'a>(&'a self, fleet: &'a [f64]) -> &'a [f64] {
        self.decode_step_ms_poly.as_deref().unwrap_or(fleet)
    }

    pub fn serves_model(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    pub fn has_rank(&self, dp_rank: DpRank) -> bool {
        dp_rank >= self.dp_start
            && u64::from(dp_rank) < u64::from(self.dp_start) + u64::from(self.dp_size)
    }
}

/// One (worker, dp_rank) pair: the unit the index, the load table and the scorer address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Index into `Config::workers`.
    pub worker: u16,
    pub dp_rank: DpRank,
}

/// The compiled, validated configuration. Immutable; see the module invariants.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The `engine` preset the configuration named, if any (its fields are already filled in).
    pub engine: Option<Engine>,
    pub mode: RoutingMode,
    /// Tokens per KV block, `1..=1024`.
    pub block_size: u32,
    /// Lowercase header name.
    pub destination_header: String,
    pub destination_format: DestinationFormat,
    /// `0..=16`.
    pub fallback_count: usize,
    /// Exact paths (no query) routed by the filter.
    pub llm_paths: Vec<String>,
    /// `1..=1 GiB`.
    pub max_body_bytes: usize,
    /// Add the worker, overlap and costs to responses (`x-kv-router-reason` is always added).
    pub response_headers: bool,
    pub client_routing_hints: ClientHints,
    /// Cap on each client hint list, `1..=65536`.
    pub client_routing_hints_max_items: usize,
    /// Finite, `>= 0`.
    pub router_temperature: f64,
    pub cost: CostWeights,
    pub busy: BusyThresholds,
    pub load: LoadConfig,
    /// Throughput weight of a non-CPU worker relative to a CPU worker. Finite, `> 0`.
    pub device_ratio: f64,
    /// `1..=60000`.
    pub tick_ms: u64,
    pub events: EventsConfig,
    pub index: IndexConfig,
    /// Text requests are tokenized by this service (exact ids) when set.
    pub tokenizer: Option<TokenizerConfig>,
    /// The predicted-block store and text prefix hashing, when set (or implied by a worker's
    /// `kv_mode`).
    pub approximate: Option<ApproximateConfig>,
    /// Load-gated prefix affinity in `kv` mode, when set.
    pub affinity: Option<AffinityConfig>,
    /// How `kv` mode scores a slot.
    pub policy: KvPolicy,
    /// The time-to-first-token model (`adaptive` learns each worker's timing against it,
    /// `predicted` scores by it); `None` with `policy: dynamo`.
    pub ttft: Option<TtftConfig>,
    /// Write each routed request's scheduling priority into its body, when set.
    pub engine_priority: Option<EnginePriorityConfig>,
    pub workers: Vec<WorkerConfig>,
    pub slots: Vec<Slot>,
    /// Follow the routed cluster's hosts (see `config/membership.rs`); `None` = static list only.
    pub membership: Option<MembershipConfig>,
}

impl Config {
    /// What in a valid configuration will likely route worse than its operator expects, one
    /// sentence each (logged once at configuration).
    pub fn advisories(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let device_blocks: u64 = self
            .workers
            .iter()
            .filter_map(|w| {
                w.kv_capacity_blocks
                    .map(|c| u64::from(c) * u64::from(w.dp_size))
            })
            .sum();
        let max_bound = u64::try_from(crate::types::MAX_INDEX_BLOCKS).unwrap_or(u64::MAX);
        let bound = u64::from(self.index.max_blocks).min(max_bound);
        if device_blocks > bound {
            notes.push(format!(
                "index.max_blocks ({bound}) is below the {device_blocks} device blocks the workers' \
                 kv_capacity_blocks add up to: the index will drop blocks the workers still hold \
                 (index.evicted) and send requests away from their cache; raise it to at least \
                 {device_blocks} (~37 bytes each, per thread)"
            ));
        }
        notes
    }

    /// Parses and validates the plugin configuration. An empty (or all-whitespace) configuration
    /// is an error naming `workers`, the one required field.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigError::Missing {
                field: "workers".to_string(),
            });
        }
        // Syntax first, so that every later error is about a field.
        let mut value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::InvalidJson {
                detail: e.to_string(),
            })?;
        // A derived struct would also accept a JSON array, field by field in order.
        let Some(root) = value.as_object_mut() else {
            return Err(ConfigError::Parse {
                field: "(root)".to_string(),
                detail: "the configuration must be a JSON object".to_string(),
            });
        };
        // The preset fills in what the configuration leaves out (see `preset`).
        let filled = preset::apply(root)?;
        let raw = serde_path_to_error::deserialize(value)
            .map_err(|e| filled.explain(ConfigError::from_serde(e)))?;
        compile(raw).map_err(|e| filled.explain(e))
    }

    /// Slot of `(worker_idx, dp_rank)`, if the worker exists and owns that rank.
    pub fn slot_of(&self, worker_idx: u16, dp_rank: DpRank) -> Option<SlotIdx> {
        let w = self.workers.get(usize::from(worker_idx))?;
        if !w.has_rank(dp_rank) {
            return None;
        }
        let offset = u16::try_from(dp_rank - w.dp_start).ok()?;
        w.first_slot.checked_add(offset)
    }

    /// The contiguous slots of worker `worker_idx` (empty for an unknown index).
    pub fn worker_slots(&self, worker_idx: u16) -> Range<SlotIdx> {
        match self.workers.get(usize::from(worker_idx)) {
            // first_slot + dp_size <= slots.len() <= u16::MAX by construction.
            Some(w) => {
                w.first_slot
                    ..w.first_slot
                        .saturating_add(u16::try_from(w.dp_size).unwrap_or(u16::MAX))
            }
            None => 0..0,
        }
    }

    /// Index into `workers` of the worker with operator id `id`.
    pub fn worker_index(&self, id: WorkerId) -> Option<u16> {
        let i = self.workers.iter().position(|w| w.id == id)?;
        u16::try_from(i).ok()
    }

    pub fn slot(&self, slot: SlotIdx) -> Option<&Slot> {
        self.slots.get(usize::from(slot))
    }

    /// The worker owning `slot`.
    pub fn worker_of_slot(&self, slot: SlotIdx) -> Option<&WorkerConfig> {
        let s = self.slot(slot)?;
        self.workers.get(usize::from(s.worker))
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }
}

/// A configuration error. Display starts with the field path, so the log line tells the operator
/// exactly what to fix.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigError {
    /// The bytes are not JSON at all.
    InvalidJson {
        detail: String,
    },
    /// A required field is absent.
    Missing {
        field: String,
    },
    /// Rejected while reading the JSON: an unknown (misspelled) key, a wrong type, an unknown
    /// enum value, an integer too big for its field. `detail` is serde's message.
    Parse {
        field: String,
        detail: String,
    },
    /// A number outside its range.
    OutOfRange {
        field: String,
        expected: &'static str,
        got: String,
    },
    /// Not `ip:port` / `[ipv6]:port` with a non-zero port.
    BadAddress {
        field: String,
        got: String,
    },
    DuplicateWorkerId {
        field: String,
        id: WorkerId,
    },
    /// Other invalid values (empty strings, malformed paths, ...).
    Invalid {
        field: String,
        detail: String,
    },
    /// The workers expand to more slots than a `SlotIdx` can address.
    TooManySlots {
        total: u64,
        max: u32,
    },
    /// A busy fraction is configured but a worker lacks the capacity it is a fraction of.
    MissingCapacity {
        field: String,
        required_by: &'static str,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::InvalidJson { detail } => {
                write!(f, "configuration is not valid JSON: {detail}")
            }
            ConfigError::Missing { field } => write!(f, "{field}: required field is missing"),
            ConfigError::Parse { field, detail } => write!(f, "{field}: {detail}"),
            ConfigError::OutOfRange {
                field,
                expected,
                got,
            } => write!(f, "{field}: must be {expected}, got {got}"),
            ConfigError::BadAddress { field, got } => write!(
                f,
                "{field}: \"{got}\" is not ip:port (IPv4 like 10.0.0.1:8000 or [IPv6]:port, port > 0)"
            ),
            ConfigError::DuplicateWorkerId { field, id } => {
                write!(f, "{field}: worker id {id} is used by an earlier worker")
            }
            ConfigError::Invalid { field, detail } => write!(f, "{field}: {detail}"),
            ConfigError::TooManySlots { total, max } => write!(
                f,
                "workers: the workers expand to {total} (worker, dp_rank) slots; at most {max} are supported"
            ),
            ConfigError::MissingCapacity { field, required_by } => {
                write!(f, "{field}: required when {required_by} is set")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// The field the error names (`None`: the JSON itself, or the whole worker list).
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::InvalidJson { .. } | ConfigError::TooManySlots { .. } => None,
            ConfigError::Missing { field }
            | ConfigError::Parse { field, .. }
            | ConfigError::OutOfRange { field, .. }
            | ConfigError::BadAddress { field, .. }
            | ConfigError::DuplicateWorkerId { field, .. }
            | ConfigError::Invalid { field, .. }
            | ConfigError::MissingCapacity { field, .. } => Some(field),
        }
    }

    /// A serde error with the path it happened at.
    fn from_serde(e: serde_path_to_error::Error<serde_json::Error>) -> ConfigError {
        ConfigError::Parse {
            field: e.path().to_string(),
            detail: e.into_inner().to_string(),
        }
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        match Config::from_json(json.as_bytes()) {
            Ok(_) => panic!("expected an error for {json}"),
            Err(e) => e.to_string(),
        }
    }

    const ONE: &str = r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#;

    #[test]
    fn engine_priority_is_off_by_default_and_its_weight_bounded() {
        assert_eq!(
            Config::from_json(ONE.as_bytes()).unwrap().engine_priority,
            None
        );
        let with = |extra: &str| {
            format!(
                r#"{{"engine_priority": {extra}, "workers": [{{"id": 1, "address": "10.0.0.1:8000"}}]}}"#
            )
        };
        let c = Config::from_json(with("{}").as_bytes()).unwrap();
        assert_eq!(
            c.engine_priority,
            Some(EnginePriorityConfig {
                arrival_weight: 0.0
            })
        );
        let c = Config::from_json(with(r#"{"arrival_weight": 1}"#).as_bytes()).unwrap();
        assert_eq!(c.engine_priority.unwrap().arrival_weight, 1.0);
        let e = err(&with(r#"{"arrival_weight": -1}"#));
        assert!(e.contains("engine_priority.arrival_weight"), "{e}");
        let e = err(&with(r#"{"field": "prio"}"#));
        assert!(e.contains("engine_priority") && e.contains("field"), "{e}");
    }

    #[test]
    fn design_example_parses_with_every_field() {
        let json = r#"{
          "mode": "kv", "block_size": 64,
          "destination_header": "X-Gateway-Destination-Endpoint",
          "destination_format": "override_host", "fallback_count": 2,
          "llm_paths": ["/v1/completions", "/v1/chat/completions"],
          "max_body_bytes": 8388608, "response_headers": false, "client_routing_hints": "ignore",
          "client_routing_hints_max_items": 64,
          "router_temperature": 0.0,
          "cost": {"overlap_score_credit": 1.0, "prefill_load_scale": 1.0,
                   "host_cache_hit_weight": 0.75, "disk_cache_hit_weight": 0.25,
                   "shared_cache_multiplier": 0.0, "decode_active_request_weight": 0.0},
          "busy": {"decode_blocks_fraction": null, "prefill_tokens": null, "prefill_tokens_fraction": null},
          "load": {"track_output_blocks": false, "prefill_load_model": "none",
                   "prefill_time_ms_poly": [16.5, 0.0152, 4.21e-7], "request_timeout_ms": 900000,
                   "reported_load": true, "unseen_traffic": "off"},
          "device_ratio": 8.0, "tick_ms": 50,
          "events": {"cluster": "kv_events", "path": "/kv/events", "dump_path": "/kv/dump",
                     "poll_interval_ms": 100, "timeout_ms": 1000, "stale_after_ms": 5000,
                     "max_response_bytes": 4194304, "long_poll_ms": 0},
          "index": {"max_blocks": 1048576},
          "workers": [
            {"id": 1, "address": "10.0.0.1:8000", "events_address": "10.0.0.1:8000",
             "dp_start": 0, "dp_size": 1, "device": "gpu", "taints": ["a100"],
             "kv_capacity_blocks": 16384, "max_num_batched_tokens": 8192, "models": []}
          ]
        }"#;
        let c = Config::from_json(json.as_bytes()).unwrap();
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!(c.workers.len(), 1);
        assert_eq!(c.workers[0].taints, vec!["a100".to_string()]);
        assert_eq!(c.workers[0].kv_capacity_blocks, Some(16384));
        assert_eq!(
            c.slots,
            vec![Slot {
                worker: 0,
                dp_rank: 0
            }]
        );
        assert_eq!(c.load.prefill_time_ms_poly, vec![16.5, 0.0152, 4.21e-7]);
    }

    #[test]
    fn an_index_smaller_than_the_fleets_caches_is_advised_against() {
        let fleet = |max_blocks: u32| {
            let json = format!(
                r#"{{"index": {{"max_blocks": {max_blocks}}}, "workers": [
                    {{"id": 1, "address": "10.0.0.1:8000", "kv_capacity_blocks": 1000, "dp_size": 2}},
                    {{"id": 2, "address": "10.0.0.2:8000", "kv_capacity_blocks": 500}},
                    {{"id": 3, "address": "10.0.0.3:8000"}}]}}"#
            );
            Config::from_json(json.as_bytes()).unwrap().advisories()
        };
        // 2 ranks x 1,000 + 500 blocks; the worker without a capacity adds nothing known.
        let notes = fleet(2499);
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].contains("(2499) is below the 2500 device blocks"),
            "{notes:?}"
        );
        assert!(fleet(2500).is_empty());
        assert!(Config::from_json(ONE.as_bytes())
            .unwrap()
            .advisories()
            .is_empty());
    }

    #[test]
    fn the_index_is_sized_to_the_fleet_and_dumps_fit_the_reply_limit() {
        let two = |cap: &str| {
            let json = format!(
                r#"{{"workers": [{{"id": 1, "address": "10.0.0.1:80"{cap}}},
                                 {{"id": 2, "address": "10.0.0.2:80", "dp_size": 2{cap}}}]}}"#
            );
            Config::from_json(json.as_bytes()).unwrap()
        };
        // Unknown capacities: the fixed default.
        assert_eq!(two("").index.max_blocks, 1 << 18);
        // 3 ranks of 200,000 blocks: 600,000 entries.
        assert_eq!(
            two(r#", "kv_capacity_blocks": 200000"#).index.max_blocks,
            600_000
        );
        // Never below the default; an explicit bound wins.
        assert_eq!(
            two(r#", "kv_capacity_blocks": 16"#).index.max_blocks,
            1 << 18
        );
        let set = br#"{"index": {"max_blocks": 5}, "workers": [{"id": 1, "address": "10.0.0.1:80", "kv_capacity_blocks": 900000}]}"#;
        assert_eq!(Config::from_json(set).unwrap().index.max_blocks, 5);
        // A full 16k-block cache dumps ~9 MB: within the default reply limit.
        assert!(EventsConfig::default().max_response_bytes >= 16 * 1024 * 1024);
    }

    #[test]
    fn defaults_apply_when_only_workers_given() {
        let c = Config::from_json(ONE.as_bytes()).unwrap();
        assert_eq!(c.mode, RoutingMode::Kv);
        assert_eq!(c.block_size, 64);
        assert_eq!(c.destination_format, DestinationFormat::OverrideHost);
        assert_eq!(c.fallback_count, 2);
        assert_eq!(c.llm_paths, vec!["/v1/completions", "/v1/chat/completions"]);
        assert_eq!(c.max_body_bytes, 8_388_608);
        assert!(
            !c.response_headers,
            "costs and worker ids are not sent to clients by default"
        );
        assert_eq!(c.client_routing_hints, ClientHints::Ignore);
        assert_eq!(c.client_routing_hints_max_items, 64);
        assert_eq!(c.router_temperature, 0.0);
        assert_eq!(c.cost, CostWeights::default());
        assert_eq!(c.cost.host_cache_hit_weight, 0.75);
        assert_eq!(c.busy, BusyThresholds::default());
        assert_eq!(c.load, LoadConfig::default());
        assert_eq!(c.device_ratio, 8.0);
        assert_eq!(c.tick_ms, 50);
        assert_eq!(c.events, EventsConfig::default());
        assert_eq!(c.index.max_blocks, 262_144);
        let w = &c.workers[0];
        assert_eq!(w.events_address, w.address);
        assert_eq!(w.address_text, "10.0.0.1:8000");
        assert_eq!(w.device, Device::Gpu);
        assert_eq!((w.dp_start, w.dp_size), (0, 1));
    }

    #[test]
    fn empty_configuration_names_workers() {
        assert_eq!(err(""), "workers: required field is missing");
        assert_eq!(err("  \n"), "workers: required field is missing");
        assert_eq!(err("{}"), "workers: required field is missing");
        assert!(err(r#"{"workers": []}"#).starts_with("workers: at least one worker"));
    }

    #[test]
    fn out_of_range_errors_name_the_field_path() {
        let e = err(
            r#"{"cost": {"overlap_score_credit": 1.5}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert_eq!(
            e,
            "cost.overlap_score_credit: must be within [0, 1], got 1.5"
        );
        let e = err(
            r#"{"cost": {"host_cache_hit_weight": -0.1}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert_eq!(
            e,
            "cost.host_cache_hit_weight: must be finite and >= 0, got -0.1"
        );
        let e = err(
            r#"{"router_temperature": -1, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("router_temperature: must be finite and >= 0"),
            "{e}"
        );
        let e = err(r#"{"block_size": 0, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("block_size: must be within [1, 1024]"), "{e}");
        let e = err(r#"{"block_size": 2048, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("block_size:"), "{e}");
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "dp_size": 0}]}"#);
        assert!(e.starts_with("workers[0].dp_size: must be >= 1"), "{e}");
        let e = err(r#"{"device_ratio": 0, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("device_ratio:"), "{e}");
        let e = err(
            r#"{"busy": {"decode_blocks_fraction": 0}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("busy.decode_blocks_fraction: must be finite and > 0"),
            "{e}"
        );
        let e = err(
            r#"{"events": {"poll_interval_ms": 200, "stale_after_ms": 100}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("events.stale_after_ms:"), "{e}");
        let e = err(
            r#"{"load": {"prefill_time_ms_poly": []}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("load.prefill_time_ms_poly:"), "{e}");
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"},
                {"id": 2, "address": "10.0.0.2:8000", "prefill_time_ms_poly": [1, 2, 3, 4, 5, 6, 7, 8, 9]}]}"#);
        assert!(e.starts_with("workers[1].prefill_time_ms_poly:"), "{e}");
        let e = err(
            r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "decode_step_ms_poly": []}]}"#,
        );
        assert!(e.starts_with("workers[0].decode_step_ms_poly:"), "{e}");
    }

    #[test]
    fn a_worker_may_have_its_own_timing_and_a_pool_its_template() {
        let json = r#"{"load": {"prefill_time_ms_poly": [10, 0.01]},
          "membership": {"cluster": "llm", "max_workers": 2,
                         "worker": {"prefill_time_ms_poly": [3, 0.003], "decode_step_ms_poly": [2]}},
          "workers": [{"id": 1, "address": "10.0.0.1:8000", "prefill_time_ms_poly": [5, 0.005]},
                      {"id": 2, "address": "10.0.0.2:8000"}]}"#;
        let c = Config::from_json(json.as_bytes()).unwrap();
        let fleet = c.load.prefill_time_ms_poly.clone();
        assert_eq!(c.workers[0].prefill_poly(&fleet), &[5.0, 0.005][..]);
        assert_eq!(c.workers[0].decode_poly(&[7.0]), &[7.0][..]);
        assert_eq!(c.workers[1].prefill_poly(&fleet), &[10.0, 0.01][..]);
        // Every pool entry takes the template's.
        assert_eq!(c.workers.len(), 4);
        for pooled in &c.workers[2..] {
            assert_eq!(pooled.prefill_poly(&fleet), &[3.0, 0.003][..]);
            assert_eq!(pooled.decode_poly(&[7.0]), &[2.0][..]);
        }
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_path() {
        let e = err(
            r#"{"cost": {"overlap_credit": 0.5}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("cost.overlap_credit: unknown field"), "{e}");
        let e = err(r#"{"modee": "kv", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("modee: unknown field"), "{e}");
        let e = err(
            r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"}, {"id": 2, "address": "10.0.0.2:8000", "taint": ["x"]}]}"#,
        );
        assert!(
            e.starts_with(
                "workers[1].taint: unknown field `taint`, expected one of `id`, `address`"
            ),
            "{e}"
        );
        let e = err(
            r#"{"events": {"long_poll": 1}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("events.long_poll: unknown field"), "{e}");
    }

    #[test]
    fn wrong_types_and_variants_name_the_field() {
        let e = err(r#"{"block_size": "64", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("block_size: invalid type"), "{e}");
        let e = err(r#"{"mode": "fastest", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(
            e.starts_with("mode: unknown variant `fastest`, expected one of `kv`, `random`"),
            "{e}"
        );
        let e = err(r#"{"cost": 3, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(
            e.starts_with("cost: invalid type: integer `3`, expected an object"),
            "{e}"
        );
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "device": "tpu"}]}"#);
        assert!(
            e.starts_with("workers[0].device: unknown variant `tpu`"),
            "{e}"
        );
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "taints": "a100"}]}"#);
        assert!(
            e.starts_with("workers[0].taints: invalid type: string"),
            "{e}"
        );
        let e = err(r#"{"workers": {"id": 1}}"#);
        assert!(e.starts_with("workers: invalid type: map"), "{e}");
        // Too big for the field's integer type, and `null` where there is no default to take.
        let e = err(
            r#"{"index": {"max_blocks": 5000000000}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("index.max_blocks: invalid value: integer `5000000000`"),
            "{e}"
        );
        let e = err(r#"{"tick_ms": null, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("tick_ms: invalid type: null"), "{e}");
        let e = err(r#"{"mode": 1, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert_eq!(e, "mode: invalid type: integer `1`, expected string or map");
        assert_eq!(
            err("[1]"),
            "(root): the configuration must be a JSON object"
        );
        assert!(err("{").starts_with("configuration is not valid JSON"));
        assert!(
            err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"}]} x"#)
                .starts_with("configuration is not valid JSON: trailing characters")
        );
    }

    #[test]
    fn workers_are_validated() {
        let e = err(
            r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"}, {"id": 1, "address": "10.0.0.2:8000"}]}"#,
        );
        assert_eq!(e, "workers[1].id: worker id 1 is used by an earlier worker");
        let e = err(r#"{"workers": [{"id": 1, "address": "worker-1:8000"}]}"#);
        assert!(
            e.starts_with("workers[0].address: \"worker-1:8000\" is not ip:port"),
            "{e}"
        );
        assert!(err(r#"{"workers": [{"id": 1, "address": "10.0.0.1"}]}"#)
            .starts_with("workers[0].address"));
        assert!(err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:0"}]}"#)
            .starts_with("workers[0].address"));
        assert!(err(r#"{"workers": [{"id": 1, "address": "::1:80"}]}"#)
            .starts_with("workers[0].address"));
        assert_eq!(
            err(r#"{"workers": [{"address": "10.0.0.1:80"}]}"#),
            "workers[0].id: required field is missing"
        );
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:80", "events_address": "x"}]}"#);
        assert!(e.starts_with("workers[0].events_address"), "{e}");
        let e = err(
            r#"{"workers": [{"id": 1, "address": "10.0.0.1:80", "dp_size": 40000}, {"id": 2, "address": "10.0.0.2:80", "dp_size": 40000}]}"#,
        );
        assert!(e.contains("80000"), "{e}");
        let e = err(
            r#"{"busy": {"decode_blocks_fraction": 0.9}, "workers": [{"id": 1, "address": "10.0.0.1:80"}]}"#,
        );
        assert_eq!(
            e,
            "workers[0].kv_capacity_blocks: required when busy.decode_blocks_fraction is set"
        );
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:80", "models": [""]}]}"#);
        assert!(
            e.starts_with("workers[0].models[0]: must not be empty"),
            "{e}"
        );
    }

    #[test]
    fn ipv6_addresses_and_dp_ranks_expand_to_slots() {
        let json = r#"{"workers": [
            {"id": 10, "address": "[::1]:8000", "dp_start": 2, "dp_size": 3},
            {"id": 20, "address": "10.0.0.2:9000"}
        ]}"#;
        let c = Config::from_json(json.as_bytes()).unwrap();
        assert_eq!(c.workers[0].address_text, "[::1]:8000");
        assert_eq!(c.num_slots(), 4);
        assert_eq!(
            c.slots,
            vec![
                Slot {
                    worker: 0,
                    dp_rank: 2
                },
                Slot {
                    worker: 0,
                    dp_rank: 3
                },
                Slot {
                    worker: 0,
                    dp_rank: 4
                },
                Slot {
                    worker: 1,
                    dp_rank: 0
                },
            ]
        );
        assert_eq!(c.worker_slots(0), 0..3);
        assert_eq!(c.worker_slots(1), 3..4);
        assert_eq!(c.worker_slots(2), 0..0);
        assert_eq!(c.slot_of(0, 2), Some(0));
        assert_eq!(c.slot_of(0, 4), Some(2));
        assert_eq!(c.slot_of(0, 1), None);
        assert_eq!(c.slot_of(0, 5), None);
        assert_eq!(c.slot_of(1, 0), Some(3));
        assert_eq!(c.slot_of(7, 0), None);
        assert_eq!(c.worker_index(20), Some(1));
        assert_eq!(c.worker_index(30), None);
        assert_eq!(c.worker_of_slot(3).map(|w| w.id), Some(20));
    }

    #[test]
    fn destination_header_is_lowercased_and_checked() {
        let c = Config::from_json(
            br#"{"destination_header": "X-Route", "destination_format": "original_dst", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        )
        .unwrap();
        assert_eq!(c.destination_header, "x-route");
        assert_eq!(c.destination_format, DestinationFormat::OriginalDst);
        let e = err(
            r#"{"destination_header": ":authority", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("destination_header:"), "{e}");
        let e = err(
            r#"{"llm_paths": ["v1/completions"], "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("llm_paths[0]:"), "{e}");
    }

    #[test]
    fn client_routing_hints_one_knob_with_a_cap() {
        let c = Config::from_json(
            br#"{"client_routing_hints": "honor", "client_routing_hints_max_items": 8, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        )
        .unwrap();
        assert_eq!(c.client_routing_hints, ClientHints::Honor);
        assert_eq!(c.client_routing_hints_max_items, 8);
        let e = err(
            r#"{"client_routing_hints": "trust", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with(
                "client_routing_hints: unknown variant `trust`, expected one of `ignore`, `reject`, `honor`"
            ),
            "{e}"
        );
        let e = err(
            r#"{"client_routing_hints_max_items": 0, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("client_routing_hints_max_items: must be within [1, 65536]"),
            "{e}"
        );
        // The old header-only switch names its replacement.
        let e = err(
            r#"{"allow_client_pinning": true, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("allow_client_pinning: replaced by client_routing_hints"),
            "{e}"
        );
        // Direct mode is nothing but the client's pin.
        let e = err(r#"{"mode": "direct", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("client_routing_hints: mode direct"), "{e}");
        assert!(Config::from_json(
            br#"{"mode": "direct", "client_routing_hints": "honor", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#
        )
        .is_ok());
    }

    #[test]
    fn engine_vllm_fills_what_the_configuration_leaves_out() {
        let c = Config::from_json(
            br#"{"engine": "vllm", "workers": [{"id": 1, "address": "10.0.0.1:8000"}, {"id": 2, "address": "[::1]:9000"}]}"#,
        )
        .unwrap();
        assert_eq!(c.engine, Some(Engine::Vllm));
        assert_eq!(c.block_size, 16);
        assert_eq!(c.events.long_poll_ms, 1000);
        assert_eq!(c.workers[0].events_address_text, "10.0.0.1:8200");
        assert_eq!(c.workers[1].events_address_text, "[::1]:8200");
        assert_eq!(c.workers[0].address_text, "10.0.0.1:8000");
        // Everything else keeps its default.
        let plain = Config::from_json(ONE.as_bytes()).unwrap();
        assert_eq!(plain.engine, None);
        assert_eq!(plain.block_size, 64);
        assert_eq!(plain.events.long_poll_ms, 0);
        assert_eq!(plain.workers[0].events_address_text, "10.0.0.1:8000");
        assert_eq!(c.events.timeout_ms, plain.events.timeout_ms);
        assert_eq!(c.policy, plain.policy);
        assert_eq!(c.ttft, plain.ttft);
        assert_eq!(c.cost, plain.cost);
        // With membership: the bridge's port on every discovered host.
        let c =
            Config::from_json(br#"{"engine": "vllm", "membership": {"cluster": "llm"}}"#).unwrap();
        assert_eq!(c.membership.as_ref().unwrap().events_port, 8200);
        assert_eq!(c.events.long_poll_ms, 1000);
    }

    #[test]
    fn an_explicit_field_overrides_the_engine_preset() {
        let c = Config::from_json(
            br#"{"engine": "vllm", "block_size": 32, "events": {"long_poll_ms": 0},
                 "workers": [{"id": 1, "address": "10.0.0.1:8000", "events_address": "10.0.0.9:7000"},
                             {"id": 2, "address": "10.0.0.2:8000", "events_address": null}]}"#,
        )
        .unwrap();
        assert_eq!(c.block_size, 32);
        assert_eq!(c.events.long_poll_ms, 0);
        assert_eq!(c.workers[0].events_address_text, "10.0.0.9:7000");
        // `null` is written: "not set", so the worker's own address, as without a preset.
        assert_eq!(c.workers[1].events_address_text, "10.0.0.2:8000");
        let c = Config::from_json(
            br#"{"engine": "vllm", "membership": {"cluster": "llm", "events_port": 9100}}"#,
        )
        .unwrap();
        assert_eq!(c.membership.as_ref().unwrap().events_port, 9100);
        // SGLang: the block size is the operator's (its page size), the bridge as for vLLM.
        let c = Config::from_json(
            br#"{"engine": "sglang", "block_size": 32, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        )
        .unwrap();
        assert_eq!(c.engine, Some(Engine::Sglang));
        assert_eq!(c.block_size, 32);
        assert_eq!(c.events.long_poll_ms, 1000);
        assert_eq!(c.workers[0].events_address_text, "10.0.0.1:8200");
    }

    #[test]
    fn engine_errors_name_the_field() {
        let e = err(r#"{"engine": "trt", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert_eq!(
            e,
            r#"engine: unknown engine "trt", expected "vllm" or "sglang" (or leave it out: no preset)"#
        );
        let e = err(r#"{"engine": 1, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("engine: unknown engine 1"), "{e}");
        // `null` is "not set": no preset.
        let c = Config::from_json(
            br#"{"engine": null, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        )
        .unwrap();
        assert_eq!((c.engine, c.block_size), (None, 64));
        let e = err(r#"{"engine": "sglang", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(
            e.starts_with("block_size: required with engine \"sglang\""),
            "{e}"
        );
        // Unknown fields and bad types are still named by their path under a preset.
        let e = err(
            r#"{"engine": "vllm", "events": {"long_pol_ms": 1}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(
            e.starts_with("events.long_pol_ms: unknown field `long_pol_ms`"),
            "{e}"
        );
        let e = err(
            r#"{"engine": "vllm", "events": 3, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("events: invalid type: integer `3`"), "{e}");
        let e = err(r#"{"engine": "vllm", "workers": [{"id": 1, "address": "worker-1:8000"}]}"#);
        assert!(e.starts_with("workers[0].address:"), "{e}");
        // A value the preset filled in that the rest of the configuration rules out says so.
        let e = err(
            r#"{"engine": "vllm", "events": {"stale_after_ms": 1500}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert_eq!(
            e,
            "events.long_poll_ms: must be such that long_poll_ms + timeout_ms <= stale_after_ms, \
             got 1000 (timeout_ms 1000, stale_after_ms 1500) (the value engine \"vllm\" sets; \
             write the field to override it)"
        );
    }

    #[test]
    fn long_poll_must_fit_inside_the_stale_window() {
        let c = Config::from_json(
            br#"{"events": {"long_poll_ms": 3000}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        )
        .unwrap();
        assert_eq!(c.events.long_poll_ms, 3000);
        // 4500 + 1000 > 5000: an idle worker would turn stale between two answers.
        let e = err(
            r#"{"events": {"long_poll_ms": 4500}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("events.long_poll_ms: must be such that long_poll_ms + timeout_ms <= stale_after_ms"), "{e}");
        let e = err(
            r#"{"events": {"long_poll_ms": 600001}, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#,
        );
        assert!(e.starts_with("events.long_poll_ms: must be within"), "{e}");
    }
}
