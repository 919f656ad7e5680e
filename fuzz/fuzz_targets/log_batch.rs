//! Shared-log batches from shared data: never panics, bounded allocation for hostile counts, and
//! whatever decodes re-encodes to the same bytes.
#![no_main]
use envoy_kv_router::events::{decode_log_batch, encode_log_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(records) = decode_log_batch(data) {
        let bytes = encode_log_batch(&records);
        assert_eq!(bytes, data, "decode/encode is not the identity");
        assert_eq!(decode_log_batch(&bytes), Ok(records));
    }
});
