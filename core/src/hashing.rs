//! Dynamo-compatible block hashing.
//!
//! A prompt is cut into full blocks of `block_size` tokens (a trailing partial block is never
//! cached by the engine, so it is never hashed). Each block gets a *local* hash: XXH3-64 over its
//! token ids as little-endian u32 bytes, seeded with [`DYNAMO_HASH_SEED`] or a LoRA-salted seed.
//! Local hashes are chained into *sequence* hashes that name a whole prefix:
//! `seq[0] = local[0]`, `seq[i] = XXH3-64(le_u64(seq[i-1]) ++ le_u64(local[i]), seed 1337)`.
//! The chain always uses the unsalted seed; the salt enters through the local hashes.
//!
//! This matches Dynamo's `compute_block_hash_for_seq` / `compute_seq_hash_for_block`
//! (`lib/kv-router/src/protocols.rs`), including its LoRA salt
//! `1337.wrapping_add(XXH3-64(lora_name, seed 0))`, with an empty name meaning "no adapter".

use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_secret_input, xxh3_64_with_seed, SecretInput};

use crate::types::{LocalBlockHash, SequenceHash};

/// Dynamo's XXH3 seed for block and sequence hashes.
pub const DYNAMO_HASH_SEED: u64 = 1337;

/// Bytes per token id in the hashed representation (little-endian u32).
const TOKEN_BYTES: usize = 4;

/// The local-hash seed for a request: Dynamo salts it with the LoRA adapter name so that blocks
/// computed under different adapters (or the base model) never match.
pub fn hash_seed(lora_name: Option<&str>) -> u64 {
    match lora_name.filter(|name| !name.is_empty()) {
        Some(name) => DYNAMO_HASH_SEED.wrapping_add(xxh3_64(name.as_bytes())),
        None => DYNAMO_HASH_SEED,
    }
}

/// Number of full blocks in `token_count` tokens; 0 when `block_size` is 0.
fn full_blocks(token_count: usize, block_size: u32) -> usize {
    match usize::try_from(block_size) {
        Ok(size) if size > 0 => token_count / size,
        _ => 0,
    }
}

/// XXH3's longest input hashed without a secret derived from the seed.
const XXH3_MID_SIZE_MAX: usize = 240;

/// `xxh3_64_with_seed(_, seed)` for many blocks. XXH3 derives a 192-byte secret from the seed
/// for every input over 240 bytes (a block of more than 60 token ids: 64, the usual size, is
/// 256 bytes); here it is derived once per request instead of once per block. For such inputs
/// XXH3 with the derived secret is the same function (`xxh3_64_long_impl` of the input and
/// `custom_default_secret(seed)`); shorter inputs go through `xxh3_64_with_seed` itself.
/// `block_hasher_matches_xxh3_with_seed` checks it on both sides of 240 bytes.
pub(crate) struct BlockHasher {
    seed: u64,
    secret: Option<SecretInput<[u8; 192]>>,
}

impl BlockHasher {
    pub(crate) fn new(seed: u64) -> BlockHasher {
        BlockHasher {
            seed,
            secret: SecretInput::try_new(const_custom_default_secret(seed)),
        }
    }

    pub(crate) fn hash(&self, bytes: &[u8]) -> u64 {
        match &self.secret {
            Some(secret) if bytes.len() > XXH3_MID_SIZE_MAX => {
                xxh3_64_with_secret_input(bytes, secret)
            }
            _ => xxh3_64_with_seed(bytes, self.seed),
        }
    }
}

/// Hashes one block's tokens, reusing `bytes` as scratch space so callers hashing many blocks
/// allocate once.
pub(crate) fn hash_block(
    block: &[u32],
    hasher: &BlockHasher,
    bytes: &mut Vec<u8>,
) -> LocalBlockHash {
    // Sized once, then overwritten in place: a fixed 4-byte store per token (vectorizable),
    // not a length check and copy per `extend_from_slice`.
    bytes.resize(block.len().saturating_mul(TOKEN_BYTES), 0);
    for (dst, token) in bytes.chunks_exact_mut(TOKEN_BYTES).zip(block) {
        dst.copy_from_slice(&token.to_le_bytes());
    }
    LocalBlockHash(hasher.hash(bytes))
}

/// Local hashes of every full block of `tokens` (a trailing partial block is ignored).
/// `block_size` 0 yields no blocks.
pub fn local_block_hashes(tokens: &[u32], block_size: u32, seed: u64) -> Vec<LocalBlockHash> {
    let count = full_blocks(tokens.len(), block_size);
    let mut hashes = Vec::with_capacity(count);
    let Ok(size) = usize::try_from(block_size) else {
        return hashes;
    };
    // No full block: return before reserving scratch space (a huge block_size would overflow it).
    if size == 0 || count == 0 {
        return hashes;
    }
    let mut bytes = Vec::with_capacity(size.saturating_mul(TOKEN_BYTES));
    let hasher = BlockHasher::new(seed);
    for block in tokens.chunks_exact(size) {
        hashes.push(hash_block(block, &hasher, &mut bytes));
    }
    hashes
}

/// One link of the chain: the sequence hash of `local` following `parent` (a chain start when
/// `parent` is `None`).
pub fn chain_sequence_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(parent) => {
            let mut bytes = [0u8; 16];
            let (head, tail) = bytes.split_at_mut(8);
            head.copy_from_slice(&parent.0.to_le_bytes());
            tail.copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, DYNAMO_HASH_SEED))
        }
    }
}

