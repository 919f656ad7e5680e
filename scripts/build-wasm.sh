#!/usr/bin/env bash
# Builds the filter for wasm32 and copies it to target/envoy_kv_router.wasm.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wasm-env.sh
# shellcheck disable=SC2086
"$CARGO" build --profile wasm --target wasm32-unknown-unknown -p envoy-kv-router --lib $WASM_BUILD_FLAGS
out="${CARGO_TARGET_DIR:-target}/wasm32-unknown-unknown/wasm/envoy_kv_router.wasm"
mkdir -p target
cp "$out" target/envoy_kv_router.wasm
echo "built target/envoy_kv_router.wasm ($(wc -c < target/envoy_kv_router.wasm) bytes)"
