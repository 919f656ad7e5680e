//! Membership: the routed cluster's hosts as Envoy has them (STATIC, DNS, EDS, any xDS), with
//! their health, read from Envoy's admin `/clusters?format=json` by the poller-lease holder.
//!
//! Invariants:
//! * The slot layout never changes: a discovered host occupies a worker entry of the fixed pool
//!   (`membership.max_workers`), or the static worker with its address. Index, load table and
//!   shared-data keys stay the same size whatever the churn.
//! * The table lives in the log head ([`Member`] per worker entry), so it reaches every VM with
//!   the events, and a join or leave is one atomic append: a `WorkerLost` record (its blocks
//!   leave every replica's index) with the head edit.
//! * A host taking an entry gets a new generation: a reply to an event call made for an earlier
//!   occupant carries the old generation and is dropped, so nothing lands on the new one.
//! * A host is unhealthy when Envoy's health checks fail it, outlier detection ejected it, EDS
//!   marks it unhealthy/draining/timeout, or it awaits its first health check. Unhealthy hosts
//!   are not chosen while a healthy one exists (see [`effective_config`]). A host pending
//!   removal has left.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::config::Config;
use crate::events::LogRecord;
use crate::load_store;
use crate::replication::log::{self as replication, LogHead, Member};
use crate::store::SharedStore;

// The worker description, and recording it in the log head, live below membership (event pages
// and the log head carry it); the old paths stay valid.
pub use crate::replication::head::set_description;
pub use crate::worker_description as description;

/// One host of the routed cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub address: SocketAddr,
    pub healthy: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipError {
    /// The admin reply is not the `/clusters?format=json` shape.
    InvalidJson { detail: String },
    /// The reply does not list the configured cluster.
    ClusterNotFound { cluster: String },
}

impl std::fmt::Display for MembershipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MembershipError::InvalidJson { detail } => {
                write!(f, "admin /clusters reply is not valid: {detail}")
            }
            MembershipError::ClusterNotFound { cluster } => {
                write!(f, "admin /clusters does not list cluster \"{cluster}\"")
            }
        }
    }
}

#[derive(Deserialize)]
struct Clusters {
    #[serde(default)]
    cluster_statuses: Vec<ClusterStatus>,
}

#[derive(Deserialize)]
struct ClusterStatus {
    #[serde(default)]
    name: String,
    #[serde(default)]
    host_statuses: Vec<HostStatus>,
}

#[derive(Deserialize)]
struct HostStatus {
    #[serde(default)]
    address: Option<AddressJson>,
    #[serde(default)]
    health_status: HealthJson,
}

#[derive(Deserialize)]
struct AddressJson {
    #[serde(default)]
    socket_address: Option<SocketAddressJson>,
}

#[derive(Deserialize)]
struct SocketAddressJson {
    #[serde(default)]
    address: String,
    #[serde(default)]
    port_value: u16,
}

/// Envoy's `HostHealthStatus` (proto3 JSON: false flags are omitted).
#[derive(Deserialize, Default)]
struct HealthJson {
    #[serde(default)]
    failed_active_health_check: bool,
    #[serde(default)]
    failed_outlier_check: bool,
    #[serde(default)]
    pending_dynamic_removal: bool,
    #[serde(default)]
    pending_active_hc: bool,
    #[serde(default)]
    excluded_via_immediate_hc_fail: bool,
    #[serde(default)]
    active_hc_timeout: bool,
    #[serde(default)]
    eds_health_status: Option<String>,
}

impl HealthJson {
    fn healthy(&self) -> bool {
        let eds_ok = !matches!(
            self.eds_health_status.as_deref(),
            Some("UNHEALTHY" | "DRAINING" | "TIMEOUT")
        );
        eds_ok
            && !self.failed_active_health_check
            && !self.failed_outlier_check
            && !self.pending_active_hc
            && !self.excluded_via_immediate_hc_fail
            && !self.active_hc_timeout
    }
}

