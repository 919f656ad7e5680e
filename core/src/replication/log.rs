//! The replicated event log that keeps every VM's KV index identical.
//!
//! Shared-data keys (fixed set, never per block or request):
//! * `ekr.log.head`  – [`LogHead`] in the binary layout of [`super::head_codec`]: last batch
//!   number, per-worker poll state (cursors, backoff: the poller's alone) and per-worker routing
//!   state (stale flag, reported load, membership). Its `version` moves only when the routing
//!   state changes, not with every poll reply.
//! * `ekr.log.seq`   – 16 bytes: the last batch number and head version published (only grows),
//!   so the request path can tell with one small read whether its replica is behind. Poll
//!   replies are coalesced per tick ([`super::coalesce`]), so both move about once per tick
//!   whatever the number of workers.
//! * `ekr.log.<n>`   – batch `seq` lives in slot `seq % LOG_SLOTS`, prefixed by `seq` (LE u64) so a
//!   reader can tell an older or newer batch from the one it wants.
//! * `ekr.snapshot`  – the index snapshot's manifest: snapshot id (the batch it was encoded at),
//!   the last batch it is valid at, part count, slot count. The poller writes a snapshot each
//!   time its replica has passed another multiple of `SNAPSHOT_EVERY` batches; replicas more
//!   than the ring behind restart from it.
//! * `ekr.snapshot.<n>` – its parts, at most [`SNAPSHOT_PARTS`], each prefixed by the snapshot id
//!   and its number: no VM ever holds the whole encoded snapshot in its linear memory (which
//!   never shrinks), only one part at a time. The writer sets the parts, then the manifest, then
//!   empties the parts a larger earlier snapshot left beyond its own. A loader that finds a part
//!   of another snapshot (a writer was overwriting them meanwhile) reads it again next tick,
//!   from an empty index (the writer sets every part within its tick); only a snapshot torn
//!   [`TORN_SNAPSHOT_RETRIES`] ticks in a row makes it lose sync. When no batch since the
//!   snapshot changed the index, the writer only moves the manifest's "valid at" forward (CAS)
//!   instead of encoding it again.
//!
//! Append protocol. Normally only the lease holder appends, but during a lease hand-over the old
//! holder may still be handling a reply while the new one appends, so it must hold for any
//! number of concurrent writers:
//! 1. *Claim*: read the head, apply the caller's edit, `seq += 1`, CAS-write the head. The head's
//!    CAS serializes claims: exactly one writer moves `seq` from S to S+1.
//! 2. *Write*: the claimant writes slot S+1 with CAS, and only while the slot holds an older
//!    batch. So a batch number's content is written once and never changes until the ring laps.
//! 3. *Publish* `ekr.log.seq`.
//!
//! Readers apply batches in order. A claimed batch whose slot is not written yet is *pending*:
//! the reader stops there and resumes on its next sync (it is never skipped). A claim whose
//! writer vanished between steps 1 and 2 (two adjacent host calls: only a VM dying there can do
//! it) would block every reader, so the poller fills a batch pending for [`ORPHAN_AFTER_MS`] with
//! "every worker lost" and resets every cursor: replicas converge and every worker re-syncs from
//! its dump. If the claimant was only slow, its own write then finds the slot taken and drops
//! its batch; the reset covers what it carried.
//!
//! Applying is deterministic, so replicas that apply the same batches hold the same index.

pub use super::head::{LogHead, Member, WorkerPollState};
use super::head_codec::{decode_head, decode_header, encode_head, routing_changed};
use crate::config::Config;
use crate::events::{
    check_log_batch, encode_log_batch, visit_log_batch, IndexEvent, LogItem, LogRecord, RecordHead,
};
use crate::index::{DeviceChange, KvIndex};
use crate::store::{SharedStore, StoreError};
use crate::types::{SequenceHash, SlotIdx};

pub const LOG_SLOTS: u64 = 64;
const SNAPSHOT_EVERY: u64 = LOG_SLOTS / 2;
const HEAD_KEY: &str = "ekr.log.head";
const SEQ_KEY: &str = "ekr.log.seq";
const SNAPSHOT_KEY: &str = "ekr.snapshot";
/// Most parts a snapshot is split into (a fixed key set: shared data never frees a key).
pub const SNAPSHOT_PARTS: u32 = 64;
/// Smallest part (bytes) before a snapshot is split into more parts (tiny in unit tests, so a
/// few hundred blocks make many parts).
const SNAPSHOT_PART_MIN_BYTES: usize = if cfg!(test) { 64 } else { 64 << 10 };
/// Part prefix: snapshot id u64 + part number u32.
const PART_HEADER_BYTES: usize = 12;
const APPEND_ATTEMPTS: usize = 8;
const SLOT_WRITE_ATTEMPTS: usize = 8;
/// A claimed batch still unwritten after this long is presumed orphaned (see the module docs).
/// A live claimant writes its slot right after claiming, within microseconds.
pub const ORPHAN_AFTER_MS: u64 = 10_000;

pub fn read_head(store: &dyn SharedStore) -> Option<(LogHead, Option<u32>)> {
    let (bytes, cas) = store.get(HEAD_KEY);
    let head = decode_head(&bytes?)?;
    Some((head, cas))
}

/// Creates the head, the sequence key and the ring's slot keys (empty) so that every later write
/// to them has a version to check: Envoy cannot create a key conditionally. Runs at configuration; only at
/// process start, before any batch exists, can two VMs both create a key.
pub fn init(store: &dyn SharedStore) {
    if store.get(HEAD_KEY).0.is_none() {
        let _ = store.set(HEAD_KEY, b"", None);
    }
    if store.get(SEQ_KEY).0.is_none() {
        let _ = store.set(SEQ_KEY, &[0; 16], None);
    }
    for n in 0..LOG_SLOTS {
        let key = slot_key(n);
        if store.get(&key).0.is_none() {
            let _ = store.set(&key, &0u64.to_le_bytes(), None);
        }
    }
}

/// What one sync did, for stats.
#[derive(Default, Debug, PartialEq)]
pub struct SyncReport {
    pub batches: u64,
    pub events_applied: u64,
    pub events_rejected: u64,
    pub evicted: u64,
    pub snapshot_loaded: bool,
    pub lost_sync: bool,
}

/// This VM's position in the log and its index replica.
pub struct Replica {
    pub index: KvIndex,
    pub applied_seq: u64,
    fingerprint: u64,
    /// The latest head seen (stale flags, reported load, membership; poll cursors only with
    /// `full_head`).
    pub head: LogHead,
    /// Decode the head's per-worker parts on every sync (the poller needs current cursors).
    /// Otherwise they are decoded only when the head's `version` moved: a sync for new batches
    /// alone reads the 64-byte header, whatever the number of workers.
    pub full_head: bool,
    /// The claimed batch this replica waits for, and since when.
    pending: Option<(u64, u64)>,
    /// What the engines put on and took off their device tiers, collected for approximate
    /// mode's predictions (`None`: not collected). Drained by the VM after each sync.
    pub device_changes: Option<DeviceChanges>,
    /// The id of the snapshot this index equals (written or loaded here, no change applied
    /// since): a due snapshot then only extends the manifest's validity.
    snapshot_basis: Option<u64>,
    /// Ticks in a row that found the snapshot torn (a writer replacing its parts).
    torn_snapshots: u8,
}

