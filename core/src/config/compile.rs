//! Compilation: the range and cross-field rules serde cannot express, each error naming its field
//! path, and the slot layout of a [`Config`].

use std::net::SocketAddr;

use super::check::{f64_in, non_empty, non_negative, positive, timing_poly, u64_in, url_path};
use super::membership;
use super::raw::{RawConfig, RawWorker};
use super::{
    BusyThresholds, ClientHints, Config, ConfigError, CostWeights, EventsConfig, IndexConfig,
    LoadConfig, RoutingMode, Slot, WorkerConfig, MAX_BLOCK_SIZE, MAX_BYTES_LIMIT,
    MAX_FALLBACK_COUNT, MAX_HINT_ITEMS_LIMIT,
};
use crate::types::SlotIdx;

pub(super) fn compile(raw: RawConfig) -> Result<Config, ConfigError> {
    if raw.allow_client_pinning.is_some() {
        return Err(ConfigError::Invalid {
            field: "allow_client_pinning".to_string(),
            detail: "replaced by client_routing_hints (\"ignore\" | \"reject\" | \"honor\"), which covers header and body pins, allow-lists and taints alike".to_string(),
        });
    }
    let block_size = u64::from(raw.block_size);
    u64_in(
        "block_size",
        block_size,
        1,
        u64::from(MAX_BLOCK_SIZE),
        "within [1, 1024] tokens",
    )?;

    let destination_header = raw.destination_header.to_ascii_lowercase();
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

    let fallback_count = raw.fallback_count as u64;
    u64_in(
        "fallback_count",
        fallback_count,
        0,
        MAX_FALLBACK_COUNT as u64,
        "within [0, 16]",
    )?;
    if raw.llm_paths.is_empty() {
        return Err(ConfigError::Invalid {
            field: "llm_paths".to_string(),
            detail: "must list at least one path (an empty list routes nothing)".to_string(),
        });
    }
    for (i, p) in raw.llm_paths.iter().enumerate() {
        url_path(&format!("llm_paths[{i}]"), p)?;
    }
    let max_body_bytes = raw.max_body_bytes as u64;
    u64_in(
        "max_body_bytes",
        max_body_bytes,
        1,
        MAX_BYTES_LIMIT,
        "within [1, 1073741824]",
    )?;

    if raw.mode == RoutingMode::Direct && raw.client_routing_hints != ClientHints::Honor {
        return Err(ConfigError::Invalid {
            field: "client_routing_hints".to_string(),
            detail: format!(
                "mode direct routes by the client's pin, so it needs \"honor\" (got \"{}\")",
                raw.client_routing_hints.as_str()
            ),
        });
    }
    u64_in(
        "client_routing_hints_max_items",
        raw.client_routing_hints_max_items as u64,
        1,
        MAX_HINT_ITEMS_LIMIT,
        "within [1, 65536]",
    )?;
    non_negative("router_temperature", raw.router_temperature)?;
    check_cost(&raw.cost)?;
    check_busy(&raw.busy)?;
    check_load(&raw.load)?;
    positive("device_ratio", raw.device_ratio)?;
    u64_in("tick_ms", raw.tick_ms, 1, 60_000, "within [1, 60000]")?;
    check_events(&raw.events)?;
    if let Some(max_blocks) = raw.index.max_blocks {
        u64_in(
            "index.max_blocks",
            u64::from(max_blocks),
            1,
            u64::from(u32::MAX),
            "within [1, 4294967295]",
        )?;
    }

    let raw_workers = match raw.workers {
        Some(w) => w,
        // With membership the workers come from the cluster; the static list is optional.
        None if raw.membership.is_some() => Vec::new(),
        None => {
            return Err(ConfigError::Missing {
                field: "workers".to_string(),
            })
        }
    };
    let (membership, raw_workers) = match raw.membership {
        None => (None, raw_workers),
        Some(m) => {
            let (m, all) = membership::compile(m, raw_workers)?;
            (Some(m), all)
        }
    };
    let (mut workers, slots) =
        compile_workers(raw_workers, &raw.busy).map_err(|e| match &membership {
            Some(m) => membership::name_template_field(e, m.first_pool_worker),
            None => e,
        })?;
    if let Some(m) = &membership {
        membership::mark_vacant(&mut workers, m);
    }
    if let Some(t) = &raw.tokenizer {
        super::tokenizer::check_tokenizer(t)?;
    }
    if let Some(a) = &raw.affinity {
        super::affinity::check_affinity(a)?;
    }
    let ttft = match (raw.policy, raw.ttft) {
        (super::KvPolicy::Dynamo, Some(_)) => {
            return Err(ConfigError::Invalid {
                field: "ttft".to_string(),
                detail:
                    "configures the time-to-first-token model, which `policy: dynamo` does not use"
                        .to_string(),
            })
        }
        (super::KvPolicy::Dynamo, None) => None,
        (super::KvPolicy::Adaptive | super::KvPolicy::Predicted, t) => Some(t.unwrap_or_default()),
    };
    if let Some(t) = &ttft {
        super::ttft::check_ttft(t)?;
    }
    if let Some(p) = &raw.engine_priority {
        super::engine_priority::check_engine_priority(p)?;
    }
    let approximate = match raw.approximate {
        Some(mut a) => {
            super::approximate::finish(&mut a, raw.block_size)?;
            Some(a)
        }
        // A worker that expects predictions implies the defaults.
        None if workers.iter().any(|w| w.kv_mode.has_predictions()) => {
            let mut a = super::ApproximateConfig::default();
            super::approximate::finish(&mut a, raw.block_size)?;
            Some(a)
        }
        None => None,
    };

    Ok(Config {
        engine: raw.engine,
        mode: raw.mode,
        block_size: raw.block_size,
        destination_header,
        destination_format: raw.destination_format,
        fallback_count: raw.fallback_count,
        llm_paths: raw.llm_paths,
        max_body_bytes: raw.max_body_bytes,
        response_headers: raw.response_headers,
        client_routing_hints: raw.client_routing_hints,
        client_routing_hints_max_items: raw.client_routing_hints_max_items,
        router_temperature: raw.router_temperature,
        cost: raw.cost,
        busy: raw.busy,
        load: raw.load,
        device_ratio: raw.device_ratio,
        tick_ms: raw.tick_ms,
        events: raw.events,
        index: IndexConfig {
            max_blocks: raw
                .index
                .max_blocks
                .unwrap_or_else(|| fleet_index_blocks(&workers)),
        },
        tokenizer: raw.tokenizer,
        approximate,
        affinity: raw.affinity,
        policy: raw.policy,
        ttft,
        engine_priority: raw.engine_priority,
        workers,
        slots,
        membership,
    })
}

