//! The load table: what the router has booked on each slot and not yet released.
//!
//! One table per Envoy process, kept under ONE shared-data key and updated by every VM with
//! get -> [`LoadTable::decode`] -> mutate -> [`LoadTable::encode`] -> CAS set (retry on mismatch).
//!
//! Invariants:
//! * The table stores one [`Entry`] per in-flight request and nothing else that sums: per-slot
//!   totals are derived in [`LoadTable::view`]. Accounting is integer (tokens, milli-blocks), so
//!   releasing a request removes exactly what it added and an idle slot reads exactly 0.
//! * Entries keep admission order (ties in `admitted_ms` resolve to the earlier admission).
//! * A request's prefill tokens count from admission until its first token; its prompt blocks and
//!   (optionally) output milli-blocks count until release.
//! * With a predicted prefill duration, only the OLDEST prefill on a slot (the "anchor") decays:
//!   `remaining = ceil(full * clamp(1 - elapsed / expected, 0, 1))`. The anchor's clock starts at
//!   its admission or when the previous anchor left prefill (first token / release / reap),
//!   whichever is later. Others count in full until they become the anchor.
//! * Entries whose VM or stream died are reaped by age ([`LoadTable::reap_older_than`]); the
//!   table is bounded by [`MAX_ENTRIES`] (the oldest entry is dropped beyond it).

use std::fmt;

use crate::types::SlotIdx;

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

    /// Drops every entry booked on a slot in `slots` (its worker left the cluster): its load is
    /// gone at once; the requests' later releases find nothing. Returns how many.
    pub fn clear_slots(&mut self, slots: std::ops::Range<SlotIdx>, now_ms: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|e| !slots.contains(&e.slot));
        for slot in slots {
            if let Some(a) = self.anchor_since_ms.get_mut(usize::from(slot)) {
                *a = (*a).max(now_ms);
            }
        }
        before - self.entries.len()
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

/// Weighted output blocks of a request, in 1/1000 block: the blocks `isl + generated` tokens
/// occupy beyond the prompt's `ceil(isl / block_size)` blocks (one more each time generation
/// crosses a block boundary), each weighted `max(0, 1 - generated / osl)` with an output-length
/// hint, 1.0 without one (a hint of 0 is treated as no hint).
pub fn output_milli_blocks(
    isl_tokens: u32,
    generated_tokens: u32,
    block_size: u32,
    osl_hint: Option<u32>,
) -> u64 {
    if block_size == 0 {
        return 0;
    }
    let bs = u64::from(block_size);
    let isl = u64::from(isl_tokens);
    let prompt_blocks = isl.div_ceil(bs);
    let total_blocks = (isl + u64::from(generated_tokens)).div_ceil(bs);
    let blocks = total_blocks.saturating_sub(prompt_blocks);
    match osl_hint {
        Some(osl) if osl > 0 => {
            let left = u64::from(osl.saturating_sub(generated_tokens));
            blocks * 1000 * left / u64::from(osl)
        }
        _ => blocks * 1000,
    }
}