/// The hosts of `cluster` in an admin `/clusters?format=json` reply, in Envoy's order, without
/// duplicates. Hosts without an IP socket address (pipes, names) and hosts pending removal are
/// skipped.
pub fn parse_admin_clusters(body: &[u8], cluster: &str) -> Result<Vec<Host>, MembershipError> {
    let parsed: Clusters =
        serde_json::from_slice(body).map_err(|e| MembershipError::InvalidJson {
            detail: e.to_string(),
        })?;
    let status = parsed
        .cluster_statuses
        .into_iter()
        .find(|c| c.name == cluster)
        .ok_or_else(|| MembershipError::ClusterNotFound {
            cluster: cluster.to_string(),
        })?;
    let mut hosts: Vec<Host> = Vec::with_capacity(status.host_statuses.len());
    for h in status.host_statuses {
        if h.health_status.pending_dynamic_removal {
            continue;
        }
        let Some(sock) = h.address.and_then(|a| a.socket_address) else {
            continue;
        };
        let Ok(ip) = sock.address.parse::<std::net::IpAddr>() else {
            continue;
        };
        if sock.port_value == 0 {
            continue;
        }
        let address = SocketAddr::new(ip, sock.port_value);
        if hosts.iter().any(|x| x.address == address) {
            continue;
        }
        hosts.push(Host {
            address,
            healthy: h.health_status.healthy(),
        });
    }
    Ok(hosts)
}

/// What one membership update changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Worker entries whose host left.
    pub left: Vec<u16>,
    /// Worker entries a host took.
    pub joined: Vec<u16>,
    /// Hosts whose health flipped.
    pub health_changed: u64,
    /// Hosts left out because every pool entry is taken.
    pub pool_full: u64,
    /// The first table (nothing else may have changed, but it must be published).
    pub first_table: bool,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.left.is_empty()
            && self.joined.is_empty()
            && self.health_changed == 0
            && !self.first_table
    }

    /// Entries whose index blocks must be dropped: their host left or a new one took them.
    pub fn cleared(&self) -> Vec<u16> {
        let mut all: Vec<u16> = self.left.iter().chain(&self.joined).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// Brings `head`'s membership table to `hosts`. Deterministic in (`head`'s members, `hosts`), so
/// the poller plans on its replica's head and re-applies inside the CAS edit after checking
/// `members_generation` did not move.
pub fn apply(config: &Config, head: &mut LogHead, hosts: &[Host], now_ms: u64) -> Changes {
    let mut changes = Changes {
        first_table: !head.members_seen,
        ..Changes::default()
    };
    let Some(m) = &config.membership else {
        return changes;
    };
    let first_pool = usize::from(m.first_pool_worker);
    head.workers
        .resize_with(config.workers.len(), Default::default);
    let static_of = |addr: &SocketAddr| {
        config
            .workers
            .iter()
            .take(first_pool)
            .position(|w| w.address == *addr)
    };
    let parsed = |member: &Member| member.address.parse::<SocketAddr>().ok();

    // Leaves: an occupant whose address Envoy no longer lists.
    for (i, w) in head.workers.iter_mut().enumerate() {
        let Some(member) = &w.member else { continue };
        let listed = parsed(member).is_some_and(|a| hosts.iter().any(|h| h.address == a));
        if !listed {
            vacate(w, now_ms);
            if let Ok(i) = u16::try_from(i) {
                changes.left.push(i);
            }
        }
    }
    // Joins and health.
    for host in hosts {
        let occupied = head.workers.iter().position(|w| {
            w.member
                .as_ref()
                .and_then(parsed)
                .is_some_and(|a| a == host.address)
        });
        if let Some(i) = occupied {
            if let Some(member) = head.workers.get_mut(i).and_then(|w| w.member.as_mut()) {
                if member.healthy != host.healthy {
                    member.healthy = host.healthy;
                    changes.health_changed += 1;
                }
            }
            continue;
        }
        let target = static_of(&host.address).or_else(|| {
            head.workers
                .iter()
                .enumerate()
                .skip(first_pool)
                .find(|(_, w)| w.member.is_none())
                .map(|(i, _)| i)
        });
        let Some(i) = target else {
            changes.pool_full += 1;
            continue;
        };
        let events_address = match config.workers.get(i) {
            Some(w) if i < first_pool => w.events_address_text.clone(),
            _ if m.events_port != 0 => {
                SocketAddr::new(host.address.ip(), m.events_port).to_string()
            }
            _ => host.address.to_string(),
        };
        head.members_generation += 1;
        let generation = head.members_generation;
        if let Some(w) = head.workers.get_mut(i) {
            vacate(w, now_ms);
            w.member = Some(Member {
                address: host.address.to_string(),
                events_address,
                generation,
                healthy: host.healthy,
                described: None,
            });
            if let Ok(i) = u16::try_from(i) {
                changes.joined.push(i);
            }
        }
    }
    if !changes.is_empty() {
        head.members_seen = true;
        head.members_generation += 1;
    }
    changes
}

/// What [`publish`] committed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    pub changes: Changes,
    /// In-flight load entries dropped because their worker's entry changed occupant.
    pub load_cleared: u64,
}

