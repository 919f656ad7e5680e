//! Filter configuration: parse the plugin's JSON, validate every field, compile into an immutable
//! [`Config`] shared by every request context.
//!
//! Invariants of a compiled `Config` (everything downstream relies on them):
//! * at least one worker, unique worker ids, `1 <= slots.len() <= u16::MAX`;
//! * `slots` lists every worker's ranks `dp_start..dp_start + dp_size` in worker order, so the slots
//!   of worker `w` are the contiguous range [`Config::worker_slots`];
//! * every numeric knob is finite and within the range documented on its field.
//!
//! Parsing walks a `serde_json::Value` object by hand instead of deriving structs with
//! `deny_unknown_fields`: the configuration is small and parsed once, and this way every error,
//! including an unknown (misspelled) key deep inside `workers[3]`, names its full path, e.g.
//! `cost.overlap_score_credit: must be within [0, 1], got 1.5` or
//! `workers[1].taints: unknown field; expected one of ...`.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::types::{DpRank, SlotIdx, WorkerId};

/// Largest accepted `block_size` in tokens.
pub const MAX_BLOCK_SIZE: u32 = 1024;
/// Largest accepted `fallback_count`.
pub const MAX_FALLBACK_COUNT: usize = 16;
/// Largest accepted byte limits (`max_body_bytes`, `events.max_response_bytes`): 1 GiB.
pub const MAX_BYTES_LIMIT: u64 = 1 << 30;

/// How the filter picks a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

    const ALL: [RoutingMode; 7] = [
        RoutingMode::Kv,
        RoutingMode::Random,
        RoutingMode::RoundRobin,
        RoutingMode::Direct,
        RoutingMode::LeastLoaded,
        RoutingMode::PowerOfTwo,
        RoutingMode::DeviceAwareWeighted,
    ];
}

/// What the filter does with a client's routing hints: header pins (`x-worker-instance-id`,
/// `x-dp-rank`), body pins (`nvext.backend_instance_id`, `nvext.dp_rank`), allow-lists
/// (`nvext.allowed_worker_ids`) and taints (`nvext.required_taints`, `nvext.preferred_taints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// Largest accepted `client_routing_hints_max_items`.
pub const MAX_HINT_ITEMS_LIMIT: u64 = 65_536;

/// How the chosen address is written into `destination_header`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestinationFormat {
    /// `ip:port` of the choice, then up to `fallback_count` next-best, comma-separated.
    OverrideHost,
    /// A single `ip:port` (ORIGINAL_DST cluster).
    OriginalDst,
}

/// Worker device class (for `device-aware-weighted`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Any non-CPU accelerator.
    Gpu,
    Cpu,
}

/// Cost weights of Dynamo's KV router (`kv_router` config). All finite and `>= 0`; `overlap_score_credit <= 1`.
#[derive(Clone, Debug, PartialEq)]
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
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BusyThresholds {
    /// Active decode blocks / the worker's `kv_capacity_blocks` (per DP rank). Finite, `> 0`.
    pub decode_blocks_fraction: Option<f64>,
    /// Active prefill tokens, absolute. `> 0`.
    pub prefill_tokens: Option<u64>,
    /// Active prefill tokens / the worker's `max_num_batched_tokens`. Finite, `> 0`.
    pub prefill_tokens_fraction: Option<f64>,
}

