//! When the poller calls each worker's event endpoint, and what it makes of a reply. Pure: the
//! adapter (`proxy::poller`) sends the calls and feeds the replies back.
//!
//! Per worker, at most one call is in flight. A call whose reply never arrives frees its worker
//! after the call's timeout plus a margin. After a reply:
//! * applied, with more events waiting (a full page), or after a dump: poll again at once;
//! * long polling (`events.long_poll_ms > 0`): poll again at once after any applied reply that
//!   carried events or that the worker held for at least half the wait, so the next event is
//!   routable as soon as it exists; an empty reply that came back early means the endpoint does
//!   not hold calls, and the plain interval applies (no busy loop against such a worker);
//! * plain polling: after `events.poll_interval_ms`;
//! * failed (no answer, not 200): after the interval;
//! * rejected (malformed, oversized, wrong block size, absurd ids): after an exponential backoff,
//!   `poll_interval_ms * 2^n` for the n-th rejection in a row, at most [`MAX_BACKOFF_MS`], so a
//!   worker whose dump is too large is not re-fetched every interval forever.

use crate::config::EventsConfig;
use crate::events::EventPage;

/// Longest pause between two polls of a worker whose replies keep being rejected.
pub const MAX_BACKOFF_MS: u64 = 30_000;
/// How long past its timeout a call counts as in flight (Envoy answers timed-out calls itself).
const LOST_CALL_MARGIN_MS: u64 = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// `GET <events.path>?after=<cursor>` (`&wait_ms=` when long polling).
    Events { after: u64 },
    /// `GET <events.dump_path>`: the worker's whole cache.
    Dump,
}

/// The request path of a call.
pub fn call_path(events: &EventsConfig, kind: CallKind) -> String {
    match kind {
        CallKind::Events { after } => {
            let sep = if events.path.contains('?') { '&' } else { '?' };
            if events.long_poll_ms > 0 {
                format!(
                    "{}{sep}after={after}&wait_ms={}",
                    events.path, events.long_poll_ms
                )
            } else {
                format!("{}{sep}after={after}", events.path)
            }
        }
        CallKind::Dump => events.dump_path.clone(),
    }
}

/// The call's timeout: a long poll may legitimately take `long_poll_ms` before it answers.
pub fn call_timeout_ms(events: &EventsConfig, kind: CallKind) -> u64 {
    match kind {
        CallKind::Events { .. } => events.timeout_ms.saturating_add(events.long_poll_ms),
        CallKind::Dump => events.timeout_ms,
    }
}

/// What to do with a reply before its body is copied into the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// No response (connect failure, timeout: no headers) or a status other than 200.
    Failed,
    /// Over `events.max_response_bytes`: rejected unread.
    TooLarge {
        body_bytes: usize,
    },
    Read,
}

/// Decides from the reply's status and announced body size alone, so an oversized page is
/// never copied out of Envoy.
pub fn disposition(
    status: Option<&str>,
    body_bytes: usize,
    max_response_bytes: usize,
) -> Disposition {
    if status != Some("200") {
        Disposition::Failed
    } else if body_bytes > max_response_bytes {
        Disposition::TooLarge { body_bytes }
    } else {
        Disposition::Read
    }
}

/// Events were lost between `after` and the page: the worker no longer buffers `after + 1`, or
/// its ids went backwards (it restarted), or the page skips ids. Never overflows: a cursor with
/// no successor (`u64::MAX`, which page validation refuses anyway) reads as a gap.
pub fn is_gap(page: &EventPage, after: u64) -> bool {
    let Some(next) = after.checked_add(1) else {
        return true;
    };
    if page.first_event_id.is_some_and(|first| first > next) || page.last_event_id < after {
        return true;
    }
    let mut expected = next;
    for e in page.events.iter().filter(|e| e.event_id > after) {
        if e.event_id != expected {
            return true;
        }
        expected = expected.saturating_add(1);
    }
    false
}

