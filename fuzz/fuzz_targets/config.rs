//! The plugin configuration: never panics, whatever the operator (or a typo) hands Envoy.
#![no_main]
use envoy_kv_router::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(config) = Config::from_json(data) {
        for slot in 0..config.num_slots().min(1024) {
            let _ = config.worker_of_slot(slot as _);
        }
    }
});
