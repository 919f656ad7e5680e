//! Load tables from shared data: never panics, bounded allocation, decode(encode(x)) == x.
#![no_main]
use envoy_kv_router::load::LoadTable;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, bytes)) = data.split_first() else {
        return;
    };
    let num_slots = usize::from(sel & 7) + 1;
    let (table, _) = LoadTable::decode_or_fresh(bytes, num_slots);
    let once = table.encode();
    let again = LoadTable::decode(&once, num_slots).map(|t| t.encode());
    assert_eq!(again.as_ref(), Ok(&once));
    let _ = table.view(u64::from(sel) * 1000);
});
