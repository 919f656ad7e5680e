//! The `membership` sub-object: follow the routed cluster's hosts as Envoy has them instead of
//! (or on top of) the static `workers` list.
//!
//! Discovered hosts take entries from a fixed pool of `max_workers` workers appended after the
//! static ones, so the slot layout (index, load table, shared-data keys) never changes at run
//! time. Each pool entry is compiled from the `worker` template (DP ranks, device, capacity,
//! models, taints); its address is filled in when a host occupies it. A static worker whose
//! address the cluster lists keeps its own entry: the static list is the per-host override.

use super::check::{non_empty, u64_in, url_path};
use super::raw::{PoolTemplate, RawMembership, RawWorker};
use super::{ConfigError, WorkerConfig};
use crate::types::WorkerId;

/// Largest accepted `membership.max_workers`.
pub const MAX_POOL_WORKERS: u64 = 4096;

/// The compiled `membership` object.
#[derive(Clone, Debug, PartialEq)]
pub struct MembershipConfig {
    /// The routed cluster whose hosts are the workers (e.g. `llm_workers`).
    pub cluster: String,
    /// A cluster reaching Envoy's own admin interface (loopback or a unix socket); no route may
    /// point at it.
    pub admin_cluster: String,
    /// `/clusters?format=json` by default.
    pub admin_path: String,
    /// `10..=60000`, default 500.
    pub poll_interval_ms: u64,
    /// `1..=60000`, default 1000.
    pub timeout_ms: u64,
    /// Larger admin replies are refused before they are copied into the VM.
    pub max_response_bytes: usize,
    /// Pool size: at most this many discovered hosts (besides static ones) at a time.
    pub max_workers: u16,
    /// Worker id of the first pool entry; pool entry `i` has id `first_id + i`.
    pub first_id: WorkerId,
    /// Port of a discovered host's event endpoint; `0` = the host's own port.
    pub events_port: u16,
    /// Index into `Config::workers` of the first pool entry (= number of static workers).
    pub first_pool_worker: u16,
}

impl PoolTemplate {
    fn entry(&self, id: WorkerId) -> RawWorker {
        RawWorker {
            id: Some(id),
            address: Some(VACANT_ADDRESS.to_string()),
            events_address: None,
            dp_start: self.dp_start,
            dp_size: self.dp_size,
            device: self.device,
            taints: self.taints.clone(),
            kv_capacity_blocks: self.kv_capacity_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            models: self.models.clone(),
            kv_mode: self.kv_mode,
            prefill_time_ms_poly: self.prefill_time_ms_poly.clone(),
            decode_step_ms_poly: self.decode_step_ms_poly.clone(),
        }
    }
}

/// Address given to pool entries at compile time; replaced by the host that occupies the entry.
pub(super) const VACANT_ADDRESS: &str = "0.0.0.0:1";

/// Checks `membership`, and appends its pool entries to the static `workers` so that one pass
/// compiles both.
pub(super) fn compile(
    raw: RawMembership,
    mut workers: Vec<RawWorker>,
) -> Result<(MembershipConfig, Vec<RawWorker>), ConfigError> {
    let field = |key: &str| format!("membership.{key}");
    let cluster = raw.cluster.ok_or_else(|| ConfigError::Missing {
        field: field("cluster"),
    })?;
    non_empty(&field("cluster"), &cluster)?;
    non_empty(&field("admin_cluster"), &raw.admin_cluster)?;
    // A query is expected here (`?format=json`); only the path part is checked.
    let path_part = raw.admin_path.split('?').next().unwrap_or_default();
    url_path(&field("admin_path"), path_part)?;
    u64_in(
        &field("poll_interval_ms"),
        raw.poll_interval_ms,
        10,
        60_000,
        "within [10, 60000]",
    )?;
    u64_in(
        &field("timeout_ms"),
        raw.timeout_ms,
        1,
        60_000,
        "within [1, 60000]",
    )?;
    u64_in(
        &field("max_response_bytes"),
        raw.max_response_bytes,
        1024,
        super::MAX_BYTES_LIMIT,
        "within [1024, 1 GiB]",
    )?;
    u64_in(
        &field("max_workers"),
        raw.max_workers,
        1,
        MAX_POOL_WORKERS,
        "within [1, 4096]",
    )?;
    u64_in(
        &field("events_port"),
        raw.events_port,
        0,
        65_535,
        "within [0, 65535]",
    )?;
    let max_workers = raw.max_workers;

    let static_ids: Vec<WorkerId> = workers.iter().filter_map(|w| w.id).collect();
    let first_id = match raw.first_id {
        Some(v) => v,
        None => static_ids.iter().max().map_or(1, |m| m.saturating_add(1)),
    };
    let last_id = first_id
        .checked_add(max_workers - 1)
        .ok_or_else(|| ConfigError::OutOfRange {
            field: field("first_id"),
            expected: "such that first_id + max_workers - 1 fits in 64 bits",
            got: first_id.to_string(),
        })?;
    if let Some(id) = static_ids
        .iter()
        .find(|id| (first_id..=last_id).contains(id))
    {
        return Err(ConfigError::Invalid {
            field: field("first_id"),
            detail: format!(
                "pool ids {first_id}..={last_id} include static worker id {id}; choose first_id above the static ids"
            ),
        });
    }

    let first_pool_worker =
        u16::try_from(workers.len()).map_err(|_| ConfigError::TooManySlots {
            total: workers.len() as u64,
            max: u32::from(u16::MAX),
        })?;
    workers.extend((0..max_workers).map(|i| raw.worker.entry(first_id + i)));
    let config = MembershipConfig {
        cluster,
        admin_cluster: raw.admin_cluster,
        admin_path: raw.admin_path,
        poll_interval_ms: raw.poll_interval_ms,
        timeout_ms: raw.timeout_ms,
        max_response_bytes: usize::try_from(raw.max_response_bytes).unwrap_or(usize::MAX),
        // <= MAX_POOL_WORKERS.
        max_workers: u16::try_from(max_workers).unwrap_or(u16::MAX),
        first_id,
        events_port: u16::try_from(raw.events_port).unwrap_or(0),
        first_pool_worker,
    };
    Ok((config, workers))
}

/// An error raised while compiling pool entry `workers[first_pool_worker]` names the template.
pub(super) fn name_template_field(err: ConfigError, first_pool_worker: u16) -> ConfigError {
    let prefix = format!("workers[{first_pool_worker}]");
    let rename = |field: String| match field.strip_prefix(&prefix) {
        Some(rest) => format!("membership.worker{rest}"),
        None => field,
    };
    match err {
        ConfigError::Parse { field, detail } => ConfigError::Parse {
            field: rename(field),
            detail,
        },
        ConfigError::OutOfRange {
            field,
            expected,
            got,
        } => ConfigError::OutOfRange {
            field: rename(field),
            expected,
            got,
        },
        ConfigError::Invalid { field, detail } => ConfigError::Invalid {
            field: rename(field),
            detail,
        },
        ConfigError::MissingCapacity { field, required_by } => ConfigError::MissingCapacity {
            field: rename(field),
            required_by,
        },
        other => other,
    }
}

/// Pool entries start vacant: no address, not routable, until a host occupies them.
pub(super) fn mark_vacant(workers: &mut [WorkerConfig], membership: &MembershipConfig) {
    for w in workers
        .iter_mut()
        .skip(usize::from(membership.first_pool_worker))
    {
        w.address_text.clear();
        w.events_address_text.clear();
        w.routable = false;
    }
}
