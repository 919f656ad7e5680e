//! Command-line flags.

use kv_router_protocol::worker::{Device, WorkerDescription};
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::core::CoreLimits;
use crate::engine::{EngineSpec, EngineTiming};
use crate::http::HttpLimits;
use kv_router_protocol::ring::PageLimits;
use kv_router_protocol::vllm::DEFAULT_MAX_PAYLOAD_BYTES;

/// Bridges vLLM / SGLang KV-cache events (ZMQ PUB, msgpack) to the HTTP event page that the
/// envoy-kv-router filter polls (`GET /kv/events?after=N`, `GET /kv/dump`).
#[derive(Clone, Debug, Parser)]
#[command(name = "kv-event-bridge", version)]
pub struct Args {
    /// The engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557. Repeat once per DP rank
    /// that publishes on its own socket (vLLM and SGLang offset the port by the rank).
    #[arg(long = "engine", required = true, value_name = "ENDPOINT")]
    pub engines: Vec<String>,

    /// The engine's replay ROUTER endpoint, paired with --engine by position ("none" to skip
    /// one). Without it, a lost batch clears that rank's blocks instead of being replayed.
    #[arg(long = "replay", value_name = "ENDPOINT")]
    pub replays: Vec<String>,

    /// DP rank of the --engine at the same position. Default: the rank the batches carry,
    /// else the position.
    #[arg(long = "dp-rank", value_name = "RANK")]
    pub dp_ranks: Vec<u32>,

    /// ZMQ topic the engine publishes under ("" = any). Any by default: vLLM publishes under
    /// "" unless its `kv-events-config` names a topic, and a subscription to one topic drops
    /// every message of another without a trace.
    #[arg(long, default_value = "")]
    pub topic: String,

    /// Address of the HTTP server.
    #[arg(long, default_value = "0.0.0.0:8200")]
    pub listen: SocketAddr,

    /// The engine's KV block size (tokens). Stored events of another size are refused loudly;
    /// it must equal the filter's `block_size`.
    #[arg(long)]
    pub block_size: u32,

    /// The engine's Prometheus endpoint, for the page's `load` (repeatable; values add up).
    #[arg(long = "engine-metrics-url", value_name = "URL")]
    pub engine_metrics_urls: Vec<String>,

    /// How often the engine metrics are scraped.
    #[arg(long, default_value_t = 1000)]
    pub engine_metrics_interval_ms: u64,

    /// Events buffered for the page; a poller further behind re-syncs from the dump.
    #[arg(long, default_value_t = 65536)]
    pub max_events: usize,

    /// Bytes of events buffered for the page.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_event_bytes: usize,

    /// Events per page at most (a poller asking for fewer with `&limit=` gets fewer). Large
    /// pages mean fewer sequential round trips for the filter; `--page-max-bytes` bounds them.
    #[arg(long, default_value_t = 10_000)]
    pub page_max_events: usize,

    /// Bytes of events per page at most (stay below the filter's events.max_response_bytes).
    #[arg(long, default_value_t = 2 << 20)]
    pub page_max_bytes: usize,

    /// Blocks the mirror holds at most, over every rank and medium. Set it to at least the
    /// engines' total cache size; stores beyond it are refused loudly.
    #[arg(long, default_value_t = 262144)]
    pub max_blocks: usize,

    /// Cap on a long poll (`/kv/events?after=N&wait_ms=M`).
    #[arg(long, default_value_t = 30000)]
    pub max_wait_ms: u64,

    /// Probe a live stream silent this long (the zeromq crate does not report a publisher
    /// that went away); a dead one is reconnected, and the reconnection verifies the engine's
    /// history. A restarted engine is noticed within about two periods.
    #[arg(long, default_value_t = 5000)]
    pub idle_probe_ms: u64,

    #[arg(long, default_value_t = 5000)]
    pub connect_timeout_ms: u64,

    /// Time allowed for each reply of a replay.
    #[arg(long, default_value_t = 5000)]
    pub replay_timeout_ms: u64,

    /// Batches one replay may return at most (vLLM buffers 10000).
    #[arg(long, default_value_t = 100000)]
    pub replay_max_batches: usize,

