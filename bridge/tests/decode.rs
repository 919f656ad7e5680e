//! The decoder against the 18 real vLLM 0.32 payloads and hand-built variants of every shape
//! the engines use.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kv_router_protocol::vllm::{
    decode_batch, split_frames, DecodeError, EngineBatch, EngineEvent, StoredBlocks,
};

const MAX: usize = 1 << 20;

fn decode(payload: &[u8]) -> EngineBatch {
    decode_batch(payload, MAX).unwrap()
}

fn only_stored(batch: &EngineBatch) -> &StoredBlocks {
    match batch.events.as_slice() {
        [EngineEvent::Stored(s)] => s,
        other => panic!("expected one BlockStored, got {other:?}"),
    }
}

// --- the real payloads (facts from DECODED.txt, the capturing run's Python decode) ----------

#[test]
fn fixture_0_three_blocks_no_parent() {
    let batch = decode(&fixtures()[0]);
    assert_eq!(batch.dp_rank, Some(0));
    assert!((batch.ts.unwrap() - 1_796_056_360.392_881_9).abs() < 1e-6);
    let s = only_stored(&batch);
    assert_eq!(
        s.block_hashes,
        vec![995114372539195884, 2422810939045071523, 6990447958680583254]
    );
    assert_eq!(s.parent, None);
    assert_eq!(s.token_ids.len(), 96);
    assert_eq!(&s.token_ids[..6], &[4, 11, 18, 25, 32, 39]);
    assert_eq!(&s.token_ids[90..], &[134, 141, 148, 155, 162, 169]);
    assert_eq!(
        (
            s.block_size,
            s.medium.as_deref(),
            s.lora_id,
            s.lora_name.as_deref()
        ),
        (Some(32), Some("GPU"), None, None)
    );
    assert!(batch.skipped.is_empty());
}

#[test]
fn fixture_1_child_of_the_shared_prefix() {
    let s = decode(&fixtures()[1]).events.remove(0);
    let EngineEvent::Stored(s) = s else { panic!() };
    assert_eq!(s.block_hashes, vec![6101281949773030706]);
    assert_eq!(s.parent, Some(6990447958680583254));
    assert_eq!(s.token_ids, (200..232).collect::<Vec<u32>>());
}

#[test]
fn fixtures_2_3_hash_above_i64_max_and_decode_filled_block() {
    let f = fixtures();
    let b2 = decode(&f[2]);
    let s2 = only_stored(&b2);
    assert_eq!(s2.block_hashes, vec![9431514961889662686]); // > i64::MAX
    assert_eq!(s2.parent, None);
    let mut want: Vec<u32> = (300..330).collect();
    want.extend([50, 476]);
    assert_eq!(s2.token_ids, want);
    let b3 = decode(&f[3]);
    let s3 = only_stored(&b3);
    assert_eq!(s3.block_hashes, vec![5803683306084988961]);
    assert_eq!(s3.parent, Some(9431514961889662686));
    assert_eq!(&s3.token_ids[..4], &[203, 393, 172, 383]);
    assert_eq!(s3.token_ids.len(), 32);
}

#[test]
fn fixtures_9_to_16_eviction_removes_before_stores() {
    let f = fixtures();
    let (mut stored, mut removed) = (0, 0);
    for payload in &f[9..17] {
        let batch = decode(payload);
        assert!(batch.skipped.is_empty());
        let first_stored = batch
            .events
            .iter()
            .position(|e| matches!(e, EngineEvent::Stored(_)));
        let last_removed = batch
            .events
            .iter()
            .rposition(|e| matches!(e, EngineEvent::Removed { .. }));
        if let (Some(s), Some(r)) = (first_stored, last_removed) {
            assert!(r < s, "removals come before the step's stores");
        }
        for e in &batch.events {
            match e {
                EngineEvent::Stored(_) => stored += 1,
                EngineEvent::Removed {
                    block_hashes,
                    medium,
                } => {
                    assert_eq!(block_hashes.len(), 1);
                    assert_eq!(medium.as_deref(), Some("GPU"));
                    removed += 1;
                }
                EngineEvent::AllCleared => panic!("no clear in the eviction phase"),
            }
        }
    }
    assert_eq!((stored, removed), (8, 47));
    let first = decode(&f[9]);
    let hashes: Vec<u64> = first.events[..3]
        .iter()
        .map(|e| match e {
            EngineEvent::Removed { block_hashes, .. } => block_hashes[0],
            _ => panic!(),
        })
        .collect();
    assert_eq!(
        hashes,
        vec![
            6101281949773030706,
            6990447958680583254,
            2422810939045071523
        ]
    );
}

