//! The load table in one shared-data key (`ekr.load`), updated by every VM with CAS (get, edit,
//! set with the version read; on mismatch read again and redo the edit) so that no update is lost.
//!
//! A release must never be lost: a lost one leaves phantom load on its worker until the reaper
//! drops it (`load.request_timeout_ms`, 15 minutes by default). So a release whose CAS loop is
//! outlasted by contention is kept in the VM's [`PendingReleases`] and folded into this VM's next
//! load update (and retried on every tick) until it lands.
//!
//! The table's size is fixed by the slot count (see [`crate::load`]), so every CAS round costs
//! the same whatever the requests in flight.

use crate::load::{bucket_ms_for, reap_due, view_bytes_at, LoadTable, SlotLoad, Ticket, Window};
use crate::store::{SharedStore, StoreError};
use crate::types::SlotIdx;

const LOAD_KEY: &str = "ekr.load";
const CAS_ATTEMPTS: usize = 64;
/// Releases a VM keeps while contention defers them (each is about 56 bytes).
pub const MAX_PENDING_RELEASES: usize = 4096;

/// Why [`update`] wrote nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateFailure {
    /// The edit returned `None` (nothing to change).
    Declined,
    /// Every attempt lost its CAS to another writer (or the host failed).
    Contended,
}

/// Creates the key if absent (so later writers always have a CAS version to check), or replaces
/// a table another configuration wrote (slot count or bucket width for `timeout_ms`).
pub fn init(store: &dyn SharedStore, num_slots: usize, timeout_ms: u64) {
    let (bytes, cas) = store.get(LOAD_KEY);
    let fits = bytes.as_deref().is_some_and(|b| {
        LoadTable::decode(b, num_slots).is_ok_and(|t| t.bucket_ms() == bucket_ms_for(timeout_ms))
    });
    if !fits {
        let fresh = LoadTable::with_timeout(num_slots, timeout_ms).encode();
        let _ = store.set(LOAD_KEY, &fresh, cas);
    }
}

pub fn read(store: &dyn SharedStore, num_slots: usize) -> LoadTable {
    let (bytes, _) = store.get(LOAD_KEY);
    LoadTable::decode_or_fresh(bytes.as_deref().unwrap_or_default(), num_slots).0
}

/// The table's bytes as read, with the version they were read at: the request path views them
/// once for its decision and hands them to [`update_slot_from`] for the booking, whose first CAS
/// attempt then needs no second get.
pub struct Snapshot {
    bytes: Vec<u8>,
    cas: Option<u32>,
    num_slots: usize,
    /// Where each slot's details start in `bytes` (and where the last ends), recorded by
    /// [`Snapshot::view_into`]: the booking on these bytes then finds its slot without a pass
    /// over the others' summaries. Empty until then.
    offsets: Vec<usize>,
}

impl Snapshot {
    /// Per-slot load at `now_ms` into `out` (idle slots if the bytes do not decode: the next
    /// write replaces them with a fresh table).
    pub fn view_into(&mut self, now_ms: u64, out: &mut Vec<SlotLoad>) {
        let offsets = Some(&mut self.offsets);
        if view_bytes_at(&self.bytes, self.num_slots, now_ms, out, offsets).is_err() {
            out.resize(self.num_slots, SlotLoad::default());
        }
    }
}

pub fn read_snapshot(store: &dyn SharedStore, num_slots: usize) -> Snapshot {
    let (bytes, cas) = store.get(LOAD_KEY);
    Snapshot {
        bytes: bytes.unwrap_or_default(),
        cas,
        num_slots,
        offsets: Vec::new(),
    }
}

/// Applies `edit` atomically, on a fresh read for every attempt. An edit that returns `None`
/// changed nothing and writes nothing.
pub fn update<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    update_from(store, num_slots, None, edit)
}

/// [`update`] whose first attempt edits `first` (a [`read_snapshot`] of this table: if the key
/// was written since, that attempt's CAS fails and the next one reads afresh, as always).
pub fn update_from<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    first: Option<Snapshot>,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    cas_loop(store, num_slots, None, first, edit)
}

/// [`update`] for an edit that touches `slot` only, at `now_ms` (the time the edit uses): only
/// that slot is decoded and re-encoded, unless a time bucket is due to be reaped (then the whole
/// table is, as in [`update`]). The edit sees a table holding that slot alone.
pub fn update_slot<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    slot: SlotIdx,
    now_ms: u64,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    cas_loop(store, num_slots, Some((slot, now_ms)), None, edit)
}