/// How booked prefill tokens evolve before the first token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillLoadModel {
    /// Full value until the first token.
    None,
    /// The oldest prefill per slot decays linearly over `predicted_prefill_ms(prefill_time_ms_poly)`.
    Polynomial,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LoadConfig {
    pub track_output_blocks: bool,
    pub prefill_load_model: PrefillLoadModel,
    /// Prefill time in ms as a polynomial in uncached tokens, lowest degree first. 1..=8 finite
    /// coefficients.
    pub prefill_time_ms_poly: Vec<f64>,
    /// In-flight entries older than this are reaped (their VM or stream died). `> 0`.
    pub request_timeout_ms: u64,
    pub reported_load: bool,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            track_output_blocks: false,
            prefill_load_model: PrefillLoadModel::None,
            prefill_time_ms_poly: vec![16.5, 0.0152, 4.21e-7],
            request_timeout_ms: 900_000,
            reported_load: true,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct EventsConfig {
    pub cluster: String,
    pub path: String,
    pub dump_path: String,
    pub poll_interval_ms: u64,
    pub timeout_ms: u64,
    /// `>= poll_interval_ms`.
    pub stale_after_ms: u64,
    pub max_response_bytes: usize,
    /// `> 0`: each events call asks the worker to hold it up to this long until an event exists
    /// (`&wait_ms=`), and the poller re-issues it as soon as it returns. `0` = plain polling.
    /// `long_poll_ms + timeout_ms <= stale_after_ms`.
    pub long_poll_ms: u64,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            cluster: "kv_events".to_string(),
            path: "/kv/events".to_string(),
            dump_path: "/kv/dump".to_string(),
            poll_interval_ms: 100,
            timeout_ms: 1000,
            stale_after_ms: 5000,
            max_response_bytes: 4 * 1024 * 1024,
            long_poll_ms: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct IndexConfig {
    /// `1..=u32::MAX`.
    pub max_blocks: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        // About 100 bytes an entry in every VM replica (threads + 1): ~27 MB each. Enough for 16
        // workers with 16k-block device caches; raise it for bigger fleets.
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
    /// Index of this worker's first slot.
    pub first_slot: SlotIdx,
}

impl WorkerConfig {
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
    pub workers: Vec<WorkerConfig>,
    pub slots: Vec<Slot>,
}

impl Config {
    /// Parses and validates the plugin configuration. An empty (or all-whitespace) configuration
    /// is an error naming `workers`, the one required field.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ConfigError::Missing {
                field: "workers".to_string(),
            });
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| ConfigError::InvalidJson {
            detail: e.to_string(),
        })?;
        let Value::Object(map) = value else {
            return Err(ConfigError::WrongType {
                field: "(root)".to_string(),
                detail: "the configuration must be a JSON object".to_string(),
            });
        };
        compile(map)
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
    /// A key the filter does not know (typo?).
    UnknownField {
        field: String,
        expected: &'static [&'static str],
    },
    /// Present but of the wrong JSON type.
    WrongType {
        field: String,
        detail: String,
    },
    /// A number outside its range.
    OutOfRange {
        field: String,
        expected: &'static str,
        got: String,
    },
    /// A string value that is not one of the accepted words.
    UnknownVariant {
        field: String,
        got: String,
        expected: &'static [&'static str],
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
            ConfigError::UnknownField { field, expected } => write!(
                f,
                "{field}: unknown field; expected one of: {}",
                expected.join(", ")
            ),
            ConfigError::WrongType { field, detail } => write!(f, "{field}: {detail}"),
            ConfigError::OutOfRange {
                field,
                expected,
                got,
            } => write!(f, "{field}: must be {expected}, got {got}"),
            ConfigError::UnknownVariant {
                field,
                got,
                expected,
            } => write!(
                f,
                "{field}: unknown value \"{got}\"; expected one of: {}",
                expected.join(", ")
            ),
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

// ---------------------------------------------------------------------------------------------
// Parsing helpers

/// A JSON object being consumed field by field; leftover keys are unknown fields.
struct Obj {
    path: String,
    map: Map<String, Value>,
    allowed: &'static [&'static str],
}

