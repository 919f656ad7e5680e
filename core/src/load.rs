//! The load table: what the router has booked on each slot and not yet released.
//!
//! One table per Envoy process, kept under ONE shared-data key and updated by every VM with
//! get -> [`LoadTable::decode`] -> mutate -> [`LoadTable::encode`] -> CAS set (retry on mismatch).
//!
//! Its size is fixed by the configuration (slots x [`BUCKETS`] counters, plus at most
//! [`PREFILL_QUEUE`] decaying prefills per slot), never by the requests in flight, so a booking,
//! first token or release costs the same with 0 or 10,000 requests open. What a request booked is
//! kept in its own [`Ticket`] (the request context), which a release hands back.
//!
//! Invariants:
//! * Per slot, per time bucket: prefill tokens, decode milli-blocks and active requests. Accounting
//!   is integer, so releasing a ticket removes exactly what it added and an idle slot reads 0.
//! * A booking lands in the bucket of its admission time (buckets are `bucket_ms` wide, a ring of
//!   [`BUCKETS`] shared by all slots). A bucket lives `(BUCKETS - 1) * bucket_ms >= timeout` to
//!   `BUCKETS * bucket_ms`; then it is dropped with whatever it still holds, counted as reaped
//!   (requests whose VM, connection or stream died without a release). A ticket whose bucket is
//!   gone releases nothing.
//! * A request's prefill tokens count from admission until its first token; its prompt blocks and
//!   (optionally) output milli-blocks count until release.
//! * With a predicted prefill duration, only the OLDEST queued prefill on a slot (the "anchor")
//!   decays: `remaining = ceil(full * clamp(1 - elapsed / expected, 0, 1))`. The anchor's clock
//!   starts at its admission or when the previous anchor left prefill (first token / release /
//!   reap), whichever is later. Each slot queues at most [`PREFILL_QUEUE`] decaying prefills in
//!   admission order; a prefill admitted while its slot's queue is full counts in full until its
//!   first token (it never becomes the anchor): a bounded, conservative approximation.
//! * [`LoadTable::clear_slot`] zeroes a slot (its worker left) and bumps the slot's generation,
//!   so tickets booked before never subtract from what is booked after.

use std::fmt;

use crate::types::SlotIdx;

pub mod placed;
pub mod recent;
mod reported;
pub mod share;
mod window;
pub use reported::{add_other_routers, kv_fill, merge_reported, reported_requests};
pub use window::{reap_due, view_bytes, view_bytes_at, Window};

/// Time buckets per slot: a booking is reaped between `timeout` and `timeout * BUCKETS / (BUCKETS - 1)`.
pub const BUCKETS: usize = 4;
/// Decaying prefills remembered per slot (the anchor and the ones queued behind it).
pub const PREFILL_QUEUE: usize = 4;
/// `load.request_timeout_ms` default, for tables made without a configuration.
pub const DEFAULT_TIMEOUT_MS: u64 = 900_000;

const MAGIC: &[u8; 4] = b"EKLT";
/// 3: every slot's fixed-size summary first, then the slots' variable details (2 interleaved
/// them, so reading slot `i` walked every slot before it). A table of another version is
/// refused and replaced by a fresh one, as any undecodable table (bookings in flight across
/// the upgrade are forgotten: their releases find nothing to subtract).
const VERSION: u8 = 3;
const HEADER_LEN: usize = 4 + 1 + 4 + 8 + 8 + 8 * BUCKETS;
const QUEUED_LEN: usize = 8 + 4 + 4 + 8;
const COUNTERS_LEN: usize = 8 + 8 + 4;
/// A slot's summary: generation, anchor time, queue length, mask of its non-zero buckets, and
/// the sum of those buckets (prefill tokens, decode milli-blocks, active requests).
const SLOT_FIXED_LEN: usize = 4 + 8 + 1 + 1 + COUNTERS_LEN;
/// Where the counters' sum starts in a slot's summary.
const TOTALS_AT: usize = 4 + 8 + 1 + 1;

/// Bytes of a slot's details with `queued` prefills and the non-zero buckets of `mask`: the
/// queue, then the buckets' counters only when there are two or more (one bucket equals the
/// summary's sum, so it is not written again).
/// `mask` must be below `1 << BUCKETS` (callers check it).
#[inline(always)]
fn details_len(queued: usize, mask: u8) -> usize {
    let buckets = BUCKETS_LEN.get(usize::from(mask)).copied().unwrap_or(0);
    queued * QUEUED_LEN + usize::from(buckets)
}

/// Bytes of a slot's buckets in its details, by mask (two or more set bits: 20 bytes each, else
/// none): a table, as x86-64's baseline has no popcount instruction and its software version
/// costs more than the rest of a slot's view (`details_len_counts_the_buckets_of_two_or_more`).
const BUCKETS_LEN: [u8; 1 << BUCKETS] = [0, 0, 0, 40, 0, 40, 40, 60, 0, 40, 40, 60, 40, 60, 60, 80];

/// Booked load of one slot at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SlotLoad {
    /// Prefill work of requests still in prefill, in token-equivalents: their uncached tokens,
    /// and the attention of a long prompt or a long cached prefix on top
    /// ([`crate::prefill_work::prefill_work_tokens`]); decayed when a model is configured.
    pub prefill_tokens: f64,
    /// Prompt blocks (and weighted output blocks) of every active request.
    pub decode_blocks: f64,
    pub active_requests: u32,
}

/// What one request booked: kept in its request context, handed back on every later phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub key: u64,
    pub slot: SlotIdx,
    /// The slot's generation at booking (see [`LoadTable::clear_slot`]).
    generation: u32,
    /// The time bucket the booking is counted in.
    epoch: u64,
    /// Uncached prompt tokens still booked as prefill; 0 once the first token arrived.
    prefill_tokens: u32,
    prompt_blocks: u32,
    output_milli_blocks: u64,
}

