# Mock workers and the load generator for the docker-compose demo.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY tools tools
COPY tests tests
RUN cargo build --release -p envoy-kv-router-tools --bin mock-worker --bin loadgen

FROM debian:bookworm-slim
COPY --from=build /src/target/release/mock-worker /src/target/release/loadgen /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/mock-worker"]
