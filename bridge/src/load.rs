//! The engine's own load, scraped from its Prometheus `/metrics`, for the page's `load` object.
//!
//! vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`
//! (a fraction 0..1 despite the name; older versions: `vllm:gpu_cache_usage_perc`).
//! SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`.
//! Series of several engines (DP ranks, label `engine="N"`) and of several scraped URLs add up;
//! the cache usage is their mean. [`run_models`] reads its `/v1/models` into the page's `worker`
//! description ([`crate::describe`]).

use std::sync::Arc;
use std::time::Duration;

use log::{debug, warn};

use crate::state::Shared;
use kv_router_protocol::page::Load;
use kv_router_protocol::prom::Scrape;

const WAITING: &[&str] = &["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const RUNNING: &[&str] = &["vllm:num_requests_running", "sglang:num_running_reqs"];
const USAGE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// Sums of the load series found in one or more scrapes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadSums {
    pub waiting: f64,
    pub running: f64,
    pub usage_sum: f64,
    pub usage_series: u32,
    /// Any of the request-count series was present.
    pub found: bool,
}

impl LoadSums {
    pub fn add(&mut self, other: &LoadSums) {
        self.waiting += other.waiting;
        self.running += other.running;
        self.usage_sum += other.usage_sum;
        self.usage_series += other.usage_series;
        self.found |= other.found;
    }

    pub fn to_load(self) -> Option<Load> {
        if !self.found {
            return None;
        }
        let count = |v: f64| {
            if v.is_finite() && v > 0.0 {
                v.round().min(f64::from(u32::MAX)) as u32
            } else {
                0
            }
        };
        let usage = if self.usage_series > 0 {
            self.usage_sum / f64::from(self.usage_series)
        } else {
            0.0
        };
        Some(Load {
            num_waiting: count(self.waiting),
            num_running: count(self.running),
            kv_usage: if usage.is_finite() {
                usage.max(0.0)
            } else {
                0.0
            },
            other_routers: None,
        })
    }
}

/// Reads the load series from a Prometheus text exposition (non-finite samples left out).
pub fn parse_metrics(text: &str) -> LoadSums {
    let scrape = Scrape::parse(text);
    let finite = |names: &'static [&'static str]| {
        names
            .iter()
            .flat_map(|name| scrape.values(name))
            .filter(|v| v.is_finite())
            .collect::<Vec<f64>>()
    };
    let (waiting, running, usage) = (finite(WAITING), finite(RUNNING), finite(USAGE));
    // Versions that export both usage names export the same value twice: the mean is unchanged.
    LoadSums {
        waiting: waiting.iter().sum(),
        running: running.iter().sum(),
        usage_sum: usage.iter().sum(),
        usage_series: u32::try_from(usage.len()).unwrap_or(u32::MAX),
        found: !(waiting.is_empty() && running.is_empty()),
    }
}

/// Scrapes every URL each `interval` and publishes the combined load.
pub async fn run(shared: Arc<Shared>, urls: Vec<String>, interval: Duration, timeout: Duration) {
    let client = match reqwest::Client::builder().timeout(timeout).build() {
        Ok(c) => c,
        Err(e) => {
            warn!("engine metrics: cannot build the HTTP client: {e}; no load reported");
            return;
        }
    };
    every(&shared, interval, || async {
        let mut sums = LoadSums::default();
        let mut all_ok = true;
        for url in &urls {
            match scrape(&client, url).await {
                Ok(text) => {
                    let found = parse_metrics(&text);
                    let learned = crate::describe::learn_from_metrics(&text);
                    if !learned.is_empty() {
                        shared.set_worker_learned(learned);
                    }
                    if !found.found {
                        debug!("engine metrics: {url} has no request-count series");
                    }
                    sums.add(&found);
                    shared
                        .metrics
                        .inc("kv_bridge_load_scrapes_total", &[("result", "ok")]);
                }
                Err(e) => {
                    all_ok = false;
                    shared
                        .metrics
                        .inc("kv_bridge_load_scrapes_total", &[("result", "failed")]);
                    debug!("engine metrics: scrape of {url} failed: {e}");
                }
            }
        }
        // A partial sum would under-report load: report only complete scrapes (an old value
        // expires after `load_max_age`).
        if all_ok {
            shared.set_load(sums.to_load());
        }
    })
    .await;
}

/// Runs `tick` every `interval` (a late tick delays the next) until the bridge shuts down.
async fn every<F, Fut>(shared: &Shared, interval: Duration, mut tick: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut shutdown = shared.shutdown_watch();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.wait_for(|&s| s) => return,
        }
        tick().await;
    }
}

async fn scrape(client: &reqwest::Client, url: &str) -> Result<String, String> {
    let response = client.get(url).send().await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    response.text().await.map_err(|e| e.to_string())
}

/// Reads the engine's `/v1/models` every `interval` into the description's `models`.
pub async fn run_models(shared: Arc<Shared>, url: String, interval: std::time::Duration) {
    let client = match reqwest::Client::builder()
        .timeout(interval.max(std::time::Duration::from_millis(500)))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            log::warn!("engine models: cannot build the HTTP client: {e}; no models reported");
            return;
        }
    };
    every(&shared, interval, || async {
        let reply = async {
            let r = client.get(&url).send().await.map_err(|e| e.to_string())?;
            if !r.status().is_success() {
                return Err(format!("HTTP {}", r.status()));
            }
            r.text().await.map_err(|e| e.to_string())
        };
        match reply
            .await
            .and_then(|body| crate::describe::parse_models(&body))
        {
            Ok(models) => shared.set_worker_models(models),
            Err(e) => log::debug!("engine models: {url}: {e}"),
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics_with_two_engines() {
        let text = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="a } b \" c"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.25
vllm:num_requests_running_created{engine="0"} 1.7e9
vllm:prompt_tokens_total{engine="0"} 100.0
"#;
        let load = parse_metrics(text).to_load().unwrap();
        assert_eq!(
            load,
            Load {
                num_waiting: 2,
                num_running: 4,
                kv_usage: 0.375,
                other_routers: None,
            }
        );
    }

    #[test]
    fn older_and_sglang_names_and_absence() {
        let old = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.1 1700000000\n";
        assert_eq!(
            parse_metrics(old).to_load(),
            Some(Load {
                num_waiting: 0,
                num_running: 1,
                kv_usage: 0.1,
                other_routers: None,
            })
        );
        let sglang = "sglang:num_running_reqs{tp_rank=\"0\"} 5\nsglang:num_queue_reqs{tp_rank=\"0\"} 7\nsglang:token_usage{tp_rank=\"0\"} 0.9\n";
        assert_eq!(
            parse_metrics(sglang).to_load(),
            Some(Load {
                num_waiting: 7,
                num_running: 5,
                kv_usage: 0.9,
                other_routers: None,
            })
        );
        assert_eq!(
            parse_metrics("process_cpu_seconds_total 3\n").to_load(),
            None
        );
        // A non-finite sample is left out, not summed into the load.
        let nan = "vllm:num_requests_running 2\nvllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.5\n";
        assert_eq!(
            parse_metrics(nan).to_load(),
            Some(Load {
                num_waiting: 0,
                num_running: 2,
                kv_usage: 0.5,
                other_routers: None,
            })
        );
    }
}