/// [`update_slot`] whose first attempt edits `first` (see [`update_from`]).
pub fn update_slot_from<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    slot: SlotIdx,
    now_ms: u64,
    first: Option<Snapshot>,
    edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    cas_loop(store, num_slots, Some((slot, now_ms)), first, edit)
}

/// The CAS loop: `window` = the only slot the edit touches and its time.
fn cas_loop<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    window: Option<(SlotIdx, u64)>,
    mut first: Option<Snapshot>,
    mut edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    for _ in 0..CAS_ATTEMPTS {
        let (mut bytes, cas, offsets) = match first.take() {
            Some(snapshot) if snapshot.num_slots == num_slots => {
                (snapshot.bytes, snapshot.cas, snapshot.offsets)
            }
            _ => {
                let (bytes, cas) = store.get(LOAD_KEY);
                (bytes.unwrap_or_default(), cas, Vec::new())
            }
        };
        let windowed = window.and_then(|(slot, now_ms)| {
            let decoded = if offsets.is_empty() {
                Window::decode(&bytes, num_slots, slot, now_ms)
            } else {
                Window::decode_at(&bytes, num_slots, slot, now_ms, &offsets)
            };
            decoded.ok().flatten()
        });
        let encoded = match windowed {
            Some(mut w) => {
                let result = edit(&mut w.table).ok_or(UpdateFailure::Declined)?;
                // In place: the other slots' bytes are not copied (the set copies them once).
                w.encode_into(&mut bytes);
                (bytes, result)
            }
            None => {
                let mut table = LoadTable::decode_or_fresh(&bytes, num_slots).0;
                let result = edit(&mut table).ok_or(UpdateFailure::Declined)?;
                (table.encode(), result)
            }
        };
        match store.set(LOAD_KEY, &encoded.0, cas) {
            Ok(()) => return Ok(encoded.1),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Err(UpdateFailure::Contended),
        }
    }
    Err(UpdateFailure::Contended)
}

