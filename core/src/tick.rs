//! The VM's tick cadence: the whole tick every `tick_ms`, and in between, on the VM that polls
//! for an Envoy sharing its fleet with other routers, relay ticks every `load.relay_interval_ms`
//! that only apply the pages that came in and declare the bookings that moved.
//!
//! A replica hears of another's booking one declaration and one applied page later: with both on
//! the 50 ms tick, about 50 ms on average and up to 100, during which the replicas decide on the
//! same view and pile onto the same workers. In the simulator (three Envoys, tuning traces that
//! are not the race's, 5 runs each) relay ticks of 10 ms took TTFT mean from 1.10x one Envoy's
//! to 1.06x on average over six traces (a 10 ms tick for the whole tick: 1.04x); a 10 ms cadence
//! for either half alone (declarations, or the pages applied) gained almost nothing: the delay is
//! their sum. One Envoy alone, which hears of no other router, keeps the plain tick.

use crate::config::{Config, UnseenTraffic};

/// How often this Envoy declares its bookings and applies the others' (ms): the relay interval
/// while it hears of other routers (`others`) with `relayed`, else the tick.
pub fn declaration_window_ms(config: &Config, others: bool) -> u64 {
    let relay = config.load.relay_interval_ms;
    let relaying = others
        && relay > 0
        && config.load.reported_load
        && config.load.unseen_traffic == UnseenTraffic::Relayed;
    if relaying {
        relay.min(config.tick_ms).max(1)
    } else {
        config.tick_ms.max(1)
    }
}

/// What a tick does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TickKind {
    /// Everything the tick does.
    Full,
    /// Only the relay: queued replies applied, moved bookings declared.
    Relay,
}

/// When the next full tick is due and the period the host was last asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TickCadence {
    next_full_ms: u64,
    period_ms: u64,
}

impl TickCadence {
    /// A VM whose host ticks every `tick_ms` (as `on_configure` sets it).
    pub fn new(tick_ms: u64) -> TickCadence {
        TickCadence {
            next_full_ms: 0,
            period_ms: tick_ms.max(1),
        }
    }

    /// The kind of the tick at `now_ms`. A tick within half a period of the full one's time is
    /// the full one (host timers drift), so full ticks keep `tick_ms` apart on average.
    pub fn kind(&mut self, tick_ms: u64, now_ms: u64) -> TickKind {
        if now_ms.saturating_add(self.period_ms / 2) >= self.next_full_ms {
            self.next_full_ms = now_ms.saturating_add(tick_ms);
            TickKind::Full
        } else {
            TickKind::Relay
        }
    }

    /// The tick period this VM wants: the relay interval while it polls (`polling`) and hears of
    /// other routers (`others`), else `tick_ms`. `Some` only when it differs from the last one
    /// asked for (the adapter then sets it on the host).
    pub fn period_change(&mut self, config: &Config, polling: bool, others: bool) -> Option<u64> {
        let want = if polling {
            declaration_window_ms(config, others)
        } else {
            config.tick_ms.max(1)
        };
        (want != self.period_ms).then(|| {
            self.period_ms = want;
            want
        })
    }

    /// The period last asked for.
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }
}

#[cfg(test)]
#[allow(clippy::expect_used)] // test code
mod tests {
    use super::*;

    fn config(relay: u64) -> Config {
        let json = format!(
            r#"{{"workers": [{{"id": 1, "address": "10.0.0.1:8000"}}], "load": {{"relay_interval_ms": {relay}}}}}"#
        );
        Config::from_json(json.as_bytes()).expect("config")
    }

    #[test]
    fn a_poller_hearing_of_other_routers_ticks_at_the_relay_interval_and_back() {
        let c = config(10);
        let mut t = TickCadence::new(c.tick_ms);
        assert_eq!(
            t.period_change(&c, true, false),
            None,
            "alone: the plain tick"
        );
        assert_eq!(t.period_change(&c, false, true), None, "not the poller");
        assert_eq!(t.period_change(&c, true, true), Some(10));
        assert_eq!(t.period_change(&c, true, true), None, "asked once");
        assert_eq!(t.period_change(&c, true, false), Some(50));
        let off = config(0);
        let mut t = TickCadence::new(off.tick_ms);
        assert_eq!(t.period_change(&off, true, true), None, "0 turns it off");
    }

    #[test]
    fn a_relay_interval_out_of_range_is_refused_by_name() {
        let json = r#"{"workers": [{"id": 1, "address": "10.0.0.1:8000"}],
                       "load": {"relay_interval_ms": 60001}}"#;
        let err = Config::from_json(json.as_bytes()).expect_err("out of range");
        assert!(err.to_string().contains("load.relay_interval_ms"), "{err}");
    }

    #[test]
    fn relay_ticks_fall_between_full_ticks_tick_ms_apart() {
        let c = config(10);
        let mut t = TickCadence::new(c.tick_ms);
        assert_eq!(t.kind(50, 1_000), TickKind::Full);
        t.period_change(&c, true, true);
        let kinds: Vec<TickKind> = (1..=10).map(|i| t.kind(50, 1_000 + 10 * i)).collect();
        use TickKind::{Full, Relay};
        assert_eq!(
            kinds,
            [Relay, Relay, Relay, Relay, Full, Relay, Relay, Relay, Relay, Full]
        );
        // A timer a few ms late or early does not skip or double a full tick.
        assert_eq!(t.kind(50, 1_143), Relay);
        assert_eq!(t.kind(50, 1_147), Full);
    }

    #[test]
    fn at_the_plain_tick_every_tick_is_full() {
        let c = config(10);
        let mut t = TickCadence::new(c.tick_ms);
        for i in 0..5 {
            assert_eq!(t.kind(50, 1_000 + 50 * i), TickKind::Full);
        }
        // Even a host timer firing early.
        assert_eq!(t.kind(50, 1_240), TickKind::Full);
    }
}
