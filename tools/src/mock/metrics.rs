//! `GET /metrics`: the worker's counters in Prometheus text format, encoded by the
//! `prometheus` crate (with vLLM's names for the gauges dashboards and the bridge expect).

use std::sync::atomic::Ordering;

use prometheus::core::Collector;
use prometheus::{Counter, Encoder, Gauge, Opts, Registry, TextEncoder};

use super::{engine, Backend, MockWorker};

/// A snapshot of the worker's figures, each registered once with its `worker_id` label.
struct Snapshot {
    registry: Registry,
    id: String,
}

impl Snapshot {
    fn add(&self, name: &str, kind: &str, help: &str, value: f64) {
        self.add_labelled(name, kind, help, value, &[]);
    }

    fn add_labelled(
        &self,
        name: &str,
        kind: &str,
        help: &str,
        value: f64,
        labels: &[(&str, String)],
    ) {
        let mut opts = Opts::new(name, help).const_label("worker_id", self.id.as_str());
        for (k, v) in labels {
            opts = opts.const_label(*k, v.as_str());
        }
        let metric: Result<Box<dyn Collector>, _> = if kind == "counter" {
            Counter::with_opts(opts).map(|c| {
                c.inc_by(value.max(0.0));
                Box::new(c) as Box<dyn Collector>
            })
        } else {
            Gauge::with_opts(opts).map(|g| {
                g.set(value);
                Box::new(g) as Box<dyn Collector>
            })
        };
        // Names are fixed and distinct: registration fails only on a typo, which the tests see
        // as a missing metric.
        if let Ok(m) = metric {
            let _ = self.registry.register(m);
        }
    }

