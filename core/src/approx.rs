//! Approximate mode: the filter's own routing decisions as predicted cached blocks.
//!
//! Every routed request whose prefix hashes are known is recorded as "these blocks are on slot
//! S until now + ttl" (Dynamo's event-less mode). Records are shared by all VMs of the process
//! through a fixed ring of shared-data keys: a writer claims record number n by CAS on
//! `ekr.approx.seq`, then writes `ekr.approx.<n % RING>`; every VM applies the records it has
//! not seen to its own [`PredictedStore`] (on the request path and on its tick).
//!
//! Invariants: keys are `1 + RING`, fixed; each VM's store holds at most `max_blocks` entries
//! (oldest dropped first) and never reports an entry past its expiry. Predictions are hints: a
//! record overwritten before a slow VM read it is skipped (counted), never waited for.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::store::SharedStore;
use crate::types::{SequenceHash, SlotIdx};

/// Records kept in the shared ring.
pub const RING: u64 = 64;
const SEQ_KEY: &str = "ekr.approx.seq";
const CLAIM_ATTEMPTS: usize = 16;

fn ring_key(n: u64) -> String {
    format!("ekr.approx.{}", n % RING)
}

/// One routing decision: `hashes` predicted on `slot` until `expires_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub slot: SlotIdx,
    pub expires_ms: u64,
    pub hashes: Vec<SequenceHash>,
}

fn encode(n: u64, r: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(22 + r.hashes.len() * 8);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&r.slot.to_le_bytes());
    out.extend_from_slice(&r.expires_ms.to_le_bytes());
    out.extend_from_slice(&(r.hashes.len() as u32).to_le_bytes());
    for h in &r.hashes {
        out.extend_from_slice(&h.0.to_le_bytes());
    }
    out
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// `(n, record)`, or `None` for a malformed value.
fn decode(b: &[u8]) -> Option<(u64, Record)> {
    let n = u64_at(b, 0)?;
    let slot = u16::from_le_bytes(b.get(8..10)?.try_into().ok()?);
    let expires_ms = u64_at(b, 10)?;
    let count = u32::from_le_bytes(b.get(18..22)?.try_into().ok()?) as usize;
    if b.len() != 22 + count.checked_mul(8)? {
        return None;
    }
    let hashes = (0..count)
        .map(|i| u64_at(b, 22 + i * 8).map(SequenceHash))
        .collect::<Option<Vec<_>>>()?;
    Some((
        n,
        Record {
            slot,
            expires_ms,
            hashes,
        },
    ))
}

fn read_seq(store: &dyn SharedStore) -> (u64, Option<u32>) {
    let (bytes, cas) = store.get(SEQ_KEY);
    (
        bytes.as_deref().and_then(|b| u64_at(b, 0)).unwrap_or(0),
        cas,
    )
}

/// Creates the sequence key (once per process; later calls change nothing).
pub fn init(store: &dyn SharedStore) {
    if store.get(SEQ_KEY).0.is_none() {
        let _ = store.set(SEQ_KEY, &0u64.to_le_bytes(), None);
    }
}

/// Publishes one record for every VM. False when the claim lost every attempt (dropped).
pub fn publish(store: &dyn SharedStore, record: &Record) -> bool {
    for _ in 0..CLAIM_ATTEMPTS {
        let (seq, cas) = read_seq(store);
        let n = seq.wrapping_add(1);
        if store.set(SEQ_KEY, &n.to_le_bytes(), cas).is_ok() {
            return store.set(&ring_key(n), &encode(n, record), None).is_ok();
        }
    }
    false
}

/// What one sync did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub applied: u64,
    /// Records overwritten or never written before this VM read them.
    pub skipped: u64,
}

/// One VM's view: the predicted entries and the last record number applied.
pub struct PredictedStore {
    /// Per hash, the slots predicted to hold it and until when.
    entries: HashMap<SequenceHash, Vec<(SlotIdx, u64)>>,
    /// Insertion order, for expiry and the size bound: `(expires_ms, hash, slot)`.
    order: VecDeque<(u64, SequenceHash, SlotIdx)>,
    max_blocks: usize,
    last_seen: u64,
}

impl PredictedStore {
    /// Whether any slot is (or was, expiry aside) predicted to hold `hash`: past the first hash
    /// none is, [`PredictedStore::overlaps`] counts nothing more.
    pub fn knows(&self, hash: SequenceHash) -> bool {
        self.entries.contains_key(&hash)
    }

    pub fn new(max_blocks: usize) -> PredictedStore {
        PredictedStore {
            entries: HashMap::new(),
            order: VecDeque::new(),
            max_blocks: max_blocks.max(1),
            last_seen: 0,
        }
    }

