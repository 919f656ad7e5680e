//! The membership poller: the lease holder reads Envoy's admin `/clusters?format=json` through
//! `membership.admin_cluster` every `membership.poll_interval_ms` and publishes the routed
//! cluster's hosts into the log head (see `crate::membership`). Every VM rebuilds its effective
//! configuration when the head's membership generation moves.

use super::host::{self, HostStore};
use super::vm::{MembersCall, VmState};
use crate::config::Config;
use crate::events::EventPage;
use crate::membership::description::{vet, WorkerDescription};
use crate::membership::{parse_admin_clusters, publish};
use crate::polling::{disposition, Disposition};
use log::{info, warn};
use proxy_wasm::types::{BufferType, MapType};
use std::rc::Rc;
use std::time::Duration;

impl VmState {
    /// Sends the admin call when due (lease holder only, one in flight).
    pub(super) fn poll_membership(&mut self, now: u64) {
        let Some(m) = self.path.base_config.membership.clone() else {
            return;
        };
        if let Some(call) = self.members_call {
            if now < call.deadline_ms {
                return;
            }
            self.members_call = None; // lost: Envoy answers every call, but never wait forever
        }
        if now < self.next_members_poll_ms {
            return;
        }
        self.next_members_poll_ms = now.saturating_add(m.poll_interval_ms);
        let headers = vec![
            (":method", "GET"),
            (":path", m.admin_path.as_str()),
            (":authority", "envoy-admin"),
            (":scheme", "http"),
        ];
        match host::http_call(
            &m.admin_cluster,
            headers,
            Duration::from_millis(m.timeout_ms),
        ) {
            Ok(token) => {
                self.members_call = Some(MembersCall {
                    token,
                    deadline_ms: now.saturating_add(m.timeout_ms.saturating_mul(2)),
                });
            }
            Err(_) => self.metrics.inc("membership.poll_failed"),
        }
    }

    /// Handles the admin reply if `token` is the membership call. False: not ours.
    pub(super) fn membership_reply(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        now: u64,
    ) -> bool {
        if self.members_call.map(|c| c.token) != Some(token) {
            return false;
        }
        self.members_call = None;
        let base = Rc::clone(&self.path.base_config);
        let Some(m) = &base.membership else {
            return true;
        };
        let status = if num_headers == 0 {
            None
        } else {
            host::header(MapType::HttpCallResponseHeaders, ":status")
        };
        match disposition(status.as_deref(), body_size, m.max_response_bytes) {
            Disposition::Failed => {
                self.metrics.inc("membership.poll_failed");
                warn!(
                    "kv-router: membership: admin call through cluster {} failed ({}); keeping the last table",
                    m.admin_cluster,
                    status.as_deref().unwrap_or("no response")
                );
                return true;
            }
            Disposition::TooLarge { body_bytes } => {
                self.metrics.inc("membership.rejected");
                warn!(
                    "kv-router: membership: admin reply of {body_bytes} bytes exceeds membership.max_response_bytes ({}); keeping the last table",
                    m.max_response_bytes
                );
                return true;
            }
            Disposition::Read => {}
        }
        let body = host::buffer(BufferType::HttpCallResponseBody, body_size).unwrap_or_default();
        let hosts = match parse_admin_clusters(&body, &m.cluster) {
            Ok(hosts) => hosts,
            Err(err) => {
                self.metrics.inc("membership.rejected");
                warn!("kv-router: membership: {err}; keeping the last table");
                return true;
            }
        };
        self.metrics.inc("membership.polls");
        self.publish_membership(&base, &hosts, now);
        true
    }

    /// Publishes the hosts (see [`crate::membership::publish`]) planned on this replica's head.
    fn publish_membership(&mut self, base: &Config, hosts: &[crate::membership::Host], now: u64) {
        self.sync_replica();
        let from = self.path.replica.head.clone();
        let Some(done) = publish(&HostStore, self.fingerprint, base, &from, hosts, now) else {
            return;
        };
        let changes = &done.changes;
        if changes.pool_full > 0 {
            self.metrics.add("membership.pool_full", changes.pool_full);
            warn!(
                "kv-router: membership: {} host(s) of cluster {} left out: every one of membership.max_workers entries is taken",
                changes.pool_full,
                base.membership.as_ref().map_or("", |m| m.cluster.as_str())
            );
        }
        self.metrics
            .add("membership.joined", changes.joined.len() as u64);
        self.metrics
            .add("membership.left", changes.left.len() as u64);
        self.metrics
            .add("membership.health_changed", changes.health_changed);
        self.metrics
            .add("membership.load_cleared", done.load_cleared);
        let id = |w: &u16| super::vm::worker_id(base, *w);
        info!(
            "kv-router: membership: {} host(s); joined {:?}, left {:?}, {} health change(s)",
            hosts.len(),
            changes.joined.iter().map(id).collect::<Vec<_>>(),
            changes.left.iter().map(id).collect::<Vec<_>>(),
            changes.health_changed
        );
        self.sync_replica();
    }

    /// The part of `page`'s worker description to record for pool entry `worker`, when it
    /// differs from the recorded one (counted and logged then). `None`: nothing to record (no
    /// description, not a pool entry, or unchanged).
    pub(super) fn vet_description(
        &mut self,
        worker: u16,
        page: &EventPage,
    ) -> Option<WorkerDescription> {
        let m = self.path.base_config.membership.as_ref()?;
        if let Some(err) = &page.invalid_worker {
            self.metrics.inc("membership.description_invalid");
            log::debug!("kv-router: membership: worker {worker}'s description is not valid: {err}");
            return None;
        }
        let described = page.worker.as_ref()?;
        if worker < m.first_pool_worker {
            return None; // a static entry: its configuration wins
        }
        let template = self.path.base_config.workers.get(usize::from(worker))?;
        let (vetted, refused) = vet(template, self.path.base_config.block_size, described);
        let member = self
            .path
            .replica
            .head
            .workers
            .get(usize::from(worker))
            .and_then(|w| w.member.as_ref())?;
        if member.described.as_ref() == Some(&vetted) {
            return None;
        }
        let id = super::vm::worker_id(&self.path.base_config, worker);
        for r in &refused {
            self.metrics.inc("membership.description_refused");
            warn!(
                "kv-router: membership: worker {id} ({}) describes itself with {r}",
                member.address
            );
        }
        self.metrics.inc("membership.described");
        info!(
            "kv-router: membership: worker {id} ({}) describes itself: {vetted:?}",
            member.address
        );
        Some(vetted)
    }

    /// `membership.workers` (hosts occupying an entry) and `membership.unhealthy`.
    pub(super) fn membership_gauges(&mut self) {
        if self.path.base_config.membership.is_none() {
            return;
        }
        let members = self
            .path
            .replica
            .head
            .workers
            .iter()
            .filter_map(|w| w.member.as_ref());
        let (mut present, mut unhealthy) = (0u64, 0u64);
        for m in members {
            present += 1;
            unhealthy += u64::from(!m.healthy);
        }
        self.metrics.gauge("membership.workers", present);
        self.metrics.gauge("membership.unhealthy", unhealthy);
    }
}