/// Chains `locals` into sequence hashes, continuing from `parent` (the sequence hash of the block
/// before `locals[0]`, or `None` when `locals[0]` starts the sequence).
pub fn sequence_hashes(
    locals: &[LocalBlockHash],
    parent: Option<SequenceHash>,
) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(locals.len());
    let mut prev = parent;
    for &local in locals {
        let seq = chain_sequence_hash(prev, local);
        out.push(seq);
        prev = Some(seq);
    }
    out
}

/// Sequence hashes of a request's prompt: the request path. One pass, one scratch buffer, one
/// output allocation.
pub fn prompt_sequence_hashes(
    tokens: &[u32],
    block_size: u32,
    lora_name: Option<&str>,
) -> Vec<SequenceHash> {
    let count = full_blocks(tokens.len(), block_size);
    let mut out = Vec::with_capacity(count);
    let Ok(size) = usize::try_from(block_size) else {
        return out;
    };
    if size == 0 || count == 0 {
        return out;
    }
    let hasher = BlockHasher::new(hash_seed(lora_name));
    let mut bytes = Vec::with_capacity(size.saturating_mul(TOKEN_BYTES));
    let mut prev = None;
    for block in tokens.chunks_exact(size) {
        let seq = chain_sequence_hash(prev, hash_block(block, &hasher, &mut bytes));
        out.push(seq);
        prev = Some(seq);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32) -> Vec<u32> {
        (0..n)
            .map(|i| i.wrapping_mul(2_654_435_761) % 50_000)
            .collect()
    }

    #[test]
    fn local_hash_is_xxh3_of_le_u32_bytes() {
        let toks = [1u32, 2, 3, 0xdead_beef];
        let mut bytes = Vec::new();
        for t in toks {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let expected = xxh3_64_with_seed(&bytes, 1337);
        assert_eq!(
            local_block_hashes(&toks, 4, 1337),
            vec![LocalBlockHash(expected)]
        );
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let toks = tokens(10);
        assert_eq!(local_block_hashes(&toks, 4, DYNAMO_HASH_SEED).len(), 2);
        assert_eq!(local_block_hashes(&toks, 11, DYNAMO_HASH_SEED).len(), 0);
        assert_eq!(local_block_hashes(&toks, 0, DYNAMO_HASH_SEED).len(), 0);
        assert!(prompt_sequence_hashes(&toks, 0, None).is_empty());
        // The partial tail must not influence the full blocks' hashes.
        let full = local_block_hashes(toks.get(..8).unwrap_or(&[]), 4, DYNAMO_HASH_SEED);
        assert_eq!(local_block_hashes(&toks, 4, DYNAMO_HASH_SEED), full);
    }

    #[test]
    fn chain_starts_with_local_hash_and_depends_on_parent() {
        let a = LocalBlockHash(11);
        let b = LocalBlockHash(22);
        assert_eq!(chain_sequence_hash(None, a), SequenceHash(11));
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&11u64.to_le_bytes());
        bytes.extend_from_slice(&22u64.to_le_bytes());
        let expected = SequenceHash(xxh3_64_with_seed(&bytes, 1337));
        assert_eq!(chain_sequence_hash(Some(SequenceHash(11)), b), expected);
        assert_ne!(chain_sequence_hash(Some(SequenceHash(12)), b), expected);
        assert_eq!(
            sequence_hashes(&[a, b], None),
            vec![SequenceHash(11), expected]
        );
    }

    #[test]
    fn sequence_hashes_continue_from_parent() {
        let locals = local_block_hashes(&tokens(64), 16, DYNAMO_HASH_SEED);
        let whole = sequence_hashes(&locals, None);
        let (head, tail) = locals.split_at(2);
        let mut joined = sequence_hashes(head, None);
        joined.extend(sequence_hashes(tail, joined.last().copied()));
        assert_eq!(joined, whole);
    }

    #[test]
    fn prompt_path_matches_two_step_path() {
        let toks = tokens(1000);
        for block_size in [1, 4, 16, 64] {
            for lora in [None, Some("adapter-a")] {
                let locals = local_block_hashes(&toks, block_size, hash_seed(lora));
                assert_eq!(
                    prompt_sequence_hashes(&toks, block_size, lora),
                    sequence_hashes(&locals, None)
                );
            }
        }
    }

    /// The per-request secret gives XXH3-64-with-seed's answer for every length (both sides of
    /// the 240-byte switch) and seed (0, Dynamo's, LoRA-salted, arbitrary).
    #[test]
    fn block_hasher_matches_xxh3_with_seed() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let bytes: Vec<u8> = (0..2048)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let seeds = [
            0,
            1,
            DYNAMO_HASH_SEED,
            hash_seed(Some("adapter-a")),
            u64::MAX,
            x,
        ];
        for seed in seeds {
            let hasher = BlockHasher::new(seed);
            for len in (0..=300).chain([383, 384, 512, 1024, 1025, 2048]) {
                let input = bytes.get(..len).unwrap_or_default();
                assert_eq!(
                    hasher.hash(input),
                    xxh3_64_with_seed(input, seed),
                    "seed {seed} length {len}"
                );
            }
        }
    }

    #[test]
    fn lora_salts_the_seed_and_empty_name_is_no_lora() {
        assert_eq!(hash_seed(None), DYNAMO_HASH_SEED);
        assert_eq!(hash_seed(Some("")), DYNAMO_HASH_SEED);
        assert_eq!(
            hash_seed(Some("a")),
            DYNAMO_HASH_SEED.wrapping_add(xxh3_64(b"a"))
        );
        assert_ne!(hash_seed(Some("a")), hash_seed(Some("b")));
        let toks = tokens(32);
        assert_ne!(
            prompt_sequence_hashes(&toks, 16, Some("a")),
            prompt_sequence_hashes(&toks, 16, None)
        );
    }
}