/// How a call ended, as the adapter saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyOutcome {
    /// No usable answer (transport failure, non-200).
    Failed,
    /// The page or dump was refused (oversized, malformed, wrong block size, absurd ids).
    Rejected,
    /// The page shows lost events; the adapter asks for the dump at once.
    Gap,
    /// Applied to the log.
    Applied { new_events: bool, more: bool },
}

/// When the worker is polled next (what [`PollSchedule::replied`] decided).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Now (the adapter may send it from the reply callback).
    Now,
    After {
        ms: u64,
    },
    /// After a rejection backoff of `ms` (the n-th rejection in a row).
    Backoff {
        ms: u64,
        rejections: u32,
    },
}

#[derive(Clone, Copy, Debug, Default)]
struct InFlight {
    kind: Option<CallKind>,
    since_ms: u64,
    timeout_ms: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct WorkerPoll {
    in_flight: Option<InFlight>,
    next_due_ms: u64,
    rejections: u32,
}

/// Per-worker poll state of this VM's poller.
#[derive(Debug, Default)]
pub struct PollSchedule {
    workers: Vec<WorkerPoll>,
}

impl PollSchedule {
    pub fn new(workers: usize) -> PollSchedule {
        PollSchedule {
            workers: vec![WorkerPoll::default(); workers],
        }
    }

    /// No call in flight (or the one in flight is lost) and its time has come.
    pub fn is_due(&self, worker: u16, now_ms: u64) -> bool {
        let Some(w) = self.workers.get(usize::from(worker)) else {
            return false;
        };
        let busy = w.in_flight.is_some_and(|c| {
            now_ms.saturating_sub(c.since_ms) < c.timeout_ms.saturating_add(LOST_CALL_MARGIN_MS)
        });
        !busy && w.next_due_ms <= now_ms
    }

    /// Workers that are due, in order.
    pub fn due(&self, now_ms: u64) -> Vec<u16> {
        (0..self.workers.len())
            .filter_map(|w| u16::try_from(w).ok())
            .filter(|w| self.is_due(*w, now_ms))
            .collect()
    }

