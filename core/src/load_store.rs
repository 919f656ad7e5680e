//! The load table in shared data, updated by every VM with CAS (get, edit, set with the version
//! read; on mismatch read again and redo the edit) so that no update is lost.
//!
//! The table is split into shards of [`SHARD_SLOTS`] slots, one key each (`ekr.load` for the
//! first, `ekr.load.<n>` for the others; a fleet of up to 128 slots has one key). The decision
//! reads every shard, but each later phase of a request (booking, first token, output, release)
//! touches its own slot only, so it copies one shard (a few KB) rather than the whole table
//! (34 KB at 1,000 slots): a per-request cost that stays flat as the fleet grows. Shards are
//! independent tables (own time buckets, own CAS); no edit needs two shards at once except a
//! retry's move to a fallback host, done as a release on one and a booking on the other.
//!
//! A release must never be lost: a lost one leaves phantom load on its worker until the reaper
//! drops it (`load.request_timeout_ms`, 15 minutes by default). So a release whose CAS loop is
//! outlasted by contention is kept in the VM's [`PendingReleases`] and folded into this VM's next
//! load update (and retried on every tick) until it lands.
//!
//! A shard's size is fixed by its slot count (see [`crate::load`]), so every CAS round costs
//! the same whatever the requests in flight.

use std::fmt;

use crate::load::{bucket_ms_for, reap_due, view_bytes_at, LoadTable, SlotLoad, Ticket, Window};
use crate::store::{SharedStore, StoreError};
use crate::types::SlotIdx;

const LOAD_KEY: &str = "ekr.load";
/// Slots per shard key. Smaller shards make each later phase's copy smaller but the decision
/// read more keys (one host call each): at 1,000 slots, 8 reads of ~4 KB.
pub const SHARD_SLOTS: usize = 128;
const CAS_ATTEMPTS: usize = 64;
/// Releases a VM keeps while contention defers them (each is about 56 bytes).
pub const MAX_PENDING_RELEASES: usize = 4096;

/// Shard keys of a table of `num_slots` slots (at least one).
pub fn shard_count(num_slots: usize) -> usize {
    num_slots.div_ceil(SHARD_SLOTS).max(1)
}

/// The shard holding `slot`.
fn shard_of(slot: SlotIdx) -> usize {
    usize::from(slot) / SHARD_SLOTS
}

/// The whole-table index of `shard`'s first slot, and how many slots it holds.
fn shard_slots(num_slots: usize, shard: usize) -> (usize, usize) {
    let base = shard * SHARD_SLOTS;
    (base, num_slots.saturating_sub(base).min(SHARD_SLOTS))
}

/// The shared-data key of `shard` (bounded by the configured slots: never per request):
/// `ekr.load`, then `ekr.load.1`, `ekr.load.2`, ... Built on the stack: the request path names
/// every shard once per decision.
pub fn shard_key(shard: usize) -> ShardKey {
    let mut key = ShardKey {
        buf: [0; SHARD_KEY_MAX],
        len: 0,
    };
    key.push(LOAD_KEY.as_bytes());
    if shard > 0 {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut n = shard;
        while n > 0 && at > 0 {
            at -= 1;
            if let Some(d) = digits.get_mut(at) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
        }
        key.push(b".");
        key.push(digits.get(at..).unwrap_or_default());
    }
    key
}

/// `ekr.load.` and the 20 digits of the largest `usize`.
const SHARD_KEY_MAX: usize = LOAD_KEY.len() + 1 + 20;

/// A shard's key, as [`shard_key`] builds it.
#[derive(Clone, Copy)]
pub struct ShardKey {
    buf: [u8; SHARD_KEY_MAX],
    len: usize,
}

impl ShardKey {
    fn push(&mut self, bytes: &[u8]) {
        let end = (self.len + bytes.len()).min(SHARD_KEY_MAX);
        if let (Some(to), Some(from)) =
            (self.buf.get_mut(self.len..end), bytes.get(..end - self.len))
        {
            to.copy_from_slice(from);
            self.len = end;
        }
    }
}

impl std::ops::Deref for ShardKey {
    type Target = str;
    fn deref(&self) -> &str {
        // ASCII only (the prefix and digits).
        std::str::from_utf8(self.buf.get(..self.len).unwrap_or_default()).unwrap_or(LOAD_KEY)
    }
}

impl fmt::Display for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self)
    }
}

impl fmt::Debug for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// Why [`update_shard`] wrote nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateFailure {
    /// The edit returned `None` (nothing to change).
    Declined,
    /// Every attempt lost its CAS to another writer (or the host failed).
    Contended,
}

/// Creates every shard's key if absent (so later writers always have a CAS version to check),
/// or replaces a shard another configuration wrote (slot count or bucket width for
/// `timeout_ms`).
pub fn init(store: &dyn SharedStore, num_slots: usize, timeout_ms: u64) {
    for shard in 0..shard_count(num_slots) {
        let key = shard_key(shard);
        let (_, len) = shard_slots(num_slots, shard);
        let (bytes, cas) = store.get(&key);
        let fits = bytes.as_deref().is_some_and(|b| {
            LoadTable::decode(b, len).is_ok_and(|t| t.bucket_ms() == bucket_ms_for(timeout_ms))
        });
        if !fits {
            let fresh = LoadTable::with_timeout(len, timeout_ms).encode();
            let _ = store.set(&key, &fresh, cas);
        }
    }
}

/// Every slot's load at `now_ms` (idle for a shard whose bytes do not decode).
pub fn view(store: &dyn SharedStore, num_slots: usize, now_ms: u64) -> Vec<SlotLoad> {
    let mut out = Vec::with_capacity(num_slots);
    read_snapshot(store, num_slots).view_into(now_ms, &mut out);
    out
}

/// This Envoy's id with the other routers in front of the fleet (8 bytes, little-endian).
const ROUTER_ID_KEY: &str = "ekr.router_id";

/// This Envoy's id with the other routers in front of the same workers (`router=` on its event
/// polls, [`crate::polling::call_path`]): the first VM to ask sets it from its random `nonce`,
/// and every VM of the Envoy reads it back, so they all declare their bookings under one id.
pub fn router_id(store: &dyn SharedStore, nonce: u64) -> u64 {
    let read = |store: &dyn SharedStore| {
        store
            .get(ROUTER_ID_KEY)
            .0
            .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map(u64::from_le_bytes)
    };
    if let Some(id) = read(store) {
        return id;
    }
    let _ = store.set(ROUTER_ID_KEY, &nonce.to_le_bytes(), None);
    read(store).unwrap_or(nonce)
}

/// What `view` (every slot's load) holds on `slots` (one worker's ranks), summed: what this
/// Envoy declares to the other routers.
pub fn booked_on(view: &[SlotLoad], slots: std::ops::Range<SlotIdx>) -> crate::events::Booked {
    let mut booked = crate::events::Booked::default();
    for slot in slots {
        if let Some(l) = view.get(usize::from(slot)) {
            booked.requests = booked.requests.saturating_add(l.active_requests);
            booked.prefill_tokens += l.prefill_tokens;
            booked.decode_blocks += l.decode_blocks;
        }
    }
    booked
}

/// One shard's bytes as read, with the version they were read at.
struct ShardBytes {
    bytes: Vec<u8>,
    cas: Option<u32>,
    /// Where each slot's details start in `bytes` (and where the last ends), recorded by
    /// [`Snapshot::view_into`]: the booking on these bytes then finds its slot without a pass
    /// over the others' summaries. Empty until then.
    offsets: Vec<usize>,
}

/// Every shard as read: the request path views them once for its decision and hands them to
/// [`update_slot_from`] for the booking, whose first CAS attempt then needs no second get.
pub struct Snapshot {
    shards: Vec<ShardBytes>,
    num_slots: usize,
}

impl Snapshot {
    /// Per-slot load at `now_ms` into `out` (idle slots for a shard whose bytes do not decode:
    /// the next write replaces them with a fresh table).
    pub fn view_into(&mut self, now_ms: u64, out: &mut Vec<SlotLoad>) {
        self.view_with(now_ms, out, &mut ViewCache::default());
    }

    /// [`Snapshot::view_into`] that takes a shard's loads from `cache` when its bytes are the
    /// ones viewed last (same CAS version) and that view still holds at `now_ms`; other shards
    /// are viewed from their bytes and remembered. Most requests book or release on a single
    /// shard, so at 1,000 slots most of the view is a copy rather than a decode.
    pub fn view_with(&mut self, now_ms: u64, out: &mut Vec<SlotLoad>, cache: &mut ViewCache) {
        out.clear();
        cache
            .shards
            .resize_with(self.shards.len(), CachedView::default);
        let ViewCache { shards, reused } = cache;
        for ((shard, read), cached) in self.shards.iter_mut().enumerate().zip(shards.iter_mut()) {
            let (_, len) = shard_slots(self.num_slots, shard);
            let fresh = read.cas.is_some() && read.cas == cached.cas && cached.loads.len() == len;
            if fresh && now_ms < cached.until_ms {
                out.extend_from_slice(&cached.loads);
                *reused += 1;
                continue;
            }
            let start = out.len();
            let offsets = Some(&mut read.offsets);
            match view_bytes_at(&read.bytes, len, now_ms, out, offsets) {
                Ok(until_ms) => {
                    cached.cas = read.cas;
                    cached.until_ms = until_ms;
                    cached.loads.clear();
                    cached
                        .loads
                        .extend_from_slice(out.get(start..).unwrap_or_default());
                }
                Err(_) => {
                    cached.cas = None;
                    out.resize(start + len, SlotLoad::default());
                }
            }
        }
    }
}

/// A VM's memory of the load shards it viewed last (see [`Snapshot::view_with`]): at most one
/// view of each shard, so its size is the slot count's.
#[derive(Debug, Default)]
pub struct ViewCache {
    shards: Vec<CachedView>,
    /// Shard views served from memory so far.
    pub reused: u64,
}

