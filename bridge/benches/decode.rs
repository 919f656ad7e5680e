//! Decode rate of engine batches on one core, and the full path (decode + mirror + page JSON).
//! Prints figures, asserts nothing: `cargo bench -p kv-event-bridge`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kv_event_bridge::core::{Core, CoreLimits};
use kv_router_protocol::vllm::{decode_batch, EngineEvent};

const BS: u64 = 32;

fn fixtures() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm");
    (0..18)
        .map(|i| std::fs::read(dir.join(format!("{i:04}.msgpack"))).unwrap())
        .collect()
}

/// A vLLM 0.32-shaped batch (tagged maps, every field vLLM sends): `removed` single-hash
/// BlockRemoved events (an eviction step) then one BlockStored of `blocks` blocks with
/// realistic token ids (a 150k vocabulary: mostly uint32 and uint16 encodings).
fn vllm_batch(seed: u64, blocks: u64, removed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let w = &mut out;
    rmp::encode::write_array_len(w, 3).unwrap();
    rmp::encode::write_f64(w, 1_796_056_360.39).unwrap();
    rmp::encode::write_array_len(w, (removed + 1) as u32).unwrap();
    let hash = |i: u64| {
        (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_mul(0xff51_afd7_ed55_8ccd))
            | (1 << 63)
    };
    for r in 0..removed {
        rmp::encode::write_map_len(w, 4).unwrap();
        rmp::encode::write_str(w, "type").unwrap();
        rmp::encode::write_str(w, "BlockRemoved").unwrap();
        rmp::encode::write_str(w, "block_hashes").unwrap();
        rmp::encode::write_array_len(w, 1).unwrap();
        rmp::encode::write_uint(w, hash(1000 + r)).unwrap();
        rmp::encode::write_str(w, "medium").unwrap();
        rmp::encode::write_str(w, "GPU").unwrap();
        rmp::encode::write_str(w, "group_idx").unwrap();
        rmp::encode::write_uint(w, 0).unwrap();
    }
    rmp::encode::write_map_len(w, 11).unwrap();
    rmp::encode::write_str(w, "type").unwrap();
    rmp::encode::write_str(w, "BlockStored").unwrap();
    rmp::encode::write_str(w, "block_hashes").unwrap();
    rmp::encode::write_array_len(w, blocks as u32).unwrap();
    for b in 0..blocks {
        rmp::encode::write_uint(w, hash(b)).unwrap();
    }
    rmp::encode::write_str(w, "parent_block_hash").unwrap();
    rmp::encode::write_nil(w).unwrap();
    rmp::encode::write_str(w, "token_ids").unwrap();
    rmp::encode::write_array_len(w, (blocks * BS) as u32).unwrap();
    for t in 0..blocks * BS {
        rmp::encode::write_uint(w, (seed * 7919 + t * 104_729) % 151_000).unwrap();
    }
    rmp::encode::write_str(w, "block_size").unwrap();
    rmp::encode::write_uint(w, BS).unwrap();
    rmp::encode::write_str(w, "lora_id").unwrap();
    rmp::encode::write_nil(w).unwrap();
    rmp::encode::write_str(w, "medium").unwrap();
    rmp::encode::write_str(w, "GPU").unwrap();
    rmp::encode::write_str(w, "lora_name").unwrap();
    rmp::encode::write_nil(w).unwrap();
    rmp::encode::write_str(w, "extra_keys").unwrap();
    rmp::encode::write_array_len(w, blocks as u32).unwrap();
    for _ in 0..blocks {
        rmp::encode::write_nil(w).unwrap();
    }
    rmp::encode::write_str(w, "group_idx").unwrap();
    rmp::encode::write_uint(w, 0).unwrap();
    rmp::encode::write_str(w, "kv_cache_spec_kind").unwrap();
    rmp::encode::write_str(w, "full_attention").unwrap();
    rmp::encode::write_uint(w, 0).unwrap();
    out
}

struct Counts {
    events: u64,
    blocks: u64,
    bytes: u64,
}

fn counts(batches: &[Vec<u8>]) -> Counts {
    let mut c = Counts {
        events: 0,
        blocks: 0,
        bytes: 0,
    };
    for b in batches {
        c.bytes += b.len() as u64;
        for e in decode_batch(b, usize::MAX).unwrap().events {
            c.events += 1;
            c.blocks += match e {
                EngineEvent::Stored(s) => s.block_hashes.len() as u64,
                EngineEvent::Removed { block_hashes, .. } => block_hashes.len() as u64,
                EngineEvent::AllCleared => 0,
            };
        }
    }
    c
}

/// Runs `f` over `batches` repeatedly for about `budget`; returns rounds per second.
fn rate(budget: Duration, batches: &[Vec<u8>], mut f: impl FnMut(&[u8])) -> f64 {
    for b in batches {
        f(b); // warm-up
    }
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < budget {
        for b in batches {
            f(b);
        }
        rounds += 1;
    }
    rounds as f64 / start.elapsed().as_secs_f64()
}

fn report(name: &str, batches: &[Vec<u8>], rounds_per_s: f64) {
    let c = counts(batches);
    let n = batches.len() as f64;
    println!(
        "{name:<44} {:>10.0} batches/s {:>11.0} events/s {:>11.0} blocks/s {:>7.1} MB/s",
        rounds_per_s * n,
        rounds_per_s * c.events as f64,
        rounds_per_s * c.blocks as f64,
        rounds_per_s * c.bytes as f64 / 1e6,
    );
}

fn main() {
    let budget = Duration::from_millis(
        std::env::var("BENCH_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1500),
    );
    println!("kv-event-bridge decode benchmark (one core, {budget:?} per case)");
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("real vLLM 0.32 fixtures (18 batches)", fixtures()),
        (
            "prefill: 1 BlockStored x 16 blocks (512 tok)",
            (0..64).map(|s| vllm_batch(s, 16, 0)).collect(),
        ),
        (
            "eviction step: 8 BlockRemoved + 1x4 blocks",
            (0..64).map(|s| vllm_batch(s, 4, 8)).collect(),
        ),
        (
            "long prompt: 1 BlockStored x 256 blocks (8k tok)",
            (0..8).map(|s| vllm_batch(s, 256, 0)).collect(),
        ),
    ];
    println!("-- decode only (wire::decode_batch)");
    for (name, batches) in &cases {
        let r = rate(budget, batches, |b| {
            black_box(decode_batch(black_box(b), usize::MAX).unwrap());
        });
        report(name, batches, r);
    }
    println!("-- decode + mirror + page JSON (what each batch costs the bridge)");
    for (name, batches) in &cases {
        let limits = CoreLimits {
            block_size: BS as u32,
            first_event_id: 1,
            max_blocks: 1 << 20,
            max_events: 65536,
            max_ring_bytes: 64 << 20,
        };
        let mut core = Core::new(limits);
        let mut applied = 0u64;
        let r = rate(budget, batches, |b| {
            let batch = decode_batch(b, usize::MAX).unwrap();
            // Fresh ranks now and then keep the mirror from only refcounting repeats.
            applied += 1;
            if applied % 4096 == 0 {
                core = Core::new(limits);
            }
            black_box(core.apply(0, 0, &batch.events));
        });
        report(name, batches, r);
    }
}
