//! What the other Envoy replicas have most likely just sent, before their declarations arrive.
//!
//! With `load.unseen_traffic: relayed` each replica hears the others' bookings one declaration
//! later (the next tick, 50 ms by default, plus a hop through the bridge). Within that window
//! the others decide on the same view of the fleet as this Envoy: the same idle workers, the
//! same prefix holders. A burst of requests sharing a new prefix, split over three replicas,
//! lands on the same one or two workers three times over (in the simulator, `burst` seed 7: one
//! Envoy spread a burst over all 8 workers, three piled its 16 requests on 2 of them; TTFT mean
//! 164 against one Envoy's 144 ms, and 149 ms with this).
//!
//! So each replica assumes the others sent, in the last moments, what it sent itself. Only its
//! placements from scratch count (requests placed where nothing of their prompt is cached): one
//! placed on the holder of its history follows a history the others' requests do not share.
//! They decay with a half-life of one declaration window ([`half_life_ms`]) and join its view
//! of each slot as many times over as the others route requests for each of its own
//! ([`super::share::TrafficShare::relayed_ratio`]: 2 for one of three). One Envoy alone, which
//! hears of no other router, adds nothing. Once the others' declarations arrive, their real
//! bookings replace the guess, which by then has decayed.

use super::SlotLoad;
use crate::types::SlotIdx;

/// Decayed sums of this VM's own bookings on each slot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecentBookings {
    /// Per slot: prefill work tokens, decode blocks, requests.
    sums: Vec<[f64; 3]>,
    last_ms: u64,
}

/// The half-life of a booking's weight (ms): one declaration window, the tick at which the
/// other replicas declare theirs, and as long again for the hop and the poll.
pub fn half_life_ms(tick_ms: u64) -> f64 {
    2.0 * tick_ms.max(1) as f64
}

impl RecentBookings {
    /// Decays every sum to `now_ms`; resizes to `slots` (a new slot starts empty).
    fn decay_to(&mut self, slots: usize, now_ms: u64, half_life_ms: f64) {
        self.sums.resize(slots, [0.0; 3]);
        let dt = now_ms.saturating_sub(self.last_ms) as f64;
        self.last_ms = self.last_ms.max(now_ms);
        if dt <= 0.0 {
            return;
        }
        let keep = 0.5f64.powf(dt / half_life_ms.max(1.0));
        // Below a thousandth of a request the guess is gone: zero it rather than denormals.
        for sums in &mut self.sums {
            if sums[2] * keep < 1e-3 {
                *sums = [0.0; 3];
            } else {
                sums.iter_mut().for_each(|s| *s *= keep);
            }
        }
    }

    /// Records a booking of `work` prefill tokens and `blocks` decode blocks on `slot`.
    pub fn record(
        &mut self,
        slots: usize,
        slot: SlotIdx,
        work: f64,
        blocks: f64,
        now_ms: u64,
        half_life_ms: f64,
    ) {
        self.decay_to(slots, now_ms, half_life_ms);
        if let Some(sums) = self.sums.get_mut(usize::from(slot)) {
            let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
            sums[0] += finite(work);
            sums[1] += finite(blocks);
            sums[2] += 1.0;
        }
    }

    /// Adds to each slot of `load` what the other replicas likely booked there since their last
    /// declarations: this VM's own recent bookings, `others` times over (the other routers'
    /// traffic for each request of this one, [`super::share::TrafficShare::relayed_ratio`]).
    pub fn add_inferred(
        &mut self,
        others: f64,
        load: &mut [SlotLoad],
        now_ms: u64,
        half_life_ms: f64,
    ) {
        if !(others > 0.0 && others.is_finite()) {
            return;
        }
        self.decay_to(load.len(), now_ms, half_life_ms);
        for (view, sums) in load.iter_mut().zip(&self.sums) {
            if sums[2] <= 0.0 {
                continue;
            }
            view.prefill_tokens += others * sums[0];
            view.decode_blocks += others * sums[1];
            let requests = f64::from(view.active_requests) + (others * sums[2]).round();
            view.active_requests = requests.min(f64::from(u32::MAX)) as u32;
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)] // test code
mod tests {
    use super::*;

    const HALF: f64 = 100.0;

    fn idle(n: usize) -> Vec<SlotLoad> {
        vec![SlotLoad::default(); n]
    }

    #[test]
    fn two_other_replicas_count_twice_what_this_one_just_sent() {
        let mut r = RecentBookings::default();
        r.record(3, 1, 1000.0, 16.0, 5_000, HALF);
        let mut load = idle(3);
        r.add_inferred(2.0, &mut load, 5_000, HALF);
        assert_eq!(load[0], SlotLoad::default());
        assert_eq!(load[2], SlotLoad::default());
        assert_eq!(
            load[1],
            SlotLoad {
                prefill_tokens: 2000.0,
                decode_blocks: 32.0,
                active_requests: 2
            }
        );
    }

    #[test]
    fn the_guess_halves_each_half_life_and_is_gone_after_a_few() {
        let mut r = RecentBookings::default();
        r.record(2, 0, 1000.0, 16.0, 0, HALF);
        let mut load = idle(2);
        r.add_inferred(1.0, &mut load, 100, HALF);
        assert!(
            (load[0].prefill_tokens - 500.0).abs() < 1e-6,
            "{:?}",
            load[0]
        );
        let mut load = idle(2);
        r.add_inferred(1.0, &mut load, 1_100, HALF);
        assert_eq!(load[0], SlotLoad::default());
    }

    #[test]
    fn one_envoy_alone_or_a_scale_that_cannot_be_trusted_adds_nothing() {
        let mut r = RecentBookings::default();
        r.record(2, 0, 1000.0, 16.0, 0, HALF);
        for others in [0.0, f64::NAN, f64::INFINITY, -3.0] {
            let mut load = idle(2);
            r.add_inferred(others, &mut load, 0, HALF);
            assert_eq!(load, idle(2), "others {others}");
        }
    }

    #[test]
    fn bad_figures_and_slots_beyond_the_table_are_ignored() {
        let mut r = RecentBookings::default();
        r.record(2, 5, 1000.0, 16.0, 0, HALF);
        r.record(2, 0, f64::NAN, f64::INFINITY, 0, HALF);
        let mut load = idle(2);
        r.add_inferred(1.0, &mut load, 0, HALF);
        assert_eq!(
            load[0],
            SlotLoad {
                prefill_tokens: 0.0,
                decode_blocks: 0.0,
                active_requests: 1
            }
        );
        assert_eq!(load[1], SlotLoad::default());
    }
}
