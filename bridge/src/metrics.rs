//! Prometheus counters. Updated per batch (not per token), so one mutex is cheap enough; gauges
//! are read from the live state when `/metrics` is rendered.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// Every counter the bridge exports, with its help text. Names are fixed; labels are bounded
/// (engine index, event type, reason, path).
pub const COUNTERS: &[(&str, &str)] = &[
    (
        "kv_bridge_batches_total",
        "Event batches received from the engine (live and replayed).",
    ),
    (
        "kv_bridge_engine_events_total",
        "Engine events decoded, by type.",
    ),
    (
        "kv_bridge_forwarded_events_total",
        "Events appended to the event page, by type.",
    ),
    (
        "kv_bridge_refused_events_total",
        "Engine events not forwarded, by reason.",
    ),
    (
        "kv_bridge_bad_frames_total",
        "Frames, batches or events that could not be decoded, by reason.",
    ),
    (
        "kv_bridge_block_size_mismatch_total",
        "BlockStored events whose block_size differs from --block-size.",
    ),
    (
        "kv_bridge_removed_unknown_blocks_total",
        "Removed hashes the mirror did not hold.",
    ),
    (
        "kv_bridge_removed_still_held_total",
        "Removed copies of blocks another copy still holds (not forwarded).",
    ),
    (
        "kv_bridge_seq_gaps_total",
        "Sequence gaps on the live stream.",
    ),
    (
        "kv_bridge_seq_duplicates_total",
        "Live batches already applied through a replay.",
    ),
    ("kv_bridge_replays_total", "Replay requests, by result."),
    (
        "kv_bridge_replayed_batches_total",
        "Batches applied from replay replies.",
    ),
    (
        "kv_bridge_resets_total",
        "Rank mirrors cleared and rebuilt, by cause.",
    ),
    (
        "kv_bridge_resubscribes_total",
        "Live-stream reconnections (publisher gone or stream error).",
    ),
    (
        "kv_bridge_idle_probes_total",
        "Liveness probes of a silent live stream, by result.",
    ),
    (
        "kv_bridge_page_requests_total",
        "HTTP requests served, by path.",
    ),
    (
        "kv_bridge_long_poll_wakeups_total",
        "Long polls answered because an event arrived.",
    ),
    (
        "kv_bridge_load_scrapes_total",
        "Engine /metrics scrapes, by result.",
    ),
];

#[derive(Debug, Default)]
pub struct Metrics {
    /// (name, rendered labels) -> value.
    counters: Mutex<BTreeMap<(&'static str, String), u64>>,
}

impl Metrics {
    pub fn add(&self, name: &'static str, labels: &[(&str, &str)], value: u64) {
        if value == 0 {
            return;
        }
        let mut rendered = String::new();
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                rendered.push(',');
            }
            let _ = write!(rendered, "{k}=\"{}\"", escape_label(v));
        }
        if let Ok(mut counters) = self.counters.lock() {
            let slot = counters.entry((name, rendered)).or_insert(0);
            *slot = slot.saturating_add(value);
        }
    }

    pub fn inc(&self, name: &'static str, labels: &[(&str, &str)]) {
        self.add(name, labels, 1);
    }

    /// Sum of a counter over all label sets (tests and health).
    pub fn total(&self, name: &str) -> u64 {
        self.counters.lock().map_or(0, |c| {
            c.iter()
                .filter(|((n, _), _)| *n == name)
                .map(|(_, v)| *v)
                .sum()
        })
    }

    /// The value of one labelled counter.
    pub fn get(&self, name: &str, labels: &str) -> u64 {
        self.counters.lock().map_or(0, |c| {
            c.iter()
                .find(|((n, l), _)| *n == name && l == labels)
                .map_or(0, |(_, v)| *v)
        })
    }

    /// Counters in Prometheus text format.
    pub fn render_counters(&self, out: &mut String) {
        let Ok(counters) = self.counters.lock() else {
            return;
        };
        for (name, help) in COUNTERS {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let mut any = false;
            for ((n, labels), value) in counters.iter() {
                if n == name {
                    any = true;
                    if labels.is_empty() {
                        let _ = writeln!(out, "{name} {value}");
                    } else {
                        let _ = writeln!(out, "{name}{{{labels}}} {value}");
                    }
                }
            }
            if !any {
                let _ = writeln!(out, "{name} 0");
            }
        }
    }
}

/// Appends one gauge.
pub fn render_gauge(out: &mut String, name: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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
        let mut out = String::new();
        m.render_counters(&mut out);
        assert!(
            out.contains("kv_bridge_batches_total{engine=\"0\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("kv_bridge_refused_events_total{reason=\"a\\\"b\"} 1\n"));
        assert!(out.contains("kv_bridge_seq_gaps_total 0\n"));
        assert_eq!(m.total("kv_bridge_batches_total"), 3);
    }
}
