#!/usr/bin/env bash
# Runs the routing core's logic tests compiled to wasm32, under Node (wasm-bindgen-test).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wasm-env.sh
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER="$PWD/.tools/bin/wasm-bindgen-test-runner"
# shellcheck disable=SC2086
"$CARGO" test --target wasm32-unknown-unknown -p envoy-kv-router --no-default-features --test wasm $WASM_BUILD_FLAGS
