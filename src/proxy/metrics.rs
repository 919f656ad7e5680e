//! Envoy stats. Names are defined lazily on first use, per VM; Envoy merges them process-wide and
//! shows them as `wasmcustom.kv_router.<name>` in `/stats` (and `/stats/prometheus`).
//!
//! Every name comes from a bounded set (outcomes, reasons, configured worker ids), so the number
//! of stats stays bounded too.

use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

const PREFIX: &str = "kv_router.";

#[derive(Default)]
pub struct Metrics {
    ids: HashMap<(MetricType, String), u32>,
}

impl Metrics {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(&(kind, name.to_string())) {
            return Some(*id);
        }
        let full = format!("{PREFIX}{name}");
        let id = hostcalls::define_metric(kind, &full).ok()?;
        self.ids.insert((kind, name.to_string()), id);
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
            let _ = hostcalls::increment_metric(id, i64::try_from(amount).unwrap_or(i64::MAX));
        }
    }

    pub fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
