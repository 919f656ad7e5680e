//! Prometheus metrics, kept and encoded by the `prometheus` crate. Counters are updated per
//! batch (not per token); gauges are read from the live state when `/metrics` is rendered.

use std::collections::HashMap;

use prometheus::{Encoder, GaugeVec, IntCounterVec, Opts, Registry, TextEncoder};

/// Every counter the bridge exports, with its help text and label names. Names are fixed;
/// labels are bounded (engine index, event type, reason, path).
pub const COUNTERS: &[(&str, &str, &[&str])] = &[
    (
        "kv_bridge_batches_total",
        "Event batches received from the engine (live and replayed).",
        &["engine"],
    ),
    (
        "kv_bridge_engine_events_total",
        "Engine events decoded, by type.",
        &["type"],
    ),
    (
        "kv_bridge_forwarded_events_total",
        "Events appended to the event page, by type.",
        &["type"],
    ),
    (
        "kv_bridge_refused_events_total",
        "Engine events not forwarded, by reason.",
        &["reason"],
    ),
    (
        "kv_bridge_bad_frames_total",
        "Frames, batches or events that could not be decoded, by reason.",
        &["engine", "reason"],
    ),
    (
        "kv_bridge_block_size_mismatch_total",
        "BlockStored events whose block_size differs from --block-size.",
        &[],
    ),
    (
        "kv_bridge_removed_unknown_blocks_total",
        "Removed hashes the mirror did not hold.",
        &[],
    ),
    (
        "kv_bridge_removed_still_held_total",
        "Removed copies of blocks another copy still holds (not forwarded).",
        &[],
    ),
    (
        "kv_bridge_seq_gaps_total",
        "Sequence gaps on the live stream.",
        &["engine"],
    ),
    (
        "kv_bridge_seq_duplicates_total",
        "Live batches already applied through a replay.",
        &["engine"],
    ),
    (
        "kv_bridge_replays_total",
        "Replay requests, by result.",
        &["engine", "result"],
    ),
    (
        "kv_bridge_replayed_batches_total",
        "Batches applied from replay replies.",
        &["engine"],
    ),
    (
        "kv_bridge_resets_total",
        "Rank mirrors cleared and rebuilt, by cause.",
        &["engine", "cause"],
    ),
    (
        "kv_bridge_resubscribes_total",
        "Live-stream reconnections (publisher gone or stream error).",
        &["engine"],
    ),
    (
        "kv_bridge_idle_probes_total",
        "Liveness probes of a silent live stream, by result.",
        &["engine", "result"],
    ),
    (
        "kv_bridge_page_requests_total",
        "HTTP requests served, by path.",
        &["path"],
    ),
    (
        "kv_bridge_long_poll_wakeups_total",
        "Long polls answered before their wait, by cause (events: an event arrived; declared: another router's bookings moved).",
        &["cause"],
    ),
    (
        "kv_bridge_declarations_total",
        "Router declarations received (router= and booked=), by path and whether they moved (woke the other routers' long polls).",
        &["path", "moved"],
    ),
    (
        "kv_bridge_load_scrapes_total",
        "Engine /metrics scrapes, by result.",
        &["result"],
    ),
];

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    counters: HashMap<&'static str, (IntCounterVec, &'static [&'static str])>,
}

impl Default for Metrics {
    fn default() -> Self {
        let registry = Registry::new();
        let mut counters = HashMap::new();
        for &(name, help, labels) in COUNTERS {
            let Ok(vec) = IntCounterVec::new(Opts::new(name, help), labels) else {
                continue;
            };
            // A counter without labels shows 0 before its first increment.
            if labels.is_empty() {
                let _ = vec.get_metric_with_label_values::<&str>(&[]);
            }
            if registry.register(Box::new(vec.clone())).is_ok() {
                counters.insert(name, (vec, labels));
            }
        }
        Metrics { registry, counters }
    }
}

impl Metrics {
    /// Adds `value` to counter `name` (one of [`COUNTERS`]) with `labels` (a label not given is
    /// empty; one the counter does not declare is ignored).
    pub fn add(&self, name: &'static str, labels: &[(&str, &str)], value: u64) {
        if value == 0 {
            return;
        }
        let Some((vec, names)) = self.counters.get(name) else {
            return;
        };
        let values: Vec<&str> = names
            .iter()
            .map(|n| labels.iter().find(|(k, _)| k == n).map_or("", |(_, v)| *v))
            .collect();
        if let Ok(c) = vec.get_metric_with_label_values(&values) {
            c.inc_by(value);
        }
    }

    pub fn inc(&self, name: &'static str, labels: &[(&str, &str)]) {
        self.add(name, labels, 1);
    }

    /// Sum of a counter over all label sets.
    pub fn total(&self, name: &str) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    /// The counters and `gauges` in Prometheus text format.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut families = self.registry.gather();
        families.extend(gauges.registry.gather());
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&families, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// Gauges read from the live state for one `/metrics` response.
#[derive(Debug, Default)]
pub struct Gauges {
    registry: Registry,
}

impl Gauges {
    /// One gauge without labels.
    pub fn set(&self, name: &str, help: &str, value: f64) {
        self.set_labelled(name, help, "", &[value]);
    }

    /// One gauge per engine (`engine="<index>"`).
    pub fn set_per_engine(&self, name: &str, help: &str, values: &[f64]) {
        self.set_labelled(name, help, "engine", values);
    }

    fn set_labelled(&self, name: &str, help: &str, label: &str, values: &[f64]) {
        let names: &[&str] = if label.is_empty() { &[] } else { &[label] };
        let Ok(vec) = GaugeVec::new(Opts::new(name, help), names) else {
            return;
        };
        for (i, v) in values.iter().enumerate() {
            let index = i.to_string();
            let labels: &[&str] = if label.is_empty() { &[] } else { &[&index] };
            if let Ok(g) = vec.get_metric_with_label_values(labels) {
                g.set(*v);
            }
        }
        let _ = self.registry.register(Box::new(vec));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_with_labels_and_zeroes() {
        let m = Metrics::default();
        m.inc("kv_bridge_batches_total", &[("engine", "0")]);
        m.add("kv_bridge_batches_total", &[("engine", "0")], 2);
        m.inc("kv_bridge_refused_events_total", &[("reason", "a\"b")]);
        let gauges = Gauges::default();
        gauges.set("kv_bridge_mirror_blocks", "Blocks.", 5.0);
        gauges.set_per_engine("kv_bridge_engine_connected", "Connected.", &[1.0, 0.0]);
        let out = m.render(&gauges);
        assert!(
            out.contains("kv_bridge_batches_total{engine=\"0\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("kv_bridge_refused_events_total{reason=\"a\\\"b\"} 1\n"));
        assert!(
            out.contains("kv_bridge_block_size_mismatch_total 0\n"),
            "{out}"
        );
        assert!(out.contains("kv_bridge_mirror_blocks 5\n"), "{out}");
        assert!(
            out.contains("kv_bridge_engine_connected{engine=\"1\"} 0\n"),
            "{out}"
        );
        assert_eq!(m.total("kv_bridge_batches_total"), 3);
    }
}
