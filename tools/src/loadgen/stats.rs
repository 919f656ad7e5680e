//! What a run measured: per-request results summed up ([`RunStats`], [`Summary`]), and the mock
//! workers' counters scraped from `/metrics` before and after a run (prefix-cache hits,
//! server-side time to first token, worker CPU).

use std::io;
use std::time::Duration;

use serde_json::{json, Value};

use crate::client;
use crate::prom::Scrape;
use crate::util::{histogram, mean, quantile_of};

/// What happened to one request.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RequestResult {
    pub index: usize,
    pub ok: bool,
    pub status: u16,
    pub error: Option<String>,
    /// Offset of the send from the start of the run.
    pub sent_at_ms: f64,
    /// How late the send was relative to the scheduled arrival (timed workloads).
    pub send_delay_ms: f64,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Vec<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` when reported.
    pub cached_tokens: Option<usize>,
    /// The `x-worker-id` response header.
    pub worker_id: Option<String>,
    /// The filter's `x-kv-router-overlap-blocks` and `x-kv-router-max-overlap-blocks` (with
    /// `response_headers` on): the chosen worker's overlap and the longest one in its index.
    pub router_overlap_blocks: Option<u32>,
    pub router_max_overlap_blocks: Option<u32>,
    /// The filter's `x-kv-router-worker` and `x-kv-router-loads` (every candidate's booked
    /// prefill tokens, requests in flight and overlap as the decision saw them).
    pub router_worker: Option<String>,
    pub router_loads: Option<String>,
}

/// Prefix-cache counters summed over mock workers (`/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheCounters {
    pub query_tokens: f64,
    pub hit_tokens: f64,
    pub host_hit_tokens: f64,
}

impl CacheCounters {
    /// Device hit rate since the start of the workers.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.query_tokens > 0.0).then(|| self.hit_tokens / self.query_tokens)
    }

    /// Counters accumulated since `before`.
    pub fn since(&self, before: &CacheCounters) -> CacheCounters {
        CacheCounters {
            query_tokens: self.query_tokens - before.query_tokens,
            hit_tokens: self.hit_tokens - before.hit_tokens,
            host_hit_tokens: self.host_hit_tokens - before.host_hit_tokens,
        }
    }
}

/// Counters of mock workers or vLLM engines, summed over the fleet (`GET /metrics`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerCounters {
    pub cache: CacheCounters,
    /// Sum of server-side times to first token (request complete to first text written).
    pub first_token_s: f64,
    pub first_tokens: f64,
    /// CPU time of the worker processes.
    pub cpu_s: f64,
    /// Modelled engine time of the steps' prefill share (beyond their decodes alone), and of
    /// whole steps (mock engines).
    pub prefill_busy_s: f64,
    pub busy_s: f64,
    /// Sum of the steps' modelled times squared (mock engines), s^2.
    pub busy_squared_s2: f64,
    /// Workers scraped.
    pub workers: f64,
    /// Requests each worker finished, in scrape order (vLLM engines: their responses name no
    /// worker, so the spread of requests over them comes from here).
    pub finished_requests: Vec<f64>,
}

impl WorkerCounters {
    /// Adds one worker's `/metrics` text.
    pub fn add_metrics_text(&mut self, text: &str) {
        let scrape = Scrape::parse(text);
        let v = |name: &str| scrape.sum(name, &[]).unwrap_or(0.0);
        // A mock worker's names (it also exports vLLM's, for the bridge), else a vLLM engine's;
        // both count prompt tokens.
        let either = |mock: &str, vllm: &str| {
            scrape
                .sum(mock, &[])
                .or_else(|| scrape.sum(vllm, &[]))
                .unwrap_or(0.0)
        };
        self.cache.query_tokens += either(
            "mock_worker_prefix_cache_queries_tokens_total",
            "vllm:prefix_cache_queries_total",
        );
        self.cache.hit_tokens += either(
            "mock_worker_prefix_cache_hits_tokens_total",
            "vllm:prefix_cache_hits_total",
        );
        self.cache.host_hit_tokens += v("mock_worker_prefix_cache_host_hits_tokens_total");
        self.first_token_s += v("mock_worker_first_token_seconds_total");
        self.first_tokens += v("mock_worker_first_tokens_total");
        self.cpu_s += v("process_cpu_seconds_total");
        self.prefill_busy_s += v("mock_worker_prefill_busy_seconds_total");
        self.busy_s += v("mock_worker_busy_seconds_total");
        self.busy_squared_s2 += v("mock_worker_busy_squared_seconds2_total");
        self.workers += 1.0;
        self.finished_requests.push(v("vllm:request_success_total"));
    }