impl Obj {
    fn new(path: &str, value: Value, allowed: &'static [&'static str]) -> Result<Obj, ConfigError> {
        match value {
            Value::Object(map) => Ok(Obj {
                path: path.to_string(),
                map,
                allowed,
            }),
            other => Err(ConfigError::WrongType {
                field: path.to_string(),
                detail: format!("expected an object, got {}", kind(&other)),
            }),
        }
    }

    fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Takes `key`; absent or `null` = `None` (the default applies).
    fn take<T: DeserializeOwned>(&mut self, key: &str) -> Result<Option<T>, ConfigError> {
        match self.map.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let shown = kind(&v);
                serde_json::from_value(v)
                    .map(Some)
                    .map_err(|e| ConfigError::WrongType {
                        field: self.field_path(key),
                        detail: format!("{e} (got {shown})"),
                    })
            }
        }
    }

    fn take_raw(&mut self, key: &str) -> Option<Value> {
        match self.map.remove(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    fn finish(self) -> Result<(), ConfigError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(key) => Err(ConfigError::UnknownField {
                field: self.field_path(key),
                expected: self.allowed,
            }),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn f64_in(
    field: String,
    v: f64,
    lo: f64,
    hi: f64,
    expected: &'static str,
) -> Result<f64, ConfigError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(ConfigError::OutOfRange {
            field,
            expected,
            got: v.to_string(),
        })
    }
}

fn u64_in(
    field: String,
    v: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<u64, ConfigError> {
    if v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(ConfigError::OutOfRange {
            field,
            expected,
            got: v.to_string(),
        })
    }
}

fn non_negative(obj: &mut Obj, key: &str, default: f64) -> Result<f64, ConfigError> {
    match obj.take::<f64>(key)? {
        None => Ok(default),
        Some(v) => f64_in(obj.field_path(key), v, 0.0, f64::MAX, "finite and >= 0"),
    }
}

fn positive_fraction(obj: &mut Obj, key: &str) -> Result<Option<f64>, ConfigError> {
    match obj.take::<f64>(key)? {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
        Some(v) => Err(ConfigError::OutOfRange {
            field: obj.field_path(key),
            expected: "finite and > 0",
            got: v.to_string(),
        }),
    }
}

fn ms(
    obj: &mut Obj,
    key: &str,
    default: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<u64, ConfigError> {
    match obj.take::<u64>(key)? {
        None => Ok(default),
        Some(v) => u64_in(obj.field_path(key), v, lo, hi, expected),
    }
}

fn url_path(obj: &mut Obj, key: &str, default: &str) -> Result<String, ConfigError> {
    let p = obj
        .take::<String>(key)?
        .unwrap_or_else(|| default.to_string());
    check_url_path(obj.field_path(key), &p)?;
    Ok(p)
}

fn check_url_path(field: String, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') || p.contains(['?', '#', ' ']) {
        return Err(ConfigError::Invalid {
            field,
            detail: format!("\"{p}\" must be an absolute path starting with '/' without query, fragment or spaces"),
        });
    }
    Ok(())
}

fn non_empty(field: String, s: &str) -> Result<(), ConfigError> {
    if s.trim().is_empty() {
        return Err(ConfigError::Invalid {
            field,
            detail: "must not be empty".to_string(),
        });
    }
    Ok(())
}

fn address(field: String, s: &str) -> Result<SocketAddr, ConfigError> {
    match s.parse::<SocketAddr>() {
        Ok(a) if a.port() != 0 => Ok(a),
        _ => Err(ConfigError::BadAddress {
            field,
            got: s.to_string(),
        }),
    }
}