/// Predicted prefill duration in ms for `uncached_tokens` new tokens: the polynomial `poly`
/// (lowest degree first) evaluated at that count, clamped to `>= 0`. A fully cached prompt
/// (0 tokens) costs nothing; a non-finite result is 0 (no decay).
pub fn predicted_prefill_ms(poly: &[f64], uncached_tokens: u32) -> f64 {
    if uncached_tokens == 0 {
        return 0.0;
    }
    let t = f64::from(uncached_tokens);
    let v = poly.iter().rev().fold(0.0, |acc, c| acc * t + c);
    if v.is_finite() {
        v.max(0.0)
    } else {
        0.0
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

    #[test]
    fn admit_first_token_release_returns_to_exactly_zero() {
        let mut t = LoadTable::new(2);
        assert!(t.admit(1, 0, 1000, 16, None, 0));
        assert!(t.admit(2, 0, 500, 8, None, 5));
        assert!(t.admit(3, 1, 64, 1, None, 5));
        let v = t.view(10);
        assert_eq!(v[0].prefill_tokens, 1500.0);
        assert_eq!(v[0].decode_blocks, 24.0);
        assert_eq!(v[0].active_requests, 2);
        assert_eq!(v[1].prefill_tokens, 64.0);

        assert!(t.first_token(1, 20));
        assert!(t.set_output_milli_blocks(1, 2500));
        let v = t.view(20);
        assert_eq!(v[0].prefill_tokens, 500.0);
        assert_eq!(v[0].decode_blocks, 26.5);

        assert!(t.release(1));
        assert!(t.release(2));
        assert!(t.release(3));
        assert!(!t.release(3));
        assert!(!t.first_token(9, 0));
        assert!(!t.set_output_milli_blocks(9, 1));
        assert_eq!(t.view(30), vec![SlotLoad::default(); 2]);
        assert_eq!(t.active_entries(), 0);
    }

    #[test]
    fn duplicate_key_replaces_and_bad_slot_is_ignored() {
        let mut t = LoadTable::new(1);
        assert!(t.admit(1, 0, 10, 1, None, 0));
        assert!(!t.admit(1, 0, 20, 2, None, 0));
        assert_eq!(t.active_entries(), 1);
        assert_eq!(t.view(0)[0].prefill_tokens, 20.0);
        assert!(!t.admit(2, 1, 20, 2, None, 0));
        assert_eq!(t.active_entries(), 1);
    }

    #[test]
    fn reference_example_oldest_prefill_decays() {
        // 100 tokens predicted to take 10 s, plus 60 queued behind it: 140 at 2 s, 110 at 5 s.
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 100, 2, Some(10_000.0), 0);
        t.admit(2, 0, 60, 1, Some(6_000.0), 0);
        assert_eq!(t.view(0)[0].prefill_tokens, 160.0);
        assert_eq!(t.view(2_000)[0].prefill_tokens, 140.0);
        assert_eq!(t.view(5_000)[0].prefill_tokens, 110.0);
        // Past its prediction the anchor reads 0 but the next one waits for the hand-over.
        assert_eq!(t.view(12_000)[0].prefill_tokens, 60.0);
        // First token of the anchor at 12 s: the 60-token request is the anchor from 12 s.
        t.first_token(1, 12_000);
        assert_eq!(t.view(12_000)[0].prefill_tokens, 60.0);
        assert_eq!(t.view(15_000)[0].prefill_tokens, 30.0);
        // ceil: 60 * (1 - 3001/6000) = 29.99 -> 30.
        assert_eq!(t.view(15_001)[0].prefill_tokens, 30.0);
        assert_eq!(t.view(15_101)[0].prefill_tokens, 29.0);
        assert_eq!(t.view(20_000)[0].prefill_tokens, 0.0);
        // Decode blocks never decay.
        assert_eq!(t.view(20_000)[0].decode_blocks, 3.0);
    }

    #[test]
    fn a_later_non_anchor_finishing_first_does_not_reset_the_anchor() {
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 100, 1, Some(10_000.0), 0);
        t.admit(2, 0, 60, 1, None, 1_000);
        t.first_token(2, 3_000);
        assert_eq!(t.view(5_000)[0].prefill_tokens, 50.0);
    }

    #[test]
    fn without_a_prediction_nothing_decays() {
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 100, 1, None, 0);
        t.admit(2, 0, 60, 1, Some(f64::NAN), 0);
        assert_eq!(t.view(1_000_000)[0].prefill_tokens, 160.0);
    }

    #[test]
    fn encode_decode_round_trip_preserves_everything() {
        let mut t = LoadTable::new(3);
        t.admit(u64::MAX, 2, 123, 4, Some(1500.0), 1_000);
        t.admit(7, 0, 50, 1, None, 1_001);
        t.admit(8, 0, 10, 1, Some(100.0), 1_002);
        t.first_token(7, 1_100);
        t.set_output_milli_blocks(u64::MAX, 333);
        let bytes = t.encode();
        let back = LoadTable::decode(&bytes, 3).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.view(1_200), t.view(1_200));
        assert_eq!(back.encode(), bytes);
    }

    #[test]
    fn decode_rejects_garbage_and_other_slot_counts() {
        assert_eq!(LoadTable::decode(&[], 4), Ok(LoadTable::new(4)));
        assert_eq!(
            LoadTable::decode(b"nope-nope-nope-nope", 4),
            Err(LoadDecodeError::BadMagic)
        );
        let mut t = LoadTable::new(4);
        t.admit(1, 3, 1, 1, None, 0);
        let bytes = t.encode();
        assert_eq!(
            LoadTable::decode(&bytes, 5),
            Err(LoadDecodeError::SlotCountMismatch {
                stored: 4,
                expected: 5
            })
        );
        assert!(matches!(
            LoadTable::decode(&bytes[..bytes.len() - 1], 4),
            Err(LoadDecodeError::Truncated { .. })
        ));
        let mut v2 = bytes.clone();
        v2[4] = 2;
        assert_eq!(
            LoadTable::decode(&v2, 4),
            Err(LoadDecodeError::UnsupportedVersion { found: 2 })
        );
        // An entry pointing past the slot count.
        let mut bad = bytes.clone();
        let slot_at = HEADER_LEN + 8;
        bad[slot_at] = 9;
        assert_eq!(
            LoadTable::decode(&bad, 4),
            Err(LoadDecodeError::SlotOutOfRange {
                slot: 9,
                num_slots: 4
            })
        );
        let (fresh, err) = LoadTable::decode_or_fresh(&bad, 4);
        assert_eq!(fresh, LoadTable::new(4));
        assert!(err.is_some());
    }

    #[test]
    fn reap_removes_only_old_entries() {
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 10, 1, None, 0);
        t.admit(2, 0, 20, 1, None, 500);
        t.admit(3, 0, 30, 1, None, 1_000);
        assert_eq!(t.reap_older_than(1_000, 500), 1);
        assert_eq!(t.active_entries(), 2);
        assert_eq!(t.view(1_000)[0].prefill_tokens, 50.0);
        assert_eq!(t.reap_older_than(10_000, 500), 2);
        assert_eq!(t.view(10_000), vec![SlotLoad::default()]);
    }

    #[test]
    fn table_is_bounded() {
        let mut t = LoadTable {
            max_entries: 8,
            ..LoadTable::new(1)
        };
        for k in 0..8 {
            assert!(t.admit(k, 0, 1, 1, None, k));
        }
        assert!(!t.admit(u64::MAX, 0, 1, 1, None, 100));
        assert_eq!(t.active_entries(), 8);
        assert!(!t.release(0), "the oldest entry was dropped");
    }

    #[test]
    fn output_blocks_cross_boundaries_and_follow_the_hint() {
        // isl 100, block 16: the prompt occupies 7 blocks (112 token slots).
        assert_eq!(output_milli_blocks(100, 0, 16, None), 0);
        assert_eq!(output_milli_blocks(100, 12, 16, None), 0);
        assert_eq!(output_milli_blocks(100, 13, 16, None), 1000);
        assert_eq!(output_milli_blocks(100, 45, 16, None), 3000);
        // osl 90, 45 generated: 3 blocks at weight 0.5.
        assert_eq!(output_milli_blocks(100, 45, 16, Some(90)), 1500);
        // osl 120: weight 1 - 45/120 = 0.625.
        assert_eq!(output_milli_blocks(100, 45, 16, Some(120)), 1875);
        // Past the hint the weight is 0.
        assert_eq!(output_milli_blocks(100, 45, 16, Some(40)), 0);
        assert_eq!(output_milli_blocks(100, 45, 16, Some(0)), 3000);
        // Prompt that fills its blocks exactly: the first generated token opens a block.
        assert_eq!(output_milli_blocks(64, 1, 64, None), 1000);
        assert_eq!(output_milli_blocks(64, 1, 0, None), 0);
    }

    #[test]
    fn predicted_prefill_follows_the_polynomial() {
        let poly = [16.5, 0.0152, 4.21e-7];
        assert_eq!(predicted_prefill_ms(&poly, 0), 0.0);
        let ms = predicted_prefill_ms(&poly, 1000);
        assert!((ms - (16.5 + 15.2 + 0.421)).abs() < 1e-9, "{ms}");
        assert_eq!(predicted_prefill_ms(&[-5.0], 10), 0.0);
        assert_eq!(predicted_prefill_ms(&[], 10), 0.0);
    }
}