    /// Counters accumulated since `before`.
    pub fn since(&self, before: &WorkerCounters) -> WorkerCounters {
        WorkerCounters {
            cache: self.cache.since(&before.cache),
            first_token_s: self.first_token_s - before.first_token_s,
            first_tokens: self.first_tokens - before.first_tokens,
            cpu_s: self.cpu_s - before.cpu_s,
            prefill_busy_s: self.prefill_busy_s - before.prefill_busy_s,
            busy_s: self.busy_s - before.busy_s,
            busy_squared_s2: self.busy_squared_s2 - before.busy_squared_s2,
            workers: self.workers,
            finished_requests: self
                .finished_requests
                .iter()
                .zip(
                    before
                        .finished_requests
                        .iter()
                        .chain(std::iter::repeat(&0.0)),
                )
                .map(|(a, b)| a - b)
                .collect(),
        }
    }

    /// Mean server-side time to first token in ms.
    pub fn mean_first_token_ms(&self) -> Option<f64> {
        (self.first_tokens > 0.0).then(|| self.first_token_s * 1000.0 / self.first_tokens)
    }
}

fn check_status(addr: &str, status: u16) -> io::Result<()> {
    if status == 200 {
        Ok(())
    } else {
        Err(io::Error::other(format!("{addr}/metrics: status {status}")))
    }
}

/// Reads and sums the counters of mock workers (blocking; not from inside an async task).
pub fn scrape_workers(worker_addrs: &[String]) -> io::Result<WorkerCounters> {
    let mut c = WorkerCounters::default();
    for addr in worker_addrs {
        let r = client::request(addr, "GET", "/metrics", &[], &[], Duration::from_secs(5))?;
        check_status(addr, r.status)?;
        c.add_metrics_text(&r.text());
    }
    Ok(c)
}

/// [`scrape_workers`] from async code.
pub async fn scrape_workers_async(
    http: &reqwest::Client,
    worker_addrs: &[String],
) -> io::Result<WorkerCounters> {
    let mut c = WorkerCounters::default();
    for addr in worker_addrs {
        let url = format!("{}/metrics", client::base_url(addr));
        let r = http
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(client::to_io_error)?;
        check_status(addr, r.status().as_u16())?;
        c.add_metrics_text(&r.text().await.map_err(client::to_io_error)?);
    }
    Ok(c)
}

/// Reads and sums the prefix-cache counters of mock workers (`GET /metrics`; blocking).
pub fn scrape_hit_rate(worker_addrs: &[String]) -> io::Result<CacheCounters> {
    scrape_workers(worker_addrs).map(|c| c.cache)
}

/// Distribution summary in milliseconds (or any unit).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// The mean and maximum exact, the percentiles from an HDR histogram (microsecond
    /// resolution for milliseconds, 3 significant digits).
    pub fn of(values: &[f64]) -> Summary {
        let v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        let Some(h) = histogram(&v) else {
            return Summary {
                count: 0,
                mean: f64::NAN,
                p50: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
            };
        };
        Summary {
            count: v.len(),
            mean: mean(&v).unwrap_or(f64::NAN),
            p50: quantile_of(&h, 50.0),
            p90: quantile_of(&h, 90.0),
            p99: quantile_of(&h, 99.0),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    pub fn to_json(&self) -> Value {
        let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({"count": self.count, "mean": f(self.mean), "p50": f(self.p50), "p90": f(self.p90),
               "p99": f(self.p99), "max": f(self.max)})
    }
}

/// Everything measured in one run.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    pub workload: String,
    pub results: Vec<RequestResult>,
    pub wall_s: f64,
    /// Worker counters accumulated during the run (when workers were given).
    pub workers: Option<WorkerCounters>,
    pub client: ClientUsage,
}