fn variant<T: Copy>(
    obj: &mut Obj,
    key: &str,
    default: T,
    table: &[(&'static str, T)],
    expected: &'static [&'static str],
) -> Result<T, ConfigError> {
    let Some(s) = obj.take::<String>(key)? else {
        return Ok(default);
    };
    table
        .iter()
        .find(|(name, _)| *name == s)
        .map(|(_, v)| *v)
        .ok_or_else(|| ConfigError::UnknownVariant {
            field: obj.field_path(key),
            got: s,
            expected,
        })
}

// ---------------------------------------------------------------------------------------------
// Compilation

const ROOT_FIELDS: &[&str] = &[
    "mode",
    "block_size",
    "destination_header",
    "destination_format",
    "fallback_count",
    "llm_paths",
    "max_body_bytes",
    "response_headers",
    "client_routing_hints",
    "client_routing_hints_max_items",
    "router_temperature",
    "cost",
    "busy",
    "load",
    "device_ratio",
    "tick_ms",
    "events",
    "index",
    "workers",
];
const COST_FIELDS: &[&str] = &[
    "overlap_score_credit",
    "prefill_load_scale",
    "host_cache_hit_weight",
    "disk_cache_hit_weight",
    "shared_cache_multiplier",
    "decode_active_request_weight",
];
const BUSY_FIELDS: &[&str] = &[
    "decode_blocks_fraction",
    "prefill_tokens",
    "prefill_tokens_fraction",
];
const LOAD_FIELDS: &[&str] = &[
    "track_output_blocks",
    "prefill_load_model",
    "prefill_time_ms_poly",
    "request_timeout_ms",
    "reported_load",
];
const EVENTS_FIELDS: &[&str] = &[
    "cluster",
    "path",
    "dump_path",
    "poll_interval_ms",
    "timeout_ms",
    "stale_after_ms",
    "max_response_bytes",
    "long_poll_ms",
];
const INDEX_FIELDS: &[&str] = &["max_blocks"];
const WORKER_FIELDS: &[&str] = &[
    "id",
    "address",
    "events_address",
    "dp_start",
    "dp_size",
    "device",
    "taints",
    "kv_capacity_blocks",
    "max_num_batched_tokens",
    "models",
];
const MODE_NAMES: &[&str] = &[
    "kv",
    "random",
    "round-robin",
    "direct",
    "least-loaded",
    "power-of-two",
    "device-aware-weighted",
];

fn compile(map: Map<String, Value>) -> Result<Config, ConfigError> {
    let mut root = Obj {
        path: String::new(),
        map,
        allowed: ROOT_FIELDS,
    };

    let modes: Vec<(&'static str, RoutingMode)> =
        RoutingMode::ALL.iter().map(|m| (m.as_str(), *m)).collect();
    let mode = variant(&mut root, "mode", RoutingMode::Kv, &modes, MODE_NAMES)?;

    let block_size = match root.take::<u64>("block_size")? {
        None => 64,
        Some(v) => u64_in(
            "block_size".to_string(),
            v,
            1,
            u64::from(MAX_BLOCK_SIZE),
            "within [1, 1024] tokens",
        )?,
    } as u32;

    let destination_header = root
        .take::<String>("destination_header")?
        .unwrap_or_else(|| "x-gateway-destination-endpoint".to_string())
        .to_ascii_lowercase();
    let header_ok = !destination_header.is_empty()
        && destination_header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !header_ok {
        return Err(ConfigError::Invalid {
            field: "destination_header".to_string(),
            detail: format!("\"{destination_header}\" is not a valid HTTP header name (pseudo-headers are not allowed)"),
        });
    }

    let destination_format = variant(
        &mut root,
        "destination_format",
        DestinationFormat::OverrideHost,
        &[
            ("override_host", DestinationFormat::OverrideHost),
            ("original_dst", DestinationFormat::OriginalDst),
        ],
        &["override_host", "original_dst"],
    )?;

    let fallback_count = match root.take::<u64>("fallback_count")? {
        None => 2,
        Some(v) => u64_in(
            "fallback_count".to_string(),
            v,
            0,
            MAX_FALLBACK_COUNT as u64,
            "within [0, 16]",
        )?,
    } as usize;

    let llm_paths = match root.take::<Vec<String>>("llm_paths")? {
        None => vec![
            "/v1/completions".to_string(),
            "/v1/chat/completions".to_string(),
        ],
        Some(paths) => {
            if paths.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "llm_paths".to_string(),
                    detail: "must list at least one path (an empty list routes nothing)"
                        .to_string(),
                });
            }
            for (i, p) in paths.iter().enumerate() {
                check_url_path(format!("llm_paths[{i}]"), p)?;
            }
            paths
        }
    };

    let max_body_bytes = match root.take::<u64>("max_body_bytes")? {
        None => 8 * 1024 * 1024,
        Some(v) => u64_in(
            "max_body_bytes".to_string(),
            v,
            1,
            MAX_BYTES_LIMIT,
            "within [1, 1073741824]",
        )?,
    } as usize;

    let response_headers = root.take::<bool>("response_headers")?.unwrap_or(false);
    if root.take_raw("allow_client_pinning").is_some() {
        return Err(ConfigError::Invalid {
            field: "allow_client_pinning".to_string(),
            detail: "replaced by client_routing_hints (\"ignore\" | \"reject\" | \"honor\"), which covers header and body pins, allow-lists and taints alike".to_string(),
        });
    }
    let client_routing_hints = variant(
        &mut root,
        "client_routing_hints",
        ClientHints::Ignore,
        &[
            ("ignore", ClientHints::Ignore),
            ("reject", ClientHints::Reject),
            ("honor", ClientHints::Honor),
        ],
        &["ignore", "reject", "honor"],
    )?;
    if mode == RoutingMode::Direct && client_routing_hints != ClientHints::Honor {
        return Err(ConfigError::Invalid {
            field: "client_routing_hints".to_string(),
            detail: format!(
                "mode direct routes by the client's pin, so it needs \"honor\" (got \"{}\")",
                client_routing_hints.as_str()
            ),
        });
    }
    let client_routing_hints_max_items = match root.take::<u64>("client_routing_hints_max_items")? {
        None => crate::request::DEFAULT_MAX_HINT_ITEMS,
        Some(v) => u64_in(
            "client_routing_hints_max_items".to_string(),
            v,
            1,
            MAX_HINT_ITEMS_LIMIT,
            "within [1, 65536]",
        )? as usize,
    };
    let router_temperature = non_negative(&mut root, "router_temperature", 0.0)?;

    let cost = match root.take_raw("cost") {
        None => CostWeights::default(),
        Some(v) => compile_cost(v)?,
    };
    let busy = match root.take_raw("busy") {
        None => BusyThresholds::default(),
        Some(v) => compile_busy(v)?,
    };
    let load = match root.take_raw("load") {
        None => LoadConfig::default(),
        Some(v) => compile_load(v)?,
    };

    let device_ratio = match root.take::<f64>("device_ratio")? {
        None => 8.0,
        Some(v) if v.is_finite() && v > 0.0 => v,
        Some(v) => {
            return Err(ConfigError::OutOfRange {
                field: "device_ratio".to_string(),
                expected: "finite and > 0",
                got: v.to_string(),
            })
        }
    };
    let tick_ms = ms(&mut root, "tick_ms", 50, 1, 60_000, "within [1, 60000]")?;

    let events = match root.take_raw("events") {
        None => EventsConfig::default(),
        Some(v) => compile_events(v)?,
    };
    let index = match root.take_raw("index") {
        None => IndexConfig::default(),
        Some(v) => compile_index(v)?,
    };

    let workers_value = root
        .take_raw("workers")
        .ok_or_else(|| ConfigError::Missing {
            field: "workers".to_string(),
        })?;
    root.finish()?;
    let (workers, slots) = compile_workers(workers_value, &busy)?;

    Ok(Config {
        mode,
        block_size,
        destination_header,
        destination_format,
        fallback_count,
        llm_paths,
        max_body_bytes,
        response_headers,
        client_routing_hints,
        client_routing_hints_max_items,
        router_temperature,
        cost,
        busy,
        load,
        device_ratio,
        tick_ms,
        events,
        index,
        workers,
        slots,
    })
}

