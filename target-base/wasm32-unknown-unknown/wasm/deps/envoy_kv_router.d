/work/main/target-base/wasm32-unknown-unknown/wasm/deps/envoy_kv_router.d: src/lib.rs src/proxy/mod.rs src/proxy/envoy_host.rs src/proxy/event_replies.rs src/proxy/gauges.rs src/proxy/host.rs src/proxy/http.rs src/proxy/learning.rs src/proxy/members.rs src/proxy/metrics.rs src/proxy/poller.rs src/proxy/root.rs src/proxy/vm.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/envoy_kv_router.wasm: src/lib.rs src/proxy/mod.rs src/proxy/envoy_host.rs src/proxy/event_replies.rs src/proxy/gauges.rs src/proxy/host.rs src/proxy/http.rs src/proxy/learning.rs src/proxy/members.rs src/proxy/metrics.rs src/proxy/poller.rs src/proxy/root.rs src/proxy/vm.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/libenvoy_kv_router.rlib: src/lib.rs src/proxy/mod.rs src/proxy/envoy_host.rs src/proxy/event_replies.rs src/proxy/gauges.rs src/proxy/host.rs src/proxy/http.rs src/proxy/learning.rs src/proxy/members.rs src/proxy/metrics.rs src/proxy/poller.rs src/proxy/root.rs src/proxy/vm.rs

src/lib.rs:
src/proxy/mod.rs:
src/proxy/envoy_host.rs:
src/proxy/event_replies.rs:
src/proxy/gauges.rs:
src/proxy/host.rs:
src/proxy/http.rs:
src/proxy/learning.rs:
src/proxy/members.rs:
src/proxy/metrics.rs:
src/proxy/poller.rs:
src/proxy/root.rs:
src/proxy/vm.rs:
