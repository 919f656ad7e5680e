#!/usr/bin/env bash
# Validates docker-compose.yaml (no Docker daemon is needed for `config`) and the build context
# of docker/*.Dockerfile against .dockerignore (scripts/check_docker_context.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if docker compose version >/dev/null 2>&1; then
  docker compose -f docker-compose.yaml config -q
elif command -v docker-compose >/dev/null; then
  docker-compose -f docker-compose.yaml config -q
else
  echo "check-compose: neither 'docker compose' nor 'docker-compose' is installed (apt-get install docker-compose)" >&2
  exit 1
fi
echo "docker-compose.yaml: valid"
python3 scripts/check_docker_context.py
