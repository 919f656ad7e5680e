//! Shared-log batches from shared data: never panics, bounded allocation for hostile counts,
//! whatever decodes re-encodes to the same bytes, and the replicas' check pass (blocks read, not
//! kept) accepts exactly what decodes.
#![no_main]
use envoy_kv_router::events::{check_log_batch, decode_log_batch, encode_log_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = decode_log_batch(data);
    assert_eq!(
        check_log_batch(data),
        decoded.as_ref().map(|_| ()).map_err(Clone::clone),
        "the check and the decode disagree"
    );
    if let Ok(records) = decoded {
        let bytes = encode_log_batch(&records);
        assert_eq!(bytes, data, "decode/encode is not the identity");
        assert_eq!(decode_log_batch(&bytes), Ok(records));
    }
});