impl Ticket {
    fn decode_milli(&self) -> u64 {
        u64::from(self.prompt_blocks)
            .saturating_mul(1000)
            .saturating_add(self.output_milli_blocks)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counters {
    prefill_tokens: u64,
    decode_milli: u64,
    active: u32,
}

impl Counters {
    fn add(&mut self, c: &Counters) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(c.prefill_tokens);
        self.decode_milli = self.decode_milli.saturating_add(c.decode_milli);
        self.active = self.active.saturating_add(c.active);
    }
}

/// A decaying prefill waiting for (or being) its slot's anchor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Queued {
    key: u64,
    epoch: u64,
    prefill_tokens: u32,
    expected_prefill_ms: u32,
    admitted_ms: u64,
}

/// At most [`PREFILL_QUEUE`] prefills in admission order, inline (decoding allocates nothing).
#[derive(Clone, Debug, Default)]
struct PrefillQueue {
    items: [Queued; PREFILL_QUEUE],
    len: usize,
}

impl PartialEq for PrefillQueue {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for PrefillQueue {}

impl PrefillQueue {
    fn as_slice(&self) -> &[Queued] {
        self.items.get(..self.len).unwrap_or_default()
    }
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn iter(&self) -> std::slice::Iter<'_, Queued> {
        self.as_slice().iter()
    }
    fn first(&self) -> Option<&Queued> {
        self.as_slice().first()
    }
    /// `false` (nothing kept) when full.
    fn push(&mut self, q: Queued) -> bool {
        match self.items.get_mut(self.len) {
            Some(slot) => {
                *slot = q;
                self.len += 1;
                true
            }
            None => false,
        }
    }
    fn remove(&mut self, i: usize) {
        if i < self.len {
            if let Some(tail) = self.items.get_mut(i..self.len) {
                tail.rotate_left(1);
            }
            self.len -= 1;
        }
    }
    fn retain(&mut self, keep: impl Fn(&Queued) -> bool) {
        let mut i = 0;
        while i < self.len {
            if self.items.get(i).is_some_and(&keep) {
                i += 1;
            } else {
                self.remove(i);
            }
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Slot {
    generation: u32,
    /// When the last anchor left prefill (0 = never).
    anchor_since_ms: u64,
    /// Admission order, at most [`PREFILL_QUEUE`].
    queue: PrefillQueue,
    /// Indexed by `epoch % BUCKETS`.
    buckets: [Counters; BUCKETS],
}

impl Slot {
    /// Which buckets are non-zero (bit `i` = ring position `i`).
    fn mask(&self) -> u8 {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, c)| **c != Counters::default())
            .fold(0u8, |m, (i, _)| m | (1 << i))
    }

    /// The sum of every bucket (saturating, in ring order).
    fn totals(&self) -> Counters {
        let mut t = Counters::default();
        for c in &self.buckets {
            t.add(c);
        }
        t
    }
}

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadTable {
    bucket_ms: u64,
    /// Requests dropped by age since the table was created (wrapping).
    reaped_total: u64,
    /// The epoch each ring position holds (`u64::MAX` = never opened).
    ring: [u64; BUCKETS],
    /// Every slot, or (a window, see `load/window.rs`) only slot `first`.
    slots: Vec<Slot>,
    /// The slot index of `slots[0]`: `base` unless this is a window.
    first: usize,
    /// The slot index of the stored table's first slot: 0 unless the table is one shard of a
    /// larger one (see `load_store.rs`). Tickets and edits use slot indices of the whole table.
    base: usize,
    /// Slots in the stored table (the shard).
    total: usize,
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
    /// A zero bucket width, or a prefill queue longer than [`PREFILL_QUEUE`].
    Malformed,
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
            LoadDecodeError::Malformed => {
                write!(f, "load table: zero bucket width or prefill queue too long")
            }
        }
    }
}

impl std::error::Error for LoadDecodeError {}

/// Bucket width for a request timeout: `BUCKETS - 1` buckets cover at least the timeout.
pub fn bucket_ms_for(timeout_ms: u64) -> u64 {
    timeout_ms.div_ceil(BUCKETS as u64 - 1).max(1)
}

impl LoadTable {
    /// A table reaping after [`DEFAULT_TIMEOUT_MS`].
    pub fn new(num_slots: usize) -> Self {
        LoadTable::with_timeout(num_slots, DEFAULT_TIMEOUT_MS)
    }

    /// A table whose bookings are reaped `timeout_ms` (up to `timeout_ms / (BUCKETS - 1)` more)
    /// after admission.
    pub fn with_timeout(num_slots: usize, timeout_ms: u64) -> Self {
        LoadTable {
            bucket_ms: bucket_ms_for(timeout_ms),
            reaped_total: 0,
            ring: [u64::MAX; BUCKETS],
            slots: vec![Slot::default(); num_slots],
            first: 0,
            base: 0,
            total: num_slots,
        }
    }

    /// Slots in the stored table (the shard).
    pub fn num_slots(&self) -> usize {
        self.total
    }

    /// This table as the shard whose first slot is slot `base` of the whole table: slot
    /// arguments and tickets then use the whole table's indices.
    pub fn rebased(mut self, base: usize) -> Self {
        self.first = self.first.saturating_sub(self.base) + base;
        self.base = base;
        self
    }

    /// Whether `slot` (a whole-table index) is one of the stored table's slots.
    fn covers(&self, slot: SlotIdx) -> bool {
        usize::from(slot)
            .checked_sub(self.base)
            .is_some_and(|i| i < self.total)
    }

    fn slot(&self, slot: SlotIdx) -> Option<&Slot> {
        self.slots.get(usize::from(slot).checked_sub(self.first)?)
    }

    fn slot_mut(&mut self, slot: SlotIdx) -> Option<&mut Slot> {
        self.slots
            .get_mut(usize::from(slot).checked_sub(self.first)?)
    }

    pub fn bucket_ms(&self) -> u64 {
        self.bucket_ms
    }

    /// Requests dropped by age since the table was created (wrapping counter).
    pub fn reaped_total(&self) -> u64 {
        self.reaped_total
    }

