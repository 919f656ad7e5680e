//! Bounds-checked little-endian reading and writing, the one-byte tier codes, and the errors of
//! binary decoding: shared by the event log codec and the index snapshot.

use core::fmt;

use crate::types::StorageTier;

/// Why a binary log batch or index snapshot could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CodecError {
    /// The input ends before a value that starts at `offset`.
    Truncated { offset: usize, needed_bytes: usize },
    /// The input does not start with the expected magic bytes (wrong key, or garbage).
    BadMagic,
    /// Written by a different codec version (mixed filter versions during a rollout).
    UnsupportedVersion { got: u8, supported: u8 },
    /// An enum tag byte with no meaning.
    InvalidTag {
        field: &'static str,
        value: u8,
        offset: usize,
    },
    /// A length prefix larger than the remaining input could hold.
    CountTooLarge {
        field: &'static str,
        count: u32,
        offset: usize,
    },
    /// Bytes left over after the last value.
    TrailingBytes { count: usize },
    /// A snapshot for a different number of slots than the current configuration.
    SlotCountMismatch { expected: usize, got: usize },
    /// A snapshot holds the same block twice in one slot.
    DuplicateBlock { slot: u16, block: u64 },
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated {
                offset,
                needed_bytes,
            } => write!(f, "truncated: need {needed_bytes} bytes at offset {offset}"),
            Self::BadMagic => f.write_str("not an envoy-kv-router record (bad magic)"),
            Self::UnsupportedVersion { got, supported } => {
                write!(
                    f,
                    "codec version {got}, this build reads version {supported}"
                )
            }
            Self::InvalidTag {
                field,
                value,
                offset,
            } => write!(f, "invalid {field} tag {value} at offset {offset}"),
            Self::CountTooLarge {
                field,
                count,
                offset,
            } => write!(
                f,
                "{field} count {count} at offset {offset} exceeds the input"
            ),
            Self::TrailingBytes { count } => write!(f, "{count} trailing bytes"),
            Self::SlotCountMismatch { expected, got } => write!(
                f,
                "snapshot has {got} slots, the configuration has {expected}"
            ),
            Self::DuplicateBlock { slot, block } => {
                write!(f, "snapshot holds block {block} twice in slot {slot}")
            }
        }
    }
}

impl std::error::Error for CodecError {}

/// Stable one-byte code of a tier (shared by the log and the index snapshot).
pub(crate) fn tier_code(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::Device => 0,
        StorageTier::Host => 1,
        StorageTier::Disk => 2,
    }
}

pub(crate) fn tier_from_code(code: u8) -> Option<StorageTier> {
    match code {
        0 => Some(StorageTier::Device),
        1 => Some(StorageTier::Host),
        2 => Some(StorageTier::Disk),
        _ => None,
    }
}

/// Little-endian append helpers.
pub(crate) struct Writer {
    pub(crate) bytes: Vec<u8>,
}

impl Writer {
    pub(crate) fn new() -> Self {
        Writer { bytes: Vec::new() }
    }

    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }

    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }

    /// A length prefix. Lengths over u32::MAX cannot occur on wasm32 (they would not fit in
    /// memory); natively they saturate, which the decoder then rejects as inconsistent.
    pub(crate) fn len_prefix(&mut self, len: usize) {
        self.u32(u32::try_from(len).unwrap_or(u32::MAX));
    }
}

/// Bounds-checked little-endian reader: every read returns `Err` instead of panicking.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    pub(crate) fn offset(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let truncated = CodecError::Truncated {
            offset: self.pos,
            needed_bytes: N,
        };
        let end = self.pos.checked_add(N).ok_or(truncated.clone())?;
        let slice = self.bytes.get(self.pos..end).ok_or(truncated.clone())?;
        let array = <[u8; N]>::try_from(slice).map_err(|_| truncated)?;
        self.pos = end;
        Ok(array)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, CodecError> {
        self.take::<1>().map(|[b]| b)
    }

    pub(crate) fn u16(&mut self) -> Result<u16, CodecError> {
        self.take::<2>().map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, CodecError> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, CodecError> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    /// A length prefix for elements of at least `min_elem_bytes` each, checked against the rest
    /// of the input so garbage cannot make us allocate gigabytes.
    pub(crate) fn count(
        &mut self,
        field: &'static str,
        min_elem_bytes: usize,
    ) -> Result<usize, CodecError> {
        let offset = self.pos;
        let count = self.u32()?;
        let fits = usize::try_from(count)
            .ok()
            .filter(|&n| n.saturating_mul(min_elem_bytes) <= self.remaining());
        fits.ok_or(CodecError::CountTooLarge {
            field,
            count,
            offset,
        })
    }

    /// Checks a 3-byte magic and a version byte.
    pub(crate) fn header(&mut self, magic: [u8; 3], version: u8) -> Result<(), CodecError> {
        let got = self.take::<3>().map_err(|_| CodecError::BadMagic)?;
        if got != magic {
            return Err(CodecError::BadMagic);
        }
        let got = self.u8()?;
        if got != version {
            return Err(CodecError::UnsupportedVersion {
                got,
                supported: version,
            });
        }
        Ok(())
    }

    pub(crate) fn finish(&self) -> Result<(), CodecError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(CodecError::TrailingBytes { count }),
        }
    }

    pub(crate) fn tier(&mut self) -> Result<StorageTier, CodecError> {
        let offset = self.pos;
        let code = self.u8()?;
        tier_from_code(code).ok_or(CodecError::InvalidTag {
            field: "tier",
            value: code,
            offset,
        })
    }

    /// A presence byte (0 absent, 1 present).
    pub(crate) fn flag(&mut self, field: &'static str) -> Result<bool, CodecError> {
        let offset = self.pos;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(CodecError::InvalidTag {
                field,
                value,
                offset,
            }),
        }
    }
}
