#!/usr/bin/env bash
# Many concurrent streams from one load generator: starts a fleet of echo-mode mock workers on
# loopback and runs loadgen as a closed loop of STREAMS clients spread over them, every answer a
# stream of CHUNKS chunks INTERVAL_MS apart whose first chunk is sent at once (so the
# client-measured TTFT minus the workers' server-side TTFT is what the client path adds).
# Prints loadgen's report (achieved concurrency, client CPU, TTFT client vs server side) and
# writes bench-out/streams-<STREAMS>.json (summary) and .jsonl (every request). Needs `make tools`.
#
#   STREAMS=10000 WORKERS=4 bash scripts/bench-streams.sh
set -euo pipefail
cd "$(dirname "$0")/.."

STREAMS=${STREAMS:-10000}
WORKERS=${WORKERS:-4}
ROUNDS=${ROUNDS:-3}
CHUNKS=${CHUNKS:-20}
INTERVAL_MS=${INTERVAL_MS:-500}
RAMP_S=${RAMP_S:-5}
BIN=${BIN:-target/release}

# Each worker holds STREAMS/WORKERS connections: raise the soft descriptor limit for the
# children too (the binaries also raise their own to the hard limit).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

addrs=()
dir=$(mktemp -d)
for id in $(seq 1 "$WORKERS"); do
  "$BIN/mock-worker" --port 0 --id "$id" --mode echo >"$dir/w$id" 2>&1 &
  pids+=($!)
done
for id in $(seq 1 "$WORKERS"); do
  for _ in $(seq 1 100); do
    line=$(head -1 "$dir/w$id" 2>/dev/null || true)
    [ -n "$line" ] && break
    sleep 0.05
  done
  addr=${line#listening }
  [ -n "$addr" ] || { echo "worker $id did not start: $(cat "$dir/w$id")" >&2; exit 1; }
  addrs+=("$addr")
done
targets=$(IFS=,; echo "${addrs[*]}")
mkdir -p bench-out
echo "bench-streams: $STREAMS streams over $WORKERS workers ($targets), $ROUNDS rounds of $CHUNKS chunks every $INTERVAL_MS ms"
"$BIN/loadgen" --target "$targets" --workers "$targets" \
  --synthetic "groups=4,prefix=16,isl=32,osl=$CHUNKS,requests=$((STREAMS * ROUNDS)),concurrency=$STREAMS" \
  --body-json "{\"mock\": {\"chunks\": $CHUNKS, \"chunk_interval_ms\": $INTERVAL_MS}}" \
  --ramp-up-s "$RAMP_S" --timeout-s 120 --label "streams-$STREAMS" \
  --json "bench-out/streams-$STREAMS.json" --requests-jsonl "bench-out/streams-$STREAMS.jsonl"
