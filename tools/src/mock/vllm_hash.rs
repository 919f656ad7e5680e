//! vLLM's prefix-cache block hashes (`vllm/v1/core/kv_cache_utils.py`, vLLM 0.32), so a test or
//! a tool can compute the hashes a real engine publishes for given token ids.
//!
//! * `hash_block_tokens(fn, parent, tokens, extra_keys=None) = fn((parent, tuple(tokens), None))`,
//!   `parent` being the previous block's full 32-byte digest, or `NONE_HASH` for the first block.
//! * `NONE_HASH = fn(seed)`, `seed` = `PYTHONHASHSEED` when set, else `"vllm-none-hash"` (for
//!   the SHA-256 algorithms; xxhash ones use a random seed and are not reproducible).
//! * `fn` = `sha256` (vLLM's default `--prefix-caching-hash-algo`): SHA-256 of
//!   `pickle.dumps(obj, protocol=5)`; `sha256_cbor`: SHA-256 of `cbor2.dumps(obj, canonical=True)`.
//! * The KV event carries `int.from_bytes(digest, "big") & (2**64 - 1)`
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default): the digest's last 8 bytes.
//!
//! The mock names its blocks this way with `--block-hash vllm-sha256|vllm-sha256-cbor`
//! ([`super::block_hasher`]). vllm-router's `kv_aware` does not need it (it keys blocks by its
//! own hash of the token ids; see README, "Against a peer router"), but with it the peer arms'
//! events carry exactly what a vLLM engine with default settings publishes.

use sha2::{Digest, Sha256};

/// vLLM's hash algorithms that are reproducible across processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmHashAlgo {
    /// `sha256`: SHA-256 over pickle protocol 5 (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 over canonical CBOR.
    Sha256Cbor,
}

/// vLLM's NONE_HASH seed when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// Pickle protocol 5 of one frame: `PROTO 5, FRAME len, body` (the body ends with STOP).
fn pickle_frame(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x80, 0x05, 0x95];
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Pickle's int opcodes: BININT1, BININT2, BININT, else LONG1.
fn pickle_int(out: &mut Vec<u8>, v: u32) {
    if let Ok(b) = u8::try_from(v) {
        out.extend_from_slice(&[b'K', b]);
    } else if let Ok(w) = u16::try_from(v) {
        out.push(b'M');
        out.extend_from_slice(&w.to_le_bytes());
    } else if let Ok(i) = i32::try_from(v) {
        out.push(b'J');
        out.extend_from_slice(&i.to_le_bytes());
    } else {
        // LONG1: 5 little-endian two's-complement bytes (the sign byte keeps it positive).
        out.extend_from_slice(&[0x8a, 5]);
        out.extend_from_slice(&u64::from(v).to_le_bytes()[..5]);
    }
}