    pub fn sent(&mut self, worker: u16, kind: CallKind, timeout_ms: u64, now_ms: u64) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            w.in_flight = Some(InFlight {
                kind: Some(kind),
                since_ms: now_ms,
                timeout_ms,
            });
        }
    }

    /// The host refused to send the call: try again after the interval.
    pub fn send_failed(&mut self, worker: u16, events: &EventsConfig, now_ms: u64) {
        if let Some(w) = self.workers.get_mut(usize::from(worker)) {
            w.in_flight = None;
            w.next_due_ms = now_ms.saturating_add(events.poll_interval_ms);
        }
    }

    /// Records a reply to the worker's call in flight and schedules its next poll.
    pub fn replied(
        &mut self,
        worker: u16,
        outcome: ReplyOutcome,
        events: &EventsConfig,
        now_ms: u64,
    ) -> Next {
        let Some(w) = self.workers.get_mut(usize::from(worker)) else {
            return Next::After {
                ms: events.poll_interval_ms,
            };
        };
        let call = w.in_flight.take().unwrap_or_default();
        let held_ms = now_ms.saturating_sub(call.since_ms);
        let interval = events.poll_interval_ms;
        let next = match outcome {
            ReplyOutcome::Failed => Next::After { ms: interval },
            ReplyOutcome::Rejected => {
                w.rejections = w.rejections.saturating_add(1);
                let factor = 1u64.checked_shl(w.rejections.min(32)).unwrap_or(u64::MAX);
                let ms = interval
                    .saturating_mul(factor)
                    .min(MAX_BACKOFF_MS.max(interval));
                Next::Backoff {
                    ms,
                    rejections: w.rejections,
                }
            }
            ReplyOutcome::Gap => Next::Now,
            ReplyOutcome::Applied { new_events, more } => {
                w.rejections = 0;
                let dump = call.kind == Some(CallKind::Dump);
                let long = events.long_poll_ms;
                let held_full = long > 0 && held_ms.saturating_mul(2) >= long;
                if more || dump || (long > 0 && (new_events || held_full)) {
                    Next::Now
                } else {
                    Next::After { ms: interval }
                }
            }
        };
        w.next_due_ms = match next {
            Next::Now => now_ms,
            Next::After { ms } | Next::Backoff { ms, .. } => now_ms.saturating_add(ms),
        };
        next
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;
    use crate::events::{IndexEvent, NumberedEvent, MAX_EVENT_ID};

    fn events(long_poll_ms: u64) -> EventsConfig {
        EventsConfig {
            poll_interval_ms: 100,
            timeout_ms: 1000,
            long_poll_ms,
            ..EventsConfig::default()
        }
    }

    const EV: CallKind = CallKind::Events { after: 5 };

    #[test]
    fn long_poll_paths_and_timeouts() {
        let plain = events(0);
        assert_eq!(call_path(&plain, EV), "/kv/events?after=5");
        assert_eq!(call_timeout_ms(&plain, EV), 1000);
        let long = events(3000);
        assert_eq!(call_path(&long, EV), "/kv/events?after=5&wait_ms=3000");
        assert_eq!(
            call_timeout_ms(&long, EV),
            4000,
            "the wait plus the usual timeout"
        );
        assert_eq!(call_path(&long, CallKind::Dump), "/kv/dump");
        assert_eq!(
            call_timeout_ms(&long, CallKind::Dump),
            1000,
            "dumps do not wait"
        );
    }

    #[test]
    fn one_long_poll_in_flight_per_worker_until_it_returns() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(2);
        assert_eq!(s.due(0), vec![0, 1]);
        s.sent(0, EV, call_timeout_ms(&cfg, EV), 0);
        // Held by the worker for the whole wait: never a second call meanwhile, even at every
        // tick past the plain poll interval.
        for now in (0..4000).step_by(50) {
            assert!(!s.is_due(0, now), "in flight at {now} ms");
            assert!(s.is_due(1, now));
        }
        // An event arrives at 1234 ms: the worker answers and is due again at once.
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: true,
                    more: false
                },
                &cfg,
                1234
            ),
            Next::Now
        );
        assert!(s.is_due(0, 1234));
        s.sent(0, EV, 4000, 1234);
        // No event for the whole wait: the empty page also re-issues at once.
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: false,
                    more: false
                },
                &cfg,
                4234
            ),
            Next::Now
        );
    }

    #[test]
    fn an_endpoint_that_does_not_hold_calls_is_polled_at_the_interval() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(1);
        s.sent(0, EV, 4000, 0);
        // An empty page after 3 ms: the worker ignores wait_ms.
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: false,
                    more: false
                },
                &cfg,
                3
            ),
            Next::After { ms: 100 }
        );
        assert!(!s.is_due(0, 50));
        assert!(s.is_due(0, 103));
    }

    #[test]
    fn a_lost_call_frees_its_worker_after_the_call_timeout() {
        let cfg = events(3000);
        let mut s = PollSchedule::new(1);
        s.sent(0, EV, call_timeout_ms(&cfg, EV), 0);
        assert!(
            !s.is_due(0, 4999),
            "within the long poll's timeout and margin"
        );
        assert!(s.is_due(0, 5000));
    }

    #[test]
    fn plain_polling_keeps_its_interval_except_for_full_pages_and_dumps() {
        let cfg = events(0);
        let mut s = PollSchedule::new(1);
        s.sent(0, EV, 1000, 0);
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: true,
                    more: false
                },
                &cfg,
                10
            ),
            Next::After { ms: 100 }
        );
        s.sent(0, EV, 1000, 200);
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: true,
                    more: true
                },
                &cfg,
                210
            ),
            Next::Now
        );
        s.sent(0, CallKind::Dump, 1000, 300);
        assert_eq!(
            s.replied(
                0,
                ReplyOutcome::Applied {
                    new_events: false,
                    more: false
                },
                &cfg,
                310
            ),
            Next::Now
        );
        s.sent(0, EV, 1000, 400);
        assert_eq!(
            s.replied(0, ReplyOutcome::Failed, &cfg, 410),
            Next::After { ms: 100 }
        );
    }

    #[test]
    fn rejected_replies_back_off_exponentially_up_to_a_bound_and_reset_on_success() {
        let cfg = events(0);
        let mut s = PollSchedule::new(1);
        let mut waits = Vec::new();
        let mut now = 0;
        for _ in 0..12 {
            s.sent(0, CallKind::Dump, 1000, now);
            match s.replied(0, ReplyOutcome::Rejected, &cfg, now + 5) {
                Next::Backoff { ms, .. } => {
                    assert!(!s.is_due(0, now + 5 + ms - 1));
                    assert!(s.is_due(0, now + 5 + ms));
                    waits.push(ms);
                    now += 5 + ms;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            waits,
            vec![200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000, 30000]
        );
        // A gap (dump next) keeps the count; success resets it.
        s.sent(0, EV, 1000, now);
        assert_eq!(s.replied(0, ReplyOutcome::Gap, &cfg, now), Next::Now);
        s.sent(0, CallKind::Dump, 1000, now);
        assert_eq!(
            s.replied(0, ReplyOutcome::Rejected, &cfg, now),
            Next::Backoff {
                ms: 30000,
                rejections: 13
            }
        );
        s.sent(0, CallKind::Dump, 1000, now);
        s.replied(
            0,
            ReplyOutcome::Applied {
                new_events: false,
                more: false,
            },
            &cfg,
            now,
        );
        s.sent(0, CallKind::Dump, 1000, now);
        assert_eq!(
            s.replied(0, ReplyOutcome::Rejected, &cfg, now),
            Next::Backoff {
                ms: 200,
                rejections: 1
            }
        );
    }

    #[test]
    fn oversized_replies_are_refused_before_their_body_is_read() {
        assert_eq!(disposition(Some("200"), 10, 10), Disposition::Read);
        assert_eq!(
            disposition(Some("200"), 11, 10),
            Disposition::TooLarge { body_bytes: 11 }
        );
        assert_eq!(disposition(Some("500"), 1 << 30, 10), Disposition::Failed);
        assert_eq!(disposition(None, 0, 10), Disposition::Failed);
    }

    fn page(first: Option<u64>, last: u64, ids: &[u64]) -> EventPage {
        EventPage {
            block_size: 4,
            first_event_id: first,
            last_event_id: last,
            events: ids
                .iter()
                .map(|&event_id| NumberedEvent {
                    event_id,
                    event: IndexEvent::Cleared { dp_rank: None },
                })
                .collect(),
            load: None,
        }
    }

    #[test]
    fn gaps_are_found_without_overflow() {
        assert!(!is_gap(&page(Some(1), 7, &[6, 7]), 5));
        assert!(!is_gap(&page(Some(1), 5, &[]), 5));
        assert!(
            is_gap(&page(Some(7), 8, &[7, 8]), 5),
            "6 no longer buffered"
        );
        assert!(is_gap(&page(Some(1), 8, &[6, 8]), 5), "7 skipped");
        assert!(is_gap(&page(Some(1), 3, &[]), 5), "ids went backwards");
        // A cursor with no successor (a worker once claimed u64::MAX): a gap, not a wrap to 0.
        assert!(is_gap(&page(Some(1), u64::MAX, &[]), u64::MAX));
        // The largest valid cursor still has a successor: an idle worker there is no gap.
        assert!(!is_gap(&page(Some(1), MAX_EVENT_ID, &[]), MAX_EVENT_ID));
    }
}