#[test]
fn fixture_17_cleared_then_stored() {
    let batch = decode(&fixtures()[17]);
    assert_eq!(batch.events.len(), 2);
    assert_eq!(batch.events[0], EngineEvent::AllCleared);
    let EngineEvent::Stored(s) = &batch.events[1] else {
        panic!()
    };
    assert_eq!(s.block_hashes, vec![1267335617115042266]);
    assert_eq!(s.token_ids, (400..432).collect::<Vec<u32>>());
}

#[test]
fn every_fixture_decodes_with_full_blocks() {
    for (i, payload) in fixtures().iter().enumerate() {
        let batch = decode(payload);
        assert!(batch.skipped.is_empty(), "fixture {i}: {:?}", batch.skipped);
        assert_eq!(batch.dp_rank, Some(0));
        assert!(!batch.events.is_empty(), "fixture {i}");
        for e in &batch.events {
            if let EngineEvent::Stored(s) = e {
                assert_eq!(s.token_ids.len(), s.block_hashes.len() * 32, "fixture {i}");
                assert_eq!(s.block_size, Some(32));
            }
        }
    }
}

// --- frames ---------------------------------------------------------------------------------

#[test]
fn frames_are_topic_seq_payload() {
    let seq = 0x0102u64.to_be_bytes();
    let f = split_frames(&[b"kv", &seq, b"P"]).unwrap();
    assert_eq!((f.topic, f.seq, f.payload), (&b"kv"[..], 0x0102, &b"P"[..]));
    assert_eq!(
        split_frames(&[b"kv", &seq]),
        Err(DecodeError::FrameCount { got: 2 })
    );
    assert_eq!(
        split_frames(&[b"kv", b"\x01", b"P"]),
        Err(DecodeError::SeqFrame { len: 1 })
    );
}

// --- batch shapes ---------------------------------------------------------------------------

#[test]
fn array_batch_with_and_without_dp_rank() {
    let with = batch(1, Some(3), cleared_map);
    assert_eq!(decode(&with).dp_rank, Some(3));
    let nil = batch(1, None, cleared_map);
    assert_eq!(decode(&nil).dp_rank, None);
    // [ts, events] (SGLang's EventBatch has no rank)
    let mut mp = Mp::new();
    mp.array(2).f64(1.0).array(1);
    cleared_map(&mut mp);
    let b = decode(&mp.take());
    assert_eq!(
        (b.dp_rank, b.events.clone()),
        (None, vec![EngineEvent::AllCleared])
    );
}

#[test]
fn map_batch() {
    let mut mp = Mp::new();
    mp.map(4).str("ts").f64(2.5).str("events").array(2);
    removed_map(&mut mp, &[7], "CPU");
    cleared_map(&mut mp);
    mp.str("data_parallel_rank").uint(2, Width::Smallest);
    mp.str("future_field").array(0);
    let b = decode(&mp.take());
    assert_eq!(b.ts, Some(2.5));
    assert_eq!(b.dp_rank, Some(2));
    assert_eq!(
        b.events,
        vec![
            EngineEvent::Removed {
                block_hashes: vec![7],
                medium: Some("CPU".into())
            },
            EngineEvent::AllCleared
        ]
    );
}

// --- positional (array_like) events: older vLLM and SGLang -----------------------------------