/// `index.max_blocks` when unset: every block the fleet's caches can hold (each worker's
/// `kv_capacity_blocks` per rank), when every worker declares its capacity, and never below the
/// fixed default (the index allocates as it fills, so a larger bound costs nothing until used).
fn fleet_index_blocks(workers: &[WorkerConfig]) -> u32 {
    let floor = IndexConfig::default().max_blocks;
    let mut total: u64 = 0;
    for w in workers {
        match w.kv_capacity_blocks {
            Some(c) => total = total.saturating_add(u64::from(c) * u64::from(w.dp_size.max(1))),
            None => return floor,
        }
    }
    u32::try_from(total).unwrap_or(u32::MAX).max(floor)
}

fn check_cost(c: &CostWeights) -> Result<(), ConfigError> {
    f64_in(
        "cost.overlap_score_credit",
        c.overlap_score_credit,
        0.0,
        1.0,
        "within [0, 1]",
    )?;
    non_negative("cost.prefill_load_scale", c.prefill_load_scale)?;
    non_negative("cost.host_cache_hit_weight", c.host_cache_hit_weight)?;
    non_negative("cost.disk_cache_hit_weight", c.disk_cache_hit_weight)?;
    non_negative("cost.shared_cache_multiplier", c.shared_cache_multiplier)?;
    non_negative(
        "cost.decode_active_request_weight",
        c.decode_active_request_weight,
    )
}