    /// Id of the first event: a number, or `time` (microseconds since the Unix epoch at start).
    /// With `time`, a restarted bridge's ids start past its predecessor's, so a poller holding
    /// an old cursor sees `first_event_id > after + 1` and re-syncs from the dump; with small
    /// ids it could mistake the new ids for the old sequence once they pass its cursor.
    /// Default `time`: a restarted sidecar must never be mistaken for its predecessor.
    #[arg(long, default_value = "time")]
    pub first_event_id: FirstEventId,

    /// The worker's description on the page (`worker`): its first DP rank...
    #[arg(long = "worker-dp-start", value_name = "RANK")]
    pub worker_dp_start: Option<u32>,
    /// ...its DP ranks...
    #[arg(long = "worker-dp-size", value_name = "N")]
    pub worker_dp_size: Option<u32>,
    /// ...its device (`gpu` or `cpu`)...
    #[arg(long = "worker-device", value_parser = ["gpu", "cpu"])]
    pub worker_device: Option<String>,
    /// ...its KV capacity per DP rank in blocks (default: vLLM's `num_gpu_blocks` from the
    /// engine metrics)...
    #[arg(long = "worker-kv-capacity-blocks", value_name = "BLOCKS")]
    pub worker_kv_capacity_blocks: Option<u32>,
    /// ...its batch budget per DP rank...
    #[arg(long = "worker-max-num-batched-tokens", value_name = "TOKENS")]
    pub worker_max_num_batched_tokens: Option<u32>,
    /// ...the models it serves (repeatable; default: the ids of `--engine-models-url`)...
    #[arg(long = "worker-model", value_name = "MODEL")]
    pub worker_models: Vec<String>,
    /// ...its engine's prefill time in ms per step by tokens, lowest degree first (what
    /// `calibrate` prints as `load.prefill_time_ms_poly`; the filter's TTFT policy prices this
    /// worker with it)...
    #[arg(
        long = "worker-prefill-time-ms-poly",
        value_name = "C0,C1,..",
        value_delimiter = ',',
        allow_hyphen_values = true
    )]
    pub worker_prefill_time_ms_poly: Vec<f64>,
    /// ...and its decode step time in ms by KV fill (`calibrate`'s `ttft.decode_step_ms_poly`).
    #[arg(
        long = "worker-decode-step-ms-poly",
        value_name = "D0,D1,..",
        value_delimiter = ',',
        allow_hyphen_values = true
    )]
    pub worker_decode_step_ms_poly: Vec<f64>,

    /// The engine's OpenAI `/v1/models`, read every `--engine-metrics-interval-ms` for the
    /// description's `models`.
    #[arg(long = "engine-models-url", value_name = "URL")]
    pub engine_models_url: Option<String>,

    /// Largest payload frame decoded.
    #[arg(long, default_value_t = DEFAULT_MAX_PAYLOAD_BYTES)]
    pub max_payload_bytes: usize,
}

/// `--first-event-id`: a fixed id or the start time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstEventId {
    Fixed(u64),
    Time,
}

impl std::str::FromStr for FirstEventId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "time" {
            return Ok(FirstEventId::Time);
        }
        match s.parse::<u64>() {
            // Below 2^53 so that JSON readers with f64 numbers keep every id exact.
            Ok(n) if (1..1u64 << 53).contains(&n) => Ok(FirstEventId::Fixed(n)),
            _ => Err(format!("`{s}`: expected `time` or an id in 1..2^53")),
        }
    }
}

impl FirstEventId {
    pub fn resolve(self) -> u64 {
        match self {
            FirstEventId::Fixed(n) => n,
            FirstEventId::Time => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(1).max(1)),
        }
    }
}

/// Everything the bridge needs, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct BridgeConfig {
    pub listen: SocketAddr,
    pub engines: Vec<EngineSpec>,
    pub core: CoreLimits,
    pub http: HttpLimits,
    pub timing: EngineTiming,
    pub engine_metrics_urls: Vec<String>,
    pub engine_metrics_interval: Duration,
    /// The page's `worker` description from the `--worker-*` flags (they win over what the
    /// engine metrics say).
    pub worker: WorkerDescription,
    /// `--engine-models-url`.
    pub engine_models_url: Option<String>,
}