#[test]
fn positional_events_of_older_vllm() {
    let mut mp = Mp::new();
    mp.array(3).f64(1.0).array(3);
    // ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name]
    mp.array(8)
        .str("BlockStored")
        .array(1)
        .uint(10, Width::Smallest)
        .uint(9, Width::Smallest);
    mp.array(2)
        .uint(1, Width::Smallest)
        .uint(2, Width::Smallest);
    mp.uint(2, Width::Smallest).nil().str("CPU").str("adapter");
    // ["BlockRemoved", hashes, medium]
    mp.array(3)
        .str("BlockRemoved")
        .array(1)
        .uint(10, Width::Smallest)
        .str("CPU");
    mp.array(1).str("AllBlocksCleared");
    mp.uint(0, Width::Smallest);
    let b = decode(&mp.take());
    assert_eq!(
        b.events,
        vec![
            EngineEvent::Stored(StoredBlocks {
                block_hashes: vec![10],
                parent: Some(9),
                token_ids: vec![1, 2],
                block_size: Some(2),
                lora_id: None,
                lora_name: Some("adapter".into()),
                medium: Some("CPU".into()),
            }),
            EngineEvent::Removed {
                block_hashes: vec![10],
                medium: Some("CPU".into())
            },
            EngineEvent::AllCleared,
        ]
    );
}

#[test]
fn sglang_page_per_event_signed_hashes() {
    // SGLang: one BlockStored per page, hashes are Python hash() values (signed i64), no medium,
    // trailing defaults omitted, batch [ts, events].
    let pages: [(i64, Option<i64>, [u32; 2]); 3] = [
        (-5, None, [1, 2]),
        (-9_000_000_000_000_000_000, Some(-5), [3, 4]),
        (42, Some(-9_000_000_000_000_000_000), [5, 6]),
    ];
    let mut mp = Mp::new();
    mp.array(2).f64(1.0).array(4);
    for (hash, parent, tokens) in pages {
        mp.array(6).str("BlockStored").array(1).sint(hash);
        match parent {
            Some(p) => mp.sint(p),
            None => mp.nil(),
        };
        mp.array(2)
            .uint(u64::from(tokens[0]), Width::Smallest)
            .uint(u64::from(tokens[1]), Width::Smallest);
        mp.uint(2, Width::Smallest).nil();
    }
    mp.array(2).str("BlockRemoved").array(1).sint(-5);
    let b = decode(&mp.take());
    let as_u = |v: i64| v as u64;
    let EngineEvent::Stored(first) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        (
            first.block_hashes.clone(),
            first.parent,
            first.medium.clone()
        ),
        (vec![as_u(-5)], None, None)
    );
    let EngineEvent::Stored(second) = &b.events[1] else {
        panic!()
    };
    assert_eq!(second.block_hashes, vec![as_u(-9_000_000_000_000_000_000)]);
    assert_eq!(second.parent, Some(as_u(-5)));
    let EngineEvent::Stored(third) = &b.events[2] else {
        panic!()
    };
    assert_eq!(
        (third.block_hashes.clone(), third.parent),
        (vec![42], Some(as_u(-9_000_000_000_000_000_000)))
    );
    assert_eq!(
        b.events[3],
        EngineEvent::Removed {
            block_hashes: vec![as_u(-5)],
            medium: None
        }
    );
}

// --- integers, hashes ------------------------------------------------------------------------

#[test]
fn every_int_width_for_hashes_and_tokens() {
    let widths = [
        Width::Smallest,
        Width::U8,
        Width::U16,
        Width::U32,
        Width::U64,
        Width::I8,
        Width::I16,
        Width::I32,
        Width::I64,
    ];
    for w in widths {
        let mut mp = Mp::new();
        mp.array(3).f64(1.0).array(1);
        mp.map(5).str("type").str("BlockStored");
        mp.str("block_hashes").array(2).uint(100, w).uint(101, w);
        mp.str("parent_block_hash").uint(99, w);
        mp.str("token_ids").array(4);
        for t in [0u64, 1, 126, 127] {
            mp.uint(t, w);
        }
        mp.str("block_size").uint(2, w);
        mp.uint(0, w);
        let b = decode(&mp.take());
        let s = only_stored(&b);
        assert_eq!(
            (s.block_hashes.clone(), s.parent, s.token_ids.clone()),
            (vec![100, 101], Some(99), vec![0, 1, 126, 127]),
            "{w:?}"
        );
        assert_eq!(b.dp_rank, Some(0));
    }
    // Wide values need wide encodings: token ids up to u32::MAX, hashes up to u64::MAX.
    let mut mp = Mp::new();
    mp.array(2).f64(1.0).array(1);
    mp.map(4)
        .str("type")
        .str("BlockStored")
        .str("block_hashes")
        .array(3);
    mp.uint(u64::MAX, Width::U64)
        .uint(u64::from(u32::MAX) + 1, Width::U64)
        .uint(70000, Width::U32);
    mp.str("token_ids")
        .array(3)
        .uint(65535, Width::U16)
        .uint(65536, Width::U32)
        .uint(u64::from(u32::MAX), Width::U32);
    mp.str("parent_block_hash").uint(1u64 << 63, Width::U64);
    let b = decode(&mp.take());
    let s = only_stored(&b);
    assert_eq!(s.block_hashes, vec![u64::MAX, 1 << 32, 70000]);
    assert_eq!(s.token_ids, vec![65535, 65536, u32::MAX]);
    assert_eq!(s.parent, Some(1 << 63));
}

