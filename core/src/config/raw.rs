//! The configuration as written: the root object and the workers, read by serde with every default
//! filled in. The sub-objects (`cost`, `busy`, `load`, `events`, `index`) deserialize straight
//! into their compiled types; [`super::compile`] checks ranges and derives the rest. `membership`
//! as written is here too; [`super::membership`] compiles it.

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::{
    ApproximateConfig, BusyThresholds, ClientHints, CostWeights, DestinationFormat, Device,
    EventsConfig, LoadConfig, RoutingMode, TokenizerConfig, WorkerKvMode,
};
use crate::types::{DpRank, WorkerId};

#[derive(Debug, Deserialize)]
#[serde(
    default,
    deny_unknown_fields,
    expecting = "the filter configuration, a JSON object"
)]
pub(super) struct RawConfig {
    /// The preset, already applied to the JSON (`super::preset`); kept for the compiled config.
    pub engine: Option<super::Engine>,
    pub mode: RoutingMode,
    pub policy: super::KvPolicy,
    pub block_size: u32,
    pub destination_header: String,
    pub destination_format: DestinationFormat,
    pub fallback_count: usize,
    pub llm_paths: Vec<String>,
    pub max_body_bytes: usize,
    pub response_headers: bool,
    pub client_routing_hints: ClientHints,
    pub client_routing_hints_max_items: usize,
    pub router_temperature: f64,
    pub cost: CostWeights,
    pub busy: BusyThresholds,
    pub load: LoadConfig,
    pub device_ratio: f64,
    pub tick_ms: u64,
    pub events: EventsConfig,
    pub index: RawIndex,
    pub tokenizer: Option<TokenizerConfig>,
    pub approximate: Option<ApproximateConfig>,
    pub affinity: Option<super::AffinityConfig>,
    pub ttft: Option<super::TtftConfig>,
    pub engine_priority: Option<super::EnginePriorityConfig>,
    pub membership: Option<RawMembership>,
    /// Required; `Option` so that its absence reads as "workers: required field is missing".
    pub workers: Option<Vec<RawWorker>>,
    /// Removed; read only to name its replacement.
    pub allow_client_pinning: Option<IgnoredAny>,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            engine: None,
            mode: RoutingMode::Kv,
            policy: super::KvPolicy::default(),
            block_size: 64,
            destination_header: "x-gateway-destination-endpoint".to_string(),
            destination_format: DestinationFormat::OverrideHost,
            fallback_count: 2,
            llm_paths: vec![
                "/v1/completions".to_string(),
                "/v1/chat/completions".to_string(),
            ],
            max_body_bytes: 8 * 1024 * 1024,
            response_headers: false,
            client_routing_hints: ClientHints::Ignore,
            client_routing_hints_max_items: super::DEFAULT_MAX_HINT_ITEMS,
            router_temperature: 0.0,
            cost: CostWeights::default(),
            busy: BusyThresholds::default(),
            load: LoadConfig::default(),
            device_ratio: 8.0,
            tick_ms: 50,
            events: EventsConfig::default(),
            index: RawIndex::default(),
            tokenizer: None,
            approximate: None,
            affinity: None,
            ttft: None,
            engine_priority: None,
            membership: None,
            workers: None,
            allow_client_pinning: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a worker object")]
pub(super) struct RawWorker {
    /// Required (see `RawConfig::workers`).
    pub id: Option<WorkerId>,
    /// Required. A string, parsed in `compile` for an error that shows the expected form.
    pub address: Option<String>,
    pub events_address: Option<String>,
    #[serde(default)]
    pub dp_start: DpRank,
    #[serde(default = "one")]
    pub dp_size: u32,
    #[serde(default = "gpu")]
    pub device: Device,
    #[serde(default)]
    pub taints: Vec<String>,
    pub kv_capacity_blocks: Option<u32>,
    pub max_num_batched_tokens: Option<u32>,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default = "events_and_predictions")]
    pub kv_mode: WorkerKvMode,
    /// This worker's own `load.prefill_time_ms_poly` (a different GPU, model shard or engine).
    pub prefill_time_ms_poly: Option<Vec<f64>>,
    /// This worker's own `ttft.decode_step_ms_poly`.
    pub decode_step_ms_poly: Option<Vec<f64>>,
}

/// `index` as written: `max_blocks` unset is derived from the fleet ([`super::compile`]).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "an object")]
pub(super) struct RawIndex {
    pub max_blocks: Option<u32>,
}

fn one() -> u32 {
    1
}

fn gpu() -> Device {
    Device::Gpu
}

/// Events, with the router's own decisions bridging their lag (a burst sharing a new prefix
/// reaches one worker before its first event arrives).
pub(super) fn events_and_predictions() -> WorkerKvMode {
    WorkerKvMode::EventsAndApproximate
}

/// `membership` as written.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "the membership object")]
pub(super) struct RawMembership {
    /// Required; `Option` so that its absence reads as "required field is missing".
    pub(super) cluster: Option<String>,
    pub(super) admin_cluster: String,
    pub(super) admin_path: String,
    pub(super) poll_interval_ms: u64,
    pub(super) timeout_ms: u64,
    pub(super) max_response_bytes: u64,
    pub(super) max_workers: u64,
    pub(super) first_id: Option<WorkerId>,
    pub(super) events_port: u64,
    pub(super) worker: PoolTemplate,
}

impl Default for RawMembership {
    fn default() -> Self {
        RawMembership {
            cluster: None,
            admin_cluster: "envoy_admin".to_string(),
            admin_path: "/clusters?format=json".to_string(),
            poll_interval_ms: 500,
            timeout_ms: 1000,
            max_response_bytes: 4 << 20,
            max_workers: 16,
            first_id: None,
            events_port: 0,
            worker: PoolTemplate::default(),
        }
    }
}

/// `membership.worker`: a worker entry without its identity and addresses, given to every pool
/// entry.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "a worker template object")]
pub(super) struct PoolTemplate {
    pub(super) dp_start: DpRank,
    pub(super) dp_size: u32,
    pub(super) device: Device,
    pub(super) taints: Vec<String>,
    pub(super) kv_capacity_blocks: Option<u32>,
    pub(super) max_num_batched_tokens: Option<u32>,
    pub(super) models: Vec<String>,
    pub(super) kv_mode: WorkerKvMode,
    pub(super) prefill_time_ms_poly: Option<Vec<f64>>,
    pub(super) decode_step_ms_poly: Option<Vec<f64>>,
}

impl Default for PoolTemplate {
    fn default() -> Self {
        PoolTemplate {
            dp_start: 0,
            dp_size: 1,
            device: Device::Gpu,
            taints: Vec::new(),
            kv_capacity_blocks: None,
            max_num_batched_tokens: None,
            models: Vec::new(),
            kv_mode: events_and_predictions(),
            prefill_time_ms_poly: None,
            decode_step_ms_poly: None,
        }
    }
}
