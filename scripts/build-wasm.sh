#!/usr/bin/env bash
# Builds the filter for wasm32 and copies it to target/envoy_kv_router.wasm.
# `--crash-trigger`: the test-only variant with the `test-crash-trigger` feature (a request header
# traps the VM; tests/fault_matrix.rs) -> target/envoy_kv_router_crash_trigger.wasm.
# `--count-host-calls`: the benchmark-only variant that counts each request's host calls
# (`debug.host_calls` / `debug.requests` stats) -> target/envoy_kv_router_count.wasm.
# `--floor`: the benchmark baseline benches/floor-filter (buffer, copy and scan the body once, fixed
# destination; same toolchain and `wasm` profile) -> target/floor_filter.wasm.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wasm-env.sh
features="" name=envoy_kv_router package=envoy-kv-router artifact=envoy_kv_router
case "${1:-}" in
  --crash-trigger) features="--features test-crash-trigger" name=envoy_kv_router_crash_trigger ;;
  --count-host-calls) features="--features count-host-calls" name=envoy_kv_router_count ;;
  --floor) package=floor-filter name=floor_filter artifact=floor_filter ;;
esac
# shellcheck disable=SC2086
"$CARGO" build --profile wasm --target wasm32-unknown-unknown -p "$package" --lib $features $WASM_BUILD_FLAGS
out="${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/wasm/$artifact.wasm"
mkdir -p target
cp "$out" "target/$name.wasm"
echo "built target/$name.wasm ($(wc -c < "target/$name.wasm") bytes)"