#[derive(Debug, Default)]
struct CachedView {
    /// The CAS version the loads were viewed at (`None`: nothing cached).
    cas: Option<u32>,
    /// The loads hold before this time (a bucket dies then, or a prefill decays).
    until_ms: u64,
    loads: Vec<SlotLoad>,
}

pub fn read_snapshot(store: &dyn SharedStore, num_slots: usize) -> Snapshot {
    let shards = (0..shard_count(num_slots))
        .map(|shard| {
            let (bytes, cas) = store.get(&shard_key(shard));
            ShardBytes {
                bytes: bytes.unwrap_or_default(),
                cas,
                offsets: Vec::new(),
            }
        })
        .collect();
    Snapshot { shards, num_slots }
}

/// Applies `edit` atomically to one shard (the edit sees that shard's slots only), on a fresh
/// read for every attempt. An edit that returns `None` changed nothing and writes nothing.
pub fn update_shard<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    shard: usize,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    cas_loop(store, num_slots, shard, None, None, edit)
}

/// [`update_shard`] on every shard in turn, each in its own CAS loop: for edits whose effect on
/// one slot does not depend on another's (reaping, clearing departed workers' slots). Returns
/// each shard's outcome, in shard order.
pub fn update_each<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    mut edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Vec<Result<R, UpdateFailure>> {
    (0..shard_count(num_slots))
        .map(|shard| update_shard(store, num_slots, shard, &mut edit))
        .collect()
}

/// An edit that touches `slot` only, at `now_ms` (the time the edit uses): only that slot is
/// decoded and re-encoded, unless a time bucket of its shard is due to be reaped (then the
/// whole shard is, as in [`update_shard`]). The edit sees a table holding that slot alone.
pub fn update_slot<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    slot: SlotIdx,
    now_ms: u64,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    let shard = shard_of(slot);
    cas_loop(store, num_slots, shard, Some((slot, now_ms)), None, edit)
}

/// [`update_slot`] whose first attempt edits `first`'s bytes of the slot's shard (a
/// [`read_snapshot`] of this table: if the key was written since, that attempt's CAS fails and
/// the next one reads afresh, as always).
pub fn update_slot_from<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    slot: SlotIdx,
    now_ms: u64,
    first: Option<Snapshot>,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    let shard = shard_of(slot);
    let read = first
        .filter(|s| s.num_slots == num_slots)
        .and_then(|s| s.shards.into_iter().nth(shard));
    cas_loop(store, num_slots, shard, Some((slot, now_ms)), read, edit)
}

/// Re-homes a booking on `slot` (Envoy retried the request on a fallback host). In one shard,
/// one atomic edit; across shards, a release on the old one, then a booking on the new one (if
/// that fails the booking is gone from both: under-counted, never counted twice).
pub fn move_booking(
    store: &dyn SharedStore,
    num_slots: usize,
    ticket: Ticket,
    slot: SlotIdx,
    now_ms: u64,
) -> Result<Ticket, UpdateFailure> {
    let (from, to) = (shard_of(ticket.slot), shard_of(slot));
    if from == to {
        return update_shard(store, num_slots, to, |t| t.move_to(&ticket, slot, now_ms));
    }
    if usize::from(slot) >= num_slots {
        return Err(UpdateFailure::Declined);
    }
    update_slot(store, num_slots, ticket.slot, now_ms, |t| {
        t.release_at(&ticket, now_ms).then_some(())
    })?;
    update_slot(store, num_slots, slot, now_ms, |t| {
        t.adopt(&ticket, slot, now_ms)
    })
}

/// The CAS loop on `shard`: `window` = the only slot the edit touches and its time; `first` =
/// the shard's bytes already read.
fn cas_loop<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    shard: usize,
    window: Option<(SlotIdx, u64)>,
    mut first: Option<ShardBytes>,
    mut edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    let key = shard_key(shard);
    let (base, len) = shard_slots(num_slots, shard);
    // The slot's index within its shard.
    let window = window.and_then(|(slot, now_ms)| {
        let local = usize::from(slot).checked_sub(base)?;
        Some((SlotIdx::try_from(local).ok()?, now_ms))
    });
    for _ in 0..CAS_ATTEMPTS {
        let ShardBytes {
            mut bytes,
            cas,
            offsets,
        } = match first.take() {
            Some(read) => read,
            None => {
                let (bytes, cas) = store.get(&key);
                ShardBytes {
                    bytes: bytes.unwrap_or_default(),
                    cas,
                    offsets: Vec::new(),
                }
            }
        };
        let windowed = window.and_then(|(local, now_ms)| {
            let decoded = if offsets.is_empty() {
                Window::decode(&bytes, len, local, now_ms)
            } else {
                Window::decode_at(&bytes, len, local, now_ms, &offsets)
            };
            decoded.ok().flatten()
        });
        let encoded = match windowed {
            Some(mut w) => {
                w.table = w.table.rebased(base);
                let result = edit(&mut w.table).ok_or(UpdateFailure::Declined)?;
                // In place: the other slots' bytes are not copied (the set copies them once).
                w.encode_into(&mut bytes);
                (bytes, result)
            }
            None => {
                let mut table = LoadTable::decode_or_fresh(&bytes, len).0.rebased(base);
                let result = edit(&mut table).ok_or(UpdateFailure::Declined)?;
                (table.encode(), result)
            }
        };
        match store.set(&key, &encoded.0, cas) {
            Ok(()) => return Ok(encoded.1),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Err(UpdateFailure::Contended),
        }
    }
    Err(UpdateFailure::Contended)
}

