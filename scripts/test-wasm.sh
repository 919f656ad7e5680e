#!/usr/bin/env bash
# Runs the routing core's logic tests (tests/wasm.rs) compiled to wasm32, under Node
# (wasm-bindgen-test). The `filter` feature is off: the proxy-wasm adapter is not compiled, so the
# test binary has no host imports. Installs the matching wasm-bindgen-test-runner into .tools when
# it is missing (as scripts/setup.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/wasm-env.sh

command -v node >/dev/null || { echo "test-wasm: node (Node.js) is needed to run the wasm32 tests" >&2; exit 1; }

runner="$PWD/.tools/bin/wasm-bindgen-test-runner"
# The runner must be the wasm-bindgen version the test crate links (Cargo.lock).
want=$(awk '/^name = "wasm-bindgen"$/{getline; gsub(/[^0-9.]/, "", $0); print; exit}' Cargo.lock)
have=$("$runner" --version 2>/dev/null | awk '{print $2}' || true)
if [ -z "$want" ]; then
  echo "test-wasm: no wasm-bindgen in Cargo.lock (is wasm-bindgen-test still a dev-dependency?)" >&2
  exit 1
fi
if [ "$have" != "$want" ]; then
  echo "test-wasm: installing wasm-bindgen-cli $want into .tools (found '${have:-none}'; a few minutes)" >&2
  # No --locked: one of its pinned dependencies is missing from the registry mirror.
  timeout 1800 cargo install -q wasm-bindgen-cli --version "$want" --root .tools
fi

export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER="$runner"
# shellcheck disable=SC2086
"$CARGO" test --target wasm32-unknown-unknown -p envoy-kv-router --no-default-features --test wasm $WASM_BUILD_FLAGS "$@"