fn compile_cost(v: Value) -> Result<CostWeights, ConfigError> {
    let mut o = Obj::new("cost", v, COST_FIELDS)?;
    let d = CostWeights::default();
    let overlap_score_credit = match o.take::<f64>("overlap_score_credit")? {
        None => d.overlap_score_credit,
        Some(v) => f64_in(
            o.field_path("overlap_score_credit"),
            v,
            0.0,
            1.0,
            "within [0, 1]",
        )?,
    };
    let c = CostWeights {
        overlap_score_credit,
        prefill_load_scale: non_negative(&mut o, "prefill_load_scale", d.prefill_load_scale)?,
        host_cache_hit_weight: non_negative(
            &mut o,
            "host_cache_hit_weight",
            d.host_cache_hit_weight,
        )?,
        disk_cache_hit_weight: non_negative(
            &mut o,
            "disk_cache_hit_weight",
            d.disk_cache_hit_weight,
        )?,
        shared_cache_multiplier: non_negative(
            &mut o,
            "shared_cache_multiplier",
            d.shared_cache_multiplier,
        )?,
        decode_active_request_weight: non_negative(
            &mut o,
            "decode_active_request_weight",
            d.decode_active_request_weight,
        )?,
    };
    o.finish()?;
    Ok(c)
}

