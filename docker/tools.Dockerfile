# Mock workers and the load generator for the docker-compose demo.
# The build stage copies everything the workspace manifests name (the root crate's lib, tests
# and declared benches, and the tools and bridge members); tools/tests/docker_context.rs checks
# that cargo accepts exactly this context.
#
# The base images are build arguments with the official images as defaults; a machine without a
# registry passes local stand-ins (scripts/container-demo.sh, docker/README.md).
ARG RUST_IMAGE=rust:1-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY core core
COPY benches benches
COPY tests tests
COPY tools tools
COPY bridge bridge
COPY protocol protocol
COPY testkit testkit
RUN cargo build --release --locked -p envoy-kv-router-tools --bin mock-worker --bin loadgen

FROM ${BASE_IMAGE}
COPY --from=build /src/target/release/mock-worker /src/target/release/loadgen /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/mock-worker"]
