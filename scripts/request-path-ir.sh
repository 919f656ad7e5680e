#!/usr/bin/env bash
# Instructions per request (callgrind) of benches/request_path.rs at several worker counts:
# (Ir at N iterations - Ir at 0 iterations) / N, so setup is not counted.
# Usage: scripts/request-path-ir.sh [binary] [tokens] [iters] [in-flight per worker]
set -euo pipefail
bin=${1:-$(ls -t target/release/deps/request_path-* | grep -v '\.d$' | head -1)}
tokens=${2:-1024}
iters=${3:-20}
per_worker=${4:-10}
out=$(mktemp -d)
ir() {
    valgrind --tool=callgrind --callgrind-out-file="$out/cg" "$bin" "$tokens" "$1" "$2" "$3" >/dev/null 2>&1
    grep -E '^(summary|totals):' "$out/cg" | head -1 | awk '{print $2}'
}
printf '%8s | %10s | %14s\n' workers "in flight" "Ir per request"
for workers in 8 64 256 1000; do
    inflight=$((workers * per_worker))
    base=$(ir 0 "$workers" "$inflight")
    run=$(ir "$iters" "$workers" "$inflight")
    printf '%8s | %10s | %14s\n' "$workers" "$inflight" $(((run - base) / iters))
done
rm -rf "$out"