fn compile_busy(v: Value) -> Result<BusyThresholds, ConfigError> {
    let mut o = Obj::new("busy", v, BUSY_FIELDS)?;
    let decode_blocks_fraction = positive_fraction(&mut o, "decode_blocks_fraction")?;
    let prefill_tokens = match o.take::<u64>("prefill_tokens")? {
        None => None,
        Some(v) => Some(u64_in(
            o.field_path("prefill_tokens"),
            v,
            1,
            u64::MAX,
            "> 0",
        )?),
    };
    let prefill_tokens_fraction = positive_fraction(&mut o, "prefill_tokens_fraction")?;
    o.finish()?;
    Ok(BusyThresholds {
        decode_blocks_fraction,
        prefill_tokens,
        prefill_tokens_fraction,
    })
}

fn compile_load(v: Value) -> Result<LoadConfig, ConfigError> {
    let mut o = Obj::new("load", v, LOAD_FIELDS)?;
    let d = LoadConfig::default();
    let track_output_blocks = o
        .take::<bool>("track_output_blocks")?
        .unwrap_or(d.track_output_blocks);
    let prefill_load_model = variant(
        &mut o,
        "prefill_load_model",
        d.prefill_load_model,
        &[
            ("none", PrefillLoadModel::None),
            ("polynomial", PrefillLoadModel::Polynomial),
        ],
        &["none", "polynomial"],
    )?;
    let prefill_time_ms_poly = match o.take::<Vec<f64>>("prefill_time_ms_poly")? {
        None => d.prefill_time_ms_poly,
        Some(p) => {
            if p.is_empty() || p.len() > 8 {
                return Err(ConfigError::OutOfRange {
                    field: o.field_path("prefill_time_ms_poly"),
                    expected: "a list of 1 to 8 coefficients (lowest degree first)",
                    got: format!("{} coefficients", p.len()),
                });
            }
            for (i, c) in p.iter().enumerate() {
                f64_in(
                    format!("load.prefill_time_ms_poly[{i}]"),
                    *c,
                    f64::MIN,
                    f64::MAX,
                    "a finite number",
                )?;
            }
            p
        }
    };
    let request_timeout_ms = ms(
        &mut o,
        "request_timeout_ms",
        d.request_timeout_ms,
        1,
        u64::from(u32::MAX),
        "within [1, 4294967295]",
    )?;
    let reported_load = o.take::<bool>("reported_load")?.unwrap_or(d.reported_load);
    o.finish()?;
    Ok(LoadConfig {
        track_output_blocks,
        prefill_load_model,
        prefill_time_ms_poly,
        request_timeout_ms,
        reported_load,
    })
}

