/work/main/target-base/wasm32-unknown-unknown/wasm/deps/kv_router_protocol-e55b57f7938703da.d: protocol/src/lib.rs protocol/src/page.rs protocol/src/ring.rs protocol/src/worker.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/libkv_router_protocol-e55b57f7938703da.rlib: protocol/src/lib.rs protocol/src/page.rs protocol/src/ring.rs protocol/src/worker.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/libkv_router_protocol-e55b57f7938703da.rmeta: protocol/src/lib.rs protocol/src/page.rs protocol/src/ring.rs protocol/src/worker.rs

protocol/src/lib.rs:
protocol/src/page.rs:
protocol/src/ring.rs:
protocol/src/worker.rs:
