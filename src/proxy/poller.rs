//! Fetches each worker's KV events through the event cluster; only the VM holding the poller lease
//! (`ekr.lease`) polls, so a process makes one call per worker per interval, not one per thread.

use super::host;
use super::replication::LogHead;
use crate::config::Config;
use hashbrown::HashMap;
use std::time::Duration;

const LEASE_KEY: &str = "ekr.lease";

/// Takes or renews the lease. A lease not renewed for `lease_ms` passes to the next VM that asks.
pub fn hold_lease(nonce: u64, now_ms: u64, lease_ms: u64) -> bool {
    let (bytes, cas) = host::shared_get(LEASE_KEY);
    let (owner, expires_ms) = bytes
        .as_deref()
        .and_then(|b| {
            let owner = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
            let expires = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
            Some((owner, expires))
        })
        .unwrap_or((0, 0));
    if owner != nonce && expires_ms > now_ms {
        return false;
    }
    let mut value = nonce.to_le_bytes().to_vec();
    value.extend_from_slice(&(now_ms + lease_ms).to_le_bytes());
    host::shared_set(LEASE_KEY, &value, cas).is_ok()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    Events { after: u64 },
    Dump,
}

#[derive(Clone, Copy, Debug)]
pub struct PendingCall {
    pub worker: u16,
    pub kind: CallKind,
}

#[derive(Default)]
pub struct Poller {
    pending: HashMap<u32, PendingCall>,
    /// When each worker's call in flight was sent. A reply that never reaches us (a callback that
    /// found the VM busy, a host that dropped it) frees the worker after the call's timeout.
    in_flight_since_ms: Vec<Option<u64>>,
    next_due_ms: Vec<u64>,
}

impl Poller {
    /// Sends the calls that are due: one in flight per worker at most.
    pub fn dispatch_due(&mut self, config: &Config, head: &LogHead, now_ms: u64) -> usize {
        let workers = config.workers.len();
        self.in_flight_since_ms.resize(workers, None);
        let lost_after_ms = config.events.timeout_ms + 1000;
        self.next_due_ms.resize(workers, 0);
        let mut failed = 0;
        for worker in 0..workers {
            let (Some(since), Some(due)) = (
                self.in_flight_since_ms.get(worker),
                self.next_due_ms.get(worker),
            ) else {
                continue;
            };
            let busy = since.is_some_and(|t| now_ms.saturating_sub(t) < lost_after_ms);
            if busy || *due > now_ms {
                continue;
            }
            let cursor = head.workers.get(worker).and_then(|w| w.cursor);
            let kind = cursor.map_or(CallKind::Dump, |after| CallKind::Events { after });
            let Ok(worker) = u16::try_from(worker) else {
                continue;
            };
            if !self.dispatch(config, worker, kind, now_ms) {
                failed += 1;
            }
        }
        failed
    }

    pub fn dispatch(&mut self, config: &Config, worker: u16, kind: CallKind, now_ms: u64) -> bool {
        let Some(spec) = config.workers.get(usize::from(worker)) else {
            return false;
        };
        let path = match kind {
            CallKind::Events { after } => {
                let sep = if config.events.path.contains('?') {
                    '&'
                } else {
                    '?'
                };
                format!("{}{}after={}", config.events.path, sep, after)
            }
            CallKind::Dump => config.events.dump_path.clone(),
        };
        let address = spec.events_address_text.as_str();
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", address),
            (":scheme", "http"),
            ("x-envoy-original-dst-host", address),
            ("x-gateway-destination-endpoint", address),
        ];
        let timeout = Duration::from_millis(config.events.timeout_ms);
        let index = usize::from(worker);
        match host::http_call(&config.events.cluster, headers, timeout) {
            Ok(token) => {
                self.pending.insert(token, PendingCall { worker, kind });
                if let Some(since) = self.in_flight_since_ms.get_mut(index) {
                    *since = Some(now_ms);
                }
                true
            }
            Err(_) => {
                if let Some(due) = self.next_due_ms.get_mut(index) {
                    *due = now_ms + config.events.poll_interval_ms;
                }
                false
            }
        }
    }

    /// Matches a reply to its call and schedules the worker's next poll.
    pub fn complete(&mut self, token: u32, next_due_ms: u64) -> Option<PendingCall> {
        let call = self.pending.remove(&token)?;
        let index = usize::from(call.worker);
        if let Some(since) = self.in_flight_since_ms.get_mut(index) {
            *since = None;
        }
        if let Some(due) = self.next_due_ms.get_mut(index) {
            *due = next_due_ms;
        }
        Some(call)
    }

    /// Polls the worker again at once (its page was full, or it needs a dump).
    pub fn poll_soon(&mut self, worker: u16) {
        if let Some(due) = self.next_due_ms.get_mut(usize::from(worker)) {
            *due = 0;
        }
    }
}
