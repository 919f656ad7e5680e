# kv-event-bridge: turns an engine's ZMQ KV events (vLLM, SGLang) into the HTTP event page the
# filter polls; runs next to each engine (deploy/kubernetes/10-vllm.yaml). Needs the `bridge`
# workspace member; the build stage copies the whole workspace, which cargo needs to load it.
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
RUN cargo build --release --locked -p kv-event-bridge --bin kv-event-bridge

FROM ${BASE_IMAGE}
COPY --from=build /src/target/release/kv-event-bridge /usr/local/bin/
# The Kubernetes manifest runs it as 65532 with a read-only root filesystem.
USER 65532:65532
EXPOSE 8200
ENTRYPOINT ["/usr/local/bin/kv-event-bridge"]
