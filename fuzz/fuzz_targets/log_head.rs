//! The replication head (`ekr.log.head`, binary in shared data): decoding arbitrary bytes never
//! panics, and whatever decodes (or any head that parses from JSON) round-trips the binary codec.
#![no_main]
use envoy_kv_router::replication::head_codec::{decode_head, encode_head};
use envoy_kv_router::replication::log::LogHead;
use libfuzzer_sys::fuzz_target;

fn round_trips(head: &LogHead) {
    let back = decode_head(&encode_head(head));
    // NaN kv_usage is the one value that cannot compare equal to itself.
    let nan = head
        .workers
        .iter()
        .any(|w| w.reported.is_some_and(|r| r.kv_usage.is_nan()));
    assert!(back.is_some(), "an encoded head does not decode");
    assert!(nan || back.as_ref() == Some(head), "head does not round-trip");
}

fuzz_target!(|data: &[u8]| {
    if let Some(head) = decode_head(data) {
        round_trips(&head);
    }
    if let Ok(head) = serde_json::from_slice::<LogHead>(data) {
        round_trips(&head);
    }
});