    /// Decodes [`LoadTable::encode`] output. Empty bytes (the key was never written) is a fresh
    /// table, not an error.
    pub fn decode(bytes: &[u8], num_slots: usize) -> Result<LoadTable, LoadDecodeError> {
        if bytes.is_empty() {
            return Ok(LoadTable::new(num_slots));
        }
        let (mut table, mut fixed) = LoadTable::decode_header(bytes, num_slots)?;
        // decode_header checked that every summary fits.
        let mut details = Reader {
            bytes,
            pos: HEADER_LEN + num_slots * SLOT_FIXED_LEN,
        };
        let mut slots = Vec::with_capacity(num_slots);
        for _ in 0..num_slots {
            slots.push(read_slot(&mut fixed, &mut details, &table)?);
        }
        details.finish()?;
        table.slots = slots;
        Ok(table)
    }

    /// The header (and a length check) of [`LoadTable::decode`]: a table with no slots decoded
    /// yet, and the reader positioned at slot 0's summary.
    fn decode_header(
        bytes: &[u8],
        num_slots: usize,
    ) -> Result<(LoadTable, Reader<'_>), LoadDecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4)? != MAGIC {
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
        let bucket_ms = r.u64()?;
        if bucket_ms == 0 {
            return Err(LoadDecodeError::Malformed);
        }
        let reaped_total = r.u64()?;
        let mut ring = [0u64; BUCKETS];
        for e in ring.iter_mut() {
            *e = r.u64()?;
        }
        // Every slot needs its summary: refuse short input before allocating.
        let needed = num_slots
            .saturating_mul(SLOT_FIXED_LEN)
            .saturating_add(HEADER_LEN);
        if bytes.len() < needed {
            return Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed,
            });
        }
        let table = LoadTable {
            bucket_ms,
            reaped_total,
            ring,
            slots: Vec::new(),
            first: 0,
            base: 0,
            total: num_slots,
        };
        Ok((table, r))
    }

    /// [`LoadTable::decode`], falling back to a fresh table; the error (if any) is returned so the
    /// adapter can log and count it.
    pub fn decode_or_fresh(bytes: &[u8], num_slots: usize) -> (LoadTable, Option<LoadDecodeError>) {
        match LoadTable::decode(bytes, num_slots) {
            Ok(t) => (t, None),
            Err(e) => (LoadTable::new(num_slots), Some(e)),
        }
    }

    /// Little-endian binary: header, ring epochs, then every slot's summary (fixed size: its
    /// generation, anchor time, queue length, a mask of its non-zero buckets and their sum),
    /// then every slot's details (its prefill queue, and its non-zero buckets' counters when
    /// there are two or more). At most `HEADER_LEN + slots * (34 + 4 * 24 + 4 * 20)` bytes,
    /// whatever the requests in flight.
    pub fn encode(&self) -> Vec<u8> {
        let details: usize = self
            .slots
            .iter()
            .map(|s| details_len(s.queue.len(), s.mask()))
            .sum();
        let mut out = Vec::with_capacity(HEADER_LEN + self.slots.len() * SLOT_FIXED_LEN + details);
        self.write_header(&mut out);
        for slot in &self.slots {
            write_summary(&mut out, slot);
        }
        for slot in &self.slots {
            write_details(&mut out, slot);
        }
        out
    }

    /// Magic, version, slot count, bucket width, reaped total and ring: `HEADER_LEN` bytes.
    fn write_header(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(self.total as u32).to_le_bytes());
        out.extend_from_slice(&self.bucket_ms.to_le_bytes());
        out.extend_from_slice(&self.reaped_total.to_le_bytes());
        for e in &self.ring {
            out.extend_from_slice(&e.to_le_bytes());
        }
    }

    fn epoch_of(&self, now_ms: u64) -> u64 {
        now_ms / self.bucket_ms.max(1)
    }

    /// Whether a bucket opened for `epoch` still counts at `now_epoch`.
    fn alive(epoch: u64, now_epoch: u64) -> bool {
        epoch != u64::MAX && epoch.saturating_add(BUCKETS as u64) > now_epoch
    }

    /// When a bucket opened for `epoch` stops counting: the first instant `alive` is false.
    fn died_ms(epoch: u64, bucket_ms: u64) -> u64 {
        epoch
            .saturating_add(BUCKETS as u64)
            .saturating_mul(bucket_ms.max(1))
    }

    fn ring_pos(epoch: u64) -> usize {
        (epoch % BUCKETS as u64) as usize
    }

    /// Drops every bucket too old at `now_ms` (and the queued prefills counted in it), adding
    /// what they still held to [`LoadTable::reaped_total`]. Returns how many requests.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let now_epoch = self.epoch_of(now_ms);
        let mut reaped = 0u64;
        for (pos, epoch) in self.ring.iter_mut().enumerate() {
            if *epoch == u64::MAX || LoadTable::alive(*epoch, now_epoch) {
                continue;
            }
            let dead = *epoch;
            *epoch = u64::MAX;
            let died_ms = LoadTable::died_ms(dead, self.bucket_ms);
            for slot in &mut self.slots {
                if let Some(c) = slot.buckets.get_mut(pos) {
                    reaped = reaped.saturating_add(u64::from(c.active));
                    *c = Counters::default();
                }
                let before = slot.queue.first().map(|q| q.key);
                slot.queue.retain(|q| q.epoch != dead);
                if slot.queue.first().map(|q| q.key) != before && before.is_some() {
                    // The anchor was reaped: the next prefill decays from when its bucket died
                    // (not from now), as a view taken before this reap counts it.
                    slot.anchor_since_ms = slot.anchor_since_ms.max(died_ms);
                }
            }
        }
        self.reaped_total = self.reaped_total.wrapping_add(reaped);
        usize::try_from(reaped).unwrap_or(usize::MAX)
    }

    /// The counters of `epoch` on `slot`, opening the ring position for it if needed (after
    /// [`LoadTable::expire`], a position holding another epoch is dead and already reaped).
    fn counters_mut(&mut self, slot: SlotIdx, epoch: u64) -> Option<&mut Counters> {
        let pos = LoadTable::ring_pos(epoch);
        let held = self.ring.get_mut(pos)?;
        if *held != epoch {
            if *held != u64::MAX {
                return None;
            }
            *held = epoch;
        }
        self.slot_mut(slot)?.buckets.get_mut(pos)
    }

    /// Whether what `ticket` booked is still counted (its bucket lives, its slot was not cleared).
    fn holds(&self, ticket: &Ticket, now_ms: u64) -> bool {
        let alive = self.ring.get(LoadTable::ring_pos(ticket.epoch)) == Some(&ticket.epoch)
            && LoadTable::alive(ticket.epoch, self.epoch_of(now_ms));
        alive
            && self
                .slot(ticket.slot)
                .is_some_and(|s| s.generation == ticket.generation)
    }

    /// Books a routed request on `slot`; the returned ticket is what later phases hand back.
    /// `expected_prefill_ms`: the predicted prefill duration (polynomial model) or `None` (no
    /// decay). `None` when `slot` is out of range (nothing booked).
    pub fn admit(
        &mut self,
        key: u64,
        slot: SlotIdx,
        prefill_tokens: u32,
        prompt_blocks: u32,
        expected_prefill_ms: Option<f64>,
        now_ms: u64,
    ) -> Option<Ticket> {
        if !self.covers(slot) {
            return None;
        }
        self.expire(now_ms);
        let epoch = self.epoch_of(now_ms);
        let generation = self.slot(slot)?.generation;
        let ticket = Ticket {
            key,
            slot,
            generation,
            epoch,
            prefill_tokens,
            prompt_blocks,
            output_milli_blocks: 0,
        };
        let c = self.counters_mut(slot, epoch)?;
        c.prefill_tokens = c.prefill_tokens.saturating_add(u64::from(prefill_tokens));
        c.decode_milli = c.decode_milli.saturating_add(ticket.decode_milli());
        c.active = c.active.saturating_add(1);
        let expected = match expected_prefill_ms {
            Some(ms) if ms.is_finite() && ms > 0.0 => ms.ceil().min(f64::from(u32::MAX)) as u32,
            _ => 0,
        };
        if expected > 0 && prefill_tokens > 0 {
            if let Some(s) = self.slot_mut(slot) {
                // A full queue keeps nothing: that prefill counts in full until its first token.
                s.queue.push(Queued {
                    key,
                    epoch,
                    prefill_tokens,
                    expected_prefill_ms: expected,
                    admitted_ms: now_ms,
                });
            }
        }
        Some(ticket)
    }

    /// Removes `ticket`'s bookings from its bucket (the caller checked [`LoadTable::holds`]).
    fn subtract(&mut self, ticket: &Ticket, now_ms: u64) {
        self.leave_prefill(ticket, now_ms);
        if let Some(c) = self.counters_mut(ticket.slot, ticket.epoch) {
            c.prefill_tokens = c
                .prefill_tokens
                .saturating_sub(u64::from(ticket.prefill_tokens));
            c.decode_milli = c.decode_milli.saturating_sub(ticket.decode_milli());
            c.active = c.active.saturating_sub(1);
        }
    }

    /// Takes the ticket's request out of its slot's prefill queue; if it was the anchor, the
    /// next prefill starts decaying at `now_ms`.
    fn leave_prefill(&mut self, ticket: &Ticket, now_ms: u64) {
        if ticket.prefill_tokens == 0 {
            return;
        }
        let Some(s) = self.slot_mut(ticket.slot) else {
            return;
        };
        if let Some(i) = s.queue.iter().position(|q| q.key == ticket.key) {
            if i == 0 {
                s.anchor_since_ms = s.anchor_since_ms.max(now_ms);
            }
            s.queue.remove(i);
        }
    }

    /// The request produced its first token: its prefill tokens drop to 0. `None` if its
    /// booking is gone (reaped, slot cleared).
    pub fn first_token(&mut self, ticket: &Ticket, now_ms: u64) -> Option<Ticket> {
        self.expire(now_ms);
        if !self.holds(ticket, now_ms) {
            return None;
        }
        self.leave_prefill(ticket, now_ms);
        let c = self.counters_mut(ticket.slot, ticket.epoch)?;
        c.prefill_tokens = c
            .prefill_tokens
            .saturating_sub(u64::from(ticket.prefill_tokens));
        Some(Ticket {
            prefill_tokens: 0,
            ..*ticket
        })
    }

    /// Sets the request's weighted output blocks ([`output_milli_blocks`]). `None` if its
    /// booking is gone.
    pub fn set_output_milli_blocks(
        &mut self,
        ticket: &Ticket,
        milli_blocks: u64,
        now_ms: u64,
    ) -> Option<Ticket> {
        self.expire(now_ms);
        if !self.holds(ticket, now_ms) {
            return None;
        }
        let c = self.counters_mut(ticket.slot, ticket.epoch)?;
        c.decode_milli = c
            .decode_milli
            .saturating_sub(ticket.output_milli_blocks)
            .saturating_add(milli_blocks);
        Some(Ticket {
            output_milli_blocks: milli_blocks,
            ..*ticket
        })
    }

    /// The request ended at `now_ms`: removes exactly what it booked (a decaying anchor hands
    /// over to the next prefill). `false` if its booking is gone (reaped, slot cleared).
    pub fn release_at(&mut self, ticket: &Ticket, now_ms: u64) -> bool {
        self.expire(now_ms);
        if !self.holds(ticket, now_ms) {
            return false;
        }
        self.subtract(ticket, now_ms);
        true
    }

    /// Re-homes a request's booking on `slot` (Envoy retried it on a fallback host), keeping what
    /// it booked (counted in full there: it joins no prefill queue). `None` if its booking is
    /// gone or the slot is out of range.
    pub fn move_to(&mut self, ticket: &Ticket, slot: SlotIdx, now_ms: u64) -> Option<Ticket> {
        if !self.covers(slot) {
            return None;
        }
        self.expire(now_ms);
        if !self.holds(ticket, now_ms) {
            return None;
        }
        if ticket.slot == slot {
            return Some(*ticket);
        }
        self.slot(slot)?;
        self.subtract(ticket, now_ms);
        self.adopt(ticket, slot, now_ms)
    }

    /// Books on `slot` what `ticket` booked elsewhere (the second half of a move whose first half,
    /// a release, was another table's: see `load_store::move_booking`), counted in full in its
    /// own time bucket. `None` if that bucket is gone or the slot is not in this table.
    pub fn adopt(&mut self, ticket: &Ticket, slot: SlotIdx, now_ms: u64) -> Option<Ticket> {
        self.expire(now_ms);
        if !LoadTable::alive(ticket.epoch, self.epoch_of(now_ms)) {
            return None;
        }
        let moved = Ticket {
            slot,
            generation: self.slot(slot)?.generation,
            ..*ticket
        };
        let c = self.counters_mut(slot, moved.epoch)?;
        c.prefill_tokens = c
            .prefill_tokens
            .saturating_add(u64::from(moved.prefill_tokens));
        c.decode_milli = c.decode_milli.saturating_add(moved.decode_milli());
        c.active = c.active.saturating_add(1);
        Some(moved)
    }

    /// Forgets everything booked on `slot` (its worker left the cluster); tickets booked there
    /// before release nothing afterwards. `false` if the slot is out of range.
    pub fn clear_slot(&mut self, slot: SlotIdx) -> bool {
        let Some(s) = self.slot_mut(slot) else {
            return false;
        };
        *s = Slot {
            generation: s.generation.wrapping_add(1),
            ..Slot::default()
        };
        true
    }

    /// [`LoadTable::clear_slot`] for each of `slots` (a departed worker's ranks). Returns how many
    /// requests were in flight there, or `None` if none of `slots` is in this table (a shard of
    /// other slots: nothing changed, nothing to write).
    pub fn clear_slots(&mut self, slots: std::ops::Range<SlotIdx>, now_ms: u64) -> Option<u64> {
        if !slots.clone().any(|s| self.slot(s).is_some()) {
            return None;
        }
        let first = self.first;
        let view = self.view(now_ms);
        let requests = slots
            .filter(|&s| self.clear_slot(s))
            .map(|s| {
                view.get(usize::from(s).wrapping_sub(first))
                    .map_or(0, |l| u64::from(l.active_requests))
            })
            .sum();
        Some(requests)
    }

    /// Per-slot load at `now_ms` (buckets too old to count are left out even before
    /// [`LoadTable::expire`] drops them).
    pub fn view(&self, now_ms: u64) -> Vec<SlotLoad> {
        let mut out = Vec::with_capacity(self.slots.len());
        self.view_into(now_ms, &mut out);
        out
    }

    /// [`LoadTable::view`] into `out` (cleared first): the request path reuses one buffer.
    pub fn view_into(&self, now_ms: u64, out: &mut Vec<SlotLoad>) {
        out.clear();
        let now_epoch = self.epoch_of(now_ms);
        let live = self.ring.map(|e| LoadTable::alive(e, now_epoch));
        out.extend(
            self.slots
                .iter()
                .map(|s| slot_load(s, &live, now_epoch, self.bucket_ms, now_ms)),
        );
    }

    /// Requests counted at `now_ms`, over all slots.
    pub fn active_requests(&self, now_ms: u64) -> u64 {
        self.view(now_ms)
            .iter()
            .map(|l| u64::from(l.active_requests))
            .sum()
    }
}

