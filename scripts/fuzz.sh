#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time and prints executions and crashes per
# target. `make test` runs it briefly; a longer run: `FUZZ_SECONDS=600 bash scripts/fuzz.sh`.
# Usage: scripts/fuzz.sh [seconds-per-target] [target...]
# A crash leaves its input in fuzz/artifacts/<target>/ and fails the script; turn each one into a
# regression test in the normal test suite (tests/fuzz_regressions.rs) and fix the code.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-${FUZZ_SECONDS:-15}}
shift || true
export PATH="$PWD/.tools/bin:$PATH"
# cargo-fuzz passes nightly-only flags (-Z...); the stable toolchain accepts them this way.
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || { echo "fuzz: cargo-fuzz missing (run scripts/setup.sh)" >&2; exit 1; }

targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cd fuzz && cargo fuzz list)

# No sanitizer: the targets run safe Rust only, so ASan adds build and run time and finds
# nothing a panic would not; panics, timeouts and over-large allocations are what is hunted.
flags=(--sanitizer none --release --debug-assertions)
cd fuzz
cargo fuzz build "${flags[@]}" 2>&1 | grep -E '^(error|warning: unused)' -A5 || true
cargo fuzz build "${flags[@]}" >/dev/null 2>&1 || { cargo fuzz build "${flags[@]}"; exit 1; }

failed=0
printf '%-16s %8s %12s %10s %8s\n' target seconds executions exec/s crashes
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t" "seeds/$t"
  log="artifacts/$t/last-run.log"
  # -rss_limit_mb / -malloc_limit_mb: a hostile length prefix must not make the decoder allocate.
  status=0
  cargo fuzz run "${flags[@]}" "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$seconds" -rss_limit_mb=1024 -malloc_limit_mb=256 -timeout=10 \
    -max_len=65536 -print_final_stats=1 >"$log" 2>&1 || status=$?
  execs=$(awk '/stat::number_of_executed_units/{print $2}' "$log" | tail -1)
  rate=$(awk '/stat::average_exec_per_sec/{print $2}' "$log" | tail -1)
  crashes=$(find "artifacts/$t" -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
  printf '%-16s %8s %12s %10s %8s\n' "$t" "$seconds" "${execs:-?}" "${rate:-?}" "$crashes"
  if [ "$status" != 0 ] || [ "$crashes" != 0 ]; then
    failed=1
    echo "fuzz: $t failed (exit $status); see fuzz/$log and fuzz/artifacts/$t/" >&2
    grep -E 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | head -5 >&2 || true
  fi
done
exit $failed
