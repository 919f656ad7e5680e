//! Index snapshots from shared data: never panics, bounded allocation, and a decoded snapshot
//! re-encodes to bytes that decode to the same index.
#![no_main]
use envoy_kv_router::index::KvIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte: slot count (1..=8) and a small block bound, so eviction runs too.
    let Some((&sel, bytes)) = data.split_first() else {
        return;
    };
    let num_slots = usize::from(sel & 7) + 1;
    let max_blocks = if sel & 8 == 0 { 1 << 16 } else { 3 };
    if let Ok(index) = KvIndex::decode_snapshot(bytes, num_slots, max_blocks) {
        let once = index.encode_snapshot();
        let again =
            KvIndex::decode_snapshot(&once, num_slots, max_blocks).map(|i| i.encode_snapshot());
        assert_eq!(again.as_ref(), Ok(&once));
    }
});
