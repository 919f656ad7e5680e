# envoy-kv-router. `make test` and `make demo` do their own set-up on a fresh machine.
.PHONY: all setup build wasm tools test soak test-native test-wasm demo container-demo bench bench-real-vllm bench-streams race lint fmt clean

all: build

setup:
	bash scripts/setup.sh

wasm:
	bash scripts/build-wasm.sh
	bash scripts/build-wasm.sh --crash-trigger
	bash scripts/build-wasm.sh --floor

tools:
	cargo build --release -p envoy-kv-router-tools -p kv-event-bridge

build: wasm tools

# Native unit tests, the wasm32 logic tests under Node, and the integration tests that run the
# real Envoy with the built .wasm and mock workers; then the compose demo in real containers,
# its Rust images fed with the binaries `build` made (scripts/container-demo.sh); a 3-minute soak
# between them.
test: setup build lint
	cargo test --workspace --release
	SOAK_SECONDS=180 SOAK_OUT_DIR=target/soak-short cargo test --release --test soak -- --ignored --nocapture
	bash scripts/test-wasm.sh
	bash scripts/check-compose.sh
	bash scripts/check-deploy.sh
	CONTAINER_DEMO_BUILD=prebuilt bash scripts/container-demo.sh
	bash scripts/fuzz.sh

# Mixed traffic with faults for SOAK_MINUTES (default 30) through the real Envoy, its memory
# sampled into target/soak/memory.csv, the figures in target/soak/summary.json (tests/soak.rs).
soak: build
	nice cargo test --release --test soak -- --ignored --nocapture

test-native: build
	cargo test --workspace --release

test-wasm:
	bash scripts/test-wasm.sh

demo:
	SETUP_WASM_TESTS=0 SETUP_FUZZ=0 SETUP_VLLM=0 bash scripts/setup.sh
	$(MAKE) build
	target/release/demo

# The compose demo with every image built from docker/*.Dockerfile (Rust compiled in the image).
container-demo:
	SETUP_WASM_TESTS=0 SETUP_FUZZ=0 SETUP_VLLM=0 bash scripts/setup.sh
	$(MAKE) wasm
	bash scripts/container-demo.sh

# `make bench QUICK=1`: the short variants (a few minutes in all). The last bench prints the
# README-pastable tables of Envoy CPU per request (plain / floor filter / kv), at fleet scale, and
# events applied per second.
BENCH_ARGS := $(if $(QUICK),--quick,)
bench: build
	cargo bench --bench router -- $(BENCH_ARGS)
	cargo bench --bench load_table -- $(BENCH_ARGS)
	cargo bench --bench index -- $(BENCH_ARGS)
	cargo bench --bench envoy_overhead -- $(BENCH_ARGS)
	cargo bench --bench envoy_memory -- $(BENCH_ARGS)
	cargo bench --bench envoy_cpu -- $(BENCH_ARGS)

# Event-to-routable latency with a real vLLM engine and its kv-event-bridge (installs vLLM).
bench-real-vllm: build
	bash scripts/vllm/install.sh
	cargo bench --bench real_vllm_events

# One load generator holding 10,000 concurrent streams against 4 mock workers (STREAMS=...).
bench-streams: tools
	bash scripts/bench-streams.sh

# The race (docs/RACE.md): six workloads x five arms (the filter at its defaults, round-robin,
# vllm-router's cache_aware, kv_aware, power_of_two), each arm on a fresh fleet, 3 runs each;
# medians against the targets in target/race/summary.md (~75 minutes). A quick pass:
# `make race RACE_ARGS="--scale 0.1 --runs 1"`.
race:
	bash scripts/race.sh $(RACE_ARGS)

# The module layers (docs/DESIGN.md, "Layers"): no import cycle in core/src, src/, protocol/src,
# bridge/src, tools/src; core/src imports only downward, src/ is the proxy-wasm adapter alone
# (scripts/check-layers.py declares the order).
lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	python3 scripts/check-layers.py

fmt:
	cargo fmt --all

clean:
	cargo clean