fn compile_events(v: Value) -> Result<EventsConfig, ConfigError> {
    let mut o = Obj::new("events", v, EVENTS_FIELDS)?;
    let d = EventsConfig::default();
    let cluster = o.take::<String>("cluster")?.unwrap_or(d.cluster);
    non_empty(o.field_path("cluster"), &cluster)?;
    let path = url_path(&mut o, "path", &d.path)?;
    let dump_path = url_path(&mut o, "dump_path", &d.dump_path)?;
    let poll_interval_ms = ms(
        &mut o,
        "poll_interval_ms",
        d.poll_interval_ms,
        1,
        3_600_000,
        "within [1, 3600000]",
    )?;
    let timeout_ms = ms(
        &mut o,
        "timeout_ms",
        d.timeout_ms,
        1,
        3_600_000,
        "within [1, 3600000]",
    )?;
    let stale_after_ms = ms(
        &mut o,
        "stale_after_ms",
        d.stale_after_ms,
        1,
        86_400_000,
        "within [1, 86400000]",
    )?;
    if stale_after_ms < poll_interval_ms {
        return Err(ConfigError::OutOfRange {
            field: o.field_path("stale_after_ms"),
            expected: ">= events.poll_interval_ms",
            got: stale_after_ms.to_string(),
        });
    }
    let max_response_bytes = match o.take::<u64>("max_response_bytes")? {
        None => d.max_response_bytes,
        Some(v) => u64_in(
            o.field_path("max_response_bytes"),
            v,
            1,
            MAX_BYTES_LIMIT,
            "within [1, 1073741824]",
        )? as usize,
    };
    let long_poll_ms = ms(
        &mut o,
        "long_poll_ms",
        d.long_poll_ms,
        0,
        600_000,
        "within [0, 600000]",
    )?;
    // An idle worker answers a long poll only when it expires: the worker must not look silent
    // (stale) meanwhile.
    if long_poll_ms > 0 && long_poll_ms + timeout_ms > stale_after_ms {
        return Err(ConfigError::OutOfRange {
            field: o.field_path("long_poll_ms"),
            expected: "such that long_poll_ms + timeout_ms <= stale_after_ms",
            got: format!(
                "{long_poll_ms} (timeout_ms {timeout_ms}, stale_after_ms {stale_after_ms})"
            ),
        });
    }
    o.finish()?;
    Ok(EventsConfig {
        cluster,
        path,
        dump_path,
        poll_interval_ms,
        timeout_ms,
        stale_after_ms,
        max_response_bytes,
        long_poll_ms,
    })
}

fn compile_index(v: Value) -> Result<IndexConfig, ConfigError> {
    let mut o = Obj::new("index", v, INDEX_FIELDS)?;
    let max_blocks = match o.take::<u64>("max_blocks")? {
        None => IndexConfig::default().max_blocks,
        Some(v) => u64_in(
            o.field_path("max_blocks"),
            v,
            1,
            u64::from(u32::MAX),
            "within [1, 4294967295]",
        )? as u32,
    };
    o.finish()?;
    Ok(IndexConfig { max_blocks })
}

