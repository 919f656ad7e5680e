//! The `membership` sub-object: follow the routed cluster's hosts as Envoy has them instead of
//! (or on top of) the static `workers` list.
//!
//! Discovered hosts take entries from a fixed pool of `max_workers` workers appended after the
//! static ones, so the slot layout (index, load table, shared-data keys) never changes at run
//! time. Each pool entry is compiled from the `worker` template (DP ranks, device, capacity,
//! models, taints); its address is filled in when a host occupies it. A static worker whose
//! address the cluster lists keeps its own entry: the static list is the per-host override.

use serde_json::{Map, Value};

use super::fields::{check_url_path, kind, ms, non_empty, u64_in, Obj};
use super::{ConfigError, WorkerConfig};
use crate::types::WorkerId;

const MEMBERSHIP_FIELDS: &[&str] = &[
    "cluster",
    "admin_cluster",
    "admin_path",
    "poll_interval_ms",
    "timeout_ms",
    "max_response_bytes",
    "max_workers",
    "first_id",
    "events_port",
    "worker",
];

/// Fields of `membership.worker` (a worker entry without its identity and addresses).
const TEMPLATE_FIELDS: &[&str] = &[
    "dp_start",
    "dp_size",
    "device",
    "taints",
    "kv_capacity_blocks",
    "max_num_batched_tokens",
    "models",
];

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

/// Address given to pool entries at compile time; replaced by the host that occupies the entry.
pub(super) const VACANT_ADDRESS: &str = "0.0.0.0:1";

/// Reads `membership`, and appends its pool entries (as worker objects) to the static `workers`
/// array so that one pass compiles both. `workers` is the raw static list.
pub(super) fn compile(
    value: Value,
    workers: Value,
) -> Result<(MembershipConfig, Value), ConfigError> {
    let mut o = Obj::new("membership", value, MEMBERSHIP_FIELDS)?;
    let cluster = o
        .take::<String>("cluster")?
        .ok_or_else(|| ConfigError::Missing {
            field: o.field_path("cluster"),
        })?;
    non_empty(o.field_path("cluster"), &cluster)?;
    let admin_cluster = o
        .take::<String>("admin_cluster")?
        .unwrap_or_else(|| "envoy_admin".to_string());
    non_empty(o.field_path("admin_cluster"), &admin_cluster)?;
    let admin_path = o
        .take::<String>("admin_path")?
        .unwrap_or_else(|| "/clusters?format=json".to_string());
    // A query is expected here (`?format=json`); only the path part is checked.
    let path_part = admin_path.split('?').next().unwrap_or_default();
    check_url_path(o.field_path("admin_path"), path_part)?;
    let poll_interval_ms = ms(
        &mut o,
        "poll_interval_ms",
        500,
        10,
        60_000,
        "within [10, 60000]",
    )?;
    let timeout_ms = ms(&mut o, "timeout_ms", 1000, 1, 60_000, "within [1, 60000]")?;
    let max_response_bytes = match o.take::<u64>("max_response_bytes")? {
        None => 4 << 20,
        Some(v) => u64_in(
            o.field_path("max_response_bytes"),
            v,
            1024,
            super::MAX_BYTES_LIMIT,
            "within [1024, 1 GiB]",
        )?,
    };
    let max_workers = match o.take::<u64>("max_workers")? {
        None => 16,
        Some(v) => u64_in(
            o.field_path("max_workers"),
            v,
            1,
            MAX_POOL_WORKERS,
            "within [1, 4096]",
        )?,
    };
    let events_port = match o.take::<u64>("events_port")? {
        None => 0,
        Some(v) => u64_in(
            o.field_path("events_port"),
            v,
            0,
            65_535,
            "within [0, 65535]",
        )?,
    };

    let Value::Array(mut items) = workers else {
        return Err(ConfigError::WrongType {
            field: "workers".to_string(),
            detail: format!(
                "expected an array of worker objects, got {}",
                kind(&workers)
            ),
        });
    };
    let static_ids: Vec<u64> = items
        .iter()
        .filter_map(|w| w.get("id").and_then(Value::as_u64))
        .collect();
    let first_id = match o.take::<u64>("first_id")? {
        Some(v) => v,
        None => static_ids.iter().max().map_or(1, |m| m.saturating_add(1)),
    };
    let last_id = first_id
        .checked_add(max_workers - 1)
        .ok_or_else(|| ConfigError::OutOfRange {
            field: o.field_path("first_id"),
            expected: "such that first_id + max_workers - 1 fits in 64 bits",
            got: first_id.to_string(),
        })?;
    if let Some(id) = static_ids
        .iter()
        .find(|id| (first_id..=last_id).contains(id))
    {
        return Err(ConfigError::Invalid {
            field: o.field_path("first_id"),
            detail: format!(
                "pool ids {first_id}..={last_id} include static worker id {id}; choose first_id above the static ids"
            ),
        });
    }
    let template = match o.take_raw("worker") {
        None | Some(Value::Null) => Map::new(),
        Some(v) => {
            let t = Obj::new("membership.worker", v, TEMPLATE_FIELDS)?;
            if let Some(key) = t
                .map
                .keys()
                .find(|k| !TEMPLATE_FIELDS.contains(&k.as_str()))
            {
                return Err(ConfigError::UnknownField {
                    field: t.field_path(key),
                    expected: TEMPLATE_FIELDS,
                });
            }
            t.map
        }
    };
    o.finish()?;

    let first_pool_worker = u16::try_from(items.len()).map_err(|_| ConfigError::TooManySlots {
        total: items.len() as u64,
        max: u32::from(u16::MAX),
    })?;
    for i in 0..max_workers {
        let mut entry = template.clone();
        entry.insert("id".to_string(), Value::from(first_id + i));
        entry.insert("address".to_string(), Value::from(VACANT_ADDRESS));
        items.push(Value::Object(entry));
    }
    let config = MembershipConfig {
        cluster,
        admin_cluster,
        admin_path,
        poll_interval_ms,
        timeout_ms,
        max_response_bytes: usize::try_from(max_response_bytes).unwrap_or(usize::MAX),
        // <= MAX_POOL_WORKERS.
        max_workers: u16::try_from(max_workers).unwrap_or(u16::MAX),
        first_id,
        events_port: u16::try_from(events_port).unwrap_or(0),
        first_pool_worker,
    };
    Ok((config, Value::Array(items)))
}

/// An error raised while compiling pool entry `workers[first_pool_worker]` names the template.
pub(super) fn name_template_field(err: ConfigError, first_pool_worker: u16) -> ConfigError {
    let prefix = format!("workers[{first_pool_worker}]");
    let rename = |field: String| match field.strip_prefix(&prefix) {
        Some(rest) => format!("membership.worker{rest}"),
        None => field,
    };
    match err {
        ConfigError::UnknownField { field, expected } => ConfigError::UnknownField {
            field: rename(field),
            expected,
        },
        ConfigError::WrongType { field, detail } => ConfigError::WrongType {
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
        ConfigError::UnknownVariant {
            field,
            got,
            expected,
        } => ConfigError::UnknownVariant {
            field: rename(field),
            got,
            expected,
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
