//! Lazy prompt hashing for the kv request path: sequence hashes are computed block by block and
//! only as far as some worker (indexed or predicted) could hold the prefix. Past the first block
//! no slot holds, no overlap can grow, so the rest of a long prompt is never hashed. The load
//! term needs the prompt's length only, which is counted, not hashed.
//!
//! Approximate mode records a decision's leading blocks (up to `max_record_blocks`) even past the
//! first miss: [`PromptHasher::extend_to`] computes them after the decision, only when a record
//! is made.

use crate::hashing::{chain_sequence_hash, hash_block, hash_seed, BlockHasher};
use crate::request::{TokenReader, TokenSpan};
use crate::types::{LocalBlockHash, SequenceHash};

/// Bytes per token id in the hashed representation (little-endian u32).
const TOKEN_BYTES: usize = 4;

/// The prompt's sequence hashes, computed on demand (identical to
/// [`crate::hashing::prompt_sequence_hashes`] for every block computed).
pub struct PromptHasher<'a> {
    blocks: Blocks<'a>,
    hasher: BlockHasher,
    scratch: Vec<u8>,
    hashes: Vec<SequenceHash>,
}

/// Where the blocks' tokens come from.
enum Blocks<'a> {
    /// Ids already read.
    Ids(std::slice::ChunksExact<'a, u32>),
    /// Ids in the body, read (and checked) block by block as they are hashed, into `block` as
    /// the little-endian bytes that are hashed (no copy between reading and hashing).
    Text {
        reader: TokenReader<'a>,
        block: Vec<[u8; TOKEN_BYTES]>,
    },
}

impl<'a> PromptHasher<'a> {
    /// `block_size` 0 yields no blocks.
    pub fn new(tokens: &'a [u32], block_size: u32, lora_name: Option<&str>) -> Self {
        let size = usize::try_from(block_size).unwrap_or(0);
        // A zero size has no blocks; chunks_exact needs a non-zero size (an empty slice then).
        let blocks = if size == 0 {
            [].chunks_exact(1)
        } else {
            tokens.chunks_exact(size)
        };
        let count = blocks.len();
        Self::with_blocks(Blocks::Ids(blocks), count, size, lora_name)
    }

    /// The ids of `span` in `body` (the parsed body), read and checked only as far as blocks
    /// are hashed; [`PromptHasher::finish`] checks and counts the rest. `block_size` 0 yields
    /// no blocks.
    pub fn from_span(
        body: &'a [u8],
        span: &TokenSpan,
        block_size: u32,
        lora_name: Option<&str>,
    ) -> Self {
        let size = usize::try_from(block_size).unwrap_or(0);
        // A block's ids, read in place; no block for size 0 or one longer than the body.
        let room = if size == 0 || size > body.len() {
            0
        } else {
            size
        };
        let blocks = Blocks::Text {
            reader: span.reader(body),
            block: vec![[0; TOKEN_BYTES]; room],
        };
        // The block is its own hashing buffer: no scratch space.
        Self::with_blocks(blocks, 0, size, lora_name)
    }

    /// For ids from a [`TokenSpan`]: the number of ids in the whole array, the ids not read
    /// checked too ([`crate::request::TokenReader::finish`]); `None` if it is not an array of
    /// ids (the hashes then stop where the bad id is: the body must be parsed again, eagerly).
    /// `None` for ids already read (nothing to check: use their number).
    pub fn finish(&self) -> Option<usize> {
        match &self.blocks {
            Blocks::Ids(_) => None,
            Blocks::Text { reader, .. } => reader.finish(),
        }
    }

    fn with_blocks(blocks: Blocks<'a>, count: usize, size: usize, lora: Option<&str>) -> Self {
        let scratch = if count == 0 {
            Vec::new()
        } else {
            Vec::with_capacity(size.saturating_mul(TOKEN_BYTES))
        };
        PromptHasher {
            blocks,
            hasher: BlockHasher::new(hash_seed(lora)),
            scratch,
            hashes: Vec::new(),
        }
    }