fn compile_workers(
    v: Value,
    busy: &BusyThresholds,
) -> Result<(Vec<WorkerConfig>, Vec<Slot>), ConfigError> {
    let Value::Array(items) = v else {
        return Err(ConfigError::WrongType {
            field: "workers".to_string(),
            detail: format!("expected an array of worker objects, got {}", kind(&v)),
        });
    };
    if items.is_empty() {
        return Err(ConfigError::Invalid {
            field: "workers".to_string(),
            detail: "at least one worker is required".to_string(),
        });
    }
    let max_slots = u32::from(u16::MAX);
    let total: u64 = items
        .iter()
        .map(|w| w.get("dp_size").and_then(Value::as_u64).unwrap_or(1))
        .fold(0u64, u64::saturating_add);
    if total > u64::from(max_slots) {
        return Err(ConfigError::TooManySlots {
            total,
            max: max_slots,
        });
    }

    let mut workers: Vec<WorkerConfig> = Vec::with_capacity(items.len());
    let mut slots: Vec<Slot> = Vec::new();
    for (i, item) in items.into_iter().enumerate() {
        let path = format!("workers[{i}]");
        let mut o = Obj::new(&path, item, WORKER_FIELDS)?;
        let id = o
            .take::<WorkerId>("id")?
            .ok_or_else(|| ConfigError::Missing {
                field: o.field_path("id"),
            })?;
        if workers.iter().any(|w| w.id == id) {
            return Err(ConfigError::DuplicateWorkerId {
                field: o.field_path("id"),
                id,
            });
        }
        let address_str = o
            .take::<String>("address")?
            .ok_or_else(|| ConfigError::Missing {
                field: o.field_path("address"),
            })?;
        let addr = address(o.field_path("address"), &address_str)?;
        let events_addr = match o.take::<String>("events_address")? {
            None => addr,
            Some(s) => address(o.field_path("events_address"), &s)?,
        };
        let dp_start = o.take::<DpRank>("dp_start")?.unwrap_or(0);
        let dp_size = match o.take::<u32>("dp_size")? {
            None => 1,
            Some(v) => u64_in(
                o.field_path("dp_size"),
                u64::from(v),
                1,
                u64::from(max_slots),
                ">= 1",
            )? as u32,
        };
        if dp_start.checked_add(dp_size).is_none() {
            return Err(ConfigError::OutOfRange {
                field: o.field_path("dp_start"),
                expected: "such that dp_start + dp_size fits in 32 bits",
                got: dp_start.to_string(),
            });
        }
        let device = variant(
            &mut o,
            "device",
            Device::Gpu,
            &[("gpu", Device::Gpu), ("cpu", Device::Cpu)],
            &["gpu", "cpu"],
        )?;
        let taints = o.take::<Vec<String>>("taints")?.unwrap_or_default();
        for (t, taint) in taints.iter().enumerate() {
            non_empty(format!("{path}.taints[{t}]"), taint)?;
        }
        let kv_capacity_blocks = match o.take::<u32>("kv_capacity_blocks")? {
            None => None,
            Some(v) => Some(u64_in(
                o.field_path("kv_capacity_blocks"),
                u64::from(v),
                1,
                u64::MAX,
                "> 0",
            )? as u32),
        };
        let max_num_batched_tokens = match o.take::<u32>("max_num_batched_tokens")? {
            None => None,
            Some(v) => Some(u64_in(
                o.field_path("max_num_batched_tokens"),
                u64::from(v),
                1,
                u64::MAX,
                "> 0",
            )? as u32),
        };
        if busy.decode_blocks_fraction.is_some() && kv_capacity_blocks.is_none() {
            return Err(ConfigError::MissingCapacity {
                field: o.field_path("kv_capacity_blocks"),
                required_by: "busy.decode_blocks_fraction",
            });
        }
        if busy.prefill_tokens_fraction.is_some() && max_num_batched_tokens.is_none() {
            return Err(ConfigError::MissingCapacity {
                field: o.field_path("max_num_batched_tokens"),
                required_by: "busy.prefill_tokens_fraction",
            });
        }
        let models = o.take::<Vec<String>>("models")?.unwrap_or_default();
        for (m, model) in models.iter().enumerate() {
            non_empty(format!("{path}.models[{m}]"), model)?;
        }
        o.finish()?;

        // total <= u16::MAX was checked above, so these conversions cannot fail; map to the
        // same error anyway rather than panic.
        let too_many = || ConfigError::TooManySlots {
            total,
            max: max_slots,
        };
        let first_slot = SlotIdx::try_from(slots.len()).map_err(|_| too_many())?;
        let worker = u16::try_from(i).map_err(|_| too_many())?;
        for r in 0..dp_size {
            slots.push(Slot {
                worker,
                dp_rank: dp_start + r,
            });
        }
        workers.push(WorkerConfig {
            id,
            address: addr,
            address_text: addr.to_string(),
            events_address: events_addr,
            events_address_text: events_addr.to_string(),
            dp_start,
            dp_size,
            device,
            taints,
            kv_capacity_blocks,
            max_num_batched_tokens,
            models,
            first_slot,
        });
    }
    Ok((workers, slots))
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
                   "reported_load": true},
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
        assert!(e.starts_with("workers[1].taint: unknown field"), "{e}");
    }

    #[test]
    fn wrong_types_and_variants_name_the_field() {
        let e = err(r#"{"block_size": "64", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("block_size: invalid type"), "{e}");
        let e = err(r#"{"mode": "fastest", "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("mode: unknown value \"fastest\""), "{e}");
        let e = err(r#"{"cost": 3, "workers": [{"id": 1, "address": "10.0.0.1:8000"}]}"#);
        assert!(e.starts_with("cost: expected an object"), "{e}");
        let e = err(r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "device": "tpu"}]}"#);
        assert!(e.starts_with("workers[0].device: unknown value"), "{e}");
        assert!(err("[1]").starts_with("(root):"));
        assert!(err("{").starts_with("configuration is not valid JSON"));
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
            e.starts_with("client_routing_hints: unknown value \"trust\""),
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