impl Args {
    pub fn into_config(self) -> Result<BridgeConfig, String> {
        if self.block_size == 0 {
            return Err("--block-size must be positive".to_owned());
        }
        if self.replays.len() > self.engines.len() {
            return Err(format!(
                "{} --replay for {} --engine: pair each replay endpoint with an engine",
                self.replays.len(),
                self.engines.len()
            ));
        }
        if self.dp_ranks.len() > self.engines.len() {
            return Err(format!(
                "{} --dp-rank for {} --engine",
                self.dp_ranks.len(),
                self.engines.len()
            ));
        }
        for endpoint in self
            .engines
            .iter()
            .chain(self.replays.iter().filter(|r| *r != "none"))
        {
            check_endpoint(endpoint)?;
        }
        for (flag, poly) in [
            (
                "--worker-prefill-time-ms-poly",
                &self.worker_prefill_time_ms_poly,
            ),
            (
                "--worker-decode-step-ms-poly",
                &self.worker_decode_step_ms_poly,
            ),
        ] {
            // Unset (empty) is allowed; anything else follows the filter's own rule.
            if !poly.is_empty() && !kv_router_core::config::is_timing_poly(poly) {
                return Err(format!(
                    "{flag}: 1 to {} finite coefficients, lowest degree first (got {poly:?})",
                    kv_router_core::config::MAX_POLY_COEFFICIENTS
                ));
            }
        }
        let mut ranks: Vec<u32> = self.dp_ranks.clone();
        ranks.sort_unstable();
        if ranks.windows(2).any(|w| w.first() == w.get(1)) {
            return Err("--dp-rank values must differ".to_owned());
        }
        if self.page_max_events == 0 || self.max_events == 0 || self.max_blocks == 0 {
            return Err(
                "--page-max-events, --max-events and --max-blocks must be positive".to_owned(),
            );
        }
        let engines = self
            .engines
            .iter()
            .enumerate()
            .map(|(index, endpoint)| EngineSpec {
                index,
                endpoint: endpoint.clone(),
                replay: self
                    .replays
                    .get(index)
                    .filter(|r| *r != "none" && !r.is_empty())
                    .cloned(),
                topic: self.topic.clone(),
                dp_rank: self.dp_ranks.get(index).copied(),
            })
            .collect();
        let ms = Duration::from_millis;
        Ok(BridgeConfig {
            listen: self.listen,
            engines,
            core: CoreLimits {
                block_size: self.block_size,
                first_event_id: self.first_event_id.resolve(),
                max_blocks: self.max_blocks,
                max_events: self.max_events,
                max_ring_bytes: self.max_event_bytes,
            },
            http: HttpLimits {
                page: PageLimits {
                    max_events: self.page_max_events,
                    max_bytes: self.page_max_bytes,
                },
                max_wait: ms(self.max_wait_ms),
            },
            timing: EngineTiming {
                connect_timeout: ms(self.connect_timeout_ms.max(1)),
                idle_probe: ms(self.idle_probe_ms.max(10)),
                replay_timeout: ms(self.replay_timeout_ms.max(1)),
                replay_max_batches: self.replay_max_batches,
                max_payload_bytes: self.max_payload_bytes,
                reconnect_backoff_max: Duration::from_secs(2),
            },
            engine_metrics_urls: self.engine_metrics_urls,
            engine_models_url: self.engine_models_url,
            worker: WorkerDescription {
                block_size: Some(self.block_size),
                dp_start: self.worker_dp_start,
                dp_size: self.worker_dp_size,
                // The value parser admits only these two.
                device: self.worker_device.as_deref().and_then(|d| match d {
                    "gpu" => Some(Device::Gpu),
                    "cpu" => Some(Device::Cpu),
                    _ => None,
                }),
                kv_capacity_blocks: self.worker_kv_capacity_blocks,
                max_num_batched_tokens: self.worker_max_num_batched_tokens,
                models: (!self.worker_models.is_empty()).then_some(self.worker_models),
                prefill_time_ms_poly: (!self.worker_prefill_time_ms_poly.is_empty())
                    .then_some(self.worker_prefill_time_ms_poly),
                decode_step_ms_poly: (!self.worker_decode_step_ms_poly.is_empty())
                    .then_some(self.worker_decode_step_ms_poly),
            },
            engine_metrics_interval: ms(self.engine_metrics_interval_ms.max(10)),
        })
    }
}

