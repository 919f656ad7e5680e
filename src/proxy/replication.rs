//! The replicated event log that keeps every VM's KV index identical.
//!
//! Shared-data keys (fixed set, never per block or request):
//! * `ekr.log.head`  – [`LogHead`]: last batch number, per-worker poll cursors and health.
//! * `ekr.log.<n>`   – batch `seq` lives in slot `seq % LOG_SLOTS`, prefixed by `seq` (LE u64) so a
//!   reader can tell an overwritten slot from the batch it wants.
//! * `ekr.snapshot`  – the poller's index at some `seq` (LE u64 prefix), written every
//!   `SNAPSHOT_EVERY` batches; replicas more than the ring behind restart from it.
//!
//! Only the lease holder (the poller) appends. Every VM applies batches in order, and applying is
//! deterministic, so replicas converge on the same index.

use super::host;
use crate::config::Config;
use crate::events::{decode_log_batch, encode_log_batch, IndexEvent, LogRecord, ReportedLoad};
use crate::index::KvIndex;
use crate::types::SlotIdx;
use serde::{Deserialize, Serialize};

pub const LOG_SLOTS: u64 = 64;
const SNAPSHOT_EVERY: u64 = LOG_SLOTS / 2;
const HEAD_KEY: &str = "ekr.log.head";
/// The last appended batch number and the head's version (16 bytes), so that the request path
/// can tell cheaply whether this VM's replica or its copy of the head is behind.
const SEQ_KEY: &str = "ekr.log.seq";
const SNAPSHOT_KEY: &str = "ekr.snapshot";
const APPEND_ATTEMPTS: usize = 8;

/// Per-worker state of the poller, kept in shared data so that a new lease holder carries on.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerPollState {
    /// Last event id applied; `None` = never synced (or lost): the next fetch is a full dump.
    pub cursor: Option<u64>,
    pub last_ok_ms: u64,
    pub stale: bool,
    #[serde(default)]
    pub reported: Option<ReportedLoad>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LogHead {
    /// Hash of the filter configuration that wrote this log; a new configuration starts a new epoch.
    pub fingerprint: u64,
    /// Replicas that applied less than this start from an empty index at this batch.
    pub epoch_start: u64,
    pub seq: u64,
    /// Bumped by every head update (cursors, stale flags, reported load).
    #[serde(default)]
    pub version: u64,
    pub snapshot_seq: u64,
    pub workers: Vec<WorkerPollState>,
}

impl LogHead {
    fn fresh(fingerprint: u64, after_seq: u64, workers: usize, now_ms: u64) -> LogHead {
        LogHead {
            fingerprint,
            epoch_start: after_seq,
            seq: after_seq,
            version: 0,
            snapshot_seq: 0,
            workers: vec![
                WorkerPollState {
                    last_ok_ms: now_ms,
                    ..WorkerPollState::default()
                };
                workers
            ],
        }
    }
}

pub fn read_head() -> Option<(LogHead, Option<u32>)> {
    let (bytes, cas) = host::shared_get(HEAD_KEY);
    let head = serde_json::from_slice(&bytes?).ok()?;
    Some((head, cas))
}

/// What one sync did, for stats.
#[derive(Default, Debug)]
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
    /// The latest head seen (poll cursors, stale flags, reported load).
    pub head: LogHead,
}

impl Replica {
    pub fn new(config: &Config, fingerprint: u64) -> Replica {
        Replica {
            index: new_index(config),
            applied_seq: 0,
            fingerprint,
            head: LogHead::default(),
        }
    }