/// How often a replica beyond the ring retries a torn snapshot, one tick apart, before it gives
/// up and loses sync: the writer sets every part within one tick, so a second read is whole.
const TORN_SNAPSHOT_RETRIES: u8 = 3;

/// What loading the snapshot found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SnapshotLoad {
    Loaded,
    /// A part of another snapshot: a writer is replacing the parts; worth another read.
    Torn,
    /// None, too old, another configuration, or a part that does not decode.
    Unusable,
}

/// The snapshot manifest (`ekr.snapshot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Manifest {
    /// The batch the snapshot was encoded at; every part carries it.
    id: u64,
    /// The last batch the snapshot is valid at (no batch after `id` up to here changed it).
    valid_seq: u64,
    parts: u32,
    slots: u32,
}

impl Manifest {
    const BYTES: usize = 24;

    fn encode(&self) -> [u8; Manifest::BYTES] {
        let mut out = [0u8; Manifest::BYTES];
        let fields = self
            .id
            .to_le_bytes()
            .into_iter()
            .chain(self.valid_seq.to_le_bytes())
            .chain(self.parts.to_le_bytes())
            .chain(self.slots.to_le_bytes());
        for (dst, b) in out.iter_mut().zip(fields) {
            *dst = b;
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Manifest> {
        let (id, rest) = split_seq(bytes)?;
        let (valid_seq, rest) = split_seq(rest)?;
        let (parts, slots) = rest.split_at_checked(4)?;
        Some(Manifest {
            id,
            valid_seq,
            parts: u32::from_le_bytes(parts.try_into().ok()?),
            slots: u32::from_le_bytes(slots.try_into().ok()?),
        })
    }
}

fn part_key(part: u32) -> String {
    format!("ekr.snapshot.{part}")
}

/// A part's snapshot id, number and body.
fn split_part(bytes: &[u8]) -> Option<(u64, u32, &[u8])> {
    let (id, rest) = split_seq(bytes)?;
    let (number, body) = rest.split_at_checked(4)?;
    Some((id, u32::from_le_bytes(number.try_into().ok()?), body))
}

/// Device-tier changes applied by the syncs since the last drain.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DeviceChanges {
    /// Blocks a "removed" event took off a slot's device tier.
    pub lost: Vec<(SlotIdx, SequenceHash)>,
    /// Blocks a "stored" event (or a re-sync's dump) put on a slot's device tier, at most
    /// [`MAX_STORED_CHANGES`] per drain (the rest are not reported).
    pub stored: Vec<(SlotIdx, SequenceHash)>,
    /// Slots cleared whole (a "cleared" event or a lost worker; not a re-sync from the dump).
    pub cleared: Vec<SlotIdx>,
}

/// Stored blocks one drain reports: a re-sync's dump can hold a million, and a VM's linear
/// memory keeps its peak for good (16 bytes each: 256 KiB).
pub const MAX_STORED_CHANGES: usize = 16_384;

/// A ring slot read for one batch number.
enum SlotRead {
    /// The slot's value (its seq, then the encoded batch), checked to decode.
    Batch(Vec<u8>),
    /// Claimed but not written yet (the slot holds an older batch).
    Pending,
    /// The ring lapped it, or it does not decode.
    Lost,
}

impl Replica {
    pub fn new(config: &Config, fingerprint: u64) -> Replica {
        Replica {
            index: new_index(config),
            applied_seq: 0,
            fingerprint,
            head: LogHead::default(),
            full_head: false,
            pending: None,
            device_changes: None,
            snapshot_basis: None,
            torn_snapshots: 0,
        }
    }

    /// Whether the log holds batches this replica has not applied, or the head changed since
    /// this VM last read it (one 16-byte shared-data get).
    pub fn is_behind(&self, store: &dyn SharedStore) -> bool {
        let (seq, version) = read_seq_key(store);
        seq > self.applied_seq || version > self.head.version
    }

    /// The batch this replica has waited for longer than [`ORPHAN_AFTER_MS`], if any.
    pub fn orphaned_batch(&self, now_ms: u64) -> Option<u64> {
        let (seq, since) = self.pending?;
        (now_ms.saturating_sub(since) > ORPHAN_AFTER_MS).then_some(seq)
    }

    /// Applies every batch appended since the last sync, up to the first one still pending.
    pub fn sync(&mut self, store: &dyn SharedStore, config: &Config, now_ms: u64) -> SyncReport {
        let mut report = SyncReport::default();
        let (Some(bytes), _) = store.get(HEAD_KEY) else {
            return report;
        };
        let Some(header) = decode_header(&bytes) else {
            return report;
        };
        if header.fingerprint != self.fingerprint {
            return report; // written under another configuration; the poller will start a new epoch
        }
        let routing_moved = header.version != self.head.version
            || header.workers != self.head.workers.len()
            || header.epoch_start != self.head.epoch_start;
        let head = if self.full_head || routing_moved {
            match decode_head(&bytes) {
                Some(head) => head,
                None => return report,
            }
        } else {
            // Only batches or poll state moved: keep the decoded per-worker parts.
            let mut head = std::mem::take(&mut self.head);
            head.seq = header.seq;
            head.snapshot_seq = header.snapshot_seq;
            head
        };
        if self.applied_seq < head.epoch_start || self.applied_seq > head.seq {
            self.index = new_index(config);
            self.snapshot_basis = None;
            self.applied_seq = head.epoch_start;
        }
        if head.seq - self.applied_seq >= LOG_SLOTS {
            let load = self.load_snapshot(store, config, &head);
            if load == SnapshotLoad::Torn && self.torn_snapshots < TORN_SNAPSHOT_RETRIES {
                // Read it again next tick, from an empty index (the parts read so far are of
                // the old snapshot); the replica stays behind the ring until then.
                self.torn_snapshots += 1;
                self.index = new_index(config);
                self.snapshot_basis = None;
                self.head = head;
                return report;
            }
            self.torn_snapshots = 0;
            if load == SnapshotLoad::Loaded {
                report.snapshot_loaded = true;
            } else {
                report.lost_sync = true;
                self.index = new_index(config);
                self.snapshot_basis = None;
                self.applied_seq = head.seq.saturating_sub(LOG_SLOTS - 1).max(head.epoch_start);
            }
        }
        let mut waiting = None;
        while self.applied_seq < head.seq {
            let seq = self.applied_seq + 1;
            match read_batch(store, seq) {
                SlotRead::Batch(bytes) => {
                    let body = split_seq(&bytes).map_or(&[][..], |(_, body)| body);
                    self.apply_batch(config, body, &mut report);
                    self.applied_seq = seq;
                    report.batches += 1;
                }
                SlotRead::Pending => {
                    waiting = Some(seq);
                    break;
                }
                SlotRead::Lost => {
                    report.lost_sync = true;
                    break;
                }
            }
        }
        self.pending = match (waiting, self.pending) {
            (Some(seq), Some((same, since))) if same == seq => Some((seq, since)),
            (Some(seq), _) => Some((seq, now_ms)),
            (None, _) => None,
        };
        self.head = head;
        report
    }

