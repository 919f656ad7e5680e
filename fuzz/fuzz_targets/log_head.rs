//! The replication head (`ekr.log.head`, JSON in shared data): never panics, round-trips.
#![no_main]
use envoy_kv_router::replication::log::LogHead;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(head) = serde_json::from_slice::<LogHead>(data) {
        if let Ok(bytes) = serde_json::to_vec(&head) {
            let back: Result<LogHead, _> = serde_json::from_slice(&bytes);
            // NaN kv_usage is the one value that cannot compare equal to itself.
            if let Ok(back) = back {
                let nan = head
                    .workers
                    .iter()
                    .any(|w| w.reported.is_some_and(|r| r.kv_usage.is_nan()));
                assert!(nan || back == head, "head does not round-trip");
            }
        }
    }
});
