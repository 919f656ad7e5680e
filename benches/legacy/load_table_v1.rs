//! The per-request load table this crate used before the fixed-size one (commit b9fae26),
//! kept only so `cargo bench --bench load_table` can time both side by side.
#![allow(dead_code, clippy::all)]
use std::fmt;

use envoy_kv_router::types::SlotIdx;

/// Upper bound on in-flight entries (about 2.5 MB encoded).
pub const MAX_ENTRIES: usize = 65_536;

const MAGIC: &[u8; 4] = b"EKLT";
const VERSION: u8 = 1;
const HEADER_LEN: usize = 4 + 1 + 4 + 4 + 4;
const ANCHOR_LEN: usize = 2 + 8;
const ENTRY_LEN: usize = 8 + 2 + 8 + 4 + 4 + 8 + 4;

/// Booked load of one slot at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SlotLoad {
    /// Uncached prompt tokens of requests still in prefill (decayed when a model is configured).
    pub prefill_tokens: f64,
    /// Prompt blocks (and weighted output blocks) of every active request.
    pub decode_blocks: f64,
    pub active_requests: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    key: u64,
    slot: SlotIdx,
    admitted_ms: u64,
    /// Full uncached prompt tokens; 0 once the first token arrived.
    prefill_tokens: u32,
    prompt_blocks: u32,
    output_milli_blocks: u64,
    /// Predicted prefill duration; 0 = no decay.
    expected_prefill_ms: u32,
}

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadTable {
    /// Per slot: when the last anchor left prefill (0 = never).
    anchor_since_ms: Vec<u64>,
    entries: Vec<Entry>,
    /// [`MAX_ENTRIES`] (smaller in tests); not encoded.
    max_entries: usize,
}

/// Why stored bytes could not be decoded (the caller starts a fresh table and should count it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadDecodeError {
    BadMagic,
    UnsupportedVersion {
        found: u8,
    },
    /// The configuration changed the number of slots since the table was written.
    SlotCountMismatch {
        stored: u32,
        expected: usize,
    },
    Truncated {
        len: usize,
        needed: usize,
    },
    SlotOutOfRange {
        slot: SlotIdx,
        num_slots: usize,
    },
    TooManyEntries {
        count: u32,
    },
}

impl fmt::Display for LoadDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadDecodeError::BadMagic => write!(f, "load table: not a load table (bad magic)"),
            LoadDecodeError::UnsupportedVersion { found } => {
                write!(f, "load table: unsupported version {found} (expected {VERSION})")
            }
            LoadDecodeError::SlotCountMismatch { stored, expected } => write!(
                f,
                "load table: written for {stored} slots but the configuration has {expected} (reconfigured?)"
            ),
            LoadDecodeError::Truncated { len, needed } => {
                write!(f, "load table: {len} bytes, expected {needed}")
            }
            LoadDecodeError::SlotOutOfRange { slot, num_slots } => {
                write!(f, "load table: entry for slot {slot} but only {num_slots} slots")
            }
            LoadDecodeError::TooManyEntries { count } => {
                write!(f, "load table: {count} entries exceed the limit {MAX_ENTRIES}")
            }
        }
    }
}

impl std::error::Error for LoadDecodeError {}

impl LoadTable {
    pub fn new(num_slots: usize) -> Self {
        LoadTable {
            anchor_since_ms: vec![0; num_slots],
            entries: Vec::new(),
            max_entries: MAX_ENTRIES,
        }
    }

    pub fn num_slots(&self) -> usize {
        self.anchor_since_ms.len()
    }