fn check_busy(b: &BusyThresholds) -> Result<(), ConfigError> {
    if let Some(v) = b.decode_blocks_fraction {
        positive("busy.decode_blocks_fraction", v)?;
    }
    if let Some(v) = b.prefill_tokens {
        u64_in("busy.prefill_tokens", v, 1, u64::MAX, "> 0")?;
    }
    if let Some(v) = b.prefill_tokens_fraction {
        positive("busy.prefill_tokens_fraction", v)?;
    }
    Ok(())
}

fn check_load(l: &LoadConfig) -> Result<(), ConfigError> {
    timing_poly("load.prefill_time_ms_poly", &l.prefill_time_ms_poly)?;
    u64_in(
        "load.request_timeout_ms",
        l.request_timeout_ms,
        1,
        u64::from(u32::MAX),
        "within [1, 4294967295]",
    )?;
    u64_in(
        "load.relay_interval_ms",
        l.relay_interval_ms,
        0,
        60_000,
        "within [0, 60000]",
    )
}

fn check_events(e: &EventsConfig) -> Result<(), ConfigError> {
    non_empty("events.cluster", &e.cluster)?;
    url_path("events.path", &e.path)?;
    url_path("events.dump_path", &e.dump_path)?;
    if !e.declare_path.is_empty() {
        url_path("events.declare_path", &e.declare_path)?;
    }
    let hour = "within [1, 3600000]";
    u64_in(
        "events.poll_interval_ms",
        e.poll_interval_ms,
        1,
        3_600_000,
        hour,
    )?;
    u64_in("events.timeout_ms", e.timeout_ms, 1, 3_600_000, hour)?;
    u64_in(
        "events.dump_timeout_ms",
        e.dump_timeout_ms,
        1,
        3_600_000,
        hour,
    )?;
    let day = "within [1, 86400000]";
    u64_in(
        "events.stale_after_ms",
        e.stale_after_ms,
        1,
        86_400_000,
        day,
    )?;
    if e.stale_after_ms < e.poll_interval_ms {
        return Err(ConfigError::OutOfRange {
            field: "events.stale_after_ms".to_string(),
            expected: ">= events.poll_interval_ms",
            got: e.stale_after_ms.to_string(),
        });
    }
    let bytes = e.max_response_bytes as u64;
    let expected = "within [1, 1073741824]";
    u64_in(
        "events.max_response_bytes",
        bytes,
        1,
        MAX_BYTES_LIMIT,
        expected,
    )?;
    let long_poll_ms = e.long_poll_ms;
    u64_in(
        "events.long_poll_ms",
        long_poll_ms,
        0,
        600_000,
        "within [0, 600000]",
    )?;
    u64_in(
        "events.page_events",
        u64::from(e.page_events),
        1,
        u64::from(crate::config::MAX_PAGE_EVENTS),
        "within [1, 100000]",
    )?;
    // An idle worker answers a long poll only when it expires: the worker must not look silent
    // (stale) meanwhile.
    if long_poll_ms > 0 && long_poll_ms + e.timeout_ms > e.stale_after_ms {
        return Err(ConfigError::OutOfRange {
            field: "events.long_poll_ms".to_string(),
            expected: "such that long_poll_ms + timeout_ms <= stale_after_ms",
            got: format!(
                "{long_poll_ms} (timeout_ms {}, stale_after_ms {})",
                e.timeout_ms, e.stale_after_ms
            ),
        });
    }
    Ok(())
}