/// The bridge connects, so an endpoint needs a host: `tcp://*:5557` is the engine's side.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        if rest.starts_with('*') {
            return Err(format!(
                "{endpoint}: the engine binds `*`; the bridge must connect to a host, e.g. tcp://127.0.0.1:{}",
                rest.rsplit(':').next().unwrap_or("5557")
            ));
        }
        if !rest.contains(':') {
            return Err(format!("{endpoint}: missing port"));
        }
        Ok(())
    } else if endpoint.starts_with("ipc://") {
        Ok(())
    } else {
        Err(format!(
            "{endpoint}: expected tcp://HOST:PORT or ipc://PATH"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<BridgeConfig, String> {
        let mut all = vec!["kv-event-bridge"];
        all.extend_from_slice(args);
        Args::try_parse_from(all)
            .map_err(|e| e.to_string())?
            .into_config()
    }

    #[test]
    fn engines_pair_with_replays_and_ranks_by_position() {
        let c = parse(&[
            "--block-size",
            "32",
            "--engine",
            "tcp://10.0.0.1:5557",
            "--replay",
            "tcp://10.0.0.1:5558",
            "--dp-rank",
            "4",
            "--engine",
            "tcp://10.0.0.1:5559",
        ])
        .unwrap();
        assert_eq!(c.engines.len(), 2);
        assert_eq!(c.engines[0].replay.as_deref(), Some("tcp://10.0.0.1:5558"));
        assert_eq!(c.engines[0].dp_rank, Some(4));
        assert_eq!(
            (c.engines[1].replay.as_deref(), c.engines[1].dp_rank),
            (None, None)
        );
        assert_eq!(c.core.block_size, 32);
        assert_eq!(c.engines[1].topic, "", "any topic unless told");
        assert!(
            c.core.first_event_id > 1_700_000_000_000_000,
            "default ids start at the start time"
        );
        let t = parse(&[
            "--block-size",
            "32",
            "--engine",
            "tcp://h:1",
            "--first-event-id",
            "time",
        ])
        .unwrap();
        assert!(
            t.core.first_event_id > 1_700_000_000_000_000,
            "{}",
            t.core.first_event_id
        );
        assert!(parse(&[
            "--block-size",
            "32",
            "--engine",
            "tcp://h:1",
            "--first-event-id",
            "0"
        ])
        .is_err());
    }

    #[test]
    fn the_workers_timing_goes_on_its_description() {
        let base = ["--block-size", "32", "--engine", "tcp://h:1"];
        let with = |extra: &[&str]| {
            let mut all = base.to_vec();
            all.extend_from_slice(extra);
            parse(&all)
        };
        let c = with(&[
            "--worker-prefill-time-ms-poly",
            "8.25,0.0076,2.105e-7",
            "--worker-decode-step-ms-poly",
            "2.87,27.005,-12.87",
        ])
        .unwrap();
        assert_eq!(
            c.worker.prefill_time_ms_poly,
            Some(vec![8.25, 0.0076, 2.105e-7])
        );
        assert_eq!(
            c.worker.decode_step_ms_poly,
            Some(vec![2.87, 27.005, -12.87])
        );
        let json = c.worker.to_json().unwrap();
        assert!(
            json.contains(r#""prefill_time_ms_poly":[8.25,0.0076,2.105e-7]"#),
            "{json}"
        );
        let plain = with(&[]).unwrap();
        assert_eq!(plain.worker.prefill_time_ms_poly, None);
        assert!(!plain.worker.to_json().unwrap().contains("poly"));
        let e = with(&["--worker-prefill-time-ms-poly", "1,2,3,4,5,6,7,8,9"]).unwrap_err();
        assert!(e.contains("--worker-prefill-time-ms-poly: 1 to 8"), "{e}");
        let e = with(&["--worker-decode-step-ms-poly", "1,inf"]).unwrap_err();
        assert!(e.contains("--worker-decode-step-ms-poly"), "{e}");
        assert!(with(&["--worker-decode-step-ms-poly", "1,x"]).is_err());
    }

    #[test]
    fn bad_flags_are_explained() {
        let e = parse(&["--block-size", "32", "--engine", "tcp://*:5557"]).unwrap_err();
        assert!(e.contains("tcp://127.0.0.1:5557"), "{e}");
        let e = parse(&["--block-size", "0", "--engine", "tcp://h:1"]).unwrap_err();
        assert!(e.contains("--block-size"), "{e}");
        let e = parse(&[
            "--block-size",
            "32",
            "--engine",
            "tcp://h:1",
            "--replay",
            "tcp://h:2",
            "--replay",
            "tcp://h:3",
        ])
        .unwrap_err();
        assert!(e.contains("pair"), "{e}");
        assert!(parse(&["--engine", "tcp://h:1"]).is_err()); // --block-size is required
    }
}