    fn encode(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

pub(super) fn render(w: &MockWorker) -> String {
    let snapshot = Snapshot {
        registry: Registry::new(),
        id: w.opts.id.to_string(),
    };
    let line =
        |name: &str, kind: &str, help: &str, value: f64| snapshot.add(name, kind, help, value);
    let in_flight = w.in_flight().max(0) as f64;
    let requests = w.requests() as f64;
    line(
        "mock_worker_requests_total",
        "counter",
        "Completion requests received.",
        requests,
    );
    line(
        "mock_worker_in_flight",
        "gauge",
        "Completion requests being served.",
        in_flight,
    );
    let (m, engine) = match &w.backend {
        Backend::Engine(e) => (e.metrics(), true),
        Backend::Echo(_) => (engine::EngineMetrics::default(), false),
    };
    let c = m.counters;
    let hit_rate = if c.prefix_queries_tokens > 0 {
        c.prefix_hit_tokens as f64 / c.prefix_queries_tokens as f64
    } else {
        0.0
    };
    let running = if engine {
        m.num_running as f64
    } else {
        in_flight
    };
    line(
        "mock_worker_kv_cache_usage_ratio",
        "gauge",
        "Fraction of KV blocks held by running requests.",
        m.kv_usage,
    );
    line(
        "mock_worker_kv_cached_blocks_device",
        "gauge",
        "Blocks cached on the device.",
        m.device_blocks as f64,
    );
    line(
        "mock_worker_kv_cached_blocks_host",
        "gauge",
        "Blocks cached on the host tier.",
        m.host_blocks as f64,
    );
    line(
        "mock_worker_prefix_cache_queries_tokens_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        c.prefix_queries_tokens as f64,
    );
    line(
        "mock_worker_prefix_cache_hits_tokens_total",
        "counter",
        "Prompt tokens found on the device.",
        c.prefix_hit_tokens as f64,
    );
    line(
        "mock_worker_prefix_cache_host_hits_tokens_total",
        "counter",
        "Prompt tokens found on the host tier.",
        c.prefix_host_hit_tokens as f64,
    );
    line(
        "mock_worker_prefix_cache_hit_rate",
        "gauge",
        "Device hit tokens / query tokens since start.",
        hit_rate,
    );
    line(
        "mock_worker_num_requests_waiting",
        "gauge",
        "Requests queued in the engine.",
        m.num_waiting as f64,
    );
    line(
        "mock_worker_num_requests_running",
        "gauge",
        "Requests running in the engine.",
        running,
    );
    line(
        "mock_worker_requests_completed_total",
        "counter",
        "Requests finished by the engine.",
        c.requests_completed as f64,
    );
    line(
        "mock_worker_prefill_busy_seconds_total",
        "counter",
        "Modelled time of the engine steps' prefill share (beyond their decodes alone).",
        c.prefill_busy_us as f64 / 1e6,
    );
    line(
        "mock_worker_busy_seconds_total",
        "counter",
        "Modelled time of the engine steps.",
        c.busy_us as f64 / 1e6,
    );
    line(
        "mock_worker_busy_squared_seconds2_total",
        "counter",
        "Sum of each engine step's modelled time squared (s^2).",
        c.busy_squared_ms2 / 1e6,
    );
    line(
        "mock_worker_prefill_tokens_total",
        "counter",
        "Tokens computed by prefill.",
        c.prefill_tokens as f64,
    );
    line(
        "mock_worker_generated_tokens_total",
        "counter",
        "Tokens generated.",
        c.generated_tokens as f64,
    );
    line(
        "mock_worker_preemptions_total",
        "counter",
        "Sequences preempted for lack of KV blocks.",
        c.preemptions as f64,
    );
    line(
        "mock_worker_kv_events_last_id",
        "gauge",
        "Id of the newest KV event.",
        m.last_event_id as f64,
    );
    line(
        "mock_worker_first_token_seconds_total",
        "counter",
        "Sum of server-side times to first token (complete request to first text written).",
        w.first_token_ns.load(Ordering::Relaxed) as f64 / 1e9,
    );
    line(
        "mock_worker_first_tokens_total",
        "counter",
        "First tokens sent (the count of the sum above).",
        w.first_tokens.load(Ordering::Relaxed) as f64,
    );
    if let Backend::Engine(e) = &w.backend {
        if let Some(p) = e.publisher() {
            let c = &p.counters;
            let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
            line(
                "mock_worker_kv_zmq_batches_total",
                "counter",
                "KV event batches published on ZMQ (the next sequence number).",
                get(&c.batches),
            );
            line(
                "mock_worker_kv_zmq_live_dropped_total",
                "counter",
                "Batches not sent live because the send queue was full (still replayable).",
                get(&c.live_dropped),
            );
            line(
                "mock_worker_kv_zmq_replays_total",
                "counter",
                "Replay requests answered.",
                get(&c.replays),
            );
            line(
                "mock_worker_kv_zmq_connections_total",
                "counter",
                "Connections the KV event PUB socket accepted (subscribers).",
                get(&c.connections),
            );
            line(
                "mock_worker_kv_zmq_encode_errors_total",
                "counter",
                "Batches that could not be encoded (not published).",
                get(&c.encode_errors),
            );
        }
    }
    if let Ok(u) = crate::sys::usage() {
        line(
            "process_cpu_seconds_total",
            "counter",
            "User and system CPU time of the worker process.",
            u.cpu().as_secs_f64(),
        );
    }
    // vLLM-compatible names for dashboards that expect them.
    line(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "KV usage (vLLM name).",
        m.kv_usage,
    );
    line(
        "vllm:num_requests_running",
        "gauge",
        "Running requests (vLLM name).",
        running,
    );
    line(
        "vllm:num_requests_waiting",
        "gauge",
        "Waiting requests (vLLM name).",
        m.num_waiting as f64,
    );
    line(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache query tokens (vLLM name).",
        c.prefix_queries_tokens as f64,
    );
    line(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hit tokens (vLLM name).",
        c.prefix_hit_tokens as f64,
    );
    if engine {
        // vLLM's info gauge: the cache's settings as labels (what `calibrate` reads the KV
        // capacity from).
        snapshot.add_labelled(
            "vllm:cache_config_info",
            "gauge",
            "Information of the KV cache config.",
            1.0,
            &[
                ("block_size", m.block_size.to_string()),
                ("num_gpu_blocks", m.capacity_blocks.to_string()),
            ],
        );
    }
    snapshot.encode()
}
