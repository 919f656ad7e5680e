//! Test-only (cargo feature `test-crash-trigger`, never in the shipped filter): a request carrying
//! the [`CRASH_HEADER`] header traps the VM, so a test can watch Envoy's `FAIL_RELOAD` replace it.

use super::host;
use proxy_wasm::types::MapType;

/// The request header that traps the VM.
pub const CRASH_HEADER: &str = "x-kv-router-test-crash";

/// Traps the VM (a wasm `unreachable`, what a panic under `panic = "abort"` ends in) when the
/// current request carries [`CRASH_HEADER`].
pub fn trap_if_asked() {
    if host::header(MapType::HttpRequestHeaders, CRASH_HEADER).is_some() {
        log::error!("{CRASH_HEADER}: trapping the VM on request");
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
    }
}