    /// Entries held (an upper bound: refreshed entries count once per refresh until expiry).
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Adds (or refreshes) the record's entries.
    pub fn insert(&mut self, record: &Record, now_ms: u64) {
        if record.expires_ms <= now_ms {
            return;
        }
        for &hash in &record.hashes {
            let slots = self.entries.entry(hash).or_default();
            match slots.iter_mut().find(|(s, _)| *s == record.slot) {
                Some(entry) => entry.1 = entry.1.max(record.expires_ms),
                None => slots.push((record.slot, record.expires_ms)),
            }
            self.order.push_back((record.expires_ms, hash, record.slot));
        }
        while self.order.len() > self.max_blocks {
            self.pop_oldest();
        }
        self.expire(now_ms);
    }

    fn pop_oldest(&mut self) {
        let Some((expires, hash, slot)) = self.order.pop_front() else {
            return;
        };
        if let Some(slots) = self.entries.get_mut(&hash) {
            // A later refresh of the same entry keeps it alive: only its own expiry removes it.
            slots.retain(|(s, e)| !(*s == slot && *e <= expires));
            if slots.is_empty() {
                self.entries.remove(&hash);
            }
        }
    }

    /// Drops the prediction that `slot` holds `hash`: its engine reported the block gone.
    /// (A prediction made after the removal but applied before it is lost too; the engine's
    /// "stored" event for the recomputed block brings the knowledge back.)
    /// Whether there was such a prediction.
    pub fn forget(&mut self, slot: SlotIdx, hash: SequenceHash) -> bool {
        let Some(slots) = self.entries.get_mut(&hash) else {
            return false;
        };
        let before = slots.len();
        slots.retain(|(s, _)| *s != slot);
        let forgot = slots.len() < before;
        if slots.is_empty() {
            self.entries.remove(&hash);
        }
        forgot
    }

    /// Drops every prediction on `slot` (its engine cleared its cache, or it left).
    pub fn forget_slot(&mut self, slot: SlotIdx) {
        self.entries.retain(|_, slots| {
            slots.retain(|(s, _)| *s != slot);
            !slots.is_empty()
        });
    }

    /// Drops entries whose time has passed (records arrive in about expiry order).
    pub fn expire(&mut self, now_ms: u64) {
        while self.order.front().is_some_and(|(e, _, _)| *e <= now_ms) {
            self.pop_oldest();
        }
    }

    /// Per slot (`num_slots` long), the leading run of `prompt` predicted on it and not expired.
    pub fn overlaps(&self, prompt: &[SequenceHash], num_slots: usize, now_ms: u64) -> Vec<u32> {
        let mut counts = vec![0u32; num_slots];
        let mut alive = vec![true; num_slots];
        let mut any = true;
        for (i, hash) in prompt.iter().enumerate() {
            if !any {
                break;
            }
            any = false;
            let held = self.entries.get(hash);
            for (slot, (count, live)) in counts.iter_mut().zip(alive.iter_mut()).enumerate() {
                if !*live {
                    continue;
                }
                let has = held.is_some_and(|slots| {
                    slots
                        .iter()
                        .any(|(s, e)| usize::from(*s) == slot && *e > now_ms)
                });
                if has {
                    *count = u32::try_from(i + 1).unwrap_or(u32::MAX);
                    any = true;
                } else {
                    *live = false;
                }
            }
        }
        counts
    }

    /// Applies every record published since the last sync.
    pub fn sync(&mut self, store: &dyn SharedStore, now_ms: u64) -> SyncReport {
        let mut report = SyncReport::default();
        let (seq, _) = read_seq(store);
        if seq <= self.last_seen {
            self.expire(now_ms);
            return report;
        }
        // Records older than the ring are gone.
        let first = self.last_seen.max(seq.saturating_sub(RING)) + 1;
        report.skipped += first - self.last_seen - 1;
        for n in first..=seq {
            let decoded = match store.get(&ring_key(n)).0 {
                None => Some((0, None)),
                Some(bytes) => decode(&bytes).map(|(m, r)| (m, Some(r))),
            };
            match decoded {
                Some((m, Some(record))) if m == n => {
                    self.insert(&record, now_ms);
                    report.applied += 1;
                }
                // Claimed but not written yet: read it next time, unless the ring moved on.
                Some((m, _)) if m < n && seq - n < RING / 2 => {
                    self.last_seen = n - 1;
                    return report;
                }
                _ => report.skipped += 1,
            }
        }
        self.last_seen = seq;
        self.expire(now_ms);
        report
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::store::fake::MemStore;

    fn h(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|x| SequenceHash(*x)).collect()
    }

    fn rec(slot: SlotIdx, expires_ms: u64, hashes: &[u64]) -> Record {
        Record {
            slot,
            expires_ms,
            hashes: h(hashes),
        }
    }

