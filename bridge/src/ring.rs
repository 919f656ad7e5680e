//! The event ring behind `GET /kv/events`: the forwarded events with the bridge's own ids
//! (monotonic from 1), each serialized once, bounded by count and bytes.
//!
//! `first_event_id` is the oldest id still buffered (or `last + 1` when none is): a poller whose
//! cursor fell behind it knows it lost events and re-syncs from the dump.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct EventRing {
    /// `(event_id, event JSON)`, ids consecutive.
    entries: VecDeque<(u64, Box<str>)>,
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

impl EventRing {
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
            .map_or(self.last_id.saturating_add(1), |(id, _)| *id)
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

    /// Appends an event serialized with id [`Self::next_id`]; returns that id. The newest
    /// event is always kept, whatever its size.
    pub fn push(&mut self, json: String) -> u64 {
        self.last_id = self.next_id();
        self.bytes = self.bytes.saturating_add(json.len());
        self.entries
            .push_back((self.last_id, json.into_boxed_str()));
        while self.entries.len() > 1
            && (self.entries.len() > self.max_events || self.bytes > self.max_bytes)
        {
            if let Some((_, old)) = self.entries.pop_front() {
                self.bytes = self.bytes.saturating_sub(old.len());
                self.dropped += 1;
            }
        }
        self.last_id
    }

    /// The events with id > `after`, oldest first, within `limits` (at least one event when
    /// any is newer than `after`).
    pub fn page(&self, after: u64, limits: PageLimits) -> Vec<&str> {
        let first = self.first_id();
        let start = if after < first {
            0
        } else {
            usize::try_from(after - first + 1).unwrap_or(usize::MAX)
        };
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for (_, json) in self.entries.range(start.min(self.entries.len())..) {
            if !out.is_empty()
                && (out.len() >= limits.max_events
                    || bytes.saturating_add(json.len()) > limits.max_bytes)
            {
                break;
            }
            bytes = bytes.saturating_add(json.len() + 1);
            out.push(&**json);
        }
        out
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
        let mut r = EventRing::new(10, 1 << 20);
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
        let mut r = EventRing::starting_at(1_000_000, 10, 1 << 20);
        assert_eq!((r.first_id(), r.last_id()), (1_000_000, 999_999));
        assert_eq!(r.push("a".into()), 1_000_000);
        assert_eq!(r.page(999_999, BIG), vec!["a"]);
    }

    #[test]
    fn bounds_drop_the_oldest() {
        let mut r = EventRing::new(3, 1 << 20);
        for i in 1..=5 {
            r.push(format!("e{i}"));
        }
        assert_eq!(
            (r.first_id(), r.last_id(), r.len(), r.dropped()),
            (3, 5, 3, 2)
        );
        // A cursor behind the ring gets what is left; first_id tells it that it lost events.
        assert_eq!(r.page(0, BIG), vec!["e3", "e4", "e5"]);

        let mut r = EventRing::new(100, 10);
        r.push("aaaa".into());
        r.push("bbbb".into());
        r.push("cccccccccccccccc".into()); // over the byte bound on its own: kept alone
        assert_eq!((r.first_id(), r.len()), (3, 1));
    }

    #[test]
    fn pages_respect_limits_but_never_come_back_empty() {
        let mut r = EventRing::new(100, 1 << 20);
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
}
