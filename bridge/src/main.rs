//! `kv-event-bridge`: see `--help` and bridge/README.md.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kv_event_bridge::config::Args;
use kv_event_bridge::Bridge;
use log::{error, info};

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let config = match Args::parse().into_config() {
        Ok(c) => c,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async move {
        let engines: Vec<String> = config.engines.iter().map(|e| e.endpoint.clone()).collect();
        let bridge = match Bridge::start(config).await {
            Ok(b) => b,
            Err(e) => {
                error!("cannot listen: {e}");
                return ExitCode::FAILURE;
            }
        };
        info!(
            "kv-event-bridge on http://{} for engines {engines:?}",
            bridge.addr
        );
        wait_for_signal().await;
        info!("shutting down");
        bridge.shutdown(Duration::from_secs(5)).await;
        info!("stopped");
        ExitCode::SUCCESS
    });
    // Tasks of the zeromq crate may still hold sockets; do not wait for them.
    runtime.shutdown_timeout(Duration::from_millis(200));
    code
}

/// SIGTERM (Kubernetes) or Ctrl-C.
async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
