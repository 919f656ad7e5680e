//! The event ring behind `GET /kv/events` (the bridge's and the mock worker's): events with
//! the producer's own ids (consecutive from 1, or from where a ring starts), each serialized once,
//! bounded by count and bytes. Each entry may keep an item beside its JSON text (the mock keeps
//! the event's value; the bridge keeps nothing).
//!
//! `first_event_id` is the oldest id still buffered (or `last + 1` when none is): a poller whose
//! cursor fell behind it knows it lost events and re-syncs from the dump. Dropping the oldest
//! events (the bounds) or skipping ids ([`EventRing::skip`], a simulated loss) moves it forward.

use std::collections::VecDeque;

/// One buffered event: its id, the item kept with it, its JSON text.
type Entry<T> = (u64, T, Box<str>);

#[derive(Debug)]
pub struct EventRing<T = ()> {
    /// Ids consecutive.
    entries: VecDeque<Entry<T>>,
    last_id: u64,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
    dropped: u64,
}

/// Limits of one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLimits {
    pub max_events: usize,
    pub max_bytes: usize,
}

impl PageLimits {
    /// The limits of one call: `limit` and `max_bytes` as the poller asked (the filter's
    /// `events.page_events` and 7/8 of its `max_response_bytes`), each absent one `default`'s,
    /// each clamped to `1..=cap`.
    pub fn asked(
        default: PageLimits,
        cap: PageLimits,
        limit: Option<usize>,
        max_bytes: Option<usize>,
    ) -> PageLimits {
        PageLimits {
            max_events: limit.map_or(default.max_events, |l| l.clamp(1, cap.max_events.max(1))),
            max_bytes: max_bytes.map_or(default.max_bytes, |b| b.clamp(1, cap.max_bytes.max(1))),
        }
    }
}

impl<T> EventRing<T> {
    pub fn new(max_events: usize, max_bytes: usize) -> Self {
        Self::starting_at(1, max_events, max_bytes)
    }

    /// A ring whose first event gets id `first_id` (at least 1).
    pub fn starting_at(first_id: u64, max_events: usize, max_bytes: usize) -> Self {
        EventRing {
            entries: VecDeque::new(),
            last_id: first_id.max(1) - 1,
            bytes: 0,
            max_events: max_events.max(1),
            max_bytes,
            dropped: 0,
        }
    }

    /// The newest id handed out (0 before the first event).
    pub fn last_id(&self) -> u64 {
        self.last_id
    }

    /// The oldest id still buffered, `last_id + 1` when the ring is empty.
    pub fn first_id(&self) -> u64 {
        self.entries
            .front()
            .map_or(self.last_id.saturating_add(1), |(id, _, _)| *id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Events pushed out by the bounds since start.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The id the next event will get.
    pub fn next_id(&self) -> u64 {
        self.last_id.saturating_add(1)
    }

    /// Appends an event serialized with id [`Self::next_id`], keeping `item` with it; returns
    /// that id. The newest event is always kept, whatever its size.
    pub fn push_item(&mut self, item: T, json: String) -> u64 {
        self.last_id = self.next_id();
        self.bytes = self.bytes.saturating_add(json.len());
        self.entries
            .push_back((self.last_id, item, json.into_boxed_str()));
        while self.entries.len() > 1
            && (self.entries.len() > self.max_events || self.bytes > self.max_bytes)
        {
            if let Some((_, _, old)) = self.entries.pop_front() {
                self.bytes = self.bytes.saturating_sub(old.len());
                self.dropped += 1;
            }
        }
        self.last_id
    }

    /// Consumes `count` ids without buffering them and forgets everything older: a gap.
    pub fn skip(&mut self, count: u64) {
        self.entries.clear();
        self.bytes = 0;
        self.last_id = self.last_id.saturating_add(count);
    }

    /// The buffered items in id order.
    pub fn items(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|(_, item, _)| item)
    }

    /// The entries with id > `after`, oldest first, within `limits` (at least one event when
    /// any is newer than `after`): `(id, item, JSON)`. The byte bound counts each event's JSON
    /// and the comma before it.
    pub fn entries_after(
        &self,
        after: u64,
        limits: PageLimits,
    ) -> impl Iterator<Item = (u64, &T, &str)> {
        let first = self.first_id();
        let start = if after < first {
            0
        } else {
            usize::try_from(after - first + 1).unwrap_or(usize::MAX)
        };
        let mut count = 0usize;
        let mut bytes = 0usize;
        self.entries
            .range(start.min(self.entries.len())..)
            .take_while(move |(_, _, json)| {
                if count > 0
                    && (count >= limits.max_events
                        || bytes.saturating_add(json.len()) > limits.max_bytes)
                {
                    return false;
                }
                count += 1;
                bytes = bytes.saturating_add(json.len() + 1);
                true
            })
            .map(|(id, item, json)| (*id, item, &**json))
    }

    /// The events' JSON with id > `after` ([`Self::entries_after`]).
    pub fn page(&self, after: u64, limits: PageLimits) -> Vec<&str> {
        self.entries_after(after, limits)
            .map(|(_, _, json)| json)
            .collect()
    }

    /// [`Self::page`] as the text of a JSON array, `[e1,e2,...]`.
    pub fn page_array(&self, after: u64, limits: PageLimits) -> String {
        let mut out = String::from("[");
        for (i, (_, _, json)) in self.entries_after(after, limits).enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(json);
        }
        out.push(']');
        out
    }
}