fn compile_workers(
    items: Vec<RawWorker>,
    busy: &BusyThresholds,
) -> Result<(Vec<WorkerConfig>, Vec<Slot>), ConfigError> {
    if items.is_empty() {
        return Err(ConfigError::Invalid {
            field: "workers".to_string(),
            detail: "at least one worker is required".to_string(),
        });
    }
    let max_slots = u32::from(u16::MAX);
    let total: u64 = items.iter().map(|w| u64::from(w.dp_size)).sum();
    let too_many = || ConfigError::TooManySlots {
        total,
        max: max_slots,
    };
    if total > u64::from(max_slots) {
        return Err(too_many());
    }

    let mut workers: Vec<WorkerConfig> = Vec::with_capacity(items.len());
    let mut slots: Vec<Slot> = Vec::new();
    for (i, w) in items.into_iter().enumerate() {
        let path = |key: &str| format!("workers[{i}].{key}");
        let id =
            w.id.ok_or_else(|| ConfigError::Missing { field: path("id") })?;
        if workers.iter().any(|earlier| earlier.id == id) {
            return Err(ConfigError::DuplicateWorkerId {
                field: path("id"),
                id,
            });
        }
        let address_text = w.address.ok_or_else(|| ConfigError::Missing {
            field: path("address"),
        })?;
        let addr = address(path("address"), &address_text)?;
        let events_addr = match w.events_address {
            None => addr,
            Some(s) => address(path("events_address"), &s)?,
        };
        u64_in(&path("dp_size"), u64::from(w.dp_size), 1, u64::MAX, ">= 1")?;
        if w.dp_start.checked_add(w.dp_size).is_none() {
            return Err(ConfigError::OutOfRange {
                field: path("dp_start"),
                expected: "such that dp_start + dp_size fits in 32 bits",
                got: w.dp_start.to_string(),
            });
        }
        for (t, taint) in w.taints.iter().enumerate() {
            non_empty(&path(&format!("taints[{t}]")), taint)?;
        }
        if let Some(v) = w.kv_capacity_blocks {
            u64_in(
                &path("kv_capacity_blocks"),
                u64::from(v),
                1,
                u64::MAX,
                "> 0",
            )?;
        }
        if let Some(v) = w.max_num_batched_tokens {
            u64_in(
                &path("max_num_batched_tokens"),
                u64::from(v),
                1,
                u64::MAX,
                "> 0",
            )?;
        }
        if busy.decode_blocks_fraction.is_some() && w.kv_capacity_blocks.is_none() {
            return Err(ConfigError::MissingCapacity {
                field: path("kv_capacity_blocks"),
                required_by: "busy.decode_blocks_fraction",
            });
        }
        if busy.prefill_tokens_fraction.is_some() && w.max_num_batched_tokens.is_none() {
            return Err(ConfigError::MissingCapacity {
                field: path("max_num_batched_tokens"),
                required_by: "busy.prefill_tokens_fraction",
            });
        }
        for (m, model) in w.models.iter().enumerate() {
            non_empty(&path(&format!("models[{m}]")), model)?;
        }
        if let Some(poly) = &w.prefill_time_ms_poly {
            timing_poly(&path("prefill_time_ms_poly"), poly)?;
        }
        if let Some(poly) = &w.decode_step_ms_poly {
            timing_poly(&path("decode_step_ms_poly"), poly)?;
        }

        // total <= u16::MAX was checked above, so these conversions cannot fail; map to the
        // same error anyway rather than panic.
        let first_slot = SlotIdx::try_from(slots.len()).map_err(|_| too_many())?;
        let worker = u16::try_from(i).map_err(|_| too_many())?;
        slots.extend((0..w.dp_size).map(|r| Slot {
            worker,
            dp_rank: w.dp_start + r,
        }));
        workers.push(WorkerConfig {
            id,
            address: addr,
            address_text: addr.to_string(),
            events_address: events_addr,
            events_address_text: events_addr.to_string(),
            dp_start: w.dp_start,
            dp_size: w.dp_size,
            device: w.device,
            taints: w.taints,
            kv_capacity_blocks: w.kv_capacity_blocks,
            max_num_batched_tokens: w.max_num_batched_tokens,
            models: w.models,
            kv_mode: w.kv_mode,
            prefill_time_ms_poly: w.prefill_time_ms_poly,
            decode_step_ms_poly: w.decode_step_ms_poly,
            first_slot,
            routable: true,
        });
    }
    Ok((workers, slots))
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
