//! What each router in front of this worker has booked on it, as declared on its polls
//! (`/kv/events?router=<id>&booked=<requests>,<tokens>,<blocks>[&timing=<sums>]`) or between
//! them (`POST /kv/declare?...`), relayed to the others in the page's `load.other_routers`:
//! Envoy replicas see each other's requests in flight through the bridge they all poll already,
//! with no other channel. A router that stops polling drops out after [`FRESH_FOR`]; at most
//! [`MAX_ROUTERS`] are kept.
//!
//! A declaration that [`Booked::moved_from`] its router's previous one (or is its first) bumps a
//! version that the identified long polls of the *other* routers wait on
//! ([`RouterBookings::others_moved`]): they return at once with it rather than at their next
//! event or the end of their wait.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_router_protocol::page::Booked;
use tokio::sync::watch;

/// A declaration older than this no longer counts (its router stopped polling or restarted).
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// Routers remembered at most (a new one beyond it replaces the oldest declaration).
pub const MAX_ROUTERS: usize = 256;

/// One router's last declaration.
#[derive(Clone, Copy, Debug)]
struct Declared {
    booked: Booked,
    at: Instant,
    /// The version its last moving declaration set.
    moved: u64,
}

/// The declarations' version as of a moment ([`RouterBookings::subscribe`]), to wait for the
/// moves after it.
#[derive(Debug)]
pub struct Versions {
    rx: watch::Receiver<u64>,
    since: u64,
}

#[derive(Debug)]
pub struct RouterBookings {
    declared: Mutex<HashMap<u64, Declared>>,
    /// Bumped by every moving declaration (under `declared`'s lock, so a version seen here is
    /// already in the table).
    version: watch::Sender<u64>,
}

impl Default for RouterBookings {
    fn default() -> Self {
        RouterBookings {
            declared: Mutex::default(),
            version: watch::Sender::new(0),
        }
    }
}

impl RouterBookings {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Declared>> {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Router `router` has `booked` on this worker as of `now`. Returns whether it moved from
    /// the router's previous fresh declaration (or is its first), which wakes the other routers'
    /// long polls.
    pub fn declare(&self, router: u64, booked: Booked, now: Instant) -> bool {
        let mut declared = self.lock();
        declared.retain(|_, d| now.saturating_duration_since(d.at) <= FRESH_FOR);
        if declared.len() >= MAX_ROUTERS && !declared.contains_key(&router) {
            let oldest = declared.iter().min_by_key(|(_, d)| d.at).map(|(k, _)| *k);
            if let Some(k) = oldest {
                declared.remove(&k);
            }
        }
        let previous = declared.get(&router).copied();
        let moved_now = previous.is_none_or(|p| booked.moved_from(&p.booked));
        let moved = match previous {
            Some(p) if !moved_now => p.moved,
            _ => {
                let mut version = 0;
                self.version.send_modify(|v| {
                    *v += 1;
                    version = *v;
                });
                version
            }
        };
        declared.insert(
            router,
            Declared {
                booked,
                at: now,
                moved,
            },
        );
        moved_now
    }

    /// The sum of the fresh declarations of every router but `caller`; `None` when there are
    /// none.
    pub fn others(&self, caller: Option<u64>, now: Instant) -> Option<Booked> {
        self.lock()
            .iter()
            .filter(|(id, d)| {
                Some(**id) != caller && now.saturating_duration_since(d.at) <= FRESH_FOR
            })
            .map(|(_, d)| d.booked)
            .reduce(Booked::plus)
    }

    /// The declarations' version now, for [`Self::others_moved`]: moves after it wake.
    pub fn subscribe(&self) -> Versions {
        let mut rx = self.version.subscribe();
        let since = *rx.borrow_and_update();
        Versions { rx, since }
    }

    /// Whether a router other than `caller` made a moving declaration after `version`.
    pub fn moved_since(&self, caller: u64, version: u64) -> bool {
        self.lock()
            .iter()
            .any(|(id, d)| *id != caller && d.moved > version)
    }