impl EventRing<()> {
    /// Appends an event serialized with id [`Self::next_id`]; returns that id.
    pub fn push(&mut self, json: String) -> u64 {
        self.push_item((), json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIG: PageLimits = PageLimits {
        max_events: 1000,
        max_bytes: 1 << 20,
    };

    #[test]
    fn ids_start_at_one_and_pages_follow_the_cursor() {
        let mut r: EventRing = EventRing::new(10, 1 << 20);
        assert_eq!((r.first_id(), r.last_id()), (1, 0));
        assert!(r.page(0, BIG).is_empty());
        for i in 1..=3 {
            assert_eq!(r.push(format!("e{i}")), i);
        }
        assert_eq!(r.page(0, BIG), vec!["e1", "e2", "e3"]);
        assert_eq!(r.page(1, BIG), vec!["e2", "e3"]);
        assert!(r.page(3, BIG).is_empty());
        assert!(r.page(99, BIG).is_empty());
    }

    #[test]
    fn ids_can_start_anywhere() {
        let mut r: EventRing = EventRing::starting_at(1_000_000, 10, 1 << 20);
        assert_eq!((r.first_id(), r.last_id()), (1_000_000, 999_999));
        assert_eq!(r.push("a".into()), 1_000_000);
        assert_eq!(r.page(999_999, BIG), vec!["a"]);
    }

    #[test]
    fn bounds_drop_the_oldest() {
        let mut r: EventRing = EventRing::new(3, 1 << 20);
        for i in 1..=5 {
            r.push(format!("e{i}"));
        }
        assert_eq!(
            (r.first_id(), r.last_id(), r.len(), r.dropped()),
            (3, 5, 3, 2)
        );
        // A cursor behind the ring gets what is left; first_id tells it that it lost events.
        assert_eq!(r.page(0, BIG), vec!["e3", "e4", "e5"]);

        let mut r: EventRing = EventRing::new(100, 10);
        r.push("aaaa".into());
        r.push("bbbb".into());
        r.push("cccccccccccccccc".into()); // over the byte bound on its own: kept alone
        assert_eq!((r.first_id(), r.len()), (3, 1));
    }

    #[test]
    fn pages_respect_limits_but_never_come_back_empty() {
        let mut r: EventRing = EventRing::new(100, 1 << 20);
        for i in 1..=5 {
            r.push(format!("event-{i}"));
        }
        let two = PageLimits {
            max_events: 2,
            max_bytes: 1 << 20,
        };
        assert_eq!(r.page(0, two), vec!["event-1", "event-2"]);
        let tiny = PageLimits {
            max_events: 100,
            max_bytes: 1,
        };
        assert_eq!(r.page(2, tiny), vec!["event-3"]);
    }

    #[test]
    fn skips_are_gaps_and_items_stay_with_their_events() {
        let mut r: EventRing<u32> = EventRing::new(10, 1 << 20);
        r.push_item(7, "a".into());
        r.skip(5);
        assert!(r.is_empty());
        assert_eq!((r.first_id(), r.last_id()), (7, 6));
        assert_eq!(r.push_item(8, "b".into()), 7);
        assert_eq!(r.items().copied().collect::<Vec<_>>(), vec![8]);
        assert_eq!(r.page_array(0, BIG), "[b]");
        let default = PageLimits {
            max_events: 1000,
            max_bytes: 1 << 20,
        };
        let cap = PageLimits {
            max_events: 100_000,
            max_bytes: 64 << 20,
        };
        assert_eq!(PageLimits::asked(default, cap, None, None), default);
        assert_eq!(PageLimits::asked(default, cap, Some(0), None).max_events, 1);
        assert_eq!(
            PageLimits::asked(default, cap, Some(1 << 30), Some(1 << 40)),
            cap
        );
    }
}
