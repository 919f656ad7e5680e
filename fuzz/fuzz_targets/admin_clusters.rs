//! Envoy's admin `/clusters?format=json` reply (`membership::parse_admin_clusters`): never
//! panics; every host it returns has a non-zero port and appears once.
#![no_main]
use envoy_kv_router::membership::parse_admin_clusters;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hosts) = parse_admin_clusters(data, "llm_workers") {
        for (i, h) in hosts.iter().enumerate() {
            assert!(h.address.port() != 0);
            assert!(!hosts[..i].iter().any(|o| o.address == h.address), "duplicate host");
        }
    }
});