/// Drops buckets older than the request timeout: requests whose VM died before releasing them.
/// Returns how many requests this call reaped (bookings and other phases expire buckets too;
/// [`LoadTable::reaped_total`] counts them all). A table with another bucket width (written
/// after corrupt data was replaced, or by another configuration) is replaced by a fresh one.
pub fn reap(store: &dyn SharedStore, num_slots: usize, now_ms: u64, timeout_ms: u64) -> usize {
    let width = bucket_ms_for(timeout_ms);
    // Every tick calls this; a whole decode only when a bucket is due (once per bucket width).
    let (bytes, _) = store.get(LOAD_KEY);
    if !reap_due(
        bytes.as_deref().unwrap_or_default(),
        num_slots,
        now_ms,
        width,
    ) {
        return 0;
    }
    update(store, num_slots, |table| {
        if table.bucket_ms() != width {
            *table = LoadTable::with_timeout(num_slots, timeout_ms);
            return Some(0);
        }
        let reaped = table.expire(now_ms);
        (reaped > 0).then_some(reaped)
    })
    .unwrap_or(0)
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

    /// Releases `ticket` at `now_ms`, together with every deferred release (one CAS loop).
    pub fn release(
        &mut self,
        store: &dyn SharedStore,
        num_slots: usize,
        ticket: Ticket,
        now_ms: u64,
    ) -> Release {
        let queued = std::mem::take(&mut self.queue);
        let edit = |table: &mut LoadTable| {
            let mut changed = false;
            for (t, at) in &queued {
                changed |= table.release_at(t, *at);
            }
            let released = table.release_at(&ticket, now_ms);
            (changed || released).then_some(released)
        };
        // Alone, the release touches its own slot only; deferred ones may be anywhere.
        let outcome = if queued.is_empty() {
            update_slot(store, num_slots, ticket.slot, now_ms, edit)
        } else {
            update(store, num_slots, edit)
        };
        match outcome {
            Ok(true) => Release::Released,
            // Declined: neither this key nor any deferred one is in the table (all reaped).
            Ok(false) | Err(UpdateFailure::Declined) => Release::Unknown,
            Err(UpdateFailure::Contended) => {
                self.queue = queued;
                self.push(ticket, now_ms);
                Release::Deferred
            }
        }
    }

    /// Retries every deferred release (one CAS loop). Returns how many are still deferred.
    pub fn flush(&mut self, store: &dyn SharedStore, num_slots: usize) -> usize {
        if self.queue.is_empty() {
            return 0;
        }
        let queued = std::mem::take(&mut self.queue);
        let outcome = update(store, num_slots, |table| {
            let mut changed = false;
            for (t, at) in &queued {
                changed |= table.release_at(t, *at);
            }
            changed.then_some(())
        });
        if outcome == Err(UpdateFailure::Contended) {
            self.queue = queued;
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
        update(store, SLOTS, |t| t.admit(key, slot, 100, 4, None, 0)).unwrap()
    }

    fn keys_in_flight(store: &MemStore) -> u64 {
        read(store, SLOTS).active_requests(60)
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
        assert_eq!(read(&store, SLOTS).view(60)[0].active_requests, 0);
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
        assert_eq!(read(&store, SLOTS).view(60)[0].active_requests, 0);
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
        let view = read(&store, SLOTS).view(60);
        assert_eq!((view[0].active_requests, view[1].active_requests), (0, 10));
    }

    #[test]
    fn a_booking_from_a_snapshot_reads_once_and_never_loses_a_newer_write() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        // Fresh snapshot: the booking is one set, no second get.
        let snapshot = read_snapshot(&store, SLOTS);
        let ops = store.ops.get();
        update_from(&store, SLOTS, Some(snapshot), |t| {
            t.admit(1, 0, 100, 4, None, 0)
        })
        .unwrap();
        assert_eq!(store.ops.get(), ops + 1);
        // Another VM booked after the snapshot: its booking survives ours.
        let stale = read_snapshot(&store, SLOTS);
        admit(&store, 2, 1);
        update_from(&store, SLOTS, Some(stale), |t| {
            t.admit(3, 0, 100, 4, None, 0)
        })
        .unwrap();
        let view = read(&store, SLOTS).view(60);
        assert_eq!((view[0].active_requests, view[1].active_requests), (2, 1));
        // A snapshot of another slot count is never written back.
        let other = read_snapshot(&store, SLOTS + 1);
        update_from(&store, SLOTS, Some(other), |t| {
            t.admit(4, 1, 100, 4, None, 0)
        })
        .unwrap();
        assert_eq!(read(&store, SLOTS).view(60)[1].active_requests, 2);
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
        let view = read(&store, SLOTS).view(30);
        assert_eq!((view[0].active_requests, view[1].active_requests), (2, 1));
        // A one-slot release removes exactly its booking.
        update_slot(&store, SLOTS, 0, 40, |t| t.release_at(&a, 40).then_some(())).unwrap();
        let view = read(&store, SLOTS).view(40);
        assert_eq!(
            (view[0].active_requests, view[0].prefill_tokens),
            (1, 100.0)
        );
        let mut out = Vec::new();
        read_snapshot(&store, SLOTS).view_into(40, &mut out);
        assert_eq!(out, view);
        // A booking on a viewed snapshot (slot offsets known) edits the same bytes as one that
        // walks to its slot.
        for slot in 0..SLOTS as u16 {
            let walked = MemStore::new();
            let located = MemStore::new();
            for s in [&walked, &located] {
                s.set(LOAD_KEY, &read_snapshot(&store, SLOTS).bytes, None)
                    .unwrap();
            }
            let plain = read_snapshot(&walked, SLOTS);
            let mut viewed = read_snapshot(&located, SLOTS);
            viewed.view_into(50, &mut out);
            assert_eq!(viewed.offsets.len(), SLOTS + 1);
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
        assert_eq!(read(&store, SLOTS).view(4_000)[0], Default::default());
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
        assert_eq!(read(&store, SLOTS).bucket_ms(), 1_000);
        assert_eq!(keys_in_flight(&store), 0);
        // Corrupt bytes decode as a default-width table; the next reap restores the width.
        store.set(LOAD_KEY, b"garbage", None).unwrap();
        assert_eq!(reap(&store, SLOTS, 10, 3_000), 0);
        assert_eq!(read(&store, SLOTS).bucket_ms(), 1_000);
    }

    #[test]
    fn a_cleared_slot_keeps_the_other_slots() {
        let store = MemStore::new();
        init(&store, SLOTS, 900_000);
        let gone = admit(&store, 7, 0);
        admit(&store, 8, 1);
        update(&store, SLOTS, |t| t.clear_slot(0).then_some(())).unwrap();
        let view = read(&store, SLOTS).view(60);
        assert_eq!((view[0].active_requests, view[1].active_requests), (0, 1));
        let mut pending = PendingReleases::default();
        assert_eq!(pending.release(&store, SLOTS, gone, 70), Release::Unknown);
    }
}
