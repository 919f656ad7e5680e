# Envoy with the envoy-kv-router filter: the .wasm (build it first: `make wasm`) and the compose
# demo's configuration baked in. Mount your own configuration over /etc/envoy/envoy.yaml to
# route to your workers; it loads the filter from /etc/envoy/envoy_kv_router.wasm.
ARG ENVOY_IMAGE=envoyproxy/envoy:v1.40.0
FROM ${ENVOY_IMAGE}
COPY target/envoy_kv_router.wasm /etc/envoy/envoy_kv_router.wasm
COPY envoy/envoy-compose.yaml /etc/envoy/envoy.yaml
EXPOSE 10000 9901
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