#[test]
fn negative_hashes_are_reinterpreted() {
    let mut mp = Mp::new();
    mp.array(2).f64(1.0).array(1);
    mp.map(3)
        .str("type")
        .str("BlockRemoved")
        .str("block_hashes")
        .array(4);
    mp.sint(-1).sint(-128).sint(-40000).sint(i64::MIN);
    mp.str("medium").str("GPU");
    let b = decode(&mp.take());
    assert_eq!(
        b.events,
        vec![EngineEvent::Removed {
            block_hashes: vec![u64::MAX, (-128i64) as u64, (-40000i64) as u64, 1 << 63],
            medium: Some("GPU".into())
        }]
    );
}

#[test]
fn bin_hashes_fold_to_their_first_eight_bytes() {
    let digest = |seed: u8| -> Vec<u8> {
        (0..32)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i))
            .collect()
    };
    let (a, b) = (digest(1), digest(2));
    let fold = |d: &[u8]| u64::from_be_bytes(d[..8].try_into().unwrap());
    let mut mp = Mp::new();
    mp.array(3).f64(1.0).array(2);
    mp.map(4)
        .str("type")
        .str("BlockStored")
        .str("block_hashes")
        .array(1)
        .bin(&b);
    mp.str("parent_block_hash")
        .bin(&a)
        .str("token_ids")
        .array(1)
        .uint(5, Width::Smallest);
    mp.map(2)
        .str("type")
        .str("BlockRemoved")
        .str("block_hashes")
        .array(1)
        .bin(&b);
    mp.nil();
    let batch = decode(&mp.take());
    let s = match &batch.events[0] {
        EngineEvent::Stored(s) => s,
        e => panic!("{e:?}"),
    };
    assert_eq!(
        (s.block_hashes.clone(), s.parent),
        (vec![fold(&b)], Some(fold(&a)))
    );
    // The same fold for removals, so they find the stored block.
    assert_eq!(
        batch.events[1],
        EngineEvent::Removed {
            block_hashes: vec![fold(&b)],
            medium: None
        }
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let mut mp = Mp::new();
    mp.array(4).f64(1.0).array(1);
    mp.map(9).str("type").str("BlockStored");
    mp.str("block_hashes").array(1).uint(1, Width::Smallest);
    mp.str("kv_cache_spec_sliding_window")
        .uint(4096, Width::Smallest);
    mp.str("token_ids").array(1).uint(3, Width::Smallest);
    mp.str("extra_keys").array(1).nil();
    mp.str("locality").map(1).str("node").str("a");
    mp.str("group_idx").uint(0, Width::Smallest);
    mp.str("session_id").bin(b"\x00\x01");
    mp.str("medium").str("DISK");
    mp.uint(0, Width::Smallest).str("a fourth batch item");
    let b = decode(&mp.take());
    let s = only_stored(&b);
    assert_eq!(
        (
            s.block_hashes.clone(),
            s.token_ids.clone(),
            s.medium.as_deref()
        ),
        (vec![1], vec![3], Some("DISK"))
    );
}

