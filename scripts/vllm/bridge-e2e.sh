#!/usr/bin/env bash
# A real vLLM engine -> kv-event-bridge, end to end (opt-in: needs scripts/vllm/install.sh).
# Starts the engine (serve.sh) and the bridge on their own ports, drives requests and checks
# after each that the bridge's dump and page equal a full replay of the engine's events
# (bridge_check.py); then restarts the bridge (it must catch up from the replay socket) and,
# with RESTART_ENGINE=1, the engine (the bridge must clear and rebuild). Stops both by PID.
#
# Environment: VLLM_HOME (<repo>/.vllm), PORT (8110), KV_PUB_PORT (5567), KV_REPLAY_PORT (5568),
# BRIDGE_PORT (8210), RESTART_ENGINE (0), OUT (a temp dir for logs).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export VLLM_HOME=${VLLM_HOME:-$ROOT/.vllm}
export PORT=${PORT:-8110} KV_PUB_PORT=${KV_PUB_PORT:-5567} KV_REPLAY_PORT=${KV_REPLAY_PORT:-5568}
BRIDGE_PORT=${BRIDGE_PORT:-8210}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export RUN_DIR=${RUN_DIR:-$OUT/vllm-run}
PY=$VLLM_HOME/venv/bin/python
BRIDGE=$ROOT/target/release/kv-event-bridge

[ -f "$VLLM_HOME/.installed-0.32.0" ] || { echo "bridge-e2e: run scripts/vllm/install.sh first" >&2; exit 1; }
(cd "$ROOT" && cargo build --release -q -p kv-event-bridge)

ENGINE_PID= BRIDGE_PID=
stop() { # PID: TERM, then wait up to 30 s, then KILL
  [ -n "$1" ] || return 0
  kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq 1 300); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
}
trap 'stop "$BRIDGE_PID"; stop "$ENGINE_PID"' EXIT

start_engine() {
  "$ROOT/scripts/vllm/serve.sh" >>"$OUT/vllm.log" 2>&1 &
  ENGINE_PID=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$ENGINE_PID" 2>/dev/null || { echo "bridge-e2e: engine died; see $OUT/vllm.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "bridge-e2e: engine not healthy after 150 s" >&2
  exit 1
}

start_bridge() {
  RUST_LOG=${RUST_LOG:-info} "$BRIDGE" --engine "tcp://127.0.0.1:$KV_PUB_PORT" \
    --replay "tcp://127.0.0.1:$KV_REPLAY_PORT" --block-size 32 --listen "127.0.0.1:$BRIDGE_PORT" \
    --engine-metrics-url "http://127.0.0.1:$PORT/metrics" --idle-probe-ms 500 \
    >>"$OUT/bridge.log" 2>&1 &
  BRIDGE_PID=$!
  for _ in $(seq 1 200); do
    curl -sf "http://127.0.0.1:$BRIDGE_PORT/health" >/dev/null && return 0
    sleep 0.1
  done
  echo "bridge-e2e: bridge not connected after 20 s; see $OUT/bridge.log" >&2
  exit 1
}

check() {
  "$PY" "$ROOT/scripts/vllm/bridge_check.py" --api "http://127.0.0.1:$PORT" \
    --bridge "http://127.0.0.1:$BRIDGE_PORT" --replay "tcp://127.0.0.1:$KV_REPLAY_PORT" "$@"
}

t0=$(date +%s)
start_engine
echo "bridge-e2e: engine up after $(($(date +%s) - t0)) s (logs in $OUT)"
start_bridge
check --phases prefix,decode,evict,reset
echo "bridge-e2e: restarting the bridge (it must catch up from the replay socket)"
stop "$BRIDGE_PID"
check_api() { curl -sf -X POST "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"tiny\",\"prompt\":[$(seq -s, 412 511)],\"max_tokens\":2,\"temperature\":0}" >/dev/null; }
check_api # events the bridge is not there to see
start_bridge
check --phases check,prefix
if [ "${RESTART_ENGINE:-0}" = 1 ]; then
  echo "bridge-e2e: restarting the engine (the bridge must clear and rebuild)"
  stop "$ENGINE_PID"
  start_engine
  check --phases prefix,evict
  grep -q "cleared ranks \[0\] (restart)" "$OUT/bridge.log" || { echo "bridge-e2e: no restart detected" >&2; exit 1; }
fi
echo "bridge-e2e: passed in $(($(date +%s) - t0)) s"