/// One slot's load at `now_ms`; `live` says which ring positions still count.
fn slot_load(
    s: &Slot,
    live: &[bool; BUCKETS],
    now_epoch: u64,
    bucket_ms: u64,
    now_ms: u64,
) -> SlotLoad {
    let mut total = Counters::default();
    for (c, _) in s.buckets.iter().zip(live).filter(|(_, l)| **l) {
        total.add(c);
    }
    // Prefills in front of the first live one died with their buckets, not yet reaped: the
    // live one decays from the last death, as it will once `expire` has run.
    let mut since = s.anchor_since_ms;
    let mut anchor = None;
    for q in s.queue.iter() {
        if LoadTable::alive(q.epoch, now_epoch) {
            anchor = Some(q);
            break;
        }
        since = since.max(LoadTable::died_ms(q.epoch, bucket_ms));
    }
    load_of(&total, anchor, since, now_ms)
}

/// A slot's load from its live counters and its anchor (the oldest live decaying prefill).
fn load_of(
    total: &Counters,
    anchor: Option<&Queued>,
    anchor_since_ms: u64,
    now_ms: u64,
) -> SlotLoad {
    let prefill = match anchor {
        Some(a) => total
            .prefill_tokens
            .saturating_sub(u64::from(a.prefill_tokens))
            .saturating_add(decayed(a, anchor_since_ms, now_ms)),
        None => total.prefill_tokens,
    };
    SlotLoad {
        prefill_tokens: prefill as f64,
        decode_blocks: total.decode_milli as f64 / 1000.0,
        active_requests: total.active,
    }
}

/// One slot of [`LoadTable::decode`]: its summary from `fixed`, its details from `details`.
/// The summary's sum must be its buckets' (one encoding per table), and no bucket may be set
/// in a ring position that holds no epoch (the in-place view counts every bucket of the sum
/// when no epoch is dead, see `load/window.rs`).
fn read_slot(
    fixed: &mut Reader<'_>,
    details: &mut Reader<'_>,
    table: &LoadTable,
) -> Result<Slot, LoadDecodeError> {
    let generation = fixed.u32()?;
    let anchor_since_ms = fixed.u64()?;
    let queued = usize::from(fixed.u8()?);
    let mask = fixed.u8()?;
    let totals = Counters {
        prefill_tokens: fixed.u64()?,
        decode_milli: fixed.u64()?,
        active: fixed.u32()?,
    };
    if queued > PREFILL_QUEUE || usize::from(mask) >> BUCKETS != 0 {
        return Err(LoadDecodeError::Malformed);
    }
    let mut queue = PrefillQueue::default();
    for _ in 0..queued {
        let key = details.u64()?;
        let prefill_tokens = details.u32()?;
        let expected_prefill_ms = details.u32()?;
        let admitted_ms = details.u64()?;
        // queued <= PREFILL_QUEUE: every push lands.
        queue.push(Queued {
            key,
            epoch: admitted_ms / table.bucket_ms.max(1),
            prefill_tokens,
            expected_prefill_ms,
            admitted_ms,
        });
    }
    let mut buckets = [Counters::default(); BUCKETS];
    let several = mask.count_ones() >= 2;
    for (i, c) in buckets.iter_mut().enumerate() {
        if mask & (1 << i) == 0 {
            continue;
        }
        if table.ring.get(i) == Some(&u64::MAX) {
            return Err(LoadDecodeError::Malformed);
        }
        *c = if several {
            Counters {
                prefill_tokens: details.u64()?,
                decode_milli: details.u64()?,
                active: details.u32()?,
            }
        } else {
            totals
        };
        if *c == Counters::default() {
            // Zero buckets are left out: one encoding per table.
            return Err(LoadDecodeError::Malformed);
        }
    }
    let slot = Slot {
        generation,
        anchor_since_ms,
        queue,
        buckets,
    };
    if slot.totals() != totals {
        return Err(LoadDecodeError::Malformed);
    }
    Ok(slot)
}

/// One slot's summary in [`LoadTable::encode`] (`SLOT_FIXED_LEN` bytes).
fn write_summary(out: &mut Vec<u8>, s: &Slot) {
    out.extend_from_slice(&s.generation.to_le_bytes());
    out.extend_from_slice(&s.anchor_since_ms.to_le_bytes());
    // At most PREFILL_QUEUE by construction (admit) and decode.
    out.push(s.queue.len().min(PREFILL_QUEUE) as u8);
    out.push(s.mask());
    let t = s.totals();
    out.extend_from_slice(&t.prefill_tokens.to_le_bytes());
    out.extend_from_slice(&t.decode_milli.to_le_bytes());
    out.extend_from_slice(&t.active.to_le_bytes());
}

/// One slot's details in [`LoadTable::encode`] (`details_len` bytes).
fn write_details(out: &mut Vec<u8>, s: &Slot) {
    for q in s.queue.iter().take(PREFILL_QUEUE) {
        out.extend_from_slice(&q.key.to_le_bytes());
        out.extend_from_slice(&q.prefill_tokens.to_le_bytes());
        out.extend_from_slice(&q.expected_prefill_ms.to_le_bytes());
        out.extend_from_slice(&q.admitted_ms.to_le_bytes());
    }
    if s.mask().count_ones() < 2 {
        return;
    }
    for c in s.buckets.iter().filter(|c| **c != Counters::default()) {
        out.extend_from_slice(&c.prefill_tokens.to_le_bytes());
        out.extend_from_slice(&c.decode_milli.to_le_bytes());
        out.extend_from_slice(&c.active.to_le_bytes());
    }
}