    /// Decodes [`LoadTable::encode`] output. Empty bytes (the key was never written) is a fresh
    /// table, not an error.
    pub fn decode(bytes: &[u8], num_slots: usize) -> Result<LoadTable, LoadDecodeError> {
        if bytes.is_empty() {
            return Ok(LoadTable::new(num_slots));
        }
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(4)?;
        if magic != MAGIC {
            return Err(LoadDecodeError::BadMagic);
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(LoadDecodeError::UnsupportedVersion { found: version });
        }
        let stored = r.u32()?;
        if usize::try_from(stored).ok() != Some(num_slots) {
            return Err(LoadDecodeError::SlotCountMismatch {
                stored,
                expected: num_slots,
            });
        }
        let anchors = r.u32()?;
        let count = r.u32()?;
        if usize::try_from(count).map_or(true, |c| c > MAX_ENTRIES) {
            return Err(LoadDecodeError::TooManyEntries { count });
        }
        let needed = (anchors as usize)
            .saturating_mul(ANCHOR_LEN)
            .saturating_add((count as usize).saturating_mul(ENTRY_LEN))
            .saturating_add(HEADER_LEN);
        if bytes.len() != needed {
            return Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed,
            });
        }
        let mut table = LoadTable::new(num_slots);
        for _ in 0..anchors {
            let slot = r.u16()?;
            let ms = r.u64()?;
            match table.anchor_since_ms.get_mut(usize::from(slot)) {
                Some(a) => *a = ms,
                None => return Err(LoadDecodeError::SlotOutOfRange { slot, num_slots }),
            }
        }
        table.entries.reserve(count as usize);
        for _ in 0..count {
            let e = Entry {
                key: r.u64()?,
                slot: r.u16()?,
                admitted_ms: r.u64()?,
                prefill_tokens: r.u32()?,
                prompt_blocks: r.u32()?,
                output_milli_blocks: r.u64()?,
                expected_prefill_ms: r.u32()?,
            };
            if usize::from(e.slot) >= num_slots {
                return Err(LoadDecodeError::SlotOutOfRange {
                    slot: e.slot,
                    num_slots,
                });
            }
            table.entries.push(e);
        }
        Ok(table)
    }

    /// [`LoadTable::decode`], falling back to a fresh table; the error (if any) is returned so the
    /// adapter can log and count it.
    pub fn decode_or_fresh(bytes: &[u8], num_slots: usize) -> (LoadTable, Option<LoadDecodeError>) {
        match LoadTable::decode(bytes, num_slots) {
            Ok(t) => (t, None),
            Err(e) => (LoadTable::new(num_slots), Some(e)),
        }
    }

    /// Compact little-endian binary: header, non-zero anchors `(slot, ms)`, entries.
    pub fn encode(&self) -> Vec<u8> {
        let anchors: Vec<(usize, u64)> = self
            .anchor_since_ms
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, ms)| *ms != 0)
            .collect();
        let mut out = Vec::with_capacity(
            HEADER_LEN + anchors.len() * ANCHOR_LEN + self.entries.len() * ENTRY_LEN,
        );
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(self.anchor_since_ms.len() as u32).to_le_bytes());
        out.extend_from_slice(&(anchors.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (slot, ms) in anchors {
            // Slots are SlotIdx (u16) by construction of every table user.
            out.extend_from_slice(&(slot as u16).to_le_bytes());
            out.extend_from_slice(&ms.to_le_bytes());
        }
        for e in &self.entries {
            out.extend_from_slice(&e.key.to_le_bytes());
            out.extend_from_slice(&e.slot.to_le_bytes());
            out.extend_from_slice(&e.admitted_ms.to_le_bytes());
            out.extend_from_slice(&e.prefill_tokens.to_le_bytes());
            out.extend_from_slice(&e.prompt_blocks.to_le_bytes());
            out.extend_from_slice(&e.output_milli_blocks.to_le_bytes());
            out.extend_from_slice(&e.expected_prefill_ms.to_le_bytes());
        }
        out
    }

    /// Books a routed request on `slot`. `key` must be unique per in-flight request (an existing
    /// entry with the same key is replaced). `expected_prefill_ms`: the predicted prefill duration
    /// (polynomial model) or `None` (no decay). Returns `false` when the booking displaced
    /// something (same key, or the oldest entry because the table is full) or `slot` is out of
    /// range (nothing booked) — worth counting.
    pub fn admit(
        &mut self,
        key: u64,
        slot: SlotIdx,
        prefill_tokens: u32,
        prompt_blocks: u32,
        expected_prefill_ms: Option<f64>,
        now_ms: u64,
    ) -> bool {
        if usize::from(slot) >= self.num_slots() {
            return false;
        }
        let mut clean = true;
        if self.remove(key, now_ms) {
            clean = false;
        }
        if self.entries.len() >= self.max_entries {
            if let Some(oldest) = self.oldest_index() {
                self.remove_at(oldest, now_ms);
            }
            clean = false;
        }
        let expected_prefill_ms = match expected_prefill_ms {
            Some(ms) if ms.is_finite() && ms > 0.0 => ms.ceil().min(f64::from(u32::MAX)) as u32,
            _ => 0,
        };
        self.entries.push(Entry {
            key,
            slot,
            admitted_ms: now_ms,
            prefill_tokens,
            prompt_blocks,
            output_milli_blocks: 0,
            expected_prefill_ms,
        });
        clean
    }

    /// The request produced its first token: its prefill tokens drop to 0. `false` if unknown.
    pub fn first_token(&mut self, key: u64, now_ms: u64) -> bool {
        let Some(i) = self.position(key) else {
            return false;
        };
        self.leave_prefill(i, now_ms);
        if let Some(e) = self.entries.get_mut(i) {
            e.prefill_tokens = 0;
        }
        true
    }

    /// Sets the request's weighted output blocks ([`output_milli_blocks`]). `false` if unknown.
    pub fn set_output_milli_blocks(&mut self, key: u64, milli_blocks: u64) -> bool {
        match self.entries.iter_mut().find(|e| e.key == key) {
            Some(e) => {
                e.output_milli_blocks = milli_blocks;
                true
            }
            None => false,
        }
    }

    /// The request ended: removes exactly what it booked. `false` if unknown (already reaped).
    ///
    /// Releasing a request that is still its slot's decaying anchor hands the decay over to the
    /// next prefill; without a clock the latest time the table has seen is used (a lower bound).
    /// Prefer [`LoadTable::release_at`] when the time is at hand.
    pub fn release(&mut self, key: u64) -> bool {
        let since = self.latest_activity_ms();
        self.remove(key, since)
    }

    /// Re-homes a request's booking on `slot` (Envoy retried it on a fallback host), keeping what
    /// it booked. `false` if the key is unknown or the slot out of range.
    pub fn move_to(&mut self, key: u64, slot: SlotIdx, now_ms: u64) -> bool {
        if usize::from(slot) >= self.num_slots() {
            return false;
        }
        let Some(i) = self.position(key) else {
            return false;
        };
        let Some(entry) = self.entries.get(i).copied() else {
            return false;
        };
        if entry.slot != slot {
            self.remove_at(i, now_ms);
            self.entries.push(Entry { slot, ..entry });
        }
        true
    }

    /// [`LoadTable::release`] at `now_ms`, so a decaying anchor hands over exactly.
    pub fn release_at(&mut self, key: u64, now_ms: u64) -> bool {
        self.remove(key, now_ms)
    }

    /// Per-slot load at `now_ms`.
    pub fn view(&self, now_ms: u64) -> Vec<SlotLoad> {
        let n = self.num_slots();
        let anchors = self.anchors();
        let mut prefill = vec![0u64; n];
        let mut decode_milli = vec![0u64; n];
        let mut active = vec![0u32; n];
        for (i, e) in self.entries.iter().enumerate() {
            let s = usize::from(e.slot);
            let tokens = if anchors.get(s).copied().flatten() == Some(i) {
                let since = self.anchor_since_ms.get(s).copied().unwrap_or(0);
                decayed(e, since, now_ms)
            } else {
                u64::from(e.prefill_tokens)
            };
            if let Some(p) = prefill.get_mut(s) {
                *p = p.saturating_add(tokens);
            }
            if let Some(d) = decode_milli.get_mut(s) {
                let blocks = u64::from(e.prompt_blocks)
                    .saturating_mul(1000)
                    .saturating_add(e.output_milli_blocks);
                *d = d.saturating_add(blocks);
            }
            if let Some(a) = active.get_mut(s) {
                *a = a.saturating_add(1);
            }
        }
        (0..n)
            .map(|s| SlotLoad {
                prefill_tokens: prefill.get(s).copied().unwrap_or(0) as f64,
                decode_blocks: decode_milli.get(s).copied().unwrap_or(0) as f64 / 1000.0,
                active_requests: active.get(s).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Removes entries admitted more than `max_age_ms` before `now_ms` (their VM, connection or
    /// stream died without a release). Returns how many.
    pub fn reap_older_than(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let anchors = self.anchors();
        let before = self.entries.len();
        let mut handed_over = Vec::new();
        let mut i = 0usize;
        self.entries.retain(|e| {
            let keep = now_ms.saturating_sub(e.admitted_ms) <= max_age_ms;
            if !keep && anchors.get(usize::from(e.slot)).copied().flatten() == Some(i) {
                handed_over.push(e.slot);
            }
            i += 1;
            keep
        });
        for slot in handed_over {
            if let Some(a) = self.anchor_since_ms.get_mut(usize::from(slot)) {
                *a = (*a).max(now_ms);
            }
        }
        before - self.entries.len()
    }

    pub fn active_entries(&self) -> usize {
        self.entries.len()
    }

    fn position(&self, key: u64) -> Option<usize> {
        self.entries.iter().position(|e| e.key == key)
    }

    fn remove(&mut self, key: u64, now_ms: u64) -> bool {
        match self.position(key) {
            Some(i) => {
                self.remove_at(i, now_ms);
                true
            }
            None => false,
        }
    }

    fn remove_at(&mut self, i: usize, now_ms: u64) {
        self.leave_prefill(i, now_ms);
        if i < self.entries.len() {
            self.entries.remove(i);
        }
    }

    /// If entry `i` is its slot's anchor, the next prefill on that slot starts decaying now.
    fn leave_prefill(&mut self, i: usize, now_ms: u64) {
        let Some(e) = self.entries.get(i) else {
            return;
        };
        if e.prefill_tokens == 0 {
            return;
        }
        let s = usize::from(e.slot);
        if self.anchor_of(e.slot) == Some(i) {
            if let Some(a) = self.anchor_since_ms.get_mut(s) {
                *a = (*a).max(now_ms);
            }
        }
    }

    /// Index of the oldest entry still in prefill on `slot`.
    fn anchor_of(&self, slot: SlotIdx) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            if e.slot == slot && e.prefill_tokens > 0 && best.is_none_or(|(t, _)| e.admitted_ms < t)
            {
                best = Some((e.admitted_ms, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// [`LoadTable::anchor_of`] for every slot in one pass.
    fn anchors(&self) -> Vec<Option<usize>> {
        let mut best: Vec<Option<(u64, usize)>> = vec![None; self.num_slots()];
        for (i, e) in self.entries.iter().enumerate() {
            if e.prefill_tokens == 0 {
                continue;
            }
            if let Some(b) = best.get_mut(usize::from(e.slot)) {
                if b.is_none_or(|(t, _)| e.admitted_ms < t) {
                    *b = Some((e.admitted_ms, i));
                }
            }
        }
        best.into_iter().map(|b| b.map(|(_, i)| i)).collect()
    }

    fn oldest_index(&self) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            if best.is_none_or(|(t, _)| e.admitted_ms < t) {
                best = Some((e.admitted_ms, i));
            }
        }
        best.map(|(_, i)| i)
    }

    fn latest_activity_ms(&self) -> u64 {
        let a = self.anchor_since_ms.iter().copied().max().unwrap_or(0);
        let e = self
            .entries
            .iter()
            .map(|e| e.admitted_ms)
            .max()
            .unwrap_or(0);
        a.max(e)
    }
}

/// Remaining prefill tokens of an anchor entry at `now_ms`.
fn decayed(e: &Entry, anchor_since_ms: u64, now_ms: u64) -> u64 {
    let full = u64::from(e.prefill_tokens);
    let expected = u64::from(e.expected_prefill_ms);
    if expected == 0 || full == 0 {
        return full;
    }
    let start = e.admitted_ms.max(anchor_since_ms);
    let elapsed = now_ms.saturating_sub(start).min(expected);
    let left = expected - elapsed;
    // ceil(full * left / expected), exact in integers.
    let num = u128::from(full) * u128::from(left);
    let den = u128::from(expected);
    num.div_ceil(den) as u64
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LoadDecodeError> {
        let end = self.pos.saturating_add(n);
        let s = self
            .bytes
            .get(self.pos..end)
            .ok_or(LoadDecodeError::Truncated {
                len: self.bytes.len(),
                needed: end,
            })?;
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], LoadDecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, LoadDecodeError> {
        Ok(u8::from_le_bytes(self.array::<1>()?))
    }
    fn u16(&mut self) -> Result<u16, LoadDecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, LoadDecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, LoadDecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}
