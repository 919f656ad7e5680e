# Local stand-in for rust:1-bookworm where no image registry is reachable: Debian 12's own Rust
# (rustc-web, 1.96 from bookworm-security) on the local Debian base, which
# scripts/container-demo.sh makes with mmdebstrap (its apt sources include bookworm-security).
# The build context's local-ca/ holds the host's own CA certificates
# (/usr/local/share/ca-certificates, possibly none): cargo in this image must reach crates.io
# through whatever TLS-inspecting proxy the host itself trusts.
ARG BASE_IMAGE=localhost/debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      rustc-web cargo-web gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && rustc --version && cargo --version
COPY local-ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