/// Remaining prefill tokens of an anchor at `now_ms`.
fn decayed(q: &Queued, anchor_since_ms: u64, now_ms: u64) -> u64 {
    let full = u64::from(q.prefill_tokens);
    let expected = u64::from(q.expected_prefill_ms);
    if expected == 0 || full == 0 {
        return full;
    }
    let start = q.admitted_ms.max(anchor_since_ms);
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
    #[inline]
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
    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], LoadDecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    #[inline]
    fn u8(&mut self) -> Result<u8, LoadDecodeError> {
        Ok(u8::from_le_bytes(self.array::<1>()?))
    }
    #[inline]
    fn u32(&mut self) -> Result<u32, LoadDecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    #[inline]
    fn u64(&mut self) -> Result<u64, LoadDecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// Every byte was read.
    fn finish(&self) -> Result<(), LoadDecodeError> {
        if self.pos == self.bytes.len() {
            Ok(())
        } else {
            Err(LoadDecodeError::Truncated {
                len: self.bytes.len(),
                needed: self.pos,
            })
        }
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

    fn book(
        t: &mut LoadTable,
        key: u64,
        slot: SlotIdx,
        tokens: u32,
        blocks: u32,
        at: u64,
    ) -> Ticket {
        t.admit(key, slot, tokens, blocks, None, at).unwrap()
    }

    #[test]
    fn admit_first_token_release_returns_to_exactly_zero() {
        let mut t = LoadTable::new(2);
        let a = book(&mut t, 1, 0, 1000, 16, 0);
        let b = book(&mut t, 2, 0, 500, 8, 5);
        let c = book(&mut t, 3, 1, 64, 1, 5);
        let v = t.view(10);
        assert_eq!(v[0].prefill_tokens, 1500.0);
        assert_eq!(v[0].decode_blocks, 24.0);
        assert_eq!(v[0].active_requests, 2);
        assert_eq!(v[1].prefill_tokens, 64.0);

        let a = t.first_token(&a, 20).unwrap();
        let a = t.set_output_milli_blocks(&a, 2500, 20).unwrap();
        let v = t.view(20);
        assert_eq!(v[0].prefill_tokens, 500.0);
        assert_eq!(v[0].decode_blocks, 26.5);
        // Output weight goes down as well as up.
        let a = t.set_output_milli_blocks(&a, 1000, 21).unwrap();
        assert_eq!(t.view(21)[0].decode_blocks, 25.0);

        assert!(t.release_at(&a, 30));
        assert!(t.release_at(&b, 30));
        assert!(t.release_at(&c, 30));
        assert_eq!(t.view(30), vec![SlotLoad::default(); 2]);
        assert_eq!(t.active_requests(30), 0);
        assert_eq!(t.admit(4, 2, 1, 1, None, 30), None, "slot out of range");
    }

    #[test]
    fn reference_example_oldest_prefill_decays() {
        // 100 tokens predicted to take 10 s, plus 60 queued behind it: 140 at 2 s, 110 at 5 s.
        let mut t = LoadTable::new(1);
        let a = t.admit(1, 0, 100, 2, Some(10_000.0), 0).unwrap();
        let b = t.admit(2, 0, 60, 1, Some(6_000.0), 0).unwrap();
        assert_eq!(t.view(0)[0].prefill_tokens, 160.0);
        assert_eq!(t.view(2_000)[0].prefill_tokens, 140.0);
        assert_eq!(t.view(5_000)[0].prefill_tokens, 110.0);
        // Past its prediction the anchor reads 0 but the next one waits for the hand-over.
        assert_eq!(t.view(12_000)[0].prefill_tokens, 60.0);
        // First token of the anchor at 12 s: the 60-token request is the anchor from 12 s.
        t.first_token(&a, 12_000).unwrap();
        assert_eq!(t.view(12_000)[0].prefill_tokens, 60.0);
        assert_eq!(t.view(15_000)[0].prefill_tokens, 30.0);
        // ceil: 60 * (1 - 3001/6000) = 29.99 -> 30.
        assert_eq!(t.view(15_001)[0].prefill_tokens, 30.0);
        assert_eq!(t.view(15_101)[0].prefill_tokens, 29.0);
        assert_eq!(t.view(20_000)[0].prefill_tokens, 0.0);
        // Decode blocks never decay.
        assert_eq!(t.view(20_000)[0].decode_blocks, 3.0);
        assert!(t.release_at(&b, 20_000));
        assert!(t.release_at(&a, 20_000));
        assert_eq!(t.view(20_000), vec![SlotLoad::default()]);
    }

    /// A decaying anchor whose bucket dies (its request timed out) hands over to the next
    /// prefill at the bucket's death, whether or not `expire` has reaped it yet: the view of
    /// the table, of a copy reaped at that instant and of its encoded bytes agree at every ms.
    #[test]
    fn a_dead_anchor_reads_the_same_before_and_after_it_is_reaped() {
        let timeout = 3_000; // buckets of 1,000 ms: a bucket counts for 4 s
        let mut t = LoadTable::with_timeout(2, timeout);
        t.admit(1, 0, 500, 4, Some(60_000.0), 0).unwrap(); // the anchor, decaying for 60 s
        t.admit(2, 0, 300, 2, Some(5_000.0), 3_000).unwrap(); // queued behind it
        t.admit(3, 1, 100, 1, None, 3_000).unwrap();
        for now in 3_000..9_000u64 {
            let plain = t.view(now);
            let mut reaped = t.clone();
            reaped.expire(now);
            assert_eq!(plain, reaped.view(now), "at {now} ms");
            let mut from_bytes = Vec::new();
            view_bytes(&t.encode(), 2, now, &mut from_bytes).unwrap();
            assert_eq!(plain, from_bytes, "at {now} ms, from the bytes");
            if now == 4_000 {
                // The anchor's bucket (epoch 0) died at 4 s: only the queued one is left, whole.
                assert_eq!(plain[0].prefill_tokens, 300.0);
            }
            if now == 6_500 {
                // Decaying from 4 s for 5 s: half left.
                assert_eq!(plain[0].prefill_tokens, 150.0);
            }
        }
    }

    #[test]
    fn a_later_non_anchor_finishing_first_does_not_reset_the_anchor() {
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 100, 1, Some(10_000.0), 0).unwrap();
        let b = t.admit(2, 0, 60, 1, None, 1_000).unwrap();
        t.first_token(&b, 3_000).unwrap();
        assert_eq!(t.view(5_000)[0].prefill_tokens, 50.0);
    }

    #[test]
    fn releasing_the_anchor_hands_the_decay_over() {
        let mut t = LoadTable::new(1);
        let a = t.admit(1, 0, 100, 1, Some(10_000.0), 0).unwrap();
        t.admit(2, 0, 100, 1, Some(10_000.0), 0).unwrap();
        assert!(t.release_at(&a, 4_000));
        assert_eq!(t.view(4_000)[0].prefill_tokens, 100.0);
        assert_eq!(t.view(9_000)[0].prefill_tokens, 50.0);
    }

    #[test]
    fn a_full_prefill_queue_counts_the_rest_in_full() {
        let mut t = LoadTable::new(1);
        let mut tickets = Vec::new();
        for k in 0..PREFILL_QUEUE as u64 + 2 {
            tickets.push(t.admit(k, 0, 100, 1, Some(1_000.0), 0).unwrap());
        }
        let n = PREFILL_QUEUE as f64 + 2.0;
        assert_eq!(t.view(500)[0].prefill_tokens, n * 100.0 - 50.0);
        // Every queued prefill decays in turn; the two beyond the queue never do.
        let mut now = 0;
        for ticket in tickets.iter().take(PREFILL_QUEUE) {
            now += 1_000;
            t.first_token(ticket, now).unwrap();
        }
        assert_eq!(t.view(now + 10_000)[0].prefill_tokens, 200.0);
        for ticket in &tickets {
            assert!(t.release_at(ticket, now));
        }
        assert_eq!(t.view(now), vec![SlotLoad::default()]);
    }

    #[test]
    fn without_a_prediction_nothing_decays() {
        let mut t = LoadTable::new(1);
        t.admit(1, 0, 100, 1, None, 0).unwrap();
        t.admit(2, 0, 60, 1, Some(f64::NAN), 0).unwrap();
        assert_eq!(t.view(100_000)[0].prefill_tokens, 160.0);
    }

    #[test]
    fn buckets_expire_after_the_timeout_and_count_as_reaped() {
        // 3 s timeout: buckets of 1 s, a booking lives 3 to 4 s.
        let mut t = LoadTable::with_timeout(2, 3_000);
        assert_eq!(t.bucket_ms(), 1_000);
        let old = book(&mut t, 1, 0, 10, 1, 500);
        let also_old = book(&mut t, 2, 1, 10, 1, 900);
        let newer = book(&mut t, 3, 0, 20, 2, 2_500);
        assert_eq!(t.expire(3_999), 0, "3.5 s old: not yet");
        assert_eq!(t.view(3_999)[0].active_requests, 2);
        // At 4 s the first second's bucket is past: both of its requests leave the view, and
        // expire counts them.
        assert_eq!(t.view(4_000)[0].active_requests, 1);
        assert_eq!(t.view(4_000)[1], SlotLoad::default());
        assert_eq!(t.expire(4_000), 2);
        assert_eq!(t.reaped_total(), 2);
        assert!(!t.release_at(&old, 4_100), "reaped: releases nothing");
        assert!(t.first_token(&also_old, 4_100).is_none());
        assert_eq!(t.view(4_100)[0].prefill_tokens, 20.0);
        // A booking in the reused ring position is not touched by the stale ticket.
        let reuse = book(&mut t, 4, 0, 5, 1, 4_200);
        assert!(!t.release_at(&old, 4_300));
        assert_eq!(t.view(4_300)[0].active_requests, 2);
        assert!(t.release_at(&newer, 4_400));
        assert!(t.release_at(&reuse, 4_400));
        assert_eq!(t.view(4_400), vec![SlotLoad::default(); 2]);
    }

    #[test]
    fn a_reaped_anchor_hands_the_decay_over() {
        let mut t = LoadTable::with_timeout(1, 3_000);
        t.admit(1, 0, 100, 1, Some(100_000.0), 500).unwrap();
        t.admit(2, 0, 100, 1, Some(10_000.0), 1_500).unwrap();
        assert_eq!(t.expire(4_000), 1);
        assert_eq!(t.view(4_000)[0].prefill_tokens, 100.0);
        assert_eq!(t.view(4_500)[0].prefill_tokens, 95.0);
    }

    #[test]
    fn clearing_a_slot_zeroes_it_and_orphans_its_tickets() {
        let mut t = LoadTable::new(2);
        let gone = book(&mut t, 1, 0, 100, 4, 0);
        let kept = book(&mut t, 2, 1, 100, 4, 0);
        assert!(t.clear_slot(0));
        assert!(!t.clear_slot(2));
        assert_eq!(t.view(1)[0], SlotLoad::default());
        let fresh = book(&mut t, 3, 0, 7, 1, 2);
        assert!(!t.release_at(&gone, 3), "booked before the clear");
        assert!(t.move_to(&gone, 1, 3).is_none());
        assert_eq!(t.view(3)[0].prefill_tokens, 7.0);
        assert!(t.release_at(&fresh, 4));
        assert!(t.release_at(&kept, 4));
        assert_eq!(t.view(4), vec![SlotLoad::default(); 2]);
    }

    #[test]
    fn a_moved_booking_follows_the_request_and_releases_to_zero() {
        let mut t = LoadTable::new(3);
        let a = t.admit(7, 0, 640, 10, None, 1_000).unwrap();
        let a = t.move_to(&a, 2, 1_010).unwrap();
        let view = t.view(1_020);
        assert_eq!((view[0].active_requests, view[0].decode_blocks), (0, 0.0));
        assert_eq!((view[2].active_requests, view[2].decode_blocks), (1, 10.0));
        assert_eq!(view[2].prefill_tokens, 640.0);
        assert!(t.move_to(&a, 3, 1_030).is_none(), "slot out of range");
        assert!(t.release_at(&a, 1_040));
        assert_eq!(t.active_requests(1_040), 0);
    }

    #[test]
    fn the_encoded_size_does_not_grow_with_requests_in_flight() {
        let mut t = LoadTable::new(64);
        let mut one_each = 0;
        for k in 0..10_000u64 {
            t.admit(k, (k % 64) as SlotIdx, 4096, 64, Some(50.0), k)
                .unwrap();
            if k == 63 {
                one_each = t.encode().len();
            }
        }
        assert_eq!(t.encode().len(), one_each + 64 * 3 * QUEUED_LEN);
        assert!(one_each < HEADER_LEN + 64 * (SLOT_FIXED_LEN + QUEUED_LEN + COUNTERS_LEN) + 1);
        assert_eq!(t.active_requests(10_000), 10_000);
    }

    #[test]
    fn details_len_counts_the_buckets_of_two_or_more() {
        for mask in 0..1u8 << BUCKETS {
            let n = mask.count_ones() as usize;
            let buckets = if n >= 2 { n * COUNTERS_LEN } else { 0 };
            assert_eq!(
                details_len(3, mask),
                3 * QUEUED_LEN + buckets,
                "mask {mask:04b}"
            );
        }
    }

    #[test]
    fn encode_decode_round_trip_preserves_everything() {
        let mut t = LoadTable::with_timeout(3, 60_000);
        let a = t.admit(u64::MAX, 2, 123, 4, Some(1500.0), 1_000).unwrap();
        let b = t.admit(7, 0, 50, 1, None, 1_001).unwrap();
        t.admit(8, 0, 10, 1, Some(100.0), 30_002).unwrap();
        t.first_token(&b, 31_100).unwrap();
        t.set_output_milli_blocks(&a, 333, 31_100).unwrap();
        t.clear_slot(1);
        let bytes = t.encode();
        let back = LoadTable::decode(&bytes, 3).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.view(31_200), t.view(31_200));
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
        t.admit(1, 3, 1, 1, Some(5.0), 0).unwrap();
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
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            LoadTable::decode(&long, 4),
            Err(LoadDecodeError::Truncated { .. })
        ));
        let mut v1 = bytes.clone();
        v1[4] = 1;
        assert_eq!(
            LoadTable::decode(&v1, 4),
            Err(LoadDecodeError::UnsupportedVersion { found: 1 })
        );
        // A prefill queue longer than the bound (slot 0's queue length byte).
        let mut bad = bytes.clone();
        bad[HEADER_LEN + 4 + 8] = PREFILL_QUEUE as u8 + 1;
        assert_eq!(LoadTable::decode(&bad, 4), Err(LoadDecodeError::Malformed));
        let mut zero_width = bytes.clone();
        zero_width[9..17].fill(0);
        assert_eq!(
            LoadTable::decode(&zero_width, 4),
            Err(LoadDecodeError::Malformed)
        );
        let (fresh, err) = LoadTable::decode_or_fresh(&bad, 4);
        assert_eq!(fresh, LoadTable::new(4));
        assert!(err.is_some());
        // A huge slot count with a short body is refused before allocating.
        assert!(matches!(
            LoadTable::decode(&bytes, 1 << 40),
            Err(LoadDecodeError::SlotCountMismatch { .. })
        ));
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