/// Folds a worker's own counters (reported with its KV events) into this router's view of one
/// of its slots. Each Envoy replica books only its own traffic; the worker sees everyone's, so
/// taking the larger of the two keeps replicas in front of the same workers from all believing
/// a worker idle. `dp_size` splits a whole-worker report evenly over its ranks.
pub fn merge_reported(
    load: &mut SlotLoad,
    reported: &crate::events::ReportedLoad,
    kv_capacity_blocks: Option<u32>,
    dp_size: u32,
) {
    let ranks = dp_size.max(1);
    let requests = reported.num_running.saturating_add(reported.num_waiting) / ranks;
    load.active_requests = load.active_requests.max(requests);
    if let Some(capacity) = kv_capacity_blocks {
        let usage = reported.kv_usage.clamp(0.0, 1.0);
        let blocks = usage * f64::from(capacity);
        if blocks.is_finite() {
            load.decode_blocks = load.decode_blocks.max(blocks);
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)] // test code: indexing is the assertion
mod move_to_tests {
    use super::*;

    #[test]
    fn a_moved_booking_follows_the_request_and_releases_to_zero() {
        let mut table = LoadTable::new(3);
        assert!(table.admit(7, 0, 640, 10, None, 1_000));
        assert!(table.move_to(7, 2, 1_010));
        let view = table.view(1_020);
        assert_eq!((view[0].active_requests, view[0].decode_blocks), (0, 0.0));
        assert_eq!((view[2].active_requests, view[2].decode_blocks), (1, 10.0));
        assert_eq!(view[2].prefill_tokens, 640.0);
        assert!(!table.move_to(7, 3, 1_030), "slot out of range");
        assert!(!table.move_to(8, 1, 1_030), "unknown key");
        assert!(table.release_at(7, 1_040));
        assert_eq!(table.active_entries(), 0);
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)] // test code
mod merge_reported_tests {
    use super::*;
    use crate::events::ReportedLoad;

    #[test]
    fn the_larger_view_wins() {
        let reported = ReportedLoad {
            num_waiting: 2,
            num_running: 6,
            kv_usage: 0.5,
        };
        let mut idle = SlotLoad {
            prefill_tokens: 0.0,
            decode_blocks: 10.0,
            active_requests: 1,
        };
        merge_reported(&mut idle, &reported, Some(1000), 1);
        assert_eq!(idle.active_requests, 8);
        assert_eq!(idle.decode_blocks, 500.0);
        let mut busy = SlotLoad {
            prefill_tokens: 0.0,
            decode_blocks: 800.0,
            active_requests: 20,
        };
        merge_reported(&mut busy, &reported, Some(1000), 2);
        assert_eq!(busy.active_requests, 20, "local view larger: kept");
        assert_eq!(busy.decode_blocks, 800.0);
    }

    #[test]
    fn without_capacity_only_requests_merge_and_bad_usage_is_clamped() {
        let reported = ReportedLoad {
            num_waiting: 0,
            num_running: 4,
            kv_usage: 7.0,
        };
        let mut load = SlotLoad {
            prefill_tokens: 0.0,
            decode_blocks: 3.0,
            active_requests: 0,
        };
        merge_reported(&mut load, &reported, None, 1);
        assert_eq!((load.active_requests, load.decode_blocks), (4, 3.0));
        merge_reported(&mut load, &reported, Some(10), 1);
        assert_eq!(load.decode_blocks, 10.0, "usage clamped to the capacity");
    }
}
