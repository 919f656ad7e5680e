#!/usr/bin/env bash
# Sourced by the build scripts: picks a toolchain that can build for wasm32-unknown-unknown and
# exports CARGO (the cargo to call) and WASM_BUILD_FLAGS. Order: a rustc whose sysroot already has
# the wasm32 std; rustup's target (only if its server answers, with a timeout); Debian's rustc-web,
# which builds std from source (installed with apt when missing and we are root).
set -euo pipefail

wasm_std_present() { [ -d "$("$1" --print sysroot 2>/dev/null)/lib/rustlib/wasm32-unknown-unknown/lib" ]; }

debian_toolchain_ready() {
  [ -x /usr/bin/rustc ] && [ -x /usr/bin/cargo ] && [ -x /usr/lib/llvm-22/bin/wasm-ld ] &&
    [ -d "$(/usr/bin/rustc --print sysroot)/lib/rustlib/src/rust/library" ] &&
    /usr/bin/rustc --version 2>/dev/null | grep -q 'rustc 1\.9[6-9]\|rustc 1\.[1-9][0-9][0-9]'
}

use_debian() {
  export CARGO=/usr/bin/cargo RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1
  export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER=/usr/lib/llvm-22/bin/wasm-ld
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_WASM:-$PWD/target/debian}"
  WASM_BUILD_FLAGS="-Z build-std=std,panic_abort"
}

if wasm_std_present rustc; then
  CARGO=cargo WASM_BUILD_FLAGS=""
elif debian_toolchain_ready; then
  use_debian
elif command -v rustup >/dev/null && timeout 60 rustup target add wasm32-unknown-unknown >/dev/null 2>&1 &&
  wasm_std_present rustc; then
  CARGO=cargo WASM_BUILD_FLAGS=""
else
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "wasm-env: installing Debian's rustc-web toolchain (builds std for wasm32)" >&2
    timeout 600 apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive timeout 1200 apt-get install -y -q rustc-web cargo-web rust-web-src lld-22 >&2
  fi
  if debian_toolchain_ready; then
    use_debian
  else
    echo "wasm-env: no wasm32 toolchain. Install rustup's wasm32-unknown-unknown target, or (Debian 12) apt-get install rustc-web cargo-web rust-web-src lld-22" >&2
    exit 1
  fi
fi
export CARGO WASM_BUILD_FLAGS
# Wasm SIMD (128-bit): V8 in Envoy runs it; XXH3 (block hashing) and auto-vectorized loops use it.
export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="${CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS:--C target-feature=+simd128}"
