//! kv-event-bridge: an engine's KV-cache events (vLLM / SGLang: ZMQ PUB, msgpack) as the HTTP
//! event page envoy-kv-router polls.
//!
//! Data flow: `engine` (one task per endpoint: SUB stream, sequence tracking, replay) ->
//! `kv_router_protocol::vllm` (frames, msgpack -> events) -> `core` (validation, `mirror` with
//! reference counts, `kv_router_protocol::ring` of page events with the bridge's ids, written by
//! `kv_router_protocol::page`) -> `http` (`/kv/events`, `/kv/dump`, `/health`, `/metrics`).
//! `load` scrapes the engine's Prometheus metrics for the page's `load`; `routers` relays what
//! each router polling the page has booked on the worker to the others.

// Production code avoids unwrap/expect (lints in Cargo.toml); tests may use them.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod config;
pub mod core;
pub mod describe;
pub mod engine;
pub mod http;
pub mod load;
pub mod metrics;
pub mod mirror;
pub mod replay;
pub mod routers;
pub mod state;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use crate::config::BridgeConfig;
use crate::state::{EngineStatus, Shared};

/// A running bridge: its HTTP address and its tasks.
pub struct Bridge {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl Bridge {
    /// Binds the HTTP listener and starts the engine tasks, the load scraper and the server.
    pub async fn start(config: BridgeConfig) -> std::io::Result<Bridge> {
        let statuses = config
            .engines
            .iter()
            .map(|e| EngineStatus {
                endpoint: e.endpoint.clone(),
                replay_endpoint: e.replay.clone(),
                state: "connecting",
                ..EngineStatus::default()
            })
            .collect();
        // A scraped load stays valid for a few missed scrapes.
        let load_max_age = config.engine_metrics_interval * 3 + Duration::from_secs(1);
        let shared = Arc::new(Shared::new(config.core, statuses, load_max_age));
        shared.set_worker_flags(config.worker.clone());
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let mut tasks = JoinSet::new();
        for spec in config.engines.iter().cloned() {
            tasks.spawn(engine::run(Arc::clone(&shared), spec, config.timing));
        }
        if let Some(url) = config.engine_models_url.clone() {
            tasks.spawn(load::run_models(
                Arc::clone(&shared),
                url,
                config.engine_metrics_interval,
            ));
        }
        if !config.engine_metrics_urls.is_empty() {
            tasks.spawn(load::run(
                Arc::clone(&shared),
                config.engine_metrics_urls.clone(),
                config.engine_metrics_interval,
                config
                    .engine_metrics_interval
                    .max(Duration::from_millis(500)),
            ));
        }
        let app = http::router(Arc::clone(&shared), config.http);
        let mut shutdown = shared.shutdown_watch();
        tasks.spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = shutdown.wait_for(|&s| s).await;
            });
            if let Err(e) = serve.await {
                log::error!("HTTP server failed: {e}");
            }
        });
        Ok(Bridge {
            addr,
            shared,
            tasks,
        })
    }

    /// Stops every task (long polls answer at once), waiting at most `grace`.
    pub async fn shutdown(mut self, grace: Duration) {
        self.shared.shut_down();
        let drain = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, drain).await.is_err() {
            log::warn!("tasks still running after {grace:?}; aborting them");
            self.tasks.abort_all();
        }
    }
}
