//! The share of the fleet's traffic this Envoy routes, inferred from what it observes: its own
//! requests in flight (the load table, every VM of the process) against the requests the engines
//! report in flight (their pages' `load` objects).
//!
//! Several Envoy replicas in front of one fleet each book only their own requests. With
//! `load.unseen_traffic: per_worker` each worker's reported requests beyond this Envoy's own
//! join its load view at the size of this Envoy's own requests (queued prefill tokens and blocks
//! per request in flight): each replica weighs load as if it saw everyone's, without gossip, a
//! leader or new infrastructure, assuming the others' requests look like its own (they run the
//! same filter behind one balancer). One Envoy alone adds about nothing.
//!
//! With `relayed` (the default) the other routers' requests in flight come from the bridges
//! instead, exactly; [`TrafficShare::relayed_ratio`] scales what a replica infers the others
//! just sent ([`super::recent`]).
//!
//! `per_worker` is off by default: measured with three replicas it evened the requests per
//! worker but moved requests off their prefix holders, and TTFT rose (docs/OPERATIONS.md,
//! "Several Envoy replicas"). The reported ratio (`scale`) is the `load.traffic_scale_pct`
//! metric either way.

/// Half-life of the decayed sums (ms): long enough to average over the engines' report lag
/// (a page's `load` is as old as the last scrape or event), short enough to follow a replica
/// joining or leaving within a minute.
pub const HALF_LIFE_MS: f64 = 10_000.0;
/// The largest scale inferred (16 replicas or more all count as 16).
pub const MAX_SCALE: f64 = 16.0;
/// Below this mean of own requests in flight the ratio is noise: the scale stays 1.
const MIN_OWN_IN_FLIGHT: f64 = 1.0;

/// Decayed sums of own, reported and relayed requests in flight, and of the own requests'
/// queued prefill tokens and active blocks: sampled at each decision with `per_worker`, on every
/// tick with `relayed` (for [`TrafficShare::relayed_ratio`]), otherwise once a second for the
/// metric.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TrafficShare {
    own: f64,
    reported: f64,
    relayed: f64,
    prefill_tokens: f64,
    decode_blocks: f64,
    samples: f64,
    last_ms: u64,
}

/// One decision's sample (sums over the workers with a fresh report).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// This Envoy's requests in flight.
    pub own: f64,
    /// The requests the workers say they run or queue.
    pub reported: f64,
    /// The other routers' requests in flight, as the bridges relay their declarations.
    pub relayed: f64,
    /// This Envoy's queued prefill tokens and active blocks.
    pub prefill_tokens: f64,
    pub decode_blocks: f64,
}

impl TrafficShare {
    pub fn observe(&mut self, sample: Sample, now_ms: u64) {
        let Sample {
            own,
            reported,
            relayed,
            prefill_tokens,
            decode_blocks,
        } = sample;
        if ![own, reported, relayed, prefill_tokens, decode_blocks]
            .iter()
            .all(|v| v.is_finite())
        {
            return;
        }
        let dt = now_ms.saturating_sub(self.last_ms) as f64;
        let keep = 0.5f64.powf(dt / HALF_LIFE_MS);
        self.own = self.own * keep + own.max(0.0);
        self.reported = self.reported * keep + reported.max(0.0);
        self.relayed = self.relayed * keep + relayed.max(0.0);
        self.prefill_tokens = self.prefill_tokens * keep + prefill_tokens.max(0.0);
        self.decode_blocks = self.decode_blocks * keep + decode_blocks.max(0.0);
        self.samples = self.samples * keep + 1.0;
        self.last_ms = now_ms;
    }

    fn enough_own(&self) -> bool {
        self.samples > 0.0 && self.own / self.samples >= MIN_OWN_IN_FLIGHT
    }

    /// What one of this Envoy's requests in flight holds on average: (queued prefill tokens,
    /// active blocks); `None` until its own traffic is enough to tell.
    pub fn per_request(&self) -> Option<(f64, f64)> {
        self.enough_own().then(|| {
            (
                self.prefill_tokens / self.own,
                self.decode_blocks / self.own,
            )
        })
    }

    /// The fleet's reported requests in flight over this Envoy's own, within `1..=MAX_SCALE`
    /// (about the number of replicas); 1 until its own traffic is enough to tell.
    pub fn scale(&self) -> f64 {
        if !self.enough_own() {
            return 1.0;
        }
        (self.reported / self.own).clamp(1.0, MAX_SCALE)
    }

    /// The other routers' relayed requests in flight over this Envoy's own, within
    /// `0..=MAX_SCALE - 1`: how much traffic the other replicas route for each request of this
    /// one (2 for one of three). Exact where [`Self::scale`] reads lagging engine reports; 0
    /// without relayed bookings, or until its own traffic is enough to tell.
    pub fn relayed_ratio(&self) -> f64 {
        if !self.enough_own() {
            return 0.0;
        }
        (self.relayed / self.own).clamp(0.0, MAX_SCALE - 1.0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // test code
mod tests {
    use super::*;

    fn sample(own: f64, reported: f64) -> Sample {
        Sample {
            own,
            reported,
            relayed: reported - own,
            prefill_tokens: own * 1000.0,
            decode_blocks: own * 64.0,
        }
    }

    fn steady(own: f64, reported: f64) -> TrafficShare {
        let mut s = TrafficShare::default();
        for i in 0..200u64 {
            // Reports lag and jitter: alternate above and below the true figure.
            let jitter = if i % 2 == 0 { 1.25 } else { 0.75 };
            s.observe(sample(own, reported * jitter), i * 100);
        }
        s
    }

    #[test]
    fn one_envoy_of_three_scales_its_load_by_three() {
        let s = steady(4.0, 12.0);
        assert!((s.scale() - 3.0).abs() < 0.05, "{}", s.scale());
        assert!(
            (s.relayed_ratio() - 2.0).abs() < 0.05,
            "{}",
            s.relayed_ratio()
        );
        let (prefill, blocks) = s.per_request().unwrap();
        assert!((prefill - 1000.0).abs() < 1e-6 && (blocks - 64.0).abs() < 1e-6);
    }

    #[test]
    fn an_envoy_alone_keeps_its_own_view() {
        assert_eq!(steady(4.0, 4.0).scale(), 1.0);
        assert_eq!(TrafficShare::default().relayed_ratio(), 0.0);
        // Engines that report fewer (requests between engine and client) never shrink it.
        assert_eq!(steady(4.0, 3.0).scale(), 1.0);
    }

    #[test]
    fn too_little_own_traffic_or_bad_input_tells_nothing() {
        assert_eq!(steady(0.5, 10.0).scale(), 1.0);
        assert_eq!(steady(0.5, 10.0).per_request(), None);
        assert_eq!(TrafficShare::default().scale(), 1.0);
        let mut s = steady(4.0, 12.0);
        let before = s;
        s.observe(sample(f64::NAN, 1.0), 30_000);
        s.observe(sample(1.0, f64::INFINITY), 30_000);
        assert_eq!(s, before);
    }

    #[test]
    fn the_scale_is_bounded_and_follows_a_replica_leaving() {
        assert_eq!(steady(2.0, 200.0).scale(), MAX_SCALE);
        let mut s = steady(4.0, 12.0);
        // The two other replicas leave: a minute later this Envoy sees all of it again.
        for i in 0..600u64 {
            s.observe(sample(4.0, 4.0), 20_000 + i * 100);
        }
        assert!(s.scale() < 1.05, "{}", s.scale());
    }
}