/// Drops buckets older than the request timeout: requests whose VM died before releasing them.
/// Returns how many requests this call reaped (bookings and other phases expire buckets too;
/// [`LoadTable::reaped_total`] counts them all). A shard with another bucket width (written
/// after corrupt data was replaced, or by another configuration) is replaced by a fresh one.
pub fn reap(store: &dyn SharedStore, num_slots: usize, now_ms: u64, timeout_ms: u64) -> usize {
    let width = bucket_ms_for(timeout_ms);
    let mut reaped = 0;
    for shard in 0..shard_count(num_slots) {
        let (_, len) = shard_slots(num_slots, shard);
        // Every tick calls this; a whole decode only when a bucket is due (once per bucket width).
        let (bytes, _) = store.get(&shard_key(shard));
        if !reap_due(bytes.as_deref().unwrap_or_default(), len, now_ms, width) {
            continue;
        }
        reaped += update_shard(store, num_slots, shard, |table| {
            if table.bucket_ms() != width {
                let base = shard_slots(num_slots, shard).0;
                *table = LoadTable::with_timeout(len, timeout_ms).rebased(base);
                return Some(0);
            }
            let reaped = table.expire(now_ms);
            (reaped > 0).then_some(reaped)
        })
        .unwrap_or(0);
    }
    reaped
}

/// What became of one release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    Released,
    /// The entry is gone already (reaped, or its booking never landed).
    Unknown,
    /// Contention outlasted the retries: kept, and retried until it lands.
    Deferred,
}

/// Releases this VM could not write yet, oldest first: `(ticket, release time)`.
#[derive(Debug, Default)]
pub struct PendingReleases {
    queue: Vec<(Ticket, u64)>,
    /// Releases dropped because the queue was full (the reaper gets them).
    pub dropped: u64,
}

impl PendingReleases {
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Releases `ticket` at `now_ms`, together with every deferred release of its shard (one
    /// CAS loop; deferred releases of other shards wait for [`PendingReleases::flush`]).
    pub fn release(
        &mut self,
        store: &dyn SharedStore,
        num_slots: usize,
        ticket: Ticket,
        now_ms: u64,
    ) -> Release {
        let shard = shard_of(ticket.slot);
        let (queued, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(|(t, _)| shard_of(t.slot) == shard);
        self.queue = others;
        let edit = |table: &mut LoadTable| {
            let mut changed = false;
            for (t, at) in &queued {
                changed |= table.release_at(t, *at);
            }
            let released = table.release_at(&ticket, now_ms);
            (changed || released).then_some(released)
        };
        // Alone, the release touches its own slot only; deferred ones may be anywhere in it.
        let outcome = if queued.is_empty() {
            update_slot(store, num_slots, ticket.slot, now_ms, edit)
        } else {
            update_shard(store, num_slots, shard, edit)
        };
        match outcome {
            Ok(true) => Release::Released,
            // Declined: neither this key nor any deferred one is in the table (all reaped).
            Ok(false) | Err(UpdateFailure::Declined) => Release::Unknown,
            Err(UpdateFailure::Contended) => {
                for (t, at) in queued {
                    self.push(t, at);
                }
                self.push(ticket, now_ms);
                Release::Deferred
            }
        }
    }

    /// Retries every deferred release (one CAS loop per shard they are in). Returns how many
    /// are still deferred.
    pub fn flush(&mut self, store: &dyn SharedStore, num_slots: usize) -> usize {
        let mut queued = std::mem::take(&mut self.queue);
        while let Some(&(first, _)) = queued.first() {
            let shard = shard_of(first.slot);
            let (mine, rest): (Vec<_>, Vec<_>) = queued
                .into_iter()
                .partition(|(t, _)| shard_of(t.slot) == shard);
            queued = rest;
            let outcome = update_shard(store, num_slots, shard, |table| {
                let mut changed = false;
                for (t, at) in &mine {
                    changed |= table.release_at(t, *at);
                }
                changed.then_some(())
            });
            if outcome == Err(UpdateFailure::Contended) {
                self.queue.extend(mine);
            }
        }
        self.queue.len()
    }

    fn push(&mut self, ticket: Ticket, now_ms: u64) {
        if self.queue.len() >= MAX_PENDING_RELEASES {
            self.queue.remove(0);
            self.dropped += 1;
        }
        self.queue.push((ticket, now_ms));
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
    use crate::store::fake::{MemStore, Op};
    use std::cell::Cell;
    use std::rc::Rc;

    const SLOTS: usize = 2;

    fn admit(store: &dyn SharedStore, key: u64, slot: u16) -> Ticket {
        update_shard(store, SLOTS, 0, |t| t.admit(key, slot, 100, 4, None, 0)).unwrap()
    }

    fn keys_in_flight(store: &MemStore) -> u64 {
        view(store, SLOTS, 60)
            .iter()
            .map(|l| u64::from(l.active_requests))
            .sum()
    }

    /// Another VM books a request between every read and write of ours, `rounds` times: every
    /// CAS of ours fails while it lasts.
    fn contend(store: &MemStore, rounds: usize) -> Rc<Cell<usize>> {
        let admitted = Rc::new(Cell::new(0usize));
        let counter = Rc::clone(&admitted);
        store.set_hook(move |s: &MemStore, op: &Op| {
            if *op == Op::Set(LOAD_KEY.to_string()) && counter.get() < rounds {
                counter.set(counter.get() + 1);
                admit(s, 1000 + counter.get() as u64, 1);
            }
        });
        admitted
    }

    #[test]
    fn a_release_outlasted_by_contention_is_kept_and_lands_later() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let seven = admit(&store, 7, 0);
        let mut pending = PendingReleases::default();
        let others = contend(&store, CAS_ATTEMPTS);
        assert_eq!(pending.release(&store, SLOTS, seven, 50), Release::Deferred);
        store.clear_hook();
        assert_eq!(pending.len(), 1);
        assert_eq!(others.get(), CAS_ATTEMPTS);
        // Still booked: the release has not landed.
        assert_eq!(keys_in_flight(&store), 1 + CAS_ATTEMPTS as u64);
        assert_eq!(pending.flush(&store, SLOTS), 0);
        assert!(pending.is_empty());
        // Ours is gone and none of the other VM's bookings was lost.
        assert_eq!(keys_in_flight(&store), CAS_ATTEMPTS as u64);
        assert_eq!(view(&store, SLOTS, 60)[0].active_requests, 0);
    }

    #[test]
    fn a_deferred_release_rides_on_the_next_release() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let seven = admit(&store, 7, 0);
        let eight = admit(&store, 8, 0);
        let mut pending = PendingReleases::default();
        let _others = contend(&store, CAS_ATTEMPTS);
        assert_eq!(pending.release(&store, SLOTS, seven, 50), Release::Deferred);
        store.clear_hook();
        assert_eq!(pending.release(&store, SLOTS, eight, 60), Release::Released);
        assert!(pending.is_empty());
        assert_eq!(view(&store, SLOTS, 60)[0].active_requests, 0);
    }

    #[test]
    fn brief_contention_is_retried_with_fresh_reads() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let seven = admit(&store, 7, 0);
        let mut pending = PendingReleases::default();
        let others = contend(&store, 10);
        assert_eq!(pending.release(&store, SLOTS, seven, 50), Release::Released);
        store.clear_hook();
        assert_eq!(others.get(), 10);
        let loads = view(&store, SLOTS, 60);
        assert_eq!(
            (loads[0].active_requests, loads[1].active_requests),
            (0, 10)
        );
    }

