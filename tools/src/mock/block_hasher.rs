//! How the mock engine names its cached blocks: its own chained hash (the default), or the hashes
//! a vLLM engine would publish for the same tokens ([`super::vllm_hash`]).

use super::kv_cache::{block_hashes, chain_hash, BlockHash};
use super::vllm_hash::{block_digest, event_hash, none_hash, VllmHashAlgo, DEFAULT_SEED};

/// `--block-hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BlockHashKind {
    /// The mock's own chained hash.
    #[default]
    Mock,
    /// vLLM's default `sha256` (over pickle).
    VllmSha256,
    /// vLLM's `sha256_cbor`.
    VllmSha256Cbor,
}

/// A 32-byte vLLM digest (the chain link vLLM hashes a child block with).
pub type Digest = [u8; 32];

#[derive(Debug, Clone, Default)]
pub enum BlockHasher {
    #[default]
    Mock,
    Vllm {
        algo: VllmHashAlgo,
        none: Digest,
    },
}

impl BlockHasher {
    /// `seed` is vLLM's `PYTHONHASHSEED` (its default when unset: [`DEFAULT_SEED`]).
    pub fn new(kind: BlockHashKind, seed: &str) -> BlockHasher {
        let vllm = |algo| BlockHasher::Vllm {
            algo,
            none: none_hash(algo, seed),
        };
        match kind {
            BlockHashKind::Mock => BlockHasher::Mock,
            BlockHashKind::VllmSha256 => vllm(VllmHashAlgo::Sha256),
            BlockHashKind::VllmSha256Cbor => vllm(VllmHashAlgo::Sha256Cbor),
        }
    }

    /// vLLM's default hashing (`sha256`, no PYTHONHASHSEED).
    pub fn vllm_default() -> BlockHasher {
        BlockHasher::new(BlockHashKind::VllmSha256, DEFAULT_SEED)
    }

    /// Hashes of every full block of `tokens`, with their vLLM digests (empty for the mock's
    /// own hash, which chains on the 64-bit hash itself).
    pub fn prompt(&self, tokens: &[u32], block_size: usize) -> (Vec<BlockHash>, Vec<Digest>) {
        match self {
            BlockHasher::Mock => (block_hashes(tokens, block_size), Vec::new()),
            BlockHasher::Vllm { algo, none } => {
                let mut parent = *none;
                let digests: Vec<Digest> = tokens
                    .chunks_exact(block_size.max(1))
                    .map(|chunk| {
                        parent = block_digest(*algo, &parent, chunk);
                        parent
                    })
                    .collect();
                (digests.iter().map(event_hash).collect(), digests)
            }
        }
    }

    /// The block of `tokens` after `parent` (its hash and, for vLLM, its digest).
    pub fn child(
        &self,
        parent: Option<BlockHash>,
        parent_digest: Option<&Digest>,
        tokens: &[u32],
    ) -> (BlockHash, Option<Digest>) {
        match self {
            BlockHasher::Mock => (chain_hash(parent, tokens), None),
            BlockHasher::Vllm { algo, none } => {
                let d = block_digest(*algo, parent_digest.unwrap_or(none), tokens);
                (event_hash(&d), Some(d))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_continues_the_prompt_chain() {
        let tokens: Vec<u32> = (0..48).collect();
        for hasher in [BlockHasher::Mock, BlockHasher::vllm_default()] {
            let (hashes, digests) = hasher.prompt(&tokens, 16);
            assert_eq!(hashes.len(), 3);
            let (h, _) = hasher.child(Some(hashes[1]), digests.get(1), &tokens[32..]);
            assert_eq!(h, hashes[2], "{hasher:?}");
            let (first, _) = hasher.child(None, None, &tokens[..16]);
            assert_eq!(first, hashes[0]);
        }
        // The default keeps the mock's own hashes.
        let (mock, _) = BlockHasher::default().prompt(&tokens, 16);
        assert_eq!(mock, block_hashes(&tokens, 16));
        assert_ne!(mock, BlockHasher::vllm_default().prompt(&tokens, 16).0);
    }
}