    #[test]
    fn codec_round_trip_and_damage() {
        let r = rec(3, 99, &[1, 2, u64::MAX]);
        let bytes = encode(7, &r);
        assert_eq!(decode(&bytes), Some((7, r)));
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]), None);
        }
    }

    #[test]
    fn leading_runs_per_slot_and_expiry() {
        let mut s = PredictedStore::new(100);
        s.insert(&rec(1, 500, &[1, 2]), 0);
        s.insert(&rec(0, 1000, &[1, 2, 3]), 0);
        assert_eq!(s.overlaps(&h(&[1, 2, 3, 4]), 3, 10), vec![3, 2, 0]);
        // A gap ends the run.
        assert_eq!(s.overlaps(&h(&[1, 9, 3]), 3, 10), vec![1, 1, 0]);
        // Slot 1's entries pass their expiry (reported as gone even before the sweep).
        assert_eq!(s.overlaps(&h(&[1, 2, 3]), 3, 500), vec![3, 0, 0]);
        s.expire(500);
        assert_eq!(s.len(), 3);
        s.expire(1000);
        assert!(s.is_empty());
        assert_eq!(s.overlaps(&h(&[1]), 3, 1000), vec![0, 0, 0]);
    }

    #[test]
    fn forgetting_ends_a_run_on_one_slot_only() {
        let mut s = PredictedStore::new(100);
        s.insert(&rec(0, 1000, &[1, 2, 3]), 0);
        s.insert(&rec(1, 1000, &[1, 2, 3]), 0);
        assert!(s.forget(0, SequenceHash(2)));
        assert!(!s.forget(0, SequenceHash(2)), "already gone");
        assert!(!s.forget(2, SequenceHash(1)), "never predicted there");
        assert_eq!(s.overlaps(&h(&[1, 2, 3]), 3, 10), vec![1, 3, 0]);
        s.forget_slot(1);
        assert_eq!(s.overlaps(&h(&[1, 2, 3]), 3, 10), vec![1, 0, 0]);
        assert!(s.knows(SequenceHash(1)) && !s.knows(SequenceHash(2)));
        // A later prediction of a forgotten block counts again, and the sweep of the
        // forgotten entry's expiry leaves it.
        s.insert(&rec(0, 2000, &[1, 2]), 10);
        s.expire(1000);
        assert_eq!(s.overlaps(&h(&[1, 2, 3]), 3, 1000), vec![2, 0, 0]);
    }

    #[test]
    fn size_bound_drops_the_oldest_and_refresh_survives() {
        let mut s = PredictedStore::new(4);
        s.insert(&rec(0, 100, &[1, 2]), 0);
        s.insert(&rec(0, 200, &[1]), 0); // refresh of hash 1
        s.insert(&rec(1, 300, &[5, 6]), 0);
        assert_eq!(s.len(), 4);
        // Hash 1 on slot 0 was refreshed: dropping its first entry kept it.
        assert_eq!(s.overlaps(&h(&[1, 2]), 2, 0), vec![2, 0]);
        s.insert(&rec(1, 300, &[7]), 0);
        // Hash 2 was the oldest entry.
        assert_eq!(s.overlaps(&h(&[1, 2]), 2, 0), vec![1, 0]);
        assert_eq!(s.overlaps(&h(&[5, 6]), 2, 0), vec![0, 2]);
    }

    #[test]
    fn records_reach_every_replica_and_a_lapped_one_skips() {
        let store = MemStore::new();
        init(&store);
        let mut a = PredictedStore::new(1000);
        let mut b = PredictedStore::new(1000);
        assert!(publish(&store, &rec(2, 1000, &[10, 11])));
        assert_eq!(a.sync(&store, 0).applied, 1);
        assert_eq!(a.overlaps(&h(&[10, 11]), 3, 0), vec![0, 0, 2]);
        // B fell more than a ring behind: it applies the last RING records, skips the rest.
        for i in 0..RING + 5 {
            assert!(publish(&store, &rec(1, 1000, &[100 + i])));
        }
        let r = b.sync(&store, 0);
        assert_eq!((r.applied, r.skipped), (RING, 6));
        assert_eq!(b.overlaps(&h(&[10]), 3, 0), vec![0, 0, 0]);
        assert_eq!(b.overlaps(&h(&[100 + RING + 4]), 3, 0), vec![0, 1, 0]);
        assert_eq!(b.sync(&store, 0), SyncReport::default());
    }

    #[test]
    fn a_claimed_unwritten_record_is_awaited() {
        let store = MemStore::new();
        init(&store);
        let mut a = PredictedStore::new(1000);
        assert!(publish(&store, &rec(0, 1000, &[1])));
        // Record 2 claimed (seq moved), its slot not written yet.
        store.put(SEQ_KEY, &2u64.to_le_bytes());
        assert_eq!(a.sync(&store, 0).applied, 1);
        store.put(&ring_key(2), &encode(2, &rec(1, 1000, &[2])));
        assert_eq!(a.sync(&store, 0).applied, 1);
        assert_eq!(a.overlaps(&h(&[2]), 2, 0), vec![0, 1]);
    }
}
