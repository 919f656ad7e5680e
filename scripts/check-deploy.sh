#!/usr/bin/env bash
# Validates the mesh manifests in deploy/ (Kubernetes schemas, CRD structure, the Envoy
# configuration each produces via `envoy --mode validate`), the stats tags of every shipped Envoy
# configuration, docs/METRICS.md against src/ and the Grafana dashboard against docs/METRICS.md
# and src/; then shows that broken variants fail (--self-test).
# See scripts/check_deploy.py. Needs .venv/bin/envoy (scripts/setup.sh) and the built .wasm.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/envoy ] || { echo "check-deploy: .venv/bin/envoy is missing: run scripts/setup.sh" >&2; exit 1; }
if ! .venv/bin/python -c 'import kubernetes_validate, yaml, jsonschema, promql_parser' 2>/dev/null; then
  echo "check-deploy: installing kubernetes-validate (Kubernetes schemas, offline once installed) and promql-parser into .venv"
  timeout 600 .venv/bin/pip install --disable-pip-version-check -q "kubernetes-validate==1.37.0" "promql-parser==0.11.0"
fi
[ -f target/envoy_kv_router.wasm ] || bash scripts/build-wasm.sh
.venv/bin/python scripts/check_deploy.py
.venv/bin/python scripts/check_deploy.py --self-test
