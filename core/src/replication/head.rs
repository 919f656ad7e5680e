//! The log head's types ([`LogHead`]: per-worker poll and routing state, membership), shared by
//! the log ([`super::log`]) and their binary layout ([`super::head_codec`]).

use serde::{Deserialize, Serialize};

use crate::events::ReportedLoad;
use crate::worker_description::WorkerDescription;

/// Per-worker state of the poller, kept in shared data so that a new lease holder carries on.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerPollState {
    /// Last event id applied; `None` = never synced (or lost): the next fetch is a full dump.
    pub cursor: Option<u64>,
    pub last_ok_ms: u64,
    pub stale: bool,
    #[serde(default)]
    pub reported: Option<ReportedLoad>,
    /// Replies refused in a row, and no poller fetches before `retry_after_ms`: the backoff
    /// survives a lease hand-over (a new poller would otherwise start again at the interval).
    #[serde(default)]
    pub rejections: u32,
    #[serde(default)]
    pub retry_after_ms: u64,
    /// With `membership`: the host occupying this worker entry now (`None` = vacant, or a static
    /// worker the cluster does not list).
    #[serde(default)]
    pub member: Option<Member>,
}

/// The host occupying a worker entry, as the membership poller last saw it in Envoy.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Member {
    /// `ip:port` Envoy routes to.
    pub address: String,
    /// `ip:port` of its event endpoint.
    pub events_address: String,
    /// [`LogHead::members_generation`] when it took the entry: replies to calls made for an
    /// earlier occupant carry another generation and are dropped.
    pub generation: u64,
    /// Not failing active health checks, not ejected by outlier detection, EDS not unhealthy.
    pub healthy: bool,
    /// The host's vetted description of itself from its event page (pool entries only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub described: Option<WorkerDescription>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LogHead {
    /// Hash of the filter configuration that wrote this log; a new configuration starts a new epoch.
    pub fingerprint: u64,
    /// Replicas that applied less than this start from an empty index at this batch.
    pub epoch_start: u64,
    /// The last claimed batch.
    pub seq: u64,
    /// Bumped by every head update that changes what requests route on (epoch, stale flags,
    /// reported load, membership); cursor and backoff updates leave it alone.
    #[serde(default)]
    pub version: u64,
    pub snapshot_seq: u64,
    pub workers: Vec<WorkerPollState>,
    /// With `membership`: a membership table has been published (before that, static workers
    /// are routable as configured).
    #[serde(default)]
    pub members_seen: bool,
    /// Bumped by every membership change (join, leave, health).
    #[serde(default)]
    pub members_generation: u64,
}

impl LogHead {
    /// The generation of the host occupying `worker` (0 without membership or when vacant).
    pub fn member_generation(&self, worker: u16) -> u64 {
        self.workers
            .get(usize::from(worker))
            .and_then(|w| w.member.as_ref())
            .map_or(0, |m| m.generation)
    }
}

impl LogHead {
    pub(super) fn fresh(fingerprint: u64, after_seq: u64, workers: usize, now_ms: u64) -> LogHead {
        LogHead {
            fingerprint,
            epoch_start: after_seq,
            seq: after_seq,
            version: 0,
            snapshot_seq: 0,
            members_seen: false,
            members_generation: 0,
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

/// Records a pool entry occupant's vetted description; a change moves the membership
/// generation so every VM rebuilds its effective configuration.
pub fn set_description(head: &mut LogHead, worker: u16, d: &WorkerDescription) {
    let Some(member) = head
        .workers
        .get_mut(usize::from(worker))
        .and_then(|w| w.member.as_mut())
    else {
        return;
    };
    if member.described.as_ref() == Some(d) {
        return;
    }
    member.described = Some(d.clone());
    head.members_generation += 1;
}
