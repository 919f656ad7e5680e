//! The share of the fleet's traffic this Envoy routes, inferred from what it observes: its own
//! requests in flight (the load table, every VM of the process) against the requests the engines
//! report in flight (their pages' `load` objects).
//!
//! Several Envoy replicas in front of one fleet each book only their own requests. Weighed
//! against a request's prefix, a load of a third of the truth pulls every replica onto the
//! holders of popular prefixes at once. Scaling the own view by `reported / own` lets each
//! replica weigh load as if it saw everyone's: without gossip, a leader or new infrastructure,
//! and assuming the others route like it does (they run the same filter behind one balancer).
//! One Envoy alone measures about 1 and changes nothing.

/// Half-life of the decayed sums (ms): long enough to average over the engines' report lag
/// (a page's `load` is as old as the last scrape or event), short enough to follow a replica
/// joining or leaving within a minute.
pub const HALF_LIFE_MS: f64 = 10_000.0;
/// The largest scale inferred (16 replicas or more all count as 16).
pub const MAX_SCALE: f64 = 16.0;
/// Below this mean of own requests in flight the ratio is noise: the scale stays 1.
const MIN_OWN_IN_FLIGHT: f64 = 1.0;

/// Decayed sums of own and reported requests in flight, sampled at each decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TrafficShare {
    own: f64,
    reported: f64,
    samples: f64,
    last_ms: u64,
}

impl TrafficShare {
    /// One sample: `own` requests this Envoy has in flight on the workers that reported,
    /// `reported` the requests those workers say they run or queue.
    pub fn observe(&mut self, own: f64, reported: f64, now_ms: u64) {
        if !(own.is_finite() && reported.is_finite()) {
            return;
        }
        let dt = now_ms.saturating_sub(self.last_ms) as f64;
        let keep = 0.5f64.powf(dt / HALF_LIFE_MS);
        self.own = self.own * keep + own.max(0.0);
        self.reported = self.reported * keep + reported.max(0.0);
        self.samples = self.samples * keep + 1.0;
        self.last_ms = now_ms;
    }

    /// The factor this Envoy's own load is scaled by: `reported / own`, within `1..=MAX_SCALE`;
    /// 1 until its own traffic is enough to tell.
    pub fn scale(&self) -> f64 {
        if self.samples <= 0.0 || self.own / self.samples < MIN_OWN_IN_FLIGHT {
            return 1.0;
        }
        (self.reported / self.own).clamp(1.0, MAX_SCALE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steady(own: f64, reported: f64) -> TrafficShare {
        let mut s = TrafficShare::default();
        for i in 0..200u64 {
            // Reports lag and jitter: alternate above and below the true figure.
            let jitter = if i % 2 == 0 { 1.25 } else { 0.75 };
            s.observe(own, reported * jitter, i * 100);
        }
        s
    }

    #[test]
    fn one_envoy_of_three_scales_its_load_by_three() {
        let s = steady(4.0, 12.0);
        assert!((s.scale() - 3.0).abs() < 0.05, "{}", s.scale());
    }

    #[test]
    fn an_envoy_alone_keeps_its_own_view() {
        assert_eq!(steady(4.0, 4.0).scale(), 1.0);
        // Engines that report fewer (requests between engine and client) never shrink it.
        assert_eq!(steady(4.0, 3.0).scale(), 1.0);
    }

    #[test]
    fn too_little_own_traffic_or_bad_input_tells_nothing() {
        assert_eq!(steady(0.5, 10.0).scale(), 1.0);
        assert_eq!(TrafficShare::default().scale(), 1.0);
        let mut s = steady(4.0, 12.0);
        let before = s;
        s.observe(f64::NAN, 1.0, 30_000);
        s.observe(1.0, f64::INFINITY, 30_000);
        assert_eq!(s, before);
    }

    #[test]
    fn the_scale_is_bounded_and_follows_a_replica_leaving() {
        assert_eq!(steady(2.0, 200.0).scale(), MAX_SCALE);
        let mut s = steady(4.0, 12.0);
        // The two other replicas leave: a minute later this Envoy sees all of it again.
        for i in 0..600u64 {
            s.observe(4.0, 4.0, 20_000 + i * 100);
        }
        assert!(s.scale() < 1.05, "{}", s.scale());
    }
}
