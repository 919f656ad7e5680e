//! The fuzz targets' properties (fuzz/fuzz_targets/) replayed in the normal test suite over the
//! seed corpora (fuzz/seeds/<target>/) and every input a fuzzer ever failed on
//! (fuzz/regressions/<target>/), so a regression shows up in `cargo test` without cargo-fuzz.
//! The bridge's msgpack decoder has the same in bridge/tests/fuzz_regressions.rs.

// Test code: a failed expectation is the assertion.
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use envoy_kv_router::config::Config;
use envoy_kv_router::events::{
    decode_log_batch, encode_log_batch, parse_dump, parse_event_page, CodecError, LogRecord,
};
use envoy_kv_router::index::KvIndex;
use envoy_kv_router::load::{LoadDecodeError, LoadTable};
use envoy_kv_router::replication::head_codec::{decode_head, encode_head};
use envoy_kv_router::replication::log::LogHead;
use envoy_kv_router::request::{parse_request, Endpoint};
use std::path::Path;

/// Every input of `target`: its seeds and its regressions (file name, bytes).
fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut out = Vec::new();
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for entry in entries.flatten() {
            let bytes = std::fs::read(entry.path()).unwrap();
            out.push((
                format!("{dir}/{target}/{}", entry.file_name().to_string_lossy()),
                bytes,
            ));
        }
    }
    assert!(!out.is_empty(), "no seeds for {target}");
    out
}

#[test]
fn request_bodies_parse_without_panicking() {
    let mut rejected = Vec::new();
    for (name, data) in inputs("request") {
        let (&sel, body) = data.split_first().unwrap();
        let endpoint = if sel & 1 == 0 {
            Endpoint::Completions
        } else {
            Endpoint::ChatCompletions
        };
        if let Err(e) = parse_request(body, endpoint) {
            assert!(!e.to_string().is_empty());
            rejected.push(name);
        }
    }
    // The batched-prompt seed is the one meant to be rejected.
    assert_eq!(rejected, ["seeds/request/batched"]);
}

#[test]
fn event_pages_survive_the_shared_log_codec() {
    let mut pages = 0;
    for (name, data) in inputs("event_page") {
        for parsed in [
            parse_event_page(&data, 64, 1 << 20),
            parse_dump(&data, 64, 1 << 20),
        ] {
            let Ok(page) = parsed else { continue };
            pages += 1;
            let records = vec![LogRecord::Resync {
                worker: 3,
                last_event_id: page.last_event_id,
                events: page.events,
            }];
            let bytes = encode_log_batch(&records);
            assert_eq!(decode_log_batch(&bytes), Ok(records), "{name}");
        }
    }
    assert!(pages >= 3, "only {pages} seed pages parsed");
}

#[test]
fn log_batches_decode_to_what_reencodes_identically() {
    for (name, data) in inputs("log_batch") {
        if let Ok(records) = decode_log_batch(&data) {
            assert_eq!(encode_log_batch(&records), data, "{name}");
        }
    }
}

#[test]
fn a_log_batch_declaring_four_billion_records_is_an_error_not_an_allocation() {
    let mut bytes = b"EKL\x01".to_vec();
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(
        matches!(
            decode_log_batch(&bytes),
            Err(CodecError::CountTooLarge { .. })
        ),
        "{:?}",
        decode_log_batch(&bytes)
    );
}

#[test]
fn index_snapshots_round_trip() {
    for (name, data) in inputs("index_snapshot") {
        let (&sel, bytes) = data.split_first().unwrap();
        let num_slots = usize::from(sel & 7) + 1;
        let max_blocks = if sel & 8 == 0 { 1 << 16 } else { 3 };
        if let Ok(index) = KvIndex::decode_snapshot(bytes, num_slots, max_blocks) {
            let once = index.encode_snapshot();
            let again =
                KvIndex::decode_snapshot(&once, num_slots, max_blocks).map(|i| i.encode_snapshot());
            assert_eq!(again.as_ref(), Ok(&once), "{name}");
        }
    }
}

#[test]
fn a_snapshot_declaring_four_billion_blocks_is_an_error_not_an_allocation() {
    // Version 2: magic and version, slot count, then the slot's block count.
    let mut bytes = b"EKS\x02".to_vec();
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        KvIndex::decode_snapshot(&bytes, 1, 1 << 16),
        Err(envoy_kv_router::events::CodecError::CountTooLarge { .. })
    ));
}

#[test]
fn load_tables_round_trip() {
    for (name, data) in inputs("load_table") {
        let (&sel, bytes) = data.split_first().unwrap();
        let num_slots = usize::from(sel & 7) + 1;
        let (table, _) = LoadTable::decode_or_fresh(bytes, num_slots);
        assert_eq!(
            LoadTable::decode(&table.encode(), num_slots),
            Ok(table),
            "{name}"
        );
    }
}

/// The seed corpus holds a table of the current wire version with bookings in it (two queued on
/// slot 0, one past its first token), so the fuzzer mutates a live table, not only the old
/// versions' refusals.
#[test]
fn the_current_version_load_table_seed_decodes_with_its_bookings() {
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/load_table/two_slots_v3"),
    )
    .unwrap();
    let table = LoadTable::decode(&data[1..], 2).unwrap();
    assert_eq!(table.active_requests(20), 3);
    let view = table.view(20);
    assert_eq!((view[0].active_requests, view[1].active_requests), (2, 1));
    assert_eq!(
        view[0].prefill_tokens, 500.0,
        "the first booking left prefill"
    );
}

/// Found by the load_table fuzzer against the per-request table (version 1): such tables are
/// refused now (the fixed-size version 2 replaced them) and the caller starts fresh.
#[test]
fn a_version_1_load_table_is_refused_and_replaced_by_a_fresh_one() {
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/load_table/zero_anchor"),
    )
    .unwrap();
    let bytes = &data[1..];
    assert_eq!(
        LoadTable::decode(bytes, 2),
        Err(LoadDecodeError::UnsupportedVersion { found: 1 })
    );
    let (fresh, err) = LoadTable::decode_or_fresh(bytes, 2);
    assert_eq!(fresh, LoadTable::new(2));
    assert!(err.is_some());
}

#[test]
fn a_load_table_declaring_four_billion_slots_is_refused_before_allocating() {
    let mut bytes = b"EKLT\x03".to_vec();
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes()); // bucket width
    bytes.extend_from_slice(&[0u8; 40]); // reaped total, ring epochs
    assert!(matches!(
        LoadTable::decode(&bytes, u32::MAX as usize),
        Err(LoadDecodeError::Truncated { .. })
    ));
}

#[test]
fn log_heads_round_trip() {
    for (name, data) in inputs("log_head") {
        // Seeds come in both layouts: the binary one in shared data, and JSON for readability.
        if let Some(head) = decode_head(&data) {
            assert_eq!(
                decode_head(&encode_head(&head)),
                Some(head),
                "{name}: binary"
            );
            continue;
        }
        let head: LogHead = serde_json::from_slice(&data)
            .unwrap_or_else(|e| panic!("{name}: neither a binary nor a JSON head: {e}"));
        let back: LogHead = serde_json::from_slice(&serde_json::to_vec(&head).unwrap()).unwrap();
        assert_eq!(back, head, "{name}");
        // The binary layout in shared data keeps every float bit for bit.
        let binary = decode_head(&encode_head(&head));
        assert_eq!(binary.as_ref(), Some(&head), "{name}: binary");
    }
}

#[test]
fn seed_configurations_compile() {
    for (name, data) in inputs("config") {
        let config = Config::from_json(&data).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(config.num_slots() >= 1, "{name}");
    }
}