/// The load generator's own resources during a run and the concurrency it achieved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClientUsage {
    /// User + system CPU time of the load generator process during the run.
    pub cpu_s: f64,
    /// Peak resident memory of the process (at the end of the run).
    pub max_rss_bytes: u64,
    /// Most requests in flight at once (sent, not finished).
    pub peak_in_flight: usize,
    /// Most responses streaming at once (head received, body not finished).
    pub peak_open_streams: usize,
    /// How late the client's runtime woke a sleeping task (sampled every 10 ms, timer
    /// granularity included): SSE arrival stamps can be late by as much.
    pub runtime_lag_ms: Summary,
}

impl RunStats {
    fn ok(&self) -> impl Iterator<Item = &RequestResult> {
        self.results.iter().filter(|r| r.ok)
    }

    pub fn completed(&self) -> usize {
        self.ok().count()
    }

    pub fn errors(&self) -> usize {
        self.results.len() - self.completed()
    }

    pub fn ttft(&self) -> Summary {
        Summary::of(&self.ok().filter_map(|r| r.ttft_ms).collect::<Vec<_>>())
    }

    pub fn itl(&self) -> Summary {
        Summary::of(
            &self
                .ok()
                .flat_map(|r| r.itl_ms.iter().copied())
                .collect::<Vec<_>>(),
        )
    }

    pub fn e2e(&self) -> Summary {
        Summary::of(&self.ok().map(|r| r.e2e_ms).collect::<Vec<_>>())
    }

    pub fn requests_per_s(&self) -> f64 {
        self.completed() as f64 / self.wall_s.max(1e-9)
    }

    pub fn output_tokens_per_s(&self) -> f64 {
        self.ok().map(|r| r.output_tokens).sum::<usize>() as f64 / self.wall_s.max(1e-9)
    }

    /// Cached prompt tokens / prompt tokens, from the responses' usage.
    pub fn reported_cache_fraction(&self) -> Option<f64> {
        let (mut cached, mut total) = (0usize, 0usize);
        for r in self.ok() {
            if let Some(c) = r.cached_tokens {
                cached += c;
                total += r.prompt_tokens;
            }
        }
        (total > 0).then(|| cached as f64 / total as f64)
    }

    /// Worker prefix-cache counters accumulated during the run.
    pub fn cache(&self) -> Option<CacheCounters> {
        self.workers.as_ref().map(|w| w.cache)
    }

    /// Mean number of requests in flight over the run (Little's law: total request time / wall).
    pub fn mean_in_flight(&self) -> f64 {
        self.results.iter().map(|r| r.e2e_ms).sum::<f64>() / 1000.0 / self.wall_s.max(1e-9)
    }

    /// The load generator's CPU use as a percentage of one core.
    pub fn client_cpu_percent(&self) -> f64 {
        self.client.cpu_s * 100.0 / self.wall_s.max(1e-9)
    }

    /// Span of the sends: from the run's start to the last send, s (the arrival window).
    pub fn send_span_s(&self) -> f64 {
        self.results
            .iter()
            .map(|r| r.sent_at_ms)
            .fold(0.0, f64::max)
            / 1000.0
    }

    /// Mock fleet utilization over the arrival window: modelled engine time of the prefill
    /// terms, and of whole steps, divided by workers x [`RunStats::send_span_s`]. `None` without
    /// worker counters or sends.
    pub fn fleet_utilization(&self) -> Option<(f64, f64)> {
        let w = self.workers.as_ref()?;
        let denom = w.workers * self.send_span_s();
        (denom > 0.0 && w.busy_s > 0.0).then(|| (w.prefill_busy_s / denom, w.busy_s / denom))
    }

    /// The mean wait, in ms, of a request that arrives while an engine runs a step, for that
    /// step to end (`sum S^2 / (2 sum S)` over the fleet's steps, the residual of a renewal
    /// process). On engines busy all the time every arrival waits this long on average before
    /// its prefill can start, whichever worker a router picks: a floor of the TTFT's queueing.
    /// `None` without mock engine counters.
    pub fn step_wait_ms(&self) -> Option<f64> {
        let w = self.workers.as_ref()?;
        (w.busy_s > 0.0 && w.busy_squared_s2 > 0.0)
            .then(|| w.busy_squared_s2 / (2.0 * w.busy_s) * 1000.0)
    }

