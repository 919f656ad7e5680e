//! What each router in front of this worker has booked on it, as declared on its polls
//! (`/kv/events?router=<id>&booked=<requests>,<tokens>,<blocks>`), relayed to the others in the
//! page's `load.other_routers`: Envoy replicas see each other's requests in flight through the
//! bridge they all poll already, with no other channel. A router that stops polling drops out
//! after [`FRESH_FOR`]; at most [`MAX_ROUTERS`] are kept.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_router_protocol::page::Booked;

/// A declaration older than this no longer counts (its router stopped polling or restarted).
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// Routers remembered at most (a new one beyond it replaces the oldest declaration).
pub const MAX_ROUTERS: usize = 256;

#[derive(Debug, Default)]
pub struct RouterBookings {
    declared: Mutex<HashMap<u64, (Booked, Instant)>>,
}

impl RouterBookings {
    /// Router `router` has `booked` on this worker as of `now`.
    pub fn declare(&self, router: u64, booked: Booked, now: Instant) {
        let mut declared = self
            .declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        declared.retain(|_, (_, at)| now.saturating_duration_since(*at) <= FRESH_FOR);
        if declared.len() >= MAX_ROUTERS && !declared.contains_key(&router) {
            let oldest = declared
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                declared.remove(&k);
            }
        }
        declared.insert(router, (booked, now));
    }

    /// The sum of the fresh declarations of every router but `caller`; `None` when there are
    /// none.
    pub fn others(&self, caller: Option<u64>, now: Instant) -> Option<Booked> {
        let declared = self
            .declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        declared
            .iter()
            .filter(|(id, (_, at))| {
                Some(**id) != caller && now.saturating_duration_since(*at) <= FRESH_FOR
            })
            .map(|(_, (b, _))| *b)
            .reduce(Booked::plus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booked(requests: u32) -> Booked {
        Booked {
            requests,
            prefill_tokens: f64::from(requests) * 1000.0,
            decode_blocks: f64::from(requests) * 10.0,
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
}
