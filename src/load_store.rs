//! The load table in one shared-data key (`ekr.load`), updated by every VM with CAS (get, edit,
//! set with the version read; on mismatch read again and redo the edit) so that no update is lost.
//!
//! A release must never be lost: a lost one leaves phantom load on its worker until the reaper
//! drops it (`load.request_timeout_ms`, 15 minutes by default). So a release whose CAS loop is
//! outlasted by contention is kept in the VM's [`PendingReleases`] and folded into this VM's next
//! load update (and retried on every tick) until it lands.

use crate::load::LoadTable;
use crate::store::{SharedStore, StoreError};

const LOAD_KEY: &str = "ekr.load";
const CAS_ATTEMPTS: usize = 64;
/// Releases a VM keeps while contention defers them (each is 16 bytes).
pub const MAX_PENDING_RELEASES: usize = 4096;

/// Why [`update`] wrote nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateFailure {
    /// The edit returned `None` (nothing to change).
    Declined,
    /// Every attempt lost its CAS to another writer (or the host failed).
    Contended,
}

/// Creates the key if absent, so later writers always have a CAS version to check.
pub fn init(store: &dyn SharedStore, num_slots: usize) {
    if store.get(LOAD_KEY).0.is_none() {
        let _ = store.set(LOAD_KEY, &LoadTable::new(num_slots).encode(), None);
    }
}

pub fn read(store: &dyn SharedStore, num_slots: usize) -> LoadTable {
    let (bytes, _) = store.get(LOAD_KEY);
    LoadTable::decode_or_fresh(bytes.as_deref().unwrap_or_default(), num_slots).0
}

/// Applies `edit` atomically, on a fresh read for every attempt. An edit that returns `None`
/// changed nothing and writes nothing.
pub fn update<R>(
    store: &dyn SharedStore,
    num_slots: usize,
    mut edit: impl FnMut(&mut LoadTable) -> Option<R>,
) -> Result<R, UpdateFailure> {
    for _ in 0..CAS_ATTEMPTS {
        let (bytes, cas) = store.get(LOAD_KEY);
        let mut table =
            LoadTable::decode_or_fresh(bytes.as_deref().unwrap_or_default(), num_slots).0;
        let result = edit(&mut table).ok_or(UpdateFailure::Declined)?;
        match store.set(LOAD_KEY, &table.encode(), cas) {
            Ok(()) => return Ok(result),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Err(UpdateFailure::Contended),
        }
    }
    Err(UpdateFailure::Contended)
}

/// Drops entries older than the request timeout: requests whose VM died before releasing them.
pub fn reap(store: &dyn SharedStore, num_slots: usize, now_ms: u64, timeout_ms: u64) -> usize {
    update(store, num_slots, |table| {
        let reaped = table.reap_older_than(now_ms, timeout_ms);
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

/// Releases this VM could not write yet, oldest first: `(request key, release time)`.
#[derive(Debug, Default)]
pub struct PendingReleases {
    queue: Vec<(u64, u64)>,
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

    /// Releases `key` at `now_ms`, together with every deferred release (one CAS loop).
    pub fn release(
        &mut self,
        store: &dyn SharedStore,
        num_slots: usize,
        key: u64,
        now_ms: u64,
    ) -> Release {
        let queued = std::mem::take(&mut self.queue);
        let outcome = update(store, num_slots, |table| {
            let mut changed = false;
            for &(k, at) in &queued {
                changed |= table.release_at(k, at);
            }
            let released = table.release_at(key, now_ms);
            (changed || released).then_some(released)
        });
        match outcome {
            Ok(true) => Release::Released,
            // Declined: neither this key nor any deferred one is in the table (all reaped).
            Ok(false) | Err(UpdateFailure::Declined) => Release::Unknown,
            Err(UpdateFailure::Contended) => {
                self.queue = queued;
                self.push(key, now_ms);
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
            for &(k, at) in &queued {
                changed |= table.release_at(k, at);
            }
            changed.then_some(())
        });
        if outcome == Err(UpdateFailure::Contended) {
            self.queue = queued;
        }
        self.queue.len()
    }

    fn push(&mut self, key: u64, now_ms: u64) {
        if self.queue.len() >= MAX_PENDING_RELEASES {
            self.queue.remove(0);
            self.dropped += 1;
        }
        self.queue.push((key, now_ms));
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

    fn admit(store: &dyn SharedStore, key: u64, slot: u16) {
        update(store, SLOTS, |t| {
            t.admit(key, slot, 100, 4, None, 0);
            Some(())
        })
        .unwrap();
    }

    fn keys_in_flight(store: &MemStore) -> usize {
        read(store, SLOTS).active_entries()
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
        init(&store, SLOTS);
        admit(&store, 7, 0);
        let mut pending = PendingReleases::default();
        let others = contend(&store, CAS_ATTEMPTS);
        assert_eq!(pending.release(&store, SLOTS, 7, 50), Release::Deferred);
        store.clear_hook();
        assert_eq!(pending.len(), 1);
        assert_eq!(others.get(), CAS_ATTEMPTS);
        // Still booked: the release has not landed.
        assert_eq!(keys_in_flight(&store), 1 + CAS_ATTEMPTS);
        assert_eq!(pending.flush(&store, SLOTS), 0);
        assert!(pending.is_empty());
        // Ours is gone and none of the other VM's bookings was lost.
        assert_eq!(keys_in_flight(&store), CAS_ATTEMPTS);
        assert_eq!(read(&store, SLOTS).view(60)[0].active_requests, 0);
    }

    #[test]
    fn a_deferred_release_rides_on_the_next_release() {
        let store = MemStore::new();
        init(&store, SLOTS);
        admit(&store, 7, 0);
        admit(&store, 8, 0);
        let mut pending = PendingReleases::default();
        let _others = contend(&store, CAS_ATTEMPTS);
        assert_eq!(pending.release(&store, SLOTS, 7, 50), Release::Deferred);
        store.clear_hook();
        assert_eq!(pending.release(&store, SLOTS, 8, 60), Release::Released);
        assert!(pending.is_empty());
        assert_eq!(read(&store, SLOTS).view(60)[0].active_requests, 0);
    }

    #[test]
    fn brief_contention_is_retried_with_fresh_reads() {
        let store = MemStore::new();
        init(&store, SLOTS);
        admit(&store, 7, 0);
        let mut pending = PendingReleases::default();
        let others = contend(&store, 10);
        assert_eq!(pending.release(&store, SLOTS, 7, 50), Release::Released);
        store.clear_hook();
        assert_eq!(others.get(), 10);
        let view = read(&store, SLOTS).view(60);
        assert_eq!((view[0].active_requests, view[1].active_requests), (0, 10));
    }

    #[test]
    fn releasing_an_unknown_key_writes_nothing() {
        let store = MemStore::new();
        init(&store, SLOTS);
        let mut pending = PendingReleases::default();
        assert_eq!(pending.release(&store, SLOTS, 99, 1), Release::Unknown);
        assert!(pending.is_empty());
    }

    #[test]
    fn the_deferred_queue_is_bounded() {
        let store = MemStore::new();
        init(&store, SLOTS);
        let mut pending = PendingReleases::default();
        for k in 0..MAX_PENDING_RELEASES as u64 + 3 {
            pending.push(k, 0);
        }
        assert_eq!(pending.len(), MAX_PENDING_RELEASES);
        assert_eq!(pending.dropped, 3);
    }
}