    /// Resolves once a router other than `caller` makes a moving declaration after `versions`
    /// was taken ([`Self::subscribe`]); never for `caller`'s own.
    pub async fn others_moved(&self, caller: u64, versions: Versions) {
        let Versions { mut rx, since } = versions;
        // `changed` holds no lock once it returns, so reading the table here cannot deadlock
        // with `declare` (which bumps the version under the table's lock).
        while rx.changed().await.is_ok() {
            if self.moved_since(caller, since) {
                return;
            }
        }
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_router_protocol::page::TimingSums;

    fn booked(requests: u32) -> Booked {
        Booked {
            requests,
            prefill_tokens: f64::from(requests) * 1000.0,
            decode_blocks: f64::from(requests) * 10.0,
            timing: None,
        }
    }

    #[test]
    fn each_router_sees_the_others_sum_never_its_own() {
        let r = RouterBookings::default();
        let t0 = Instant::now();
        assert_eq!(r.others(Some(1), t0), None);
        r.declare(1, booked(2), t0);
        assert_eq!(r.others(Some(1), t0), None);
        r.declare(2, booked(3), t0);
        r.declare(3, booked(4), t0);
        assert_eq!(r.others(Some(1), t0), Some(booked(7)));
        assert_eq!(r.others(Some(2), t0), Some(booked(6)));
        // A caller that does not say who it is sees everyone.
        assert_eq!(r.others(None, t0), Some(booked(9)));
        // A new declaration replaces the router's last one.
        r.declare(3, booked(1), t0);
        assert_eq!(r.others(Some(1), t0), Some(booked(4)));
    }

    #[test]
    fn a_router_that_stops_polling_drops_out_and_the_table_stays_bounded() {
        let r = RouterBookings::default();
        let t0 = Instant::now();
        r.declare(1, booked(2), t0);
        let later = t0 + FRESH_FOR + Duration::from_millis(1);
        assert_eq!(r.others(Some(9), later), None);
        for id in 0..(MAX_ROUTERS as u64 + 50) {
            r.declare(id, booked(1), later);
        }
        let n = r.declared.lock().unwrap().len();
        assert_eq!(n, MAX_ROUTERS);
        assert_eq!(
            r.others(None, later).map(|b| b.requests),
            Some(MAX_ROUTERS as u32)
        );
    }

    #[test]
    fn only_a_moving_declaration_of_another_router_counts_as_moved() {
        let r = RouterBookings::default();
        let t0 = Instant::now();
        let versions = r.version.subscribe();
        // A router's first declaration moves.
        assert!(r.declare(1, booked(2), t0));
        assert_eq!(*versions.borrow(), 1);
        assert!(r.moved_since(2, 0));
        assert!(!r.moved_since(1, 0), "never its own");
        let since = *versions.borrow();
        // The same booking, more decode blocks, a little prefill drift, learned timing: not moved.
        assert!(!r.declare(1, booked(2), t0));
        let mut drift = booked(2);
        drift.decode_blocks += 50.0;
        drift.prefill_tokens += 64.0;
        drift.timing = TimingSums::parse("1,2,3,4,5,6,7");
        assert!(drift.timing.is_some());
        assert!(!r.declare(1, drift, t0));
        assert_eq!(*versions.borrow(), since);
        assert!(!r.moved_since(2, since));
        // ... though the others see the latest declaration.
        assert_eq!(r.others(Some(2), t0), Some(drift));
        // A request more (or queued prefill beyond 64 + 25 %) moves.
        assert!(r.declare(1, booked(3), t0));
        assert!(r.moved_since(2, since));
        let since = *versions.borrow();
        let mut prefill = booked(3);
        prefill.prefill_tokens += 2000.0;
        assert!(r.declare(1, prefill, t0));
        assert!(r.moved_since(2, since));
        // Another router's moves bump the same version; each caller sees only the others'.
        let since = *versions.borrow();
        assert!(r.declare(2, booked(1), t0));
        assert!(r.moved_since(1, since));
        assert!(!r.moved_since(2, since));
        // A router whose declaration went stale declares anew: a first one again.
        let later = t0 + FRESH_FOR + Duration::from_millis(1);
        assert!(r.declare(1, booked(3), later));
    }

    // Paused time: the timeouts below pass only once the waiting task has nothing left to do.
    #[tokio::test(start_paused = true)]
    async fn others_moved_wakes_for_the_others_moves_only() {
        let r = std::sync::Arc::new(RouterBookings::default());
        let t0 = Instant::now();
        r.declare(1, booked(1), t0);
        r.declare(2, booked(1), t0);
        let mut waiting = {
            let r = std::sync::Arc::clone(&r);
            let versions = r.subscribe();
            tokio::spawn(async move { r.others_moved(1, versions).await })
        };
        // Its own moves and the others' non-moving declarations do not wake router 1.
        r.declare(1, booked(5), t0);
        r.declare(2, booked(1), t0);
        let still = tokio::time::timeout(Duration::from_secs(1), &mut waiting).await;
        assert!(still.is_err(), "woke without another router moving");
        // Another router's moving declaration does.
        r.declare(2, booked(2), t0);
        tokio::time::timeout(Duration::from_secs(1), &mut waiting)
            .await
            .expect("not woken by another router's move")
            .expect("the waiting task panicked");
    }
}