#[test]
fn bad_events_are_skipped_and_bad_batches_refused() {
    let mut mp = Mp::new();
    mp.array(3).f64(1.0).array(5);
    mp.map(1).str("type").str("BlockUpdated");
    mp.map(2)
        .str("type")
        .str("BlockStored")
        .str("token_ids")
        .array(0); // no block_hashes
    mp.map(3)
        .str("type")
        .str("BlockStored")
        .str("block_hashes")
        .array(1)
        .uint(1, Width::Smallest);
    mp.str("token_ids").array(1).sint(-3); // negative token id
    mp.uint(7, Width::Smallest); // neither map nor array
    cleared_map(&mut mp);
    mp.uint(0, Width::Smallest);
    let b = decode(&mp.take());
    assert_eq!(b.events, vec![EngineEvent::AllCleared]);
    let labels: Vec<_> = b.skipped.iter().map(DecodeError::label).collect();
    assert_eq!(
        labels,
        vec![
            "unknown_event_type",
            "event_field",
            "event_field",
            "event_shape"
        ]
    );

    for (bytes, label) in [
        (vec![0xd9u8], "msgpack"),                 // str8 without its length
        (vec![0x93, 0xcb], "msgpack"),             // truncated
        (vec![0x2a], "batch_shape"),               // a bare int
        (vec![0x91, 0xc0], "batch_shape"),         // [nil]
        (vec![0x92, 0xc0, 0x05], "batch_shape"),   // events not an array
        (vec![0x92, 0xc0, 0x90, 0x00], "msgpack"), // trailing bytes
        (vec![0x93, 0xc0, 0x90, 0xa1, b'x'], "batch_shape"), // dp_rank a string
    ] {
        assert_eq!(
            decode_batch(&bytes, MAX).unwrap_err().label(),
            label,
            "{bytes:x?}"
        );
    }
    // A huge declared length with no data behind it allocates nothing and fails.
    assert_eq!(
        decode_batch(
            &[0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff],
            MAX
        )
        .unwrap_err()
        .label(),
        "msgpack"
    );
    assert_eq!(
        decode_batch(&[0u8; 100], 10).unwrap_err().label(),
        "payload_too_large"
    );
    // Deep nesting is bounded.
    let deep = vec![0x91u8; 100_000];
    assert_eq!(decode_batch(&deep, MAX).unwrap_err().label(), "msgpack");
}

#[test]
fn every_fixture_matches_an_independent_decode() {
    // EXPECTED.json: the fixtures decoded by msgspec, vLLM's own msgpack library
    // (tests/data/vllm/make_expected.py).
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("EXPECTED.json")).unwrap(),
    )
    .unwrap();
    let fixtures = fixtures();
    let mut checked_events = 0;
    for want in expected.as_array().unwrap() {
        let seq = want["seq"].as_u64().unwrap() as usize;
        let batch = decode(&fixtures[seq]);
        assert_eq!(
            batch.dp_rank,
            want["dp_rank"].as_u64().map(|r| r as u32),
            "seq {seq}"
        );
        assert!(
            (batch.ts.unwrap() - want["ts"].as_f64().unwrap()).abs() < 1e-6,
            "seq {seq}"
        );
        let want_events = want["events"].as_array().unwrap();
        assert_eq!(batch.events.len(), want_events.len(), "seq {seq}");
        for (got, w) in batch.events.iter().zip(want_events) {
            let hashes = |v: &serde_json::Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect()
            };
            match (got, w["type"].as_str().unwrap()) {
                (EngineEvent::Stored(s), "BlockStored") => {
                    assert_eq!(s.block_hashes, hashes(&w["block_hashes"]), "seq {seq}");
                    assert_eq!(s.parent, w["parent_block_hash"].as_u64(), "seq {seq}");
                    let tokens: Vec<u32> = w["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect();
                    assert_eq!(s.token_ids, tokens, "seq {seq}");
                    assert_eq!(s.block_size, w["block_size"].as_u64());
                    assert_eq!(s.medium.as_deref(), w["medium"].as_str());
                    assert_eq!(s.lora_name.as_deref(), w["lora_name"].as_str());
                }
                (
                    EngineEvent::Removed {
                        block_hashes,
                        medium,
                    },
                    "BlockRemoved",
                ) => {
                    assert_eq!(*block_hashes, hashes(&w["block_hashes"]), "seq {seq}");
                    assert_eq!(medium.as_deref(), w["medium"].as_str());
                }
                (EngineEvent::AllCleared, "AllBlocksCleared") => {}
                (got, want) => panic!("seq {seq}: decoded {got:?}, msgspec says {want}"),
            }
            checked_events += 1;
        }
    }
    assert_eq!(checked_events, 18 - 8 + 8 + 47 + 1); // 10 single-store batches, 8+47 eviction, 1 clear
}
