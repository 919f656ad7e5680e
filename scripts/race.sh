#!/usr/bin/env bash
# `make race`: builds the tools and runs `loadgen race` (docs/RACE.md): every workload through
# every arm, each arm on a fresh fleet, RUNS times; results in target/race (or --out DIR).
# Arguments go to `loadgen race`, e.g. `bash scripts/race.sh --scale 0.1 --runs 1
# --workloads agent,conversation --arms kv,round-robin` (or `make race RACE_ARGS="..."`).
#
# The Mooncake synthetic trace is read from $RACE_SYNTHETIC_TRACE (default
# bench-data/mooncake_synthetic_trace.jsonl, git-ignored; from github.com/kvcache-ai/Mooncake,
# FAST25-release/traces/synthetic_trace.jsonl). When it is missing and a copy exists in
# $RACE_SHARED_DATA (default /work/shared/data), that copy is used; else `loadgen race` skips
# the `synthetic` workload and says why.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/envoy ]; then
  echo "race: no .venv/bin/envoy: run \`make setup\` (or SETUP_VLLM=0 SETUP_FUZZ=0 bash scripts/setup.sh)" >&2
  exit 2
fi
if [ ! -x .venv/bin/vllm-router ]; then
  echo "race: no .venv/bin/vllm-router: the vllm-router arms will be skipped (\`make setup\` installs it)" >&2
fi
# Always (a no-op in a fraction of a second when it is current): a stale .wasm would race old code.
bash scripts/build-wasm.sh
cargo build --release -p envoy-kv-router-tools -p kv-event-bridge

trace="${RACE_SYNTHETIC_TRACE:-bench-data/mooncake_synthetic_trace.jsonl}"
shared="${RACE_SHARED_DATA:-/work/shared/data}/mooncake_synthetic_trace.jsonl"
if [ ! -f "$trace" ] && [ -f "$shared" ]; then
  mkdir -p "$(dirname "$trace")"
  cp "$shared" "$trace"
  echo "race: copied $shared to $trace" >&2
fi

exec target/release/loadgen race --synthetic-trace "$trace" "$@"
