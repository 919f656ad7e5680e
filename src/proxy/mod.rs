//! The proxy-wasm adapter (being written).