    /// Loads the snapshot part by part into the existing index (its memory is reused instead of
    /// doubled; unless `Loaded`, the caller starts a new one anyway).
    fn load_snapshot(
        &mut self,
        store: &dyn SharedStore,
        config: &Config,
        head: &LogHead,
    ) -> SnapshotLoad {
        let (Some(bytes), _) = store.get(SNAPSHOT_KEY) else {
            return SnapshotLoad::Unusable;
        };
        let Some(m) = Manifest::decode(&bytes) else {
            return SnapshotLoad::Unusable;
        };
        if m.id < head.epoch_start
            || m.id > m.valid_seq
            || m.valid_seq > head.seq
            || head.seq - m.valid_seq >= LOG_SLOTS
            || m.parts == 0
            || m.parts > SNAPSHOT_PARTS
            || usize::try_from(m.slots).ok() != Some(config.slots.len())
        {
            return SnapshotLoad::Unusable;
        }
        self.index
            .begin_snapshot_parts(config.slots.len(), max_blocks(config));
        for number in 0..m.parts {
            let (Some(bytes), _) = store.get(&part_key(number)) else {
                return SnapshotLoad::Unusable;
            };
            match split_part(&bytes) {
                Some((id, n, body)) if id == m.id && n == number => {
                    if self.index.decode_snapshot_part(body).is_err() {
                        return SnapshotLoad::Unusable;
                    }
                }
                _ => return SnapshotLoad::Torn, // a writer is replacing the parts
            }
        }
        self.index.finish_snapshot_parts();
        self.applied_seq = m.valid_seq;
        self.snapshot_basis = Some(m.id);
        SnapshotLoad::Loaded
    }

    /// Writes this replica's index as the snapshot when it is due (the poller calls this): the
    /// parts one at a time from one part-sized buffer, then the manifest. When the index has not
    /// changed since the snapshot in place, only the manifest's validity moves.
    pub fn maybe_write_snapshot(&mut self, store: &dyn SharedStore) {
        // Due once the log has passed another multiple of SNAPSHOT_EVERY batches (a tick may
        // apply several batches: waiting for an exact multiple could skip snapshots for long).
        if self.applied_seq / SNAPSHOT_EVERY <= self.head.snapshot_seq / SNAPSHOT_EVERY {
            return;
        }
        let applied = self.applied_seq;
        let extended = self
            .snapshot_basis
            .is_some_and(|id| self.extend_snapshot(store, id, applied));
        let written = extended || self.write_snapshot(store, applied);
        if written {
            let _ = update_head(
                store,
                self.fingerprint,
                self.head.workers.len(),
                0,
                |head| {
                    head.snapshot_seq = head.snapshot_seq.max(applied);
                    true
                },
            );
        }
    }

    /// Moves the manifest's validity to `valid_seq` if it still describes snapshot `id`.
    fn extend_snapshot(&self, store: &dyn SharedStore, id: u64, valid_seq: u64) -> bool {
        let (Some(bytes), cas) = store.get(SNAPSHOT_KEY) else {
            return false;
        };
        let Some(m) = Manifest::decode(&bytes) else {
            return false;
        };
        if m.id != id || usize::try_from(m.slots).ok() != Some(self.index.num_slots()) {
            return false;
        }
        if m.valid_seq >= valid_seq {
            return true;
        }
        let moved = Manifest { valid_seq, ..m };
        store.set(SNAPSHOT_KEY, &moved.encode(), cas).is_ok()
    }

    /// Encodes and sets the parts, then the manifest, then empties stale parts.
    fn write_snapshot(&mut self, store: &dyn SharedStore, id: u64) -> bool {
        let Ok(slots) = u32::try_from(self.index.num_slots()) else {
            return false;
        };
        let mut buf = Vec::new();
        let parts = self.index.encode_snapshot_parts(
            PART_HEADER_BYTES,
            SNAPSHOT_PART_MIN_BYTES,
            SNAPSHOT_PARTS,
            &mut buf,
            |number, part| {
                let header = id.to_le_bytes().into_iter().chain(number.to_le_bytes());
                for (dst, b) in part.iter_mut().zip(header) {
                    *dst = b;
                }
                store.set(&part_key(number), part, None).is_ok()
            },
        );
        drop(buf);
        let Some(parts) = parts else {
            return false;
        };
        let manifest = Manifest {
            id,
            valid_seq: id,
            parts,
            slots,
        };
        if store.set(SNAPSHOT_KEY, &manifest.encode(), None).is_err() {
            return false;
        }
        self.snapshot_basis = Some(id);
        // Parts an earlier, larger snapshot left: their memory goes (parts are contiguous).
        for number in parts..SNAPSHOT_PARTS {
            match store.get(&part_key(number)) {
                (Some(bytes), _) if !bytes.is_empty() => {
                    let _ = store.set(&part_key(number), b"", None);
                }
                _ => break,
            }
        }
        true
    }

    /// Applies a batch [`read_batch`] checked, event by event as it is decoded: a batch holds up
    /// to ~128 KiB of events, and decoding it whole first would keep that much more of this VM's
    /// linear memory for good.
    fn apply_batch(&mut self, config: &Config, batch: &[u8], report: &mut SyncReport) {
        let mut worker = 0;
        // It decoded once already (read_batch), so it decodes again to the end.
        let _ = visit_log_batch(batch, |item| match item {
            LogItem::Record(RecordHead::Events { worker: w }) => worker = w,
            LogItem::Record(RecordHead::Resync { worker: w, .. }) => {
                worker = w;
                // The dump replaces the index's view; predictions made ahead of it stay (its
                // own "removed" events, not the re-sync, refute them).
                self.clear_worker(config, w, false);
            }
            LogItem::Record(RecordHead::WorkerLost { worker: w }) => {
                self.clear_worker(config, w, true)
            }
            LogItem::Event(numbered) => self.apply_event(config, worker, &numbered.event, report),
        });
    }

    /// Drops the worker's blocks from the index; `lost`: its predictions go too (it left).
    fn clear_worker(&mut self, config: &Config, worker: u16, lost: bool) {
        self.snapshot_basis = None;
        for slot in config.worker_slots(worker) {
            self.index.clear_slot(slot);
            if let (true, Some(changes)) = (lost, self.device_changes.as_mut()) {
                changes.cleared.push(slot);
            }
        }
    }

    fn apply_event(
        &mut self,
        config: &Config,
        worker: u16,
        event: &IndexEvent,
        report: &mut SyncReport,
    ) {
        let slots: Vec<SlotIdx> = match event {
            IndexEvent::Cleared { dp_rank: None } => config.worker_slots(worker).collect(),
            IndexEvent::Cleared {
                dp_rank: Some(rank),
            }
            | IndexEvent::Stored { dp_rank: rank, .. }
            | IndexEvent::Removed { dp_rank: rank, .. } => {
                config.slot_of(worker, *rank).into_iter().collect()
            }
        };
        if slots.is_empty() {
            report.events_rejected += 1; // a DP rank the configuration does not give this worker
            return;
        }
        for slot in slots {
            let changes = &mut self.device_changes;
            if let (Some(changes), IndexEvent::Cleared { .. }) = (changes.as_mut(), event) {
                changes.cleared.push(slot);
            }
            let applied = self.index.apply_noting(slot, event, |seq, change| {
                let Some(changes) = changes.as_mut() else {
                    return;
                };
                match change {
                    DeviceChange::Lost => changes.lost.push((slot, seq)),
                    DeviceChange::Stored if changes.stored.len() < MAX_STORED_CHANGES => {
                        changes.stored.push((slot, seq))
                    }
                    DeviceChange::Stored => {}
                }
            });
            // Conservatively a change even if the event was refused.
            self.snapshot_basis = None;
            match applied {
                Ok(stats) => {
                    report.events_applied += 1;
                    report.evicted += stats.evicted_blocks as u64;
                }
                Err(_) => report.events_rejected += 1,
            }
        }
    }
}

fn max_blocks(config: &Config) -> usize {
    usize::try_from(config.index.max_blocks).unwrap_or(usize::MAX)
}

fn new_index(config: &Config) -> KvIndex {
    KvIndex::new(config.slots.len(), max_blocks(config))
}

fn split_seq(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let (seq_bytes, body) = bytes.split_at_checked(8)?;
    let seq = u64::from_le_bytes(seq_bytes.try_into().ok()?);
    Some((seq, body))
}

fn slot_key(seq: u64) -> String {
    format!("ekr.log.{}", seq % LOG_SLOTS)
}

fn read_batch(store: &dyn SharedStore, seq: u64) -> SlotRead {
    let (bytes, _) = store.get(&slot_key(seq));
    let Some((stored_seq, body)) = bytes.as_deref().and_then(split_seq) else {
        return SlotRead::Pending; // never written
    };
    if stored_seq < seq {
        return SlotRead::Pending;
    }
    if stored_seq > seq {
        return SlotRead::Lost;
    }
    // All or nothing: a batch that does not decode to its end is not applied at all (checked
    // without keeping a block; the apply decodes the events one at a time).
    if check_log_batch(body).is_err() {
        return SlotRead::Lost;
    }
    match bytes {
        Some(bytes) => SlotRead::Batch(bytes),
        None => SlotRead::Lost,
    }
}

fn read_seq_key(store: &dyn SharedStore) -> (u64, u64) {
    seq_words(store.get(SEQ_KEY).0.as_deref())
}

/// `(batch, head version)` from the 16-byte `ekr.log.seq` value (zeros when absent).
fn seq_words(bytes: Option<&[u8]>) -> (u64, u64) {
    let word = |range: std::ops::Range<usize>| {
        bytes
            .and_then(|b| b.get(range))
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    (word(0..8), word(8..16))
}

/// Raises `ekr.log.seq` to at least `(seq, version)`; it never goes back, whatever the order in
/// which concurrent writers get here.
fn publish_seq(store: &dyn SharedStore, seq: u64, version: u64) {
    for _ in 0..APPEND_ATTEMPTS {
        let (bytes, cas) = store.get(SEQ_KEY);
        let (stored_seq, stored_version) = seq_words(bytes.as_deref());
        if stored_seq >= seq && stored_version >= version {
            return;
        }
        let mut value = stored_seq.max(seq).to_le_bytes().to_vec();
        value.extend_from_slice(&stored_version.max(version).to_le_bytes());
        // A mismatch means someone published meanwhile: read again.
        if store.set(SEQ_KEY, &value, cas).is_ok() {
            return;
        }
    }
}

/// Step 2 of the append protocol: writes batch `seq` into its slot unless the slot already holds
/// that batch (or a later one). True if this call wrote it.
fn write_slot(store: &dyn SharedStore, seq: u64, batch: &[u8]) -> bool {
    let key = slot_key(seq);
    let mut value = Vec::with_capacity(batch.len() + 8);
    value.extend_from_slice(&seq.to_le_bytes());
    value.extend_from_slice(batch);
    for _ in 0..SLOT_WRITE_ATTEMPTS {
        let (bytes, cas) = store.get(&key);
        let stored = bytes.as_deref().and_then(split_seq).map(|(s, _)| s);
        if stored.is_some_and(|s| s >= seq) {
            return false;
        }
        match store.set(&key, &value, cas) {
            Ok(()) => return true,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return false,
        }
    }
    false
}

/// Read-modify-write of the head under CAS. `edit` returns false to abandon the update (its
/// precondition no longer holds). A head from another configuration is replaced by a new epoch.
pub fn update_head(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    mut edit: impl FnMut(&mut LogHead) -> bool,
) -> bool {
    append_inner(store, fingerprint, workers, now_ms, &mut |head| {
        edit(head).then_some(None)
    })
}

/// Appends one batch of `records` together with the head `edit` (both or neither). False when the
/// edit declined, contention outlasted the retries, or (after an orphan fill) the batch's slot
/// was taken.
pub fn append(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    records: &[LogRecord],
    mut edit: impl FnMut(&mut LogHead) -> bool,
) -> bool {
    let batch = encode_log_batch(records);
    append_inner(store, fingerprint, workers, now_ms, &mut |head| {
        edit(head).then(|| Some(batch.clone()))
    })
}

/// The general form of [`append`]: `edit` edits the head and returns the encoded batch to append
/// with it (`Some(None)`: a head update alone; `None`: abandon). It may run more than once
/// (CAS retries), each time on the head as it is then, so what it appends can depend on which
/// of its preconditions still hold. False as for [`append`].
pub fn append_with(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    mut edit: impl FnMut(&mut LogHead) -> Option<Option<Vec<u8>>>,
) -> bool {
    append_inner(store, fingerprint, workers, now_ms, &mut edit)
}

/// Step 1 (claim, with the head edit) then steps 2 and 3 of the append protocol.
fn append_inner(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    edit: &mut dyn FnMut(&mut LogHead) -> Option<Option<Vec<u8>>>,
) -> bool {
    for _ in 0..APPEND_ATTEMPTS {
        let Some(claimed) = claim(store, fingerprint, workers, now_ms, edit) else {
            return false;
        };
        let Ok((head, batch)) = claimed else { continue };
        let written = match batch {
            Some(batch) => write_slot(store, head.seq, &batch),
            None => true,
        };
        publish_seq(store, head.seq, head.version);
        if !written {
            log::error!(
                "kv-router: event log batch {} was filled as orphaned before its writer stored it; its events are dropped and every worker re-syncs",
                head.seq
            );
        }
        return written;
    }
    false
}

/// The head and the batch a claim committed.
type Claimed = (LogHead, Option<Vec<u8>>);

/// One claim attempt: `None` = the edit declined; `Some(Err(()))` = the head changed (retry);
/// `Some(Ok(..))` = the head as committed, with the batch to write into its slot.
fn claim(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    edit: &mut dyn FnMut(&mut LogHead) -> Option<Option<Vec<u8>>>,
) -> Option<Result<Claimed, ()>> {
    // One read for the head and its version: a second read for the version alone could see a
    // head written in between and let this claim overwrite it.
    let (bytes, cas) = store.get(HEAD_KEY);
    let current: Option<LogHead> = bytes.as_deref().and_then(decode_head);
    let (mut head, before) = match current {
        Some(head) if head.fingerprint == fingerprint => (head.clone(), Some(head)),
        Some(old) => (
            LogHead {
                // Versions only grow, so that replicas notice the new epoch's head.
                version: old.version,
                ..LogHead::fresh(fingerprint, old.seq + 1, workers, now_ms)
            },
            None,
        ),
        None => (LogHead::fresh(fingerprint, 0, workers, now_ms), None),
    };
    let batch = edit(&mut head)?;
    if batch.is_some() {
        head.seq += 1;
    }
    // Requests re-read the head only when `version` moves: poll state alone does not move it.
    if before.is_none_or(|before| routing_changed(&before, &head)) {
        head.version += 1;
    }
    let encoded = encode_head(&head);
    // `init` created the key, so there is always a version to check.
    match store.set(HEAD_KEY, &encoded, cas) {
        Ok(()) => Some(Ok((head, batch))),
        Err(StoreError::CasMismatch) => Some(Err(())),
        Err(StoreError::Failed) => None,
    }
}

/// Fills orphaned batch `seq` (see the module docs): every worker's blocks are dropped and every
/// cursor reset, so each worker re-syncs from its dump. False if the slot was written meanwhile.
pub fn fill_orphan(
    store: &dyn SharedStore,
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    seq: u64,
) -> bool {
    let records: Vec<LogRecord> = (0..workers)
        .filter_map(|w| u16::try_from(w).ok())
        .map(|worker| LogRecord::WorkerLost { worker })
        .collect();
    if !write_slot(store, seq, &encode_log_batch(&records)) {
        return false;
    }
    let reset = update_head(store, fingerprint, workers, now_ms, |head| {
        for w in &mut head.workers {
            w.cursor = None;
            w.reported = None;
        }
        true
    });
    if !reset {
        log::error!("kv-router: could not reset the worker cursors after filling orphaned batch {seq}; they re-sync on their next gap");
    }
    true
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
    use crate::events::NumberedEvent;
    use crate::store::fake::{MemStore, Op};
    use crate::types::{ExternalBlockHash, LocalBlockHash, StorageTier};
    use std::cell::Cell;
    use std::rc::Rc;

    const FP: u64 = 42;

    fn config(workers: usize) -> Config {
        let list: Vec<String> = (1..=workers)
            .map(|i| format!(r#"{{"id": {i}, "address": "10.0.0.{i}:8000"}}"#))
            .collect();
        Config::from_json(format!(r#"{{"workers": [{}]}}"#, list.join(",")).as_bytes()).unwrap()
    }

    /// A batch that stores one block `hash` on `worker` (event id `id`).
    fn stored(worker: u16, id: u64, hash: u64) -> LogRecord {
        LogRecord::Events {
            worker,
            events: vec![NumberedEvent {
                event_id: id,
                event: IndexEvent::Stored {
                    dp_rank: 0,
                    tier: StorageTier::Device,
                    parent: None,
                    blocks: vec![(ExternalBlockHash(hash), LocalBlockHash(hash))],
                },
            }],
        }
    }

    /// An append the way the poller makes one: the worker's cursor must still be `after`.
    fn poller_append(
        store: &MemStore,
        worker: u16,
        after: Option<u64>,
        id: u64,
        hash: u64,
    ) -> bool {
        append(store, FP, 2, 0, &[stored(worker, id, hash)], |head| {
            let w = &mut head.workers[usize::from(worker)];
            if w.cursor != after {
                return false;
            }
            w.cursor = Some(id);
            true
        })
    }

    /// Every batch in the log, in order, as a fresh replica reads them.
    fn batches(store: &MemStore) -> Vec<Vec<LogRecord>> {
        let (head, _) = read_head(store).unwrap();
        (head.epoch_start + 1..=head.seq)
            .map(|seq| match read_batch(store, seq) {
                SlotRead::Batch(bytes) => {
                    crate::events::decode_log_batch(split_seq(&bytes).unwrap().1).unwrap()
                }
                SlotRead::Pending => panic!("batch {seq} pending"),
                SlotRead::Lost => panic!("batch {seq} lost"),
            })
            .collect()
    }

    /// Two pollers during a lease hand-over: B appends in full between any two store operations
    /// of A's append. Whatever the interleaving, each committed cursor move has its own batch in
    /// the log, exactly once, and every replica reads the same log.
    #[test]
    fn concurrent_appends_never_share_or_lose_a_slot() {
        // How many store operations A's append takes without interference.
        let probe = MemStore::new();
        init(&probe);
        let before = probe.ops.get();
        assert!(poller_append(&probe, 0, None, 1, 100));
        let steps = probe.ops.get() - before;
        assert!(steps >= 4, "claim and write are separate steps: {steps}");

        for at in 1..=steps + 1 {
            let store = MemStore::new();
            init(&store);
            let seen = Rc::new(Cell::new(0usize));
            let b_result = Rc::new(Cell::new(None));
            let (seen_h, b_h) = (Rc::clone(&seen), Rc::clone(&b_result));
            store.set_hook(move |s: &MemStore, _op: &Op| {
                seen_h.set(seen_h.get() + 1);
                if seen_h.get() == at {
                    b_h.set(Some(poller_append(s, 1, None, 7, 200)));
                }
            });
            let a = poller_append(&store, 0, None, 1, 100);
            store.clear_hook();
            let b = b_result
                .get()
                .unwrap_or_else(|| poller_append(&store, 1, None, 7, 200));
            assert!(
                a && b,
                "interleaving at op {at}: both appends succeed (a {a}, b {b})"
            );

            let (head, _) = read_head(&store).unwrap();
            assert_eq!(head.workers[0].cursor, Some(1), "op {at}");
            assert_eq!(head.workers[1].cursor, Some(7), "op {at}");
            let log = batches(&store);
            assert_eq!(log.len(), 2, "op {at}: one batch per append");
            assert_eq!(
                log.iter()
                    .filter(|b| **b == vec![stored(0, 1, 100)])
                    .count(),
                1,
                "op {at}: A's batch exactly once"
            );
            assert_eq!(
                log.iter()
                    .filter(|b| **b == vec![stored(1, 7, 200)])
                    .count(),
                1,
                "op {at}: B's batch exactly once"
            );
        }
    }

    /// The same page handled by both pollers (the old holder's late reply and the new holder's
    /// fetch): the cursor check lets one through, and the log holds it once.
    #[test]
    fn the_same_page_from_two_pollers_is_appended_once() {
        for at in 1..=8 {
            let store = MemStore::new();
            init(&store);
            let seen = Rc::new(Cell::new(0usize));
            let seen_h = Rc::clone(&seen);
            let b_result = Rc::new(Cell::new(None));
            let b_h = Rc::clone(&b_result);
            store.set_hook(move |s: &MemStore, _op: &Op| {
                seen_h.set(seen_h.get() + 1);
                if seen_h.get() == at {
                    b_h.set(Some(poller_append(s, 0, None, 1, 100)));
                }
            });
            let a = poller_append(&store, 0, None, 1, 100);
            store.clear_hook();
            let b = b_result.get().unwrap_or(false);
            assert!(a != b, "op {at}: exactly one wins (a {a}, b {b})");
            assert_eq!(batches(&store), vec![vec![stored(0, 1, 100)]], "op {at}");
        }
    }

    /// Approximate mode's predictions need what the engines put on and took off their GPU
    /// caches: a replica that collects them reports device stores (a re-sync's dump included),
    /// device removals of blocks it held (by prefix hash) and cleared slots; not host-tier
    /// removals, blocks it never held, or a re-sync as a clear.
    #[test]
    fn a_collecting_replica_reports_device_changes() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        let removed = |tier, hashes: &[u64]| NumberedEvent {
            event_id: 0,
            event: IndexEvent::Removed {
                dp_rank: 0,
                tier,
                blocks: hashes.iter().map(|h| ExternalBlockHash(*h)).collect(),
            },
        };
        // Worker 1 re-synced from its dump: not a loss (its predictions stay).
        let LogRecord::Events { events: dump, .. } = stored(1, 3, 300) else {
            unreachable!()
        };
        let resync = LogRecord::Resync {
            worker: 1,
            last_event_id: 3,
            events: dump,
        };
        let mut records = vec![stored(0, 1, 100), stored(0, 2, 200), resync];
        records.push(LogRecord::Events {
            worker: 0,
            events: vec![
                removed(StorageTier::Device, &[100, 999]),
                removed(StorageTier::Host, &[200]),
            ],
        });
        records.push(LogRecord::Events {
            worker: 1,
            events: vec![NumberedEvent {
                event_id: 4,
                event: IndexEvent::Cleared { dp_rank: None },
            }],
        });
        assert!(append(&store, FP, 2, 0, &records, |_| true));
        let mut plain = Replica::new(&config, FP);
        plain.sync(&store, &config, 1000);
        assert_eq!(plain.device_changes, None);
        let mut collecting = Replica::new(&config, FP);
        collecting.device_changes = Some(DeviceChanges::default());
        collecting.sync(&store, &config, 1000);
        let seq = |h| crate::hashing::chain_sequence_hash(None, LocalBlockHash(h));
        let (slot0, slot1) = (config.slot_of(0, 0).unwrap(), config.slot_of(1, 0).unwrap());
        assert_eq!(
            collecting.device_changes,
            Some(DeviceChanges {
                lost: vec![(slot0, seq(100))],
                stored: vec![(slot0, seq(100)), (slot0, seq(200)), (slot1, seq(300))],
                cleared: vec![slot1],
            })
        );
        assert_eq!(
            collecting.index.entries(),
            1,
            "block 200 stays (host removal only)"
        );
    }

    #[test]
    fn a_replica_waits_for_a_claimed_batch_instead_of_skipping_it() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        assert!(poller_append(&store, 0, None, 1, 100));
        // Claim batch 2 without writing it yet (a writer between steps 1 and 2).
        let (claimed, _) = claim(&store, FP, 2, 0, &mut |_| Some(Some(Vec::new())))
            .unwrap()
            .unwrap();
        assert_eq!(claimed.seq, 2);
        let mut replica = Replica::new(&config, FP);
        let report = replica.sync(&store, &config, 1000);
        assert_eq!((replica.applied_seq, report.lost_sync), (1, false));
        assert_eq!(replica.orphaned_batch(1000 + ORPHAN_AFTER_MS), None);
        // The claimant writes: the replica carries on.
        assert!(write_slot(
            &store,
            2,
            &encode_log_batch(&[stored(1, 3, 300)])
        ));
        replica.sync(&store, &config, 2000);
        assert_eq!(replica.applied_seq, 2);
        assert_eq!(replica.orphaned_batch(u64::MAX), None);
        assert_eq!(replica.index.entries(), 2);
    }

    /// A batch is applied item by item as it is decoded, in record order (a store, the worker's
    /// loss, another worker's store and its re-sync dump); a batch whose last byte is missing is
    /// not applied at all, though all but its last event decode.
    #[test]
    fn a_batch_applies_in_record_order_and_one_that_does_not_decode_applies_nothing() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        let dump = match stored(1, 2, 300) {
            LogRecord::Events { events, .. } => events,
            _ => unreachable!(),
        };
        let records = [
            stored(0, 1, 100),
            LogRecord::WorkerLost { worker: 0 },
            stored(1, 1, 200),
            stored(1, 2, 201),
            LogRecord::Resync {
                worker: 1,
                last_event_id: 2,
                events: dump,
            },
            stored(0, 2, 400),
        ];
        assert!(append(&store, FP, 2, 0, &records, |_| true));
        let mut replica = Replica::new(&config, FP);
        let report = replica.sync(&store, &config, 1000);
        assert_eq!((report.batches, report.lost_sync), (1, false));
        // Worker 0: 100 dropped with its loss, 400 after it; worker 1: only the dump's 300.
        assert_eq!(
            (replica.index.slot_blocks(0), replica.index.slot_blocks(1)),
            (1, 1)
        );
        assert_eq!(report.events_applied, 5);

        let (claimed, _) = claim(&store, FP, 2, 0, &mut |_| Some(Some(Vec::new())))
            .unwrap()
            .unwrap();
        let whole = encode_log_batch(&[stored(0, 3, 500), stored(1, 3, 600)]);
        assert!(write_slot(&store, claimed.seq, &whole[..whole.len() - 1]));
        let report = replica.sync(&store, &config, 2000);
        assert!(report.lost_sync);
        assert_eq!(replica.applied_seq, 1);
        assert_eq!(
            (replica.index.slot_blocks(0), replica.index.slot_blocks(1)),
            (1, 1)
        );
    }

    /// A claimant that never writes its batch: after `ORPHAN_AFTER_MS` the poller fills it; every
    /// replica moves on, every cursor is reset (re-sync from dumps), and the claimant's late
    /// write cannot change the filled batch.
    #[test]
    fn an_orphaned_claim_is_filled_and_every_worker_resyncs() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        assert!(poller_append(&store, 0, None, 1, 100));
        assert!(poller_append(&store, 1, None, 5, 500));
        let (orphan, _) = claim(&store, FP, 2, 0, &mut |head| {
            head.workers[0].cursor = Some(2);
            Some(Some(Vec::new()))
        })
        .unwrap()
        .unwrap();
        let mut replica = Replica::new(&config, FP);
        replica.sync(&store, &config, 10);
        assert_eq!(replica.applied_seq, 2);
        assert_eq!(replica.orphaned_batch(10 + ORPHAN_AFTER_MS), None);
        replica.sync(&store, &config, 20 + ORPHAN_AFTER_MS);
        assert_eq!(
            replica.orphaned_batch(20 + ORPHAN_AFTER_MS),
            Some(orphan.seq)
        );

        assert!(fill_orphan(&store, FP, 2, 30, orphan.seq));
        assert!(!fill_orphan(&store, FP, 2, 31, orphan.seq), "filled once");
        assert!(
            !write_slot(&store, orphan.seq, &encode_log_batch(&[stored(0, 2, 999)])),
            "the late claimant cannot overwrite the filled batch"
        );
        replica.sync(&store, &config, 40 + ORPHAN_AFTER_MS);
        assert_eq!(replica.applied_seq, orphan.seq);
        assert_eq!(replica.index.entries(), 0, "every worker's blocks dropped");
        let (head, _) = read_head(&store).unwrap();
        assert!(
            head.workers.iter().all(|w| w.cursor.is_none()),
            "every worker re-syncs"
        );
        // A second replica that starts now reads the same log.
        let mut other = Replica::new(&config, FP);
        other.sync(&store, &config, 50);
        assert_eq!(other.applied_seq, replica.applied_seq);
        assert_eq!(other.index.entries(), replica.index.entries());
    }

    #[test]
    fn the_published_sequence_never_goes_back() {
        let store = MemStore::new();
        publish_seq(&store, 5, 9);
        publish_seq(&store, 4, 8); // a slower writer publishing an older head
        assert_eq!(read_seq_key(&store), (5, 9));
        publish_seq(&store, 5, 10);
        assert_eq!(read_seq_key(&store), (5, 10));
    }

    #[test]
    fn a_lapped_slot_is_lost_not_pending() {
        let store = MemStore::new();
        init(&store);
        assert!(write_slot(&store, 3 + LOG_SLOTS, &encode_log_batch(&[])));
        assert!(matches!(read_batch(&store, 3), SlotRead::Lost));
        assert!(matches!(read_batch(&store, 4), SlotRead::Pending));
        assert!(
            !write_slot(&store, 3, &encode_log_batch(&[])),
            "never written backwards"
        );
    }

    /// A new configuration (another fingerprint) starts a new epoch after the old log: its
    /// replicas start from an empty index there, the version keeps growing, and a replica of the
    /// old configuration applies nothing of the new epoch.
    #[test]
    fn a_configuration_change_starts_a_new_epoch() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        assert!(poller_append(&store, 0, None, 1, 100));
        assert!(poller_append(&store, 1, None, 5, 500));
        let mut old = Replica::new(&config, FP);
        old.sync(&store, &config, 0);
        assert_eq!(old.index.entries(), 2);
        let (before, _) = read_head(&store).unwrap();

        const NEW_FP: u64 = 43;
        assert!(append(&store, NEW_FP, 2, 0, &[stored(1, 9, 900)], |head| {
            assert!(
                head.workers.iter().all(|w| w.cursor.is_none()),
                "fresh cursors"
            );
            head.workers[1].cursor = Some(9);
            true
        }));
        let (head, _) = read_head(&store).unwrap();
        assert_eq!(
            (head.fingerprint, head.epoch_start, head.seq),
            (NEW_FP, 3, 4)
        );
        assert!(
            head.version > before.version,
            "replicas notice the new head"
        );
        let mut new = Replica::new(&config, NEW_FP);
        new.sync(&store, &config, 0);
        assert_eq!((new.applied_seq, new.index.entries()), (4, 1));
        // A replica that applied the old epoch moves to the new one too when reconfigured.
        old.fingerprint = NEW_FP;
        old.sync(&store, &config, 0);
        assert_eq!(
            (old.applied_seq, old.index.entries()),
            (4, 1),
            "old blocks dropped"
        );
        let mut stale = Replica::new(&config, FP);
        assert_eq!(stale.sync(&store, &config, 0), SyncReport::default());
        assert_eq!(
            stale.index.entries(),
            0,
            "the old configuration applies nothing"
        );
    }

    /// A replica further behind than the ring restarts from the snapshot and then applies the
    /// batches after it: it ends with the same index as one that applied everything.
    #[test]
    fn a_replica_beyond_the_ring_loads_the_snapshot() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        let mut poller = Replica::new(&config, FP);
        poller.full_head = true;
        let batches = 2 * LOG_SLOTS + 5;
        for id in 1..=batches {
            assert!(poller_append(&store, 0, (id > 1).then(|| id - 1), id, id));
            poller.sync(&store, &config, 0);
            poller.maybe_write_snapshot(&store);
        }
        let (head, _) = read_head(&store).unwrap();
        assert_eq!(head.snapshot_seq, 2 * LOG_SLOTS);
        let manifest = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert!(manifest.parts > 8, "split into parts: {manifest:?}");
        let mut late = Replica::new(&config, FP);
        let report = late.sync(&store, &config, 0);
        assert!(report.snapshot_loaded && !report.lost_sync);
        assert_eq!(
            report.batches,
            batches - 2 * LOG_SLOTS,
            "only what follows the snapshot"
        );
        assert_eq!(late.applied_seq, batches);
        assert_eq!(late.index.entries(), poller.index.entries());
        assert_eq!(late.index.entries(), usize::try_from(batches).unwrap());
    }

    /// Beyond the ring without a usable snapshot: the replica says it lost sync, restarts from
    /// an empty index at the oldest batch the ring still holds, and carries on from there.
    #[test]
    fn a_replica_beyond_the_ring_without_a_snapshot_loses_sync_and_recovers() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        let batches = LOG_SLOTS + 10;
        for id in 1..=batches {
            assert!(poller_append(&store, 0, (id > 1).then(|| id - 1), id, id));
        }
        let mut replica = Replica::new(&config, FP);
        let report = replica.sync(&store, &config, 0);
        assert!(report.lost_sync && !report.snapshot_loaded);
        assert_eq!(report.batches, LOG_SLOTS - 1);
        assert_eq!(replica.applied_seq, batches);
        assert_eq!(
            replica.index.entries(),
            usize::try_from(LOG_SLOTS - 1).unwrap()
        );
        assert!(poller_append(&store, 0, Some(batches), batches + 1, 0xfeed));
        let report = replica.sync(&store, &config, 0);
        assert_eq!(
            (report.batches, report.lost_sync),
            (1, false),
            "back in step"
        );
    }

    /// A sync for new batches alone reads the head's header: the per-worker parts decoded at the
    /// last version change stay, and the request check is clean afterwards.
    #[test]
    fn a_sync_without_a_version_change_keeps_the_decoded_workers() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        assert!(poller_append(&store, 0, None, 1, 100));
        let mut replica = Replica::new(&config, FP);
        replica.sync(&store, &config, 0);
        let version = replica.head.version;
        assert!(poller_append(&store, 0, Some(1), 2, 200));
        assert!(replica.is_behind(&store), "a new batch");
        replica.sync(&store, &config, 0);
        assert_eq!((replica.head.version, replica.head.seq), (version, 2));
        assert_eq!(
            replica.head.workers[0].cursor,
            Some(1),
            "cursors not re-decoded"
        );
        assert!(!replica.is_behind(&store));
        replica.full_head = true;
        replica.sync(&store, &config, 0);
        assert_eq!(
            replica.head.workers[0].cursor,
            Some(2),
            "the poller's full decode"
        );
    }

    /// A poller that applied `batches` batches, one new block each, writing snapshots as due.
    fn log_with_snapshots(store: &MemStore, config: &Config, batches: u64) -> Replica {
        init(store);
        let mut poller = Replica::new(config, FP);
        poller.full_head = true;
        for id in 1..=batches {
            assert!(poller_append(store, 0, (id > 1).then(|| id - 1), id, id));
            poller.sync(store, config, 0);
            poller.maybe_write_snapshot(store);
        }
        poller
    }

    /// Replaces part 1 with the same part of a later snapshot (a writer mid-way); returns the
    /// part it replaced.
    fn tear_part_1(store: &MemStore) -> Vec<u8> {
        let (Some(part), _) = store.get(&part_key(1)) else {
            panic!("no part 1")
        };
        let mut other = (2 * LOG_SLOTS + 32).to_le_bytes().to_vec();
        other.extend_from_slice(&part[8..]);
        store.set(&part_key(1), &other, None).unwrap();
        part
    }

    /// A part of another snapshot among the parts (a writer replacing them while a replica
    /// loads): the loader reads it again on the next ticks, from an empty index and without
    /// applying anything, and loads it once it is whole.
    #[test]
    fn a_torn_snapshot_is_read_again_next_tick() {
        let config = config(2);
        let store = MemStore::new();
        let batches = 2 * LOG_SLOTS + 5;
        log_with_snapshots(&store, &config, batches);
        let part = tear_part_1(&store);
        let mut late = Replica::new(&config, FP);
        let report = late.sync(&store, &config, 0);
        assert!(!report.lost_sync && !report.snapshot_loaded);
        assert_eq!((late.applied_seq, late.index.entries()), (0, 0));
        // The writer finished: the parts are whole again.
        store.set(&part_key(1), &part, None).unwrap();
        let report = late.sync(&store, &config, 0);
        assert!(report.snapshot_loaded && !report.lost_sync);
        assert_eq!(late.applied_seq, batches);
        assert_eq!(late.index.entries(), usize::try_from(batches).unwrap());
    }

    /// A snapshot that stays torn (no writer will finish it): after the retries the replica
    /// takes the lost-sync path, from an empty index at the ring's oldest batch, without any of
    /// the torn snapshot's blocks.
    #[test]
    fn a_snapshot_torn_for_good_ends_in_lost_sync() {
        let config = config(2);
        let store = MemStore::new();
        let batches = 2 * LOG_SLOTS + 5;
        log_with_snapshots(&store, &config, batches);
        tear_part_1(&store);
        let mut late = Replica::new(&config, FP);
        for _ in 0..TORN_SNAPSHOT_RETRIES {
            let report = late.sync(&store, &config, 0);
            assert!(!report.lost_sync && !report.snapshot_loaded);
        }
        let report = late.sync(&store, &config, 0);
        assert!(report.lost_sync && !report.snapshot_loaded);
        assert_eq!(late.applied_seq, batches);
        assert_eq!(
            late.index.entries(),
            usize::try_from(LOG_SLOTS - 1).unwrap(),
            "only the ring's batches"
        );
    }

    /// Parts are written from one part-sized buffer: no store write carries the whole index,
    /// never more than `SNAPSHOT_PARTS` parts, and a later, smaller snapshot empties the parts
    /// it does not use.
    #[test]
    fn snapshot_parts_stay_bounded_and_stale_parts_are_emptied() {
        let config = config(2);
        let store = MemStore::new();
        let part_sets = Rc::new(Cell::new(0usize));
        let seen = Rc::clone(&part_sets);
        let mut poller = log_with_snapshots(&store, &config, 4 * LOG_SLOTS);
        let whole = poller.index.encode_snapshot().len();
        store.set_hook(move |_: &MemStore, op: &Op| {
            if matches!(op, Op::Set(key) if key.starts_with("ekr.snapshot.")) {
                seen.set(seen.get() + 1);
            }
        });
        poller.snapshot_basis = None;
        poller.head.snapshot_seq = 0;
        poller.maybe_write_snapshot(&store);
        store.clear_hook();
        let manifest = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert_eq!(part_sets.get(), usize::try_from(manifest.parts).unwrap());
        assert!(manifest.parts > 1 && manifest.parts <= SNAPSHOT_PARTS);
        for n in 0..manifest.parts {
            let part = store.get(&part_key(n)).0.unwrap();
            assert!(
                part.len() * 16 < whole,
                "part {n}: {} of {whole} bytes",
                part.len()
            );
        }
        // Worker 0 leaves: the next snapshot is one small part, the rest are emptied.
        let seq = poller.applied_seq;
        for id in 1..=SNAPSHOT_EVERY {
            let records = if id == 1 {
                vec![LogRecord::WorkerLost { worker: 0 }]
            } else {
                Vec::new()
            };
            assert!(append(&store, FP, 2, 0, &records, |_| true));
        }
        poller.sync(&store, &config, 0);
        assert_eq!(poller.applied_seq, seq + SNAPSHOT_EVERY);
        poller.maybe_write_snapshot(&store);
        let small = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert_eq!((small.id, small.parts), (seq + SNAPSHOT_EVERY, 1));
        for n in 1..SNAPSHOT_PARTS {
            assert!(
                store.get(&part_key(n)).0.is_none_or(|p| p.is_empty()),
                "part {n} emptied"
            );
        }
    }

    /// Batches that change nothing: the due snapshot is not encoded again, only its manifest
    /// moves, and a replica beyond the ring loads it as valid at the later batch.
    #[test]
    fn an_unchanged_index_only_extends_the_snapshot() {
        let config = config(2);
        let store = MemStore::new();
        let mut poller = log_with_snapshots(&store, &config, 2 * LOG_SLOTS);
        let written = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert_eq!(written.id, 2 * LOG_SLOTS);
        let part_writes = Rc::new(Cell::new(0usize));
        let seen = Rc::clone(&part_writes);
        store.set_hook(move |_: &MemStore, op: &Op| {
            if matches!(op, Op::Set(key) if key.starts_with("ekr.snapshot.")) {
                seen.set(seen.get() + 1);
            }
        });
        for _ in 0..2 * SNAPSHOT_EVERY {
            assert!(append(&store, FP, 2, 0, &[], |_| true));
            poller.sync(&store, &config, 0);
            poller.maybe_write_snapshot(&store);
        }
        store.clear_hook();
        assert_eq!(part_writes.get(), 0, "no part written again");
        let moved = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert_eq!(
            moved,
            Manifest {
                valid_seq: 3 * LOG_SLOTS,
                ..written
            }
        );
        assert_eq!(read_head(&store).unwrap().0.snapshot_seq, 3 * LOG_SLOTS);
        // Beyond the ring of the written snapshot's id, within it of its validity.
        let mut late = Replica::new(&config, FP);
        let report = late.sync(&store, &config, 0);
        assert!(report.snapshot_loaded && !report.lost_sync);
        assert_eq!(report.batches, 0);
        assert_eq!(late.applied_seq, 3 * LOG_SLOTS);
        assert_eq!(late.index.encode_snapshot(), poller.index.encode_snapshot());
        // A change: the next due snapshot is encoded again.
        assert!(poller_append(&store, 1, None, 1, 0xbeef));
        for _ in 1..SNAPSHOT_EVERY {
            assert!(append(&store, FP, 2, 0, &[], |_| true));
        }
        poller.sync(&store, &config, 0);
        poller.maybe_write_snapshot(&store);
        let rewritten = Manifest::decode(&store.get(SNAPSHOT_KEY).0.unwrap()).unwrap();
        assert_eq!(
            (rewritten.id, rewritten.valid_seq),
            (
                3 * LOG_SLOTS + SNAPSHOT_EVERY,
                3 * LOG_SLOTS + SNAPSHOT_EVERY
            )
        );
    }

    /// A poller that applies several batches per sync still writes a snapshot each time it
    /// passes a multiple of `SNAPSHOT_EVERY`, not only when it lands on one.
    #[test]
    fn a_poller_applying_several_batches_per_sync_still_writes_snapshots() {
        let config = config(2);
        let store = MemStore::new();
        init(&store);
        let mut poller = Replica::new(&config, FP);
        poller.full_head = true;
        let mut written = Vec::new();
        for id in 1..=100 {
            assert!(poller_append(&store, 0, (id > 1).then(|| id - 1), id, id));
            if id % 5 == 0 {
                poller.sync(&store, &config, 0);
                poller.maybe_write_snapshot(&store);
                let (head, _) = read_head(&store).unwrap();
                if written.last() != Some(&head.snapshot_seq) {
                    written.push(head.snapshot_seq);
                }
            }
        }
        assert_eq!(written, vec![0, 35, 65, 100]);
    }
}