    /// The hashes computed so far (a prefix of the prompt's).
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }

    pub fn into_hashes(self) -> Vec<SequenceHash> {
        self.hashes
    }

    /// Computes the next block's hash; `None` past the last full block.
    fn step(&mut self) -> Option<SequenceHash> {
        let local = match &mut self.blocks {
            Blocks::Ids(blocks) => hash_block(blocks.next()?, &self.hasher, &mut self.scratch),
            Blocks::Text { reader, block } => {
                if block.is_empty() {
                    return None;
                }
                reader.read_block(block.as_mut_slice())?;
                LocalBlockHash(self.hasher.hash(block.as_flattened()))
            }
        };
        let seq = chain_sequence_hash(self.hashes.last().copied(), local);
        self.hashes.push(seq);
        Some(seq)
    }

    /// Hashes until (and including) the first block `held` says nobody holds, or the end.
    pub fn hash_while_held(&mut self, mut held: impl FnMut(SequenceHash) -> bool) {
        while let Some(seq) = self.step() {
            if !held(seq) {
                return;
            }
        }
    }

    /// Makes at least `n` hashes available (fewer if the prompt has fewer full blocks).
    pub fn extend_to(&mut self, n: usize) {
        while self.hashes.len() < n && self.step().is_some() {}
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;
    use crate::approx::{PredictedStore, Record};
    use crate::config::Config;
    use crate::events::IndexEvent;
    use crate::hashing::{local_block_hashes, prompt_sequence_hashes};
    use crate::index::KvIndex;
    use crate::load::SlotLoad;
    use crate::request::{parse_request_with, Endpoint, LlmRequest, ParseOptions};
    use crate::router::SelectorState;
    use crate::router::{decide, prompt_blocks, RouteInput};
    use crate::types::{ExternalBlockHash, Overlap, SlotIdx, StorageTier};

    const BS: u32 = 4;
    const SLOTS: u16 = 6;

    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % n
        }
    }

    /// Prompts sharing a few prefixes, then a private tail of varying length.
    fn prompt(rng: &mut Lcg) -> Vec<u32> {
        let family = rng.below(4) as u32;
        let shared = rng.below(12) as u32;
        let tail = rng.below(20) as u32 + rng.below(3) as u32;
        let mut t: Vec<u32> = (0..shared * BS).map(|i| family * 1_000_003 + i).collect();
        let own = rng.below(1 << 30) as u32;
        t.extend((0..tail).map(|i| own.wrapping_add(i * 7)));
        t
    }

    /// Stores a random prefix range of `tokens` on a random slot.
    fn store(index: &mut KvIndex, tokens: &[u32], rng: &mut Lcg) {
        let seqs = prompt_sequence_hashes(tokens, BS, None);
        let locals = local_block_hashes(tokens, BS, crate::hashing::DYNAMO_HASH_SEED);
        if seqs.is_empty() {
            return;
        }
        let slot = rng.below(u64::from(SLOTS)) as SlotIdx;
        let end = 1 + rng.below(seqs.len() as u64) as usize;
        let ext = |i: usize| ExternalBlockHash(seqs[i].0 ^ ((u64::from(slot) + 1) * 0x9e37));
        let tier = [StorageTier::Device, StorageTier::Host][rng.below(2) as usize];
        let event = IndexEvent::Stored {
            dp_rank: 0,
            tier,
            parent: None,
            blocks: (0..end).map(|i| (ext(i), locals[i])).collect(),
        };
        index.apply(slot, &event).unwrap();
    }

    fn config() -> Config {
        let workers: Vec<String> = (0..SLOTS)
            .map(|i| format!(r#"{{"id": {i}, "address": "10.0.0.{i}:8000"}}"#))
            .collect();
        let json = format!(
            r#"{{"mode": "kv", "block_size": {BS}, "workers": [{}]}}"#,
            workers.join(",")
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    /// A completions body with `tokens` as its prompt (`, ` or `,` between ids), parsed as the
    /// filter does: the request and the body (where its ids are).
    fn lazy_request(tokens: &[u32], spaced: bool) -> (LlmRequest, Vec<u8>) {
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let sep = if spaced { ", " } else { "," };
        let body = format!(
            r#"{{"model": "m", "prompt": [{}], "max_tokens": 4}}"#,
            list.join(sep)
        );
        let opts = ParseOptions {
            lazy_token_ids: true,
            ..ParseOptions::default()
        };
        let req = parse_request_with(body.as_bytes(), Endpoint::Completions, &opts).unwrap();
        (req, body.into_bytes())
    }

    /// The hasher over ids still in the body: the same hashes as over read ids, stopped early
    /// and extended, for every block size.
    #[test]
    fn hashing_from_the_body_equals_hashing_read_ids() {
        let mut rng = Lcg(5);
        let mut from_body = 0;
        for round in 0..300 {
            let mut tokens = prompt(&mut rng);
            // Ids of every length the lazy reader takes (1 to 7 digits).
            for t in tokens.iter_mut() {
                *t %= 10u32.pow(1 + (*t % 7));
            }
            let block = [1u32, 3, 4, 16][round % 4];
            let (req, body) = lazy_request(&tokens, round % 2 == 0);
            let span = req.token_span.unwrap();
            assert_eq!(span.check(&body), Some(tokens.len()));
            from_body += usize::from(!tokens.is_empty());
            let full = prompt_sequence_hashes(&tokens, block, Some("a"));
            let mut lazy = PromptHasher::from_span(&body, &span, block, Some("a"));
            let stop = rng.below(8) as usize;
            let mut seen = 0;
            lazy.hash_while_held(|_| {
                seen += 1;
                seen <= stop
            });
            assert_eq!(lazy.hashes(), &full[..full.len().min(stop + 1)]);
            assert_eq!(lazy.finish(), Some(tokens.len()));
            lazy.extend_to(stop + 3);
            assert_eq!(lazy.hashes(), &full[..full.len().min(stop + 3)]);
            lazy.extend_to(usize::MAX);
            assert_eq!(lazy.into_hashes(), full);
        }
        assert!(from_body > 250, "{from_body}");
        let (req, body) = lazy_request(&[1, 2, 3], false);
        let span = req.token_span.unwrap();
        let mut none = PromptHasher::from_span(&body, &span, 0, None);
        none.extend_to(5);
        assert!(none.hashes().is_empty());
    }

    #[test]
    fn lazy_hashes_are_a_prefix_of_the_full_hashes_and_extend_exactly() {
        let mut rng = Lcg(3);
        for _ in 0..200 {
            let tokens = prompt(&mut rng);
            let full = prompt_sequence_hashes(&tokens, BS, Some("adapter"));
            let mut lazy = PromptHasher::new(&tokens, BS, Some("adapter"));
            let stop = rng.below(8) as usize;
            let mut seen = 0;
            lazy.hash_while_held(|_| {
                seen += 1;
                seen <= stop
            });
            assert_eq!(lazy.hashes(), &full[..full.len().min(stop + 1)]);
            lazy.extend_to(stop + 3);
            assert_eq!(lazy.hashes(), &full[..full.len().min(stop + 3)]);
            lazy.extend_to(usize::MAX);
            assert_eq!(lazy.into_hashes(), full);
        }
        assert!(PromptHasher::new(&[1, 2, 3], 0, None).hashes().is_empty());
        let mut none = PromptHasher::new(&[1, 2, 3], 0, None);
        none.extend_to(5);
        assert!(none.hashes().is_empty());
    }

    /// The differential test: on generated prompts, indexes and predictions, overlaps and
    /// routing decisions from the lazy prefix equal those from full hashing.
    #[test]
    fn routing_decisions_are_unchanged_by_lazy_hashing() {
        let config = config();
        let mut rng = Lcg(11);
        let mut stopped_early = 0;
        for round in 0..40 {
            let mut index = KvIndex::new(usize::from(SLOTS), 10_000);
            let mut predicted = PredictedStore::new(10_000);
            let corpus: Vec<Vec<u32>> = (0..30).map(|_| prompt(&mut rng)).collect();
            for _ in 0..20 {
                let p = &corpus[rng.below(corpus.len() as u64) as usize];
                store(&mut index, p, &mut rng);
            }
            for _ in 0..5 {
                let p = &corpus[rng.below(corpus.len() as u64) as usize];
                let mut hashes = prompt_sequence_hashes(p, BS, None);
                hashes.truncate(1 + rng.below(10) as usize);
                let record = Record {
                    slot: rng.below(u64::from(SLOTS)) as SlotIdx,
                    expires_ms: 1_000 + rng.below(2) * 10_000,
                    hashes,
                };
                predicted.insert(&record, 0);
            }
            let load: Vec<SlotLoad> = (0..SLOTS)
                .map(|_| SlotLoad {
                    prefill_tokens: rng.below(5_000) as f64,
                    decode_blocks: rng.below(300) as f64,
                    active_requests: rng.below(9) as u32,
                })
                .collect();
            for i in 0..30 {
                let tokens = if i % 3 == 0 {
                    prompt(&mut rng)
                } else {
                    corpus[rng.below(corpus.len() as u64) as usize].clone()
                };
                let full = prompt_sequence_hashes(&tokens, BS, None);
                // The filter's path: ids left in the body, read as blocks are hashed.
                let (mut lazy_req, body) = lazy_request(&tokens, i % 2 == 0);
                let span = lazy_req.token_span.unwrap();
                let mut lazy = PromptHasher::from_span(&body, &span, BS, None);
                lazy.hash_while_held(|h| index.holds_anywhere(h) || predicted.knows(h));
                // The rest checked and counted, as the filter does before deciding.
                if let Some(s) = lazy_req.token_span.as_mut() {
                    s.set_count(lazy.finish().unwrap());
                }
                assert_eq!(lazy_req.token_count(), Some(tokens.len()));
                if lazy.hashes().len() < full.len() {
                    stopped_early += 1;
                }
                let now = 5_000;
                let overlaps_of = |hashes: &[SequenceHash]| {
                    let mut out: Vec<Overlap> = Vec::new();
                    index.find_overlaps(hashes, &mut out);
                    let p = predicted.overlaps(hashes, usize::from(SLOTS), now);
                    for (o, blocks) in out.iter_mut().zip(p) {
                        o.device_blocks = o.device_blocks.max(blocks);
                    }
                    out
                };
                let want = overlaps_of(&full);
                assert_eq!(overlaps_of(lazy.hashes()), want, "round {round} prompt {i}");
                let request = LlmRequest {
                    token_ids: Some(tokens.clone()),
                    ..LlmRequest::default()
                };
                let route = |request: &LlmRequest, overlaps: &[Overlap]| {
                    let input = RouteInput {
                        request,
                        header_pin: Default::default(),
                        prompt_blocks: prompt_blocks(&config, request),
                        overlaps,
                        load: &load,
                        stale_slots: &[],
                        kv_usage: &[],
                        learned: None,
                        arrivals_per_ms: 0.0,
                    };
                    // Same selector seed on both sides: ties resolve identically.
                    decide(&config, &input, &mut SelectorState::new(round))
                        .map(|d| (d.slot, d.reason, d.fallbacks))
                };
                assert_eq!(
                    route(&lazy_req, &overlaps_of(lazy.hashes())),
                    route(&request, &want)
                );
            }
        }
        assert!(
            stopped_early > 300,
            "the generator exercises the early stop"
        );
    }
}
