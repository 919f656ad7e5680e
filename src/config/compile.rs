//! Compilation: the configuration's schema (which fields, defaults) walked with the `fields`
//! readers, the range and cross-field rules, and the slot layout of a [`Config`].

use serde_json::{Map, Value};

use super::fields::*;
use super::membership;
use super::{
    BusyThresholds, ClientHints, Config, ConfigError, CostWeights, DestinationFormat, Device,
    EventsConfig, IndexConfig, LoadConfig, PrefillLoadModel, RoutingMode, Slot, WorkerConfig,
    MAX_BLOCK_SIZE, MAX_BYTES_LIMIT, MAX_FALLBACK_COUNT, MAX_HINT_ITEMS_LIMIT,
};
use crate::types::{DpRank, SlotIdx, WorkerId};

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
    "membership",
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

pub(super) fn compile(map: Map<String, Value>) -> Result<Config, ConfigError> {
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

    let membership_value = root.take_raw("membership");
    let workers_value = match root.take_raw("workers") {
        Some(v) => v,
        // With membership the workers come from the cluster; the static list is optional.
        None if membership_value.is_some() => Value::Array(Vec::new()),
        None => {
            return Err(ConfigError::Missing {
                field: "workers".to_string(),
            })
        }
    };
    root.finish()?;
    let (membership, workers_value) = match membership_value {
        None => (None, workers_value),
        Some(v) => {
            let (m, all) = membership::compile(v, workers_value)?;
            (Some(m), all)
        }
    };
    let (mut workers, slots) =
        compile_workers(workers_value, &busy).map_err(|e| match &membership {
            Some(m) => membership::name_template_field(e, m.first_pool_worker),
            None => e,
        })?;
    if let Some(m) = &membership {
        membership::mark_vacant(&mut workers, m);
    }

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
        membership,
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
            routable: true,
        });
    }
    Ok((workers, slots))
}