    #[test]
    fn a_booking_from_a_snapshot_reads_once_and_never_loses_a_newer_write() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        // Fresh snapshot: the booking is one set, no second get.
        let snapshot = read_snapshot(&store, SLOTS);
        let ops = store.ops.get();
        update_slot_from(&store, SLOTS, 0, 0, Some(snapshot), |t| {
            t.admit(1, 0, 100, 4, None, 0)
        })
        .unwrap();
        assert_eq!(store.ops.get(), ops + 1);
        // Another VM booked after the snapshot: its booking survives ours.
        let stale = read_snapshot(&store, SLOTS);
        admit(&store, 2, 1);
        update_slot_from(&store, SLOTS, 0, 0, Some(stale), |t| {
            t.admit(3, 0, 100, 4, None, 0)
        })
        .unwrap();
        let loads = view(&store, SLOTS, 60);
        assert_eq!((loads[0].active_requests, loads[1].active_requests), (2, 1));
        // A snapshot of another slot count is never written back.
        let other = read_snapshot(&store, SLOTS + 1);
        update_slot_from(&store, SLOTS, 1, 0, Some(other), |t| {
            t.admit(4, 1, 100, 4, None, 0)
        })
        .unwrap();
        assert_eq!(view(&store, SLOTS, 60)[1].active_requests, 2);
    }

    #[test]
    fn a_one_slot_booking_from_a_stale_snapshot_rereads_and_keeps_other_writes() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let fresh = read_snapshot(&store, SLOTS);
        let ops = store.ops.get();
        let a = update_slot_from(&store, SLOTS, 0, 10, Some(fresh), |t| {
            t.admit(1, 0, 100, 4, None, 10)
        })
        .unwrap();
        assert_eq!(store.ops.get(), ops + 1, "fresh snapshot: one set, no get");
        let stale = read_snapshot(&store, SLOTS);
        admit(&store, 2, 1);
        update_slot_from(&store, SLOTS, 0, 20, Some(stale), |t| {
            t.admit(3, 0, 100, 4, None, 20)
        })
        .unwrap();
        let loads = view(&store, SLOTS, 30);
        assert_eq!((loads[0].active_requests, loads[1].active_requests), (2, 1));
        // A one-slot release removes exactly its booking.
        update_slot(&store, SLOTS, 0, 40, |t| t.release_at(&a, 40).then_some(())).unwrap();
        let loads = view(&store, SLOTS, 40);
        assert_eq!(
            (loads[0].active_requests, loads[0].prefill_tokens),
            (1, 100.0)
        );
        let mut out = Vec::new();
        read_snapshot(&store, SLOTS).view_into(40, &mut out);
        assert_eq!(out, loads);
        // A booking on a viewed snapshot (slot offsets known) edits the same bytes as one that
        // walks to its slot.
        for slot in 0..SLOTS as u16 {
            let walked = MemStore::new();
            let located = MemStore::new();
            for s in [&walked, &located] {
                s.set(
                    LOAD_KEY,
                    &read_snapshot(&store, SLOTS).shards[0].bytes,
                    None,
                )
                .unwrap();
            }
            let plain = read_snapshot(&walked, SLOTS);
            let mut viewed = read_snapshot(&located, SLOTS);
            viewed.view_into(50, &mut out);
            assert_eq!(viewed.shards[0].offsets.len(), SLOTS + 1);
            for (s, snapshot) in [(&walked, plain), (&located, viewed)] {
                update_slot_from(s, SLOTS, slot, 50, Some(snapshot), |t| {
                    t.admit(9, slot, 70, 3, Some(500.0), 50)
                })
                .unwrap();
            }
            assert_eq!(
                walked.get(LOAD_KEY).0,
                located.get(LOAD_KEY).0,
                "slot {slot}"
            );
        }
    }

    #[test]
    fn releasing_an_unknown_key_writes_nothing() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let mut other = LoadTable::new(SLOTS);
        let never_landed = other.admit(99, 0, 1, 1, None, 0).unwrap();
        let mut pending = PendingReleases::default();
        assert_eq!(
            pending.release(&store, SLOTS, never_landed, 1),
            Release::Unknown
        );
        assert!(pending.is_empty());
    }

    #[test]
    fn the_deferred_queue_is_bounded() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let ticket = LoadTable::new(SLOTS).admit(1, 0, 1, 1, None, 0).unwrap();
        let mut pending = PendingReleases::default();
        for k in 0..MAX_PENDING_RELEASES as u64 + 3 {
            pending.push(ticket, k);
        }
        assert_eq!(pending.len(), MAX_PENDING_RELEASES);
        assert_eq!(pending.dropped, 3);
    }

    #[test]
    fn reaping_drops_what_no_release_came_for() {
        let store = MemStore::new();
        init(&store, SLOTS, 3_000);
        let lost = admit(&store, 7, 0);
        assert_eq!(reap(&store, SLOTS, 3_999, 3_000), 0);
        assert_eq!(reap(&store, SLOTS, 4_000, 3_000), 1);
        assert_eq!(view(&store, SLOTS, 4_000)[0], Default::default());
        let mut pending = PendingReleases::default();
        assert_eq!(
            pending.release(&store, SLOTS, lost, 4_100),
            Release::Unknown
        );
    }

    #[test]
    fn a_table_of_another_width_or_slot_count_is_replaced() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        admit(&store, 7, 0);
        init(&store, SLOTS, 900_000);
        assert_eq!(keys_in_flight(&store), 1, "same configuration: kept");
        init(&store, SLOTS, 3_000);
        assert_eq!(
            LoadTable::decode(&store.get(LOAD_KEY).0.unwrap(), SLOTS)
                .unwrap()
                .bucket_ms(),
            1_000
        );
        assert_eq!(keys_in_flight(&store), 0);
        // Corrupt bytes decode as a default-width table; the next reap restores the width.
        store.set(LOAD_KEY, b"garbage", None).unwrap();
        assert_eq!(reap(&store, SLOTS, 10, 3_000), 0);
        assert_eq!(
            LoadTable::decode(&store.get(LOAD_KEY).0.unwrap(), SLOTS)
                .unwrap()
                .bucket_ms(),
            1_000
        );
    }

    #[test]
    fn a_cleared_slot_keeps_the_other_slots() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let gone = admit(&store, 7, 0);
        admit(&store, 8, 1);
        update_shard(&store, SLOTS, 0, |t| t.clear_slot(0).then_some(())).unwrap();
        let loads = view(&store, SLOTS, 60);
        assert_eq!((loads[0].active_requests, loads[1].active_requests), (0, 1));
        let mut pending = PendingReleases::default();
        assert_eq!(pending.release(&store, SLOTS, gone, 70), Release::Unknown);
    }

    /// Three shards (128 + 128 + 44 slots).
    const MANY: usize = 300;

    #[test]
    fn shard_keys_are_the_load_key_then_numbered() {
        assert_eq!(&*shard_key(0), "ekr.load");
        assert_eq!(&*shard_key(1), "ekr.load.1");
        assert_eq!(&*shard_key(511), "ekr.load.511");
        assert_eq!(&*shard_key(usize::MAX), format!("ekr.load.{}", usize::MAX));
    }

    #[test]
    fn a_large_table_is_one_key_per_shard_and_a_slot_edit_writes_its_shard_only() {
        let store = MemStore::new();
        init(&store, MANY, 900_000);
        assert_eq!(shard_count(MANY), 3);
        assert_eq!(store.key_count(), 3);
        for shard in 0..3 {
            assert!(store.peek(&shard_key(shard)).is_some(), "shard {shard}");
        }
        let before: Vec<_> = (0..3).map(|s| store.peek(&shard_key(s))).collect();
        let ticket =
            update_slot(&store, MANY, 200, 10, |t| t.admit(5, 200, 300, 6, None, 10)).unwrap();
        let after: Vec<_> = (0..3).map(|s| store.peek(&shard_key(s))).collect();
        assert_eq!(
            (before[0] == after[0], before[1] == after[1]),
            (true, false)
        );
        assert_eq!(before[2], after[2]);
        let loads = view(&store, MANY, 20);
        assert_eq!(loads.len(), MANY);
        assert_eq!(
            (loads[200].active_requests, loads[200].prefill_tokens),
            (1, 300.0)
        );
        assert_eq!(loads.iter().map(|l| l.active_requests).sum::<u32>(), 1);
        // Past the last shard: nothing booked, nothing written.
        assert!(update_slot(&store, MANY, 300, 10, |t| t.admit(6, 300, 1, 1, None, 10)).is_err());
        let mut pending = PendingReleases::default();
        assert_eq!(pending.release(&store, MANY, ticket, 30), Release::Released);
        assert!(view(&store, MANY, 40)
            .iter()
            .all(|l| *l == SlotLoad::default()));
        // A table of 128 slots or fewer keeps the one key it always had.
        let small = MemStore::new();
        init(&small, SHARD_SLOTS, 900_000);
        assert_eq!(small.key_count(), 1);
        assert!(small.peek(LOAD_KEY).is_some());
    }

    /// Random bookings, first tokens, releases (some deferred by contention), moves within and
    /// across shards, departed slots and reaping, through the sharded store and on one whole
    /// table: every slot's load is the same after every step.
    #[test]
    fn the_sharded_table_loads_like_one_whole_table() {
        let timeout = 4_000;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        let store = MemStore::new();
        init(&store, MANY, timeout);
        let mut whole = LoadTable::with_timeout(MANY, timeout);
        let mut pending = PendingReleases::default();
        let mut cache = ViewCache::default();
        // (sharded ticket, whole-table ticket)
        let mut open: Vec<(Ticket, Ticket)> = Vec::new();
        let mut now = 0u64;
        // What the run exercised: cross-shard moves, deferred releases, requests cleared.
        let (mut moved_across, mut deferred, mut cleared_total) = (0, 0, 0);
        for step in 0..3_000u64 {
            now += next(40);
            let slot = next(MANY as u64) as SlotIdx;
            // Both drop dead buckets at the same times: a view before and after that differs
            // for a slot whose anchor died (its successor's clock starts at the drop).
            reap(&store, MANY, now, timeout);
            whole.expire(now);
            match next(10) {
                0..=3 => {
                    let (tokens, blocks) = (next(5_000) as u32, next(80) as u32);
                    let expected = (next(2) == 0).then_some(next(900) as f64 + 1.0);
                    let a = update_slot(&store, MANY, slot, now, |t| {
                        t.admit(step, slot, tokens, blocks, expected, now)
                    });
                    let b = whole.admit(step, slot, tokens, blocks, expected, now);
                    assert_eq!(a.is_ok(), b.is_some(), "step {step}");
                    if let (Ok(a), Some(b)) = (a, b) {
                        open.push((a, b));
                    }
                }
                4 if !open.is_empty() => {
                    let i = next(open.len() as u64) as usize;
                    let (a, b) = open[i];
                    let a = update_slot(&store, MANY, a.slot, now, |t| t.first_token(&a, now));
                    let b = whole.first_token(&b, now);
                    assert_eq!(a.is_ok(), b.is_some(), "step {step}");
                    if let (Ok(a), Some(b)) = (a, b) {
                        open[i] = (a, b);
                    }
                }
                5..=7 if !open.is_empty() => {
                    let (a, b) = open.swap_remove(next(open.len() as u64) as usize);
                    // Now and then another writer outlasts every attempt: the release waits.
                    let shard = shard_of(a.slot);
                    let other_slot = (shard * SHARD_SLOTS) as SlotIdx;
                    let others = (next(6) == 0).then(|| {
                        let booked = Rc::new(Cell::new(0u64));
                        let counter = Rc::clone(&booked);
                        store.set_hook(move |s: &MemStore, op: &Op| {
                            let mine = *op == Op::Set(shard_key(shard).to_string());
                            if mine && counter.get() < CAS_ATTEMPTS as u64 {
                                counter.set(counter.get() + 1);
                                let key = 1 << 40 | step << 8 | counter.get();
                                update_slot(s, MANY, other_slot, now, |t| {
                                    t.admit(key, other_slot, 100, 4, None, now)
                                })
                                .unwrap();
                            }
                        });
                        booked
                    });
                    let released = pending.release(&store, MANY, a, now);
                    store.clear_hook();
                    if let Some(others) = others {
                        // What the other writer booked counts in both.
                        for k in 0..others.get() {
                            whole.admit(
                                1 << 40 | step << 8 | (k + 1),
                                other_slot,
                                100,
                                4,
                                None,
                                now,
                            );
                        }
                    }
                    let expected = whole.release_at(&b, now);
                    if released == Release::Deferred {
                        deferred += 1;
                    } else {
                        assert_eq!(released == Release::Released, expected, "step {step}");
                    }
                }
                8 if !open.is_empty() => {
                    let i = next(open.len() as u64) as usize;
                    let (a, b) = open[i];
                    let moved = move_booking(&store, MANY, a, slot, now);
                    let b = whole.move_to(&b, slot, now);
                    assert_eq!(moved.is_ok(), b.is_some(), "step {step}: move to {slot}");
                    match (moved, b) {
                        (Ok(moved), Some(b)) => {
                            moved_across += usize::from(shard_of(moved.slot) != shard_of(a.slot));
                            open[i] = (moved, b);
                        }
                        _ => {
                            open.swap_remove(i);
                        }
                    }
                }
                9 if next(20) == 0 => {
                    let range = slot..slot.saturating_add(3).min(MANY as SlotIdx);
                    let cleared: u64 =
                        update_each(&store, MANY, |t| t.clear_slots(range.clone(), now))
                            .into_iter()
                            .flatten()
                            .sum();
                    assert_eq!(
                        cleared,
                        whole.clear_slots(range, now).unwrap_or(0),
                        "step {step}"
                    );
                    cleared_total += cleared;
                }
                _ => {}
            }
            if step % 50 == 0 {
                pending.flush(&store, MANY);
            }
            // A view that remembers the shards it saw equals one that decodes every shard.
            let mut remembered = Vec::new();
            read_snapshot(&store, MANY).view_with(now, &mut remembered, &mut cache);
            assert_eq!(remembered, view(&store, MANY, now), "step {step}");
            if pending.is_empty() {
                let (sharded, one) = (view(&store, MANY, now), whole.view(now));
                let differs = (0..MANY).find(|&i| sharded[i] != one[i]);
                assert_eq!(
                    differs,
                    None,
                    "step {step}: {:?}",
                    differs.map(|i| (sharded[i], one[i]))
                );
            }
        }
        // Decaying prefills and dying buckets keep most views fresh here; some are reused.
        assert!(cache.reused > 100, "{} shard views reused", cache.reused);
        assert!(
            moved_across > 20 && deferred > 20 && cleared_total > 0,
            "{moved_across} {deferred} {cleared_total}"
        );
    }

    /// One booking or release per step writes one shard: the next view decodes that shard and
    /// takes the other two from memory, until a time bucket dies (then every shard is decoded).
    #[test]
    fn a_view_decodes_only_the_shards_written_since_the_last() {
        let store = MemStore::new();
        init(&store, MANY, 3_000);
        let mut cache = ViewCache::default();
        let mut out = Vec::new();
        read_snapshot(&store, MANY).view_with(0, &mut out, &mut cache);
        assert_eq!(cache.reused, 0);
        let mut tickets = Vec::new();
        for step in 0..30u64 {
            let slot = (step * 37 % MANY as u64) as SlotIdx;
            let now = 10 + step;
            if step % 3 == 2 {
                let ticket: Ticket = tickets.remove(0);
                let mut pending = PendingReleases::default();
                assert_eq!(
                    pending.release(&store, MANY, ticket, now),
                    Release::Released
                );
            } else {
                tickets.push(
                    update_slot(&store, MANY, slot, now, |t| {
                        t.admit(step, slot, 100, 2, None, now)
                    })
                    .unwrap(),
                );
            }
            let before = cache.reused;
            read_snapshot(&store, MANY).view_with(now, &mut out, &mut cache);
            assert_eq!(cache.reused - before, 2, "step {step}");
            assert_eq!(out, view(&store, MANY, now), "step {step}");
        }
        // Buckets are 1 s wide and live 4: at 4 s the first one dies, so no shard's view holds.
        let before = cache.reused;
        read_snapshot(&store, MANY).view_with(4_000, &mut out, &mut cache);
        assert_eq!(cache.reused, before);
        assert_eq!(out, view(&store, MANY, 4_000));
        assert!(
            out.iter().all(|l| *l == SlotLoad::default()),
            "all reaped by age"
        );
        // A decaying prefill moves with the clock: its shard is decoded every time.
        update_slot(&store, MANY, 5, 4_000, |t| {
            t.admit(99, 5, 500, 2, Some(1_000.0), 4_000)
        })
        .unwrap();
        read_snapshot(&store, MANY).view_with(4_000, &mut out, &mut cache);
        for now in [4_100, 4_500] {
            let before = cache.reused;
            read_snapshot(&store, MANY).view_with(now, &mut out, &mut cache);
            assert_eq!(cache.reused - before, 2, "only the other two shards");
            assert_eq!(out, view(&store, MANY, now));
        }
        assert!(out[5].prefill_tokens < 500.0 && out[5].prefill_tokens > 0.0);
    }
}