    /// Whether the log holds batches this replica has not applied, or the head changed since
    /// this VM last read it (one 16-byte shared-data get).
    pub fn is_behind(&self) -> bool {
        let (bytes, _) = host::shared_get(SEQ_KEY);
        let word = |range: std::ops::Range<usize>| {
            bytes
                .as_deref()
                .and_then(|b| b.get(range))
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        word(0..8) > self.applied_seq || word(8..16) > self.head.version
    }

    /// Applies every batch appended since the last sync.
    pub fn sync(&mut self, config: &Config) -> SyncReport {
        let mut report = SyncReport::default();
        let Some((head, _)) = read_head() else {
            return report;
        };
        if head.fingerprint != self.fingerprint {
            return report; // written under another configuration; the poller will start a new epoch
        }
        if self.applied_seq < head.epoch_start || self.applied_seq > head.seq {
            self.index = new_index(config);
            self.applied_seq = head.epoch_start;
        }
        if head.seq - self.applied_seq >= LOG_SLOTS {
            if self.load_snapshot(config, &head) {
                report.snapshot_loaded = true;
            } else {
                report.lost_sync = true;
                self.index = new_index(config);
                self.applied_seq = head.seq.saturating_sub(LOG_SLOTS - 1).max(head.epoch_start);
            }
        }
        while self.applied_seq < head.seq {
            let seq = self.applied_seq + 1;
            let Some(records) = read_batch(seq) else {
                report.lost_sync = true;
                break;
            };
            self.apply_records(config, &records, &mut report);
            self.applied_seq = seq;
            report.batches += 1;
        }
        self.head = head;
        report
    }

    fn load_snapshot(&mut self, config: &Config, head: &LogHead) -> bool {
        let (Some(bytes), _) = host::shared_get(SNAPSHOT_KEY) else {
            return false;
        };
        let Some((seq, body)) = split_seq(&bytes) else {
            return false;
        };
        if seq < head.epoch_start || seq > head.seq || head.seq - seq >= LOG_SLOTS {
            return false;
        }
        match KvIndex::decode_snapshot(body, config.slots.len(), max_blocks(config)) {
            Ok(index) => {
                self.index = index;
                self.applied_seq = seq;
                true
            }
            Err(_) => false,
        }
    }

    /// Writes this replica's index as the snapshot when it is due (the poller calls this).
    pub fn maybe_write_snapshot(&self) {
        if self.applied_seq == 0
            || self.applied_seq % SNAPSHOT_EVERY != 0
            || self.head.snapshot_seq >= self.applied_seq
        {
            return;
        }
        let mut bytes = self.applied_seq.to_le_bytes().to_vec();
        bytes.extend_from_slice(&self.index.encode_snapshot());
        if host::shared_set(SNAPSHOT_KEY, &bytes, None).is_ok() {
            let applied = self.applied_seq;
            let _ = update_head(self.fingerprint, self.head.workers.len(), 0, |head| {
                head.snapshot_seq = head.snapshot_seq.max(applied);
                true
            });
        }
    }

    fn apply_records(&mut self, config: &Config, records: &[LogRecord], report: &mut SyncReport) {
        for record in records {
            match record {
                LogRecord::Events { worker, events } => {
                    for numbered in events {
                        self.apply_event(config, *worker, &numbered.event, report);
                    }
                }
                LogRecord::Resync { worker, events, .. } => {
                    self.clear_worker(config, *worker);
                    for numbered in events {
                        self.apply_event(config, *worker, &numbered.event, report);
                    }
                }
                LogRecord::WorkerLost { worker } => self.clear_worker(config, *worker),
            }
        }
    }

    fn clear_worker(&mut self, config: &Config, worker: u16) {
        for slot in config.worker_slots(worker) {
            self.index.clear_slot(slot);
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
            match self.index.apply(slot, event) {
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

fn read_batch(seq: u64) -> Option<Vec<LogRecord>> {
    let (bytes, _) = host::shared_get(&slot_key(seq));
    let bytes = bytes?;
    let (stored_seq, body) = split_seq(&bytes)?;
    if stored_seq != seq {
        return None;
    }
    decode_log_batch(body).ok()
}

/// Read-modify-write of the head under CAS. `edit` returns false to abandon the update (its
/// precondition no longer holds). A head from another configuration is replaced by a new epoch.
/// With `records`, a new batch is written first and the head's `seq` advanced to name it.
pub fn update_head(
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    mut edit: impl FnMut(&mut LogHead) -> bool,
) -> bool {
    append_inner(fingerprint, workers, now_ms, None, &mut edit)
}

pub fn append(
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    records: &[LogRecord],
    mut edit: impl FnMut(&mut LogHead) -> bool,
) -> bool {
    let batch = encode_log_batch(records);
    append_inner(fingerprint, workers, now_ms, Some(&batch), &mut edit)
}

fn append_inner(
    fingerprint: u64,
    workers: usize,
    now_ms: u64,
    batch: Option<&[u8]>,
    edit: &mut dyn FnMut(&mut LogHead) -> bool,
) -> bool {
    for _ in 0..APPEND_ATTEMPTS {
        let (current, cas) = match read_head() {
            Some((head, cas)) => (Some(head), cas),
            None => (None, host::shared_get(HEAD_KEY).1),
        };
        let mut head = match current {
            Some(head) if head.fingerprint == fingerprint => head,
            Some(old) => LogHead {
                // Versions only grow, so that replicas notice the new epoch's head.
                version: old.version,
                ..LogHead::fresh(fingerprint, old.seq + 1, workers, now_ms)
            },
            None => LogHead::fresh(fingerprint, 0, workers, now_ms),
        };
        if !edit(&mut head) {
            return false;
        }
        if let Some(batch) = batch {
            head.seq += 1;
            let mut bytes = Vec::with_capacity(batch.len() + 8);
            bytes.extend_from_slice(&head.seq.to_le_bytes());
            bytes.extend_from_slice(batch);
            if host::shared_set(&slot_key(head.seq), &bytes, None).is_err() {
                return false;
            }
        }
        head.version += 1;
        let Ok(encoded) = serde_json::to_vec(&head) else {
            return false;
        };
        // A missing key has no CAS; Envoy treats 0 as "unconditional", so creation can race once.
        match host::shared_set(HEAD_KEY, &encoded, cas) {
            Ok(()) => {
                let mut seq_key = head.seq.to_le_bytes().to_vec();
                seq_key.extend_from_slice(&head.version.to_le_bytes());
                let _ = host::shared_set(SEQ_KEY, &seq_key, None);
                return true;
            }
            Err(_) => continue,
        }
    }
    false
}
