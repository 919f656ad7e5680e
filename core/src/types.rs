//! Plain identifiers shared by every part of the routing core.
//!
//! Newtypes per hash kind keep the three block hashes apart: the engine's opaque hash (only an id),
//! our local hash of one block's tokens, and the chained sequence hash that names a whole prefix.

use serde::{Deserialize, Serialize};

/// Operator-facing worker id, from the filter configuration (`workers[].id`).
pub type WorkerId = u64;

/// Data-parallel rank inside a worker.
pub type DpRank = u32;

/// Dense index of one (worker, dp_rank) pair in the compiled configuration: `0..config.slots.len()`.
/// The index, the load table and the scorer all address workers by slot.
pub type SlotIdx = u16;

/// The largest effective `index.max_blocks`: the index's 24-bit entry-id space (`index::pool`) less
/// a margin of 2^16 ids, so the pool never runs out of ids. Here, below both, because the
/// configuration checks against it and the index enforces it (`index::MAX_BOUND`).
pub const MAX_INDEX_BLOCKS: usize = (1 << 24) - 1 - (1 << 16);

/// XXH3-64 (seed 1337, or a salted seed) of one full block's token ids as little-endian u32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalBlockHash(pub u64);

/// Chained hash naming a whole prefix up to and including one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u64);

/// The engine's own block hash, as it appears in its KV events: an opaque id, used to find the block
/// again in "removed" events and to link a "stored" batch to its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExternalBlockHash(pub u64);

/// Where a worker holds a cached block. External / remote / shared storage counts as `Disk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageTier {
    Device,
    Host,
    Disk,
}

impl StorageTier {
    /// Parses Dynamo's `storage_tier` and vLLM's `medium` spellings; absent means device.
    pub fn parse(name: Option<&str>) -> Option<StorageTier> {
        let Some(name) = name else {
            return Some(StorageTier::Device);
        };
        match name.to_ascii_uppercase().as_str() {
            "" | "GPU" | "DEVICE" | "CUDA" | "HBM" => Some(StorageTier::Device),
            "CPU" | "CPU_PINNED" | "HOST" | "HOST_PINNED" => Some(StorageTier::Host),
            "DISK" | "NVME" | "SSD" | "STORAGE" | "EXTERNAL" | "REMOTE" | "SHARED" => {
                Some(StorageTier::Disk)
            }
            _ => None,
        }
    }
}

/// How many of a request's prompt blocks one slot holds, per tier.
///
/// `device_blocks` is the length of the leading run of blocks cached on the device. `host_blocks`
/// and `disk_blocks` count blocks past that device prefix that continue the prefix on the slower
/// tiers (the run stops at the first block the slot does not hold on any tier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

impl Overlap {
    pub fn total_blocks(&self) -> u32 {
        self.device_blocks + self.host_blocks + self.disk_blocks
    }
}