/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)`.
fn pickle_block(parent: &[u8; 32], tokens: &[u32]) -> Vec<u8> {
    const MEMOIZE: u8 = 0x94;
    let mut body = vec![b'C', 32];
    body.extend_from_slice(parent);
    body.push(MEMOIZE);
    // Tuples of up to 3 items have their own opcodes; longer ones open with MARK.
    if tokens.len() > 3 {
        body.push(b'(');
    }
    for &t in tokens {
        pickle_int(&mut body, t);
    }
    body.push(match tokens.len() {
        0 => b')',
        1 => 0x85,
        2 => 0x86,
        3 => 0x87,
        _ => b't',
    });
    if !tokens.is_empty() {
        body.push(MEMOIZE);
    }
    body.extend_from_slice(&[b'N', 0x87, MEMOIZE, b'.']);
    pickle_frame(&body)
}

/// `pickle.dumps(seed, protocol=5)` for a short str.
fn pickle_str(seed: &str) -> Vec<u8> {
    let mut body = Vec::new();
    if let Ok(n) = u8::try_from(seed.len()) {
        body.extend_from_slice(&[0x8c, n]);
    } else {
        body.push(b'X');
        body.extend_from_slice(&(seed.len() as u32).to_le_bytes());
    }
    body.extend_from_slice(seed.as_bytes());
    body.extend_from_slice(&[0x94, b'.']);
    pickle_frame(&body)
}

/// A canonical CBOR head: major type and argument in its shortest form.
fn cbor_head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if let Ok(b) = u8::try_from(v) {
        out.extend_from_slice(&[m | 24, b]);
    } else if let Ok(w) = u16::try_from(v) {
        out.push(m | 25);
        out.extend_from_slice(&w.to_be_bytes());
    } else if let Ok(d) = u32::try_from(v) {
        out.push(m | 26);
        out.extend_from_slice(&d.to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// `cbor2.dumps((parent, tuple(tokens), None), canonical=True)`.
fn cbor_block(parent: &[u8; 32], tokens: &[u32]) -> Vec<u8> {
    let mut out = vec![0x83];
    cbor_head(&mut out, 2, 32);
    out.extend_from_slice(parent);
    cbor_head(&mut out, 4, tokens.len() as u64);
    for &t in tokens {
        cbor_head(&mut out, 0, u64::from(t));
    }
    out.push(0xf6);
    out
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The digest's value in a KV event: its last 8 bytes, big-endian.
pub fn event_hash(digest: &[u8; 32]) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(low)
}

/// vLLM's NONE_HASH for `algo` and `seed` (`PYTHONHASHSEED`, or [`DEFAULT_SEED`]).
pub fn none_hash(algo: VllmHashAlgo, seed: &str) -> [u8; 32] {
    match algo {
        VllmHashAlgo::Sha256 => sha256(&pickle_str(seed)),
        VllmHashAlgo::Sha256Cbor => {
            let mut out = Vec::new();
            cbor_head(&mut out, 3, seed.len() as u64);
            out.extend_from_slice(seed.as_bytes());
            sha256(&out)
        }
    }
}

/// `hash_block_tokens`: the digest of one full block after `parent`'s.
pub fn block_digest(algo: VllmHashAlgo, parent: &[u8; 32], tokens: &[u32]) -> [u8; 32] {
    match algo {
        VllmHashAlgo::Sha256 => sha256(&pickle_block(parent, tokens)),
        VllmHashAlgo::Sha256Cbor => sha256(&cbor_block(parent, tokens)),
    }
}

/// The full digests of every full block of `tokens`, chained from NONE_HASH.
pub fn block_digests(
    algo: VllmHashAlgo,
    seed: &str,
    tokens: &[u32],
    block_size: usize,
) -> Vec<[u8; 32]> {
    let mut parent = none_hash(algo, seed);
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            parent = block_digest(algo, &parent, chunk);
            parent
        })
        .collect()
}

/// The hashes a vLLM engine publishes in its "stored" events for `tokens`' full blocks.
pub fn event_hashes(algo: VllmHashAlgo, seed: &str, tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_digests(algo, seed, tokens, block_size)
        .iter()
        .map(event_hash)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pickle_and_cbor_bytes_match_python() {
        // From vLLM's venv: pickle.dumps((b"\x01" * 32, (4, 300, 70000, 5), None), protocol=5),
        // the same with (4, 300), pickle.dumps("vllm-none-hash", protocol=5), and cbor2.dumps of
        // the first tuple with canonical=True.
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let ones = [1u8; 32];
        let tail = "0101010101010101010101010101010101010101010101010101010101010101";
        assert_eq!(
            hex(&pickle_block(&ones, &[4, 300, 70000, 5])),
            format!(
                "8005953600000000000000432001{}94284b044d2c014a701101004b0574944e87942e",
                &tail[2..]
            )
        );
        assert_eq!(
            hex(&pickle_block(&ones, &[4, 300])),
            format!(
                "8005952e00000000000000432001{}944b044d2c0186944e87942e",
                &tail[2..]
            )
        );
        assert_eq!(
            hex(&pickle_str(DEFAULT_SEED)),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
        assert_eq!(
            hex(&cbor_block(&ones, &[4, 300, 70000, 5])),
            format!("835820{tail}840419012c1a0001117005f6")
        );
    }

    /// The captured prompt's token ids: 4 + (7 i mod 500).
    fn captured_prompt() -> Vec<u32> {
        (0..96u32).map(|i| 4 + (7 * i) % 500).collect()
    }

    #[test]
    fn sha256_hashes_match_a_real_vllm_engine() {
        // /work/shared/engines/vllm/fixtures/DECODED.txt (vLLM 0.32, default sha256, no
        // PYTHONHASHSEED, block size 32): req1 stored 3 blocks of its 96-token prefix, req2 the
        // block of tokens 200..=231 after them.
        let prompt = captured_prompt();
        assert_eq!(&prompt[..6], [4, 11, 18, 25, 32, 39]);
        assert_eq!(&prompt[70..74], [494, 501, 8, 15]);
        assert_eq!(prompt[95], 169);
        let digests = block_digests(VllmHashAlgo::Sha256, DEFAULT_SEED, &prompt, 32);
        let hashes: Vec<u64> = digests.iter().map(event_hash).collect();
        assert_eq!(
            hashes,
            [995114372539195884, 2422810939045071523, 6990447958680583254]
        );
        let next: Vec<u32> = (200..232).collect();
        let d = block_digest(VllmHashAlgo::Sha256, &digests[2], &next);
        assert_eq!(event_hash(&d), 6101281949773030706);
    }

    #[test]
    fn seeded_and_cbor_hashes_match_vllm() {
        // vLLM 0.32's own init_none_hash + hash_block_tokens (its venv), block size 16, 64
        // consecutive token ids from `first`, PYTHONHASHSEED unset or "0".
        let run = |algo, seed, first: u32| {
            let tokens: Vec<u32> = (first..first + 64).collect();
            event_hashes(algo, seed, &tokens, 16)
        };
        assert_eq!(
            run(VllmHashAlgo::Sha256, DEFAULT_SEED, 1100),
            [
                11801645359171880713,
                6975338372619664351,
                3260214247629434047,
                3502103539487430761
            ]
        );
        assert_eq!(
            run(VllmHashAlgo::Sha256Cbor, DEFAULT_SEED, 1200),
            [
                62342635994966013,
                2727432593192527037,
                8286638175488538074,
                15000654619110635448
            ]
        );
        assert_eq!(
            run(VllmHashAlgo::Sha256, "0", 1300),
            [
                4163598359294721114,
                10075671202009649289,
                12089531664098742370,
                13084744077243779666
            ]
        );
        assert_eq!(
            run(VllmHashAlgo::Sha256Cbor, "0", 1400),
            [
                12620982591065485403,
                15764993475022709107,
                10373727584478920571,
                12406778422900445529
            ]
        );
    }
}
