# Mock workers and the load generator for the docker-compose demo.
# The build stage copies everything the workspace manifests name (the root crate's lib, tests
# and declared benches, and the tools member); tools/tests/docker_context.rs checks that cargo
# accepts exactly this context.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY benches benches
COPY tests tests
COPY tools tools
RUN cargo build --release --locked -p envoy-kv-router-tools --bin mock-worker --bin loadgen

FROM debian:bookworm-slim
COPY --from=build /src/target/release/mock-worker /src/target/release/loadgen /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/mock-worker"]