/// The poller's step: plans `hosts` against `from` (its replica's head), appends a `WorkerLost`
/// record for every entry whose occupant changed together with the head edit (only if the
/// membership did not move since `from`), then drops those entries' load. `None`: nothing
/// changed, or another writer moved the membership first (the next poll plans again).
pub fn publish(
    store: &dyn SharedStore,
    fingerprint: u64,
    config: &Config,
    from: &LogHead,
    hosts: &[Host],
    now_ms: u64,
) -> Option<Published> {
    let mut planned = from.clone();
    let (from_generation, from_seen) = (from.members_generation, from.members_seen);
    let changes = apply(config, &mut planned, hosts, now_ms);
    if changes.is_empty() {
        return None;
    }
    let cleared = changes.cleared();
    let records: Vec<LogRecord> = cleared
        .iter()
        .map(|&worker| LogRecord::WorkerLost { worker })
        .collect();
    let workers = config.workers.len();
    let edit = |head: &mut LogHead| {
        if head.members_generation != from_generation || head.members_seen != from_seen {
            return false;
        }
        apply(config, head, hosts, now_ms);
        true
    };
    let committed = if records.is_empty() {
        replication::update_head(store, fingerprint, workers, now_ms, edit)
    } else {
        replication::append(store, fingerprint, workers, now_ms, &records, edit)
    };
    if !committed {
        return None;
    }
    // Only the shards holding a departed worker's slots are written.
    let load_cleared = load_store::update_each(store, config.slots.len(), |table| {
        cleared
            .iter()
            .filter_map(|&w| table.clear_slots(config.worker_slots(w), now_ms))
            .reduce(|a, b| a + b)
    })
    .into_iter()
    .flatten()
    .sum();
    Some(Published {
        changes,
        load_cleared,
    })
}

/// Resets a worker entry's poll state as if new: no cursor (the next fetch is a full dump), no
/// reported load, not stale, no backoff.
fn vacate(w: &mut crate::replication::log::WorkerPollState, now_ms: u64) {
    w.member = None;
    w.cursor = None;
    w.reported = None;
    w.stale = false;
    w.rejections = 0;
    w.retry_after_ms = 0;
    w.last_ok_ms = now_ms;
}

/// The configuration with the membership table applied: pool entries get their host's address
/// (or stay vacant), static workers the cluster does not list are not routable, and unhealthy
/// hosts are routable only while no healthy one exists. Without `membership`, or before the
/// first table, the configuration as compiled.
pub fn effective_config(base: &Config, head: &LogHead) -> Config {
    let mut config = base.clone();
    if config.membership.is_none() || !head.members_seen {
        return config;
    }
    let first_pool = config
        .membership
        .as_ref()
        .map_or(usize::MAX, |m| usize::from(m.first_pool_worker));
    let mut any_healthy = false;
    for (i, w) in config.workers.iter_mut().enumerate() {
        let member = head.workers.get(i).and_then(|s| s.member.as_ref());
        if let Some(d) = member.and_then(|m| m.described.as_ref()) {
            if i >= first_pool {
                description::apply(w, d);
            }
        }
        let addresses = member.and_then(|m| {
            Some((
                m.address.parse::<SocketAddr>().ok()?,
                m.events_address.parse::<SocketAddr>().ok()?,
                m.healthy,
            ))
        });
        match addresses {
            Some((address, events_address, healthy)) => {
                w.address = address;
                w.address_text = address.to_string();
                w.events_address = events_address;
                w.events_address_text = events_address.to_string();
                w.routable = healthy;
                any_healthy |= healthy;
            }
            None => {
                w.address_text.clear();
                w.events_address_text.clear();
                w.routable = false;
            }
        }
    }
    if !any_healthy {
        // Every host failing: route among them rather than refuse (as Envoy's panic threshold).
        for w in &mut config.workers {
            w.routable = !w.is_vacant();
        }
    }
    config
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests;
