//! Test helpers: a msgpack writer that picks exact integer widths, and vLLM/SGLang-shaped
//! event batches built with it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

/// Integer encodings of msgpack.
#[derive(Clone, Copy, Debug)]
pub enum Width {
    /// The smallest encoding (what msgspec emits).
    Smallest,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
}

pub const ALL_UNSIGNED: [Width; 5] = [
    Width::Smallest,
    Width::U8,
    Width::U16,
    Width::U32,
    Width::U64,
];

/// A msgpack writer.
#[derive(Default)]
pub struct Mp(pub Vec<u8>);

impl Mp {
    pub fn new() -> Self {
        Mp(Vec::new())
    }
    pub fn array(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_array_len(&mut self.0, n).unwrap();
        self
    }
    pub fn map(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_map_len(&mut self.0, n).unwrap();
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        rmp::encode::write_str(&mut self.0, s).unwrap();
        self
    }
    pub fn nil(&mut self) -> &mut Self {
        rmp::encode::write_nil(&mut self.0).unwrap();
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        rmp::encode::write_f64(&mut self.0, v).unwrap();
        self
    }
    pub fn bin(&mut self, b: &[u8]) -> &mut Self {
        rmp::encode::write_bin(&mut self.0, b).unwrap();
        self
    }
    /// An unsigned value in the given width (it must fit).
    pub fn uint(&mut self, v: u64, w: Width) -> &mut Self {
        let out = &mut self.0;
        match w {
            Width::Smallest => {
                rmp::encode::write_uint(out, v).unwrap();
            }
            Width::U8 => rmp::encode::write_u8(out, u8::try_from(v).unwrap()).unwrap(),
            Width::U16 => rmp::encode::write_u16(out, u16::try_from(v).unwrap()).unwrap(),
            Width::U32 => rmp::encode::write_u32(out, u32::try_from(v).unwrap()).unwrap(),
            Width::U64 => rmp::encode::write_u64(out, v).unwrap(),
            Width::I8 => rmp::encode::write_i8(out, i8::try_from(v).unwrap()).unwrap(),
            Width::I16 => rmp::encode::write_i16(out, i16::try_from(v).unwrap()).unwrap(),
            Width::I32 => rmp::encode::write_i32(out, i32::try_from(v).unwrap()).unwrap(),
            Width::I64 => rmp::encode::write_i64(out, i64::try_from(v).unwrap()).unwrap(),
        }
        self
    }
    /// A signed value, smallest encoding (negative values use the int family).
    pub fn sint(&mut self, v: i64) -> &mut Self {
        rmp::encode::write_sint(&mut self.0, v).unwrap();
        self
    }
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// A vLLM-style (>= 0.26) tagged-map BlockStored.
pub fn stored_map(
    mp: &mut Mp,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    block_size: u64,
    medium: Option<&str>,
) {
    mp.map(7).str("type").str("BlockStored");
    mp.str("block_hashes").array(hashes.len() as u32);
    for &h in hashes {
        mp.uint(h, Width::Smallest);
    }
    mp.str("parent_block_hash");
    match parent {
        Some(p) => mp.uint(p, Width::Smallest),
        None => mp.nil(),
    };
    mp.str("token_ids").array(tokens.len() as u32);
    for &t in tokens {
        mp.uint(u64::from(t), Width::Smallest);
    }
    mp.str("block_size").uint(block_size, Width::Smallest);
    mp.str("lora_id").nil();
    mp.str("medium");
    match medium {
        Some(m) => mp.str(m),
        None => mp.nil(),
    };
}

pub fn removed_map(mp: &mut Mp, hashes: &[u64], medium: &str) {
    mp.map(4).str("type").str("BlockRemoved");
    mp.str("block_hashes").array(hashes.len() as u32);
    for &h in hashes {
        mp.uint(h, Width::Smallest);
    }
    mp.str("medium")
        .str(medium)
        .str("group_idx")
        .uint(0, Width::Smallest);
}

pub fn cleared_map(mp: &mut Mp) {
    mp.map(1).str("type").str("AllBlocksCleared");
}

/// `[ts, [events...], dp_rank]` with the events written by `events`.
pub fn batch(n_events: u32, dp_rank: Option<u64>, events: impl FnOnce(&mut Mp)) -> Vec<u8> {
    let mut mp = Mp::new();
    mp.array(3).f64(1_796_056_360.5).array(n_events);
    events(&mut mp);
    match dp_rank {
        Some(r) => mp.uint(r, Width::Smallest),
        None => mp.nil(),
    };
    mp.take()
}

/// Tokens of a block: distinct per hash so that blocks are told apart.
pub fn block_tokens(hash: u64, block_size: usize) -> Vec<u32> {
    (0..block_size)
        .map(|i| ((hash as u32) ^ 0x5a5a).wrapping_add(i as u32) % 60000)
        .collect()
}

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm")
}

/// The 18 captured vLLM 0.32 payloads, in sequence order.
pub fn fixtures() -> Vec<Vec<u8>> {
    (0..18)
        .map(|i| std::fs::read(fixtures_dir().join(format!("{i:04}.msgpack"))).unwrap())
        .collect()
}
