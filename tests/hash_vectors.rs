//! Checks our block hashing against vectors computed independently by
//! `scripts/gen_hash_vectors.py` (Python `xxhash`), so a shared misunderstanding between the code
//! and its unit tests cannot pass unnoticed.

// A malformed vector file should fail the test loudly.
#![allow(clippy::expect_used)]

use envoy_kv_router::hashing::{
    hash_seed, local_block_hashes, prompt_sequence_hashes, sequence_hashes,
};
use envoy_kv_router::types::{LocalBlockHash, SequenceHash};
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    vectors: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    tokens: Vec<u32>,
    block_size: u32,
    lora_name: Option<String>,
    seed: String,
    local_hashes: Vec<String>,
    sequence_hashes: Vec<String>,
}

fn parse_u64s(values: &[String]) -> Vec<u64> {
    values
        .iter()
        .map(|v| v.parse::<u64>().expect("vector file holds decimal u64"))
        .collect()
}

#[test]
fn hashes_match_independent_python_vectors() {
    let text = include_str!("data/hash_vectors.json");
    let file: Vectors = serde_json::from_str(text).expect("vector file parses");
    assert!(file.vectors.len() >= 30, "vector file looks truncated");
    let mut checked_blocks = 0usize;
    for v in &file.vectors {
        let label = format!("{} bs={} lora={:?}", v.name, v.block_size, v.lora_name);
        let lora = v.lora_name.as_deref();
        let seed = hash_seed(lora);
        assert_eq!(seed.to_string(), v.seed, "seed for {label}");

        let locals = local_block_hashes(&v.tokens, v.block_size, seed);
        let expected_locals: Vec<LocalBlockHash> = parse_u64s(&v.local_hashes)
            .into_iter()
            .map(LocalBlockHash)
            .collect();
        assert_eq!(locals, expected_locals, "local hashes for {label}");

        let expected_seq: Vec<SequenceHash> = parse_u64s(&v.sequence_hashes)
            .into_iter()
            .map(SequenceHash)
            .collect();
        assert_eq!(
            sequence_hashes(&locals, None),
            expected_seq,
            "chain for {label}"
        );
        assert_eq!(
            prompt_sequence_hashes(&v.tokens, v.block_size, lora),
            expected_seq,
            "request path for {label}"
        );
        checked_blocks += expected_seq.len();
    }
    assert!(
        checked_blocks > 100,
        "too few blocks checked: {checked_blocks}"
    );
}
