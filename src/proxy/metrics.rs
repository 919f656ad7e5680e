//! Envoy stats. Names are defined lazily on first use, per VM; Envoy merges them process-wide and
//! shows them as `wasmcustom.kv_router.<name>` in `/stats` (and `/stats/prometheus`).
//!
//! Every name comes from a bounded set (outcomes, reasons, configured worker ids), so the number
//! of stats stays bounded too.

use super::host;
use crate::events::{IndexEvent, NumberedEvent};
use hashbrown::HashMap;
use proxy_wasm::types::MetricType;

const PREFIX: &str = "kv_router.";

/// How many events of each kind a page brought in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventKinds {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
}

impl EventKinds {
    pub fn of(events: &[NumberedEvent]) -> EventKinds {
        let mut kinds = EventKinds::default();
        for e in events {
            match e.event {
                IndexEvent::Stored { .. } => kinds.stored += 1,
                IndexEvent::Removed { .. } => kinds.removed += 1,
                IndexEvent::Cleared { .. } => kinds.cleared += 1,
            }
        }
        kinds
    }
}

#[derive(Default)]
pub struct Metrics {
    counters: HashMap<String, u32>,
    gauges: HashMap<String, u32>,
    histograms: HashMap<String, u32>,
}

impl Metrics {
    /// The metric's id, defined on first use. Lookups by `&str` allocate nothing.
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        let ids = match kind {
            MetricType::Counter => &mut self.counters,
            MetricType::Gauge => &mut self.gauges,
            _ => &mut self.histograms,
        };
        if let Some(id) = ids.get(name) {
            return Some(*id);
        }
        let id = host::define_metric(kind, &format!("{PREFIX}{name}"))?;
        ids.insert(name.to_string(), id);
        Some(id)
    }

    pub fn inc(&mut self, name: &str) {
        self.add(name, 1);
    }

    pub fn add(&mut self, name: &str, amount: u64) {
        if amount == 0 {
            return;
        }
        if let Some(id) = self.id(MetricType::Counter, name) {
            host::increment_metric(id, i64::try_from(amount).unwrap_or(i64::MAX));
        }
    }

    /// `events.stored`, `events.removed`, `events.cleared`: a page's events by kind.
    pub fn add_event_kinds(&mut self, kinds: EventKinds) {
        self.add("events.stored", kinds.stored);
        self.add("events.removed", kinds.removed);
        self.add("events.cleared", kinds.cleared);
    }

    pub fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            host::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            host::record_metric(id, value);
        }
    }
}
