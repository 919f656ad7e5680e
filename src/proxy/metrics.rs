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

/// The two host calls behind a counter: define a metric (its id), add to it. [`Metrics`] holds
/// them as plain function pointers so that a test can count without a host.
type DefineMetric = fn(MetricType, &str) -> Option<u32>;
type IncrementMetric = fn(u32, i64);

/// This VM's metric ids by name, defined on first use. A request's counters have static names
/// (`request_path::counters`): once a name is defined, counting it is a map lookup by `&str` and
/// no allocation (`counting_a_defined_counter_allocates_nothing` below).
pub struct Metrics {
    counters: HashMap<String, u32>,
    gauges: HashMap<String, u32>,
    histograms: HashMap<String, u32>,
    /// Counter increments of the request path not yet handed to the host: `(metric id, amount)`.
    pending: Vec<(u32, u64)>,
    define: DefineMetric,
    increment: IncrementMetric,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::with_host(host::define_metric, host::increment_metric)
    }
}

impl Metrics {
    fn with_host(define: DefineMetric, increment: IncrementMetric) -> Metrics {
        Metrics {
            counters: HashMap::new(),
            gauges: HashMap::new(),
            histograms: HashMap::new(),
            pending: Vec::new(),
            define,
            increment,
        }
    }

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
        let id = (self.define)(kind, &format!("{PREFIX}{name}"))?;
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
            (self.increment)(id, i64::try_from(amount).unwrap_or(i64::MAX));
        }
    }

    /// [`Metrics::add`] for a counter every request bumps: kept in the VM and handed to the host
    /// by [`Metrics::flush`] on the next tick (`tick_ms`, 50 ms by default), one host call per
    /// counter instead of one per request. Envoy itself only flushes stats to its sinks every
    /// `stats_flush_interval` (5 s by default), so no sink sees the difference; `/stats` shows the
    /// count up to one tick late.
    pub fn add_later(&mut self, name: &str, amount: u64) {
        if amount == 0 {
            return;
        }
        let Some(id) = self.id(MetricType::Counter, name) else {
            return;
        };
        match self.pending.iter_mut().find(|(i, _)| *i == id) {
            Some((_, n)) => *n = n.saturating_add(amount),
            None => self.pending.push((id, amount)),
        }
    }

    /// Hands the counts [`Metrics::add_later`] kept to the host (the tick calls it).
    pub fn flush(&mut self) {
        for (id, amount) in &mut self.pending {
            if *amount > 0 {
                (self.increment)(*id, i64::try_from(*amount).unwrap_or(i64::MAX));
                *amount = 0;
            }
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

    /// Moves a gauge that several VMs add to by `delta` (Envoy merges gauges process-wide, so
    /// each VM adds its own share instead of setting the value).
    pub fn gauge_add(&mut self, name: &str, delta: i64) {
        if delta == 0 {
            return;
        }
        if let Some(id) = self.id(MetricType::Gauge, name) {
            (self.increment)(id, delta);
        }
    }

    /// A histogram's id, for a caller that records it often under a name it would otherwise
    /// have to format each time (see [`Metrics::record`]).
    pub fn histogram_id(&mut self, name: &str) -> Option<u32> {
        self.id(MetricType::Histogram, name)
    }

    /// Records `value` into the histogram `id` ([`Metrics::histogram_id`]).
    pub fn record(&mut self, id: Option<u32>, value: u64) {
        if let Some(id) = id {
            host::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            host::record_metric(id, value);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)] // test code
mod tests {
    use super::*;
    use std::cell::RefCell;

    thread_local! {
        /// What the fake host saw: names defined (in order, id = index), increments.
        static DEFINED: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
        static TOTALS: RefCell<[i64; 64]> = const { RefCell::new([0; 64]) };
    }

    fn define(_: MetricType, name: &str) -> Option<u32> {
        DEFINED.with(|d| {
            let mut d = d.borrow_mut();
            d.push(name.to_string());
            u32::try_from(d.len() - 1).ok()
        })
    }

    fn increment(id: u32, amount: i64) {
        TOTALS.with(|t| t.borrow_mut()[id as usize] += amount);
    }

    fn total(name: &str) -> i64 {
        let id = DEFINED.with(|d| d.borrow().iter().position(|n| n == name).unwrap());
        TOTALS.with(|t| t.borrow()[id])
    }

    /// Every request bumps `routed.<reason>` (kept until the tick) and maybe `fallback.<why>`
    /// or `rejected.<kind>` (now): after each name's first use has defined it, counting
    /// allocates nothing, with the names the request path passes (`&'static str`).
    #[test]
    fn counting_a_defined_counter_allocates_nothing() {
        let mut m = Metrics::with_host(define, increment);
        let names = [
            "routed.kv",
            "routed.kv-text",
            "routed.pinned",
            "fallback.invalid_json",
            "rejected.all_workers_overloaded",
        ];
        // Warm: each name defined once (its id, its key, its pending entry).
        for name in names {
            m.add_later(name, 1);
            m.inc(name);
        }
        m.flush();
        let before = crate::alloc_count::allocations();
        for i in 0..1000u64 {
            let name = names[(i % names.len() as u64) as usize];
            m.add_later(name, 1);
            m.inc(name);
            if i % 100 == 99 {
                m.flush();
            }
        }
        m.flush();
        assert_eq!(crate::alloc_count::allocations() - before, 0);
        // Each name defined once, with the prefix, and every count arrived.
        let defined = DEFINED.with(|d| d.borrow().clone());
        assert_eq!(defined.len(), names.len());
        for name in names {
            assert_eq!(total(&format!("{PREFIX}{name}")), 2 + 400);
        }
    }
}