    /// Mean server-side time to first token (workers' `/metrics`), ms.
    pub fn server_ttft_mean_ms(&self) -> Option<f64> {
        self.workers
            .as_ref()
            .and_then(WorkerCounters::mean_first_token_ms)
    }

    /// Client-measured mean TTFT minus the server-side mean: what the network path, the client
    /// and the measurement add.
    pub fn ttft_overhead_ms(&self) -> Option<f64> {
        let client = self.ttft().mean;
        let server = self.server_ttft_mean_ms()?;
        client.is_finite().then_some(client - server)
    }

    /// Worker prefix-cache hit rate during the run (from `/metrics`), else the usage-based one.
    pub fn hit_rate(&self) -> Option<f64> {
        self.cache()
            .and_then(|c| c.hit_rate())
            .or_else(|| self.reported_cache_fraction())
    }

    /// Completed requests per `x-worker-id`, sorted by id.
    pub fn per_worker(&self) -> Vec<(String, usize)> {
        let mut m: std::collections::BTreeMap<String, usize> = Default::default();
        let named = self.ok().any(|r| r.worker_id.is_some());
        if let (false, Some(w)) = (named, &self.workers) {
            // No response named its worker (real engines): the workers' own counts.
            if w.finished_requests.iter().any(|n| *n > 0.0) {
                return (1..)
                    .zip(&w.finished_requests)
                    .map(|(i, n)| (format!("worker {i}"), n.max(0.0) as usize))
                    .collect();
            }
        }
        for r in self.ok() {
            *m.entry(r.worker_id.clone().unwrap_or_else(|| "?".into()))
                .or_default() += 1;
        }
        m.into_iter().collect()
    }

    /// The first few distinct error messages with counts.
    pub fn error_summary(&self) -> Vec<(String, usize)> {
        let mut m: std::collections::BTreeMap<String, usize> = Default::default();
        for r in self.results.iter().filter(|r| !r.ok) {
            *m.entry(r.error.clone().unwrap_or_default()).or_default() += 1;
        }
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }

    pub fn summary_json(&self) -> Value {
        json!({
            "workload": self.workload,
            "requests": self.results.len(),
            "completed": self.completed(),
            "errors": self.errors(),
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s(),
            "output_tokens_per_s": self.output_tokens_per_s(),
            "ttft_ms": self.ttft().to_json(),
            "itl_ms": self.itl().to_json(),
            "e2e_ms": self.e2e().to_json(),
            "hit_rate": self.hit_rate(),
            "reported_cache_fraction": self.reported_cache_fraction(),
            "per_worker": self.per_worker().into_iter().collect::<std::collections::BTreeMap<_, _>>(),
            "error_kinds": self.error_summary().into_iter().take(5).collect::<Vec<_>>(),
            "concurrency": {
                "peak_in_flight": self.client.peak_in_flight,
                "peak_open_streams": self.client.peak_open_streams,
                "mean_in_flight": self.mean_in_flight(),
            },
            "client": {
                "cpu_s": self.client.cpu_s,
                "cpu_percent_of_one_core": self.client_cpu_percent(),
                "max_rss_mb": self.client.max_rss_bytes as f64 / (1 << 20) as f64,
                "runtime_lag_ms": self.client.runtime_lag_ms.to_json(),
            },
            "server_ttft_mean_ms": self.server_ttft_mean_ms(),
            "ttft_overhead_ms": self.ttft_overhead_ms(),
            "workers_cpu_s": self.workers.as_ref().map(|w| w.cpu_s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_counters_read_mock_and_vllm_names() {
        let mut c = WorkerCounters::default();
        c.add_metrics_text(
            "mock_worker_prefix_cache_queries_tokens_total{worker_id=\"1\"} 100\n\
             vllm:prefix_cache_queries_total{worker_id=\"1\"} 100\n\
             mock_worker_prefix_cache_hits_tokens_total{worker_id=\"1\"} 40\n",
        );
        c.add_metrics_text(
            "# TYPE vllm:prefix_cache_queries_total counter\n\
             vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 50.0\n\
             vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 10.0\n\
             vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 7.0\n",
        );
        assert_eq!(c.cache.query_tokens, 150.0);
        assert_eq!(c.cache.hit_tokens, 50.0);
        assert_eq!(c.workers, 2.0);
        assert_eq!(c.finished_requests, vec![0.0, 7.0]);
    }
}
