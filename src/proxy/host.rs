//! Host calls that cannot panic on the request path.
//!
//! The SDK's convenience methods unwrap host results (and `get_map_value` unwraps UTF-8), so the
//! adapter goes through these wrappers: failures become `None` / `false` and are counted by callers.

use crate::store::{SharedStore, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};

/// Host calls made so far by this VM (the `count-host-calls` build only; always 0 otherwise).
/// The request context sums the calls of its own callbacks (see `proxy::http`), so that a
/// benchmark can show exactly how many boundary crossings a request costs.
#[cfg(feature = "count-host-calls")]
mod count {
    use std::cell::Cell;
    thread_local! {
        pub static CALLS: Cell<u64> = const { Cell::new(0) };
    }
}

#[inline(always)]
fn counted() {
    #[cfg(feature = "count-host-calls")]
    count::CALLS.with(|c| c.set(c.get() + 1));
}

/// See [`count`]: the number of host calls this VM has made through this module.
#[inline(always)]
pub fn calls() -> u64 {
    #[cfg(feature = "count-host-calls")]
    return count::CALLS.with(std::cell::Cell::get);
    #[cfg(not(feature = "count-host-calls"))]
    0
}

/// Host wall-clock time in milliseconds (wasm32-unknown-unknown has no clock of its own).
pub fn now_ms() -> u64 {
    counted();
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Host time in nanoseconds, used to seed per-VM randomness.
pub fn now_nanos() -> u64 {
    counted();
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A header value, lossily decoded (a client can send any bytes).
pub fn header(map: MapType, name: &str) -> Option<String> {
    counted();
    match hostcalls::get_map_value_bytes(map, name) {
        Ok(Some(bytes)) => Some(String::from_utf8_lossy(&bytes).into_owned()),
        _ => None,
    }
}

/// A stream property such as `["upstream", "address"]`, as text.
pub fn property(path: &[&str]) -> Option<String> {
    counted();
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok()
}

pub fn set_header(map: MapType, name: &str, value: Option<&str>) -> bool {
    counted();
    hostcalls::set_map_value(map, name, value).is_ok()
}

pub fn buffer(kind: BufferType, len: usize) -> Option<Vec<u8>> {
    counted();
    match hostcalls::get_buffer(kind, 0, len) {
        Ok(Some(bytes)) => Some(bytes),
        Ok(None) => Some(Vec::new()),
        Err(_) => None,
    }
}

/// Replaces the first `drain` bytes of a buffer with `insert` (Envoy edits a buffer only at its
/// start or its end).
pub fn replace_buffer_start(kind: BufferType, drain: usize, insert: &[u8]) -> bool {
    counted();
    hostcalls::set_buffer(kind, 0, drain, insert).is_ok()
}

/// Envoy's shared data (process-wide, per `vm_id`) as the core's [`SharedStore`].
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        counted();
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        counted();
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(_) => Err(StoreError::Failed),
        }
    }
}

pub fn local_reply(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> bool {
    counted();
    hostcalls::send_http_response(status, headers, Some(body)).is_ok()
}

pub fn http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    timeout: Duration,
) -> Result<u32, Status> {
    counted();
    hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout)
}

/// A callout with a request body (the tokenizer call).
pub fn http_call_with_body(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Status> {
    counted();
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout)
}

pub fn resume_request() -> bool {
    counted();
    hostcalls::resume_http_request().is_ok()
}

pub fn define_metric(kind: MetricType, name: &str) -> Option<u32> {
    counted();
    hostcalls::define_metric(kind, name).ok()
}

pub fn increment_metric(id: u32, amount: i64) {
    counted();
    let _ = hostcalls::increment_metric(id, amount);
}

/// This VM's wasm linear memory, in bytes (0 off wasm32). It only grows: a VM keeps its peak.
pub fn linear_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        (core::arch::wasm32::memory_size::<0>() as u64) << 16
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}

pub fn record_metric(id: u32, value: u64) {
    counted();
    let _ = hostcalls::record_metric(id, value);
}
