//! The mock's KV events, served by `GET /kv/events?after=N`: the shared
//! [`kv_router_protocol::ring::EventRing`] (ids, bounds, page cuts: the bridge's), keeping each
//! event's value beside its JSON text (the echo mode's dump filters them).
//!
//! Invariants: ids are assigned consecutively from 1; the buffer holds a contiguous id range
//! `first_id..=last_id` (empty when `first_id == last_id + 1`); dropping the oldest events (capacity)
//! or skipping ids (a simulated loss) moves `first_id` forward, which tells the poller it missed
//! events and must re-sync from the dump.

use kv_router_protocol::ring::EventRing;
pub use kv_router_protocol::ring::PageLimits;
use serde_json::{json, Value};

/// Most events in a page returned by [`EventLog::page`].
pub const MAX_PAGE_EVENTS: usize = 1000;
/// A page stops growing once its events' JSON reaches this size (it always holds at least one
/// event): vLLM-shaped stored events carry their token ids and can be tens of KiB each.
pub const MAX_PAGE_BYTES: usize = 1 << 20;
/// The most a client may ask for with `limit` and `max_bytes` (the filter's `events.page_events`
/// and 7/8 of its `max_response_bytes`).
pub const MAX_ASKED_PAGE_EVENTS: usize = 100_000;
pub const MAX_ASKED_PAGE_BYTES: usize = 64 << 20;

/// A page's bounds when the client asks for none: [`MAX_PAGE_EVENTS`] and [`MAX_PAGE_BYTES`].
pub const DEFAULT_PAGE: PageLimits = PageLimits {
    max_events: MAX_PAGE_EVENTS,
    max_bytes: MAX_PAGE_BYTES,
};

/// The limits a client asked for (`&limit=`, `&max_bytes=`; each absent one: [`DEFAULT_PAGE`]),
/// up to [`MAX_ASKED_PAGE_EVENTS`] and [`MAX_ASKED_PAGE_BYTES`].
pub fn asked(limit: Option<usize>, max_bytes: Option<usize>) -> PageLimits {
    let cap = PageLimits {
        max_events: MAX_ASKED_PAGE_EVENTS,
        max_bytes: MAX_ASKED_PAGE_BYTES,
    };
    PageLimits::asked(DEFAULT_PAGE, cap, limit, max_bytes)
}

/// Default bound on the JSON size of all buffered events.
pub const DEFAULT_MAX_BUFFER_BYTES: usize = 64 << 20;

#[derive(Debug)]
pub struct EventLog {
    /// Each event with its JSON text: pages are served from the text, without re-serializing.
    ring: EventRing<Value>,
}

impl EventLog {
    /// A log of at most `capacity` events and [`DEFAULT_MAX_BUFFER_BYTES`] of JSON.
    pub fn new(capacity: usize) -> Self {
        Self::with_limits(capacity, DEFAULT_MAX_BUFFER_BYTES)
    }

    /// A log of at most `capacity` events and `max_bytes` of JSON (the newest event always stays).
    pub fn with_limits(capacity: usize, max_bytes: usize) -> Self {
        EventLog {
            ring: EventRing::new(capacity, max_bytes),
        }
    }

    /// Appends an event, setting its `event_id` (inside `event` for Dynamo's wrapped shape).
    pub fn push(&mut self, mut event: Value) -> u64 {
        set_event_id(&mut event, self.ring.next_id());
        let text = serde_json::to_string(&event).unwrap_or_default();
        self.ring.push_item(event, text)
    }

    /// Consumes `count` ids without buffering them and forgets everything older: a gap.
    pub fn skip(&mut self, count: u64) {
        self.ring.skip(count);
    }

    /// The oldest buffered id (`last_id + 1` when empty).
    pub fn first_id(&self) -> u64 {
        self.ring.first_id()
    }

    /// The newest id assigned (0 before any event).
    pub fn last_id(&self) -> u64 {
        self.ring.last_id()
    }

    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Buffered events in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Value> {
        self.ring.items()
    }

    /// Up to `max` buffered events with id > `after`, stopping once `max_bytes` of JSON is
    /// reached (at least one event if any).
    pub fn events_after(&self, after: u64, max: usize, max_bytes: usize) -> Vec<Value> {
        let limits = PageLimits {
            max_events: max,
            max_bytes,
        };
        self.ring
            .entries_after(after, limits)
            .map(|(_, e, _)| e.clone())
            .collect()
    }

    /// [`EventLog::page`] without its `events`, and the JSON text of that `events` array, cut
    /// from the texts kept at push (no per-event clone or re-serialization: serving a page costs
    /// a copy of its bytes, as in the bridge). Join them with [`splice_events`].
    pub fn page_parts(&self, after: u64, block_size: usize, limits: PageLimits) -> (Value, String) {
        let events = self.ring.page_array(after, limits);
        let page = json!({
            "block_size": block_size,
            "first_event_id": self.first_id(),
            "last_event_id": self.last_id(),
        });
        (page, events)
    }

    /// The page body of DESIGN.md's event endpoint (without `load`).
    pub fn page(&self, after: u64, block_size: usize) -> Value {
        json!({
            "block_size": block_size,
            "first_event_id": self.first_id(),
            "last_event_id": self.last_id(),
            "events": self.events_after(after, MAX_PAGE_EVENTS, MAX_PAGE_BYTES),
        })
    }
}

/// The JSON text of the object `page` (no `events` key) with `"events": <events>` added.
pub fn splice_events(page: &Value, events: &str) -> Vec<u8> {
    let rest = serde_json::to_vec(page).unwrap_or_default();
    let mut out = Vec::with_capacity(rest.len() + events.len() + 12);
    out.extend_from_slice(b"{\"events\":");
    out.extend_from_slice(events.as_bytes());
    match rest.get(1..) {
        // `{}`: nothing else to add.
        Some(b"}") | None => out.push(b'}'),
        Some(tail) => {
            out.push(b',');
            out.extend_from_slice(tail);
        }
    }
    out
}

fn set_event_id(event: &mut Value, id: u64) {
    if let Some(obj) = event.as_object_mut() {
        let wrapped = !obj.contains_key("data")
            && !obj.contains_key("type")
            && obj.get("event").is_some_and(Value::is_object);
        if wrapped {
            if let Some(inner) = obj.get_mut("event").and_then(Value::as_object_mut) {
                inner.insert("event_id".into(), json!(id));
            }
        } else {
            obj.insert("event_id".into(), json!(id));
        }
    }
}

/// Whether an event (any DESIGN.md shape) is a "stored" event.
pub fn is_stored_event(event: &Value) -> bool {
    if event["type"] == "BlockStored" {
        return true;
    }
    let data = if event.get("data").is_some() {
        &event["data"]
    } else {
        &event["event"]["data"]
    };
    data.get("stored").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(events: &[Value]) -> Vec<u64> {
        events
            .iter()
            .map(|e| e["event_id"].as_u64().unwrap())
            .collect()
    }

    #[test]
    fn ids_pages_capacity_and_gaps() {
        let mut log = EventLog::new(3);
        assert_eq!((log.first_id(), log.last_id()), (1, 0));
        for _ in 0..2 {
            log.push(json!({"type": "AllBlocksCleared"}));
        }
        assert_eq!(ids(&log.events_after(0, 10, usize::MAX)), vec![1, 2]);
        assert_eq!(ids(&log.events_after(1, 10, usize::MAX)), vec![2]);
        assert!(log.events_after(2, 10, usize::MAX).is_empty());
        log.push(json!({"data": "cleared"}));
        log.push(json!({"data": "cleared"}));
        assert_eq!((log.first_id(), log.last_id()), (2, 4));
        assert_eq!(ids(&log.events_after(0, 10, usize::MAX)), vec![2, 3, 4]);
        assert_eq!(ids(&log.events_after(2, 1, usize::MAX)), vec![3]);
        log.skip(5);
        assert_eq!((log.first_id(), log.last_id()), (10, 9));
        assert!(log.is_empty());
        assert_eq!(log.push(json!({"type": "BlockRemoved"})), 10);
        let page = log.page(4, 64);
        assert_eq!(page["first_event_id"], 10);
        assert_eq!(page["last_event_id"], 10);
        assert_eq!(page["block_size"], 64);
        // The byte budget cuts pages but always returns one event.
        log.push(json!({"type": "BlockStored", "token_ids": vec![1; 100]}));
        assert_eq!(log.events_after(0, 10, 1).len(), 1);
        assert_eq!(log.events_after(0, 10, usize::MAX).len(), 2);
        // The buffer's byte bound drops the oldest events.
        let mut small = EventLog::with_limits(100, 250);
        for _ in 0..3 {
            small.push(json!({"type": "BlockStored", "token_ids": vec![1; 40]}));
        }
        assert_eq!((small.first_id(), small.last_id(), small.len()), (3, 3, 1));
    }

    #[test]
    fn wrapped_events_get_inner_ids() {
        let mut log = EventLog::new(10);
        log.push(json!({"worker_id": 1, "event": {"data": {"stored": {"blocks": []}}}}));
        let e = &log.events_after(0, 1, usize::MAX)[0];
        assert_eq!(e["event"]["event_id"], 1);
        assert!(e.get("event_id").is_none());
        assert!(is_stored_event(e));
        assert!(is_stored_event(&json!({"type": "BlockStored"})));
        assert!(!is_stored_event(&json!({"data": "cleared"})));
    }

    #[test]
    fn served_pages_equal_the_value_pages() {
        let mut log = EventLog::with_limits(5000, 1 << 20);
        let (page, events) = log.page_parts(0, 16, DEFAULT_PAGE);
        let body: Value = serde_json::from_slice(&splice_events(&page, &events)).unwrap();
        assert_eq!(body, log.page(0, 16));
        for i in 0..1500u64 {
            log.push(json!({"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"}));
        }
        for after in [0, 1450, 1500, 2000] {
            let (page, events) = log.page_parts(after, 16, DEFAULT_PAGE);
            let body: Value = serde_json::from_slice(&splice_events(&page, &events)).unwrap();
            assert_eq!(body, log.page(after, 16), "after {after}");
        }
        // Larger pages when asked, by count and by bytes.
        let limits = asked(Some(5000), None);
        let (_, events) = log.page_parts(0, 16, limits);
        assert_eq!(
            serde_json::from_str::<Vec<Value>>(&events).unwrap().len(),
            1500
        );
        let limits = asked(Some(5000), Some(200));
        let (_, events) = log.page_parts(0, 16, limits);
        let got = serde_json::from_str::<Vec<Value>>(&events).unwrap();
        assert!(!got.is_empty() && got.len() < 5, "{} events", got.len());
        assert_eq!(asked(Some(0), Some(1 << 40)).max_events, 1);
        assert_eq!(
            asked(Some(1 << 30), Some(1 << 40)).max_bytes,
            MAX_ASKED_PAGE_BYTES
        );
    }
}
