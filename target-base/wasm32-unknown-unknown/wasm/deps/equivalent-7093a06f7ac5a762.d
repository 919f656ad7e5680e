/work/main/target-base/wasm32-unknown-unknown/wasm/deps/equivalent-7093a06f7ac5a762.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/equivalent-1.0.3/src/lib.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/libequivalent-7093a06f7ac5a762.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/equivalent-1.0.3/src/lib.rs

/work/main/target-base/wasm32-unknown-unknown/wasm/deps/libequivalent-7093a06f7ac5a762.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/equivalent-1.0.3/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/equivalent-1.0.3/src/lib.rs:
