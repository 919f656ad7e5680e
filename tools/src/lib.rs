//! Native tools for envoy-kv-router (never compiled to wasm).
