#!/usr/bin/env python3
"""Checks the mesh manifests in deploy/, the metric names in docs/METRICS.md and the Grafana
dashboard. Run by scripts/check-deploy.sh (make test) with .venv's Python, which has
kubernetes-validate (and its PyYAML and jsonschema) and promql-parser.

What is checked:
* Every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an unknown
  field is an error). kubernetes-validate has no schemas for CRDs; the Istio, Gateway API and
  Envoy Gateway resources are checked against CRD_SCHEMAS below: hand-written subsets of the
  upstream CRD schemas (same field names and enums, core types such as Volume taken from the
  Kubernetes schemas) covering the fields these manifests use, strict as well.
* The Envoy configuration each deployment produces, with `envoy --mode validate` (which also
  loads the .wasm and runs the filter's configuration parser): the ConfigMap's envoy.yaml as is;
  for Istio and Envoy Gateway, the EnvoyFilter / EnvoyPatchPolicy patches applied to a bootstrap
  shaped like what istiod / Envoy Gateway generate for the Gateway and routes in the manifests.
* What Envoy cannot know: the filter's options that body-based routing needs, that its workers'
  ip:port are hosts of the routed cluster, that the destination header is the one the cluster
  steers by, that the event cluster exists, and that vLLM, the bridge and the filter agree on the
  KV block size.
* The stats tags (docs/METRICS.md, "Tags"): every shipped Envoy configuration (envoy/*.yaml and
  each deployment's rendered bootstrap, Istio's custom bootstrap and Envoy Gateway's bootstrap
  merge included) carries envoy/envoy.yaml's `stats_config.stats_tags` for the filter's stats, no
  other tag regex (Istio's own) also matches them, and no stats matcher drops them.
* docs/METRICS.md against the metric names in src/ and core/src/ (the filter's adapter and its
  routing core; "src/" below means both), its Prometheus names against Envoy's tag extraction
  (simulated here with those tags); the dashboard's queries parse as PromQL, select only metrics
  docs/METRICS.md lists and src/ defines as Envoy exports them (histogram suffixes only on
  histograms), and group or filter only by labels those series carry, so a renamed metric or a
  lost tag fails here.

`--self-test` feeds deliberately broken variants to each check and fails unless each is caught.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib.resources import files as package_files
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import kubernetes_validate
import promql_parser
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
METRICS_DOC = ROOT / "docs" / "METRICS.md"
DASHBOARD = DEPLOY / "grafana" / "envoy-kv-router.json"
ENVOY = ROOT / ".venv" / "bin" / "envoy"
WASM = Path(os.environ.get("KV_ROUTER_WASM", ROOT / "target" / "envoy_kv_router.wasm"))
K8S_VERSIONS = ["1.29", kubernetes_validate.latest_version()]
WASM_CONFIGMAP = "kv-router-wasm"
FILTER_DEFAULTS = {
    "destination_header": "x-gateway-destination-endpoint",
    "destination_format": "override_host",
    "events_cluster": "kv_events",
    "block_size": 64,
}


class CheckError(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# Manifests


class Manifests:
    """Every YAML document under deploy/, with the file it came from."""

    def __init__(self, docs: list[tuple[Path, dict]]):
        self.docs = docs

    @classmethod
    def load(cls, root: Path) -> "Manifests":
        docs = []
        for path in sorted(root.rglob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    docs.append((path, doc))
        return cls(docs)

    def of(self, kind: str, api_prefix: str = "", under: str = "") -> list[dict]:
        return [
            d
            for p, d in self.docs
            if d.get("kind") == kind
            and d.get("apiVersion", "").startswith(api_prefix)
            and str(p.relative_to(DEPLOY)).startswith(under)
        ]

    def one(self, kind: str, api_prefix: str = "", under: str = "", name: str | None = None) -> dict:
        found = [d for d in self.of(kind, api_prefix, under) if name in (None, d["metadata"]["name"])]
        if len(found) != 1:
            raise CheckError(f"expected one {kind} {name or ''} under deploy/{under}, found {len(found)}")
        return found[0]

    def service(self, name: str, namespace: str) -> dict:
        for svc in self.of("Service", "v1"):
            meta = svc["metadata"]
            if meta["name"] == name and meta.get("namespace", "default") == namespace:
                return svc
        raise CheckError(f"no Service {namespace}/{name} in deploy/")

    def service_by_ip(self, ip: str) -> dict | None:
        for svc in self.of("Service", "v1"):
            if svc["spec"].get("clusterIP") == ip:
                return svc
        return None


# ------------------------------------------------------------------------------------------------
# Kubernetes and CRD schemas

K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"
STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
FREE = {"type": "object"}  # protobuf Struct / free JSON, checked by Envoy instead
STR_MAP = {"type": "object", "additionalProperties": STR}


def obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def arr(items: dict, min_items: int = 0) -> dict:
    return {"type": "array", "items": items, "minItems": min_items}


def enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def core(name: str) -> dict:
    return {"$ref": K8S_DEFS + name}


def resource(spec: dict, spec_required: bool = True) -> dict:
    return obj(
        {"apiVersion": STR, "kind": STR, "metadata": core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"), "spec": spec},
        ("apiVersion", "kind", "metadata", "spec") if spec_required else ("apiVersion", "kind", "metadata"),
    )


GW_API_PARENT = obj({"group": STR, "kind": STR, "namespace": STR, "name": STR, "sectionName": STR, "port": INT}, ("name",))
TARGET_REF = obj({"group": STR, "kind": STR, "name": STR, "sectionName": STR}, ("group", "kind", "name"))
ENVOY_RESOURCE_TYPES = enum(
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
)
QUANTITY = {"type": ["string", "integer"], "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mk])?$"}

# (apiVersion, kind) -> schema. Subsets of the upstream CRDs (Istio api, Gateway API standard
# channel, Envoy Gateway v1.9): field names and enums as upstream; extend from the upstream CRD
# when a manifest needs a field that is missing here.
CRD_SCHEMAS: dict[tuple[str, str], dict] = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): resource(obj({
        "workloadSelector": obj({"labels": STR_MAP}),
        "priority": INT,
        "configPatches": arr(obj({
            "applyTo": enum("INVALID", "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER",
                            "ROUTE_CONFIGURATION", "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER",
                            "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER"),
            "match": obj({
                "context": enum("ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"),
                "proxy": obj({"proxyVersion": STR, "metadata": STR_MAP}),
                "listener": obj({
                    "portNumber": INT, "name": STR, "listenerFilter": STR,
                    "filterChain": obj({
                        "name": STR, "sni": STR, "transportProtocol": STR, "applicationProtocols": STR,
                        "destinationPort": INT,
                        "filter": obj({"name": STR, "subFilter": obj({"name": STR})}),
                    }),
                }),
                "cluster": obj({"portNumber": INT, "service": STR, "subset": STR, "name": STR}),
            }),
            "patch": obj({
                "operation": enum("INVALID", "MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER",
                                  "INSERT_FIRST", "REPLACE", "MERGE_AND_REPLACE_LIST"),
                "value": FREE,
                "filterClass": enum("UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"),
            }),
        }, ("applyTo", "patch")), 1),
    }, ("configPatches",))),
    ("networking.istio.io/v1", "Gateway"): resource(obj({
        "selector": STR_MAP,
        "servers": arr(obj({
            "port": obj({"number": INT, "protocol": STR, "name": STR, "targetPort": INT}, ("number", "protocol", "name")),
            "hosts": arr(STR, 1), "bind": STR, "defaultEndpoint": STR, "name": STR, "tls": FREE,
        }, ("port", "hosts")), 1),
    }, ("servers",))),
    ("networking.istio.io/v1", "ServiceEntry"): resource(obj({
        "hosts": arr(STR, 1), "addresses": arr(STR), "exportTo": arr(STR), "subjectAltNames": arr(STR),
        "location": enum("MESH_EXTERNAL", "MESH_INTERNAL"),
        "resolution": enum("NONE", "STATIC", "DNS", "DNS_ROUND_ROBIN", "DYNAMIC_DNS"),
        "ports": arr(obj({"number": INT, "protocol": STR, "name": STR, "targetPort": INT}, ("number", "name"))),
        "endpoints": arr(obj({"address": STR, "ports": {"type": "object", "additionalProperties": INT},
                              "labels": STR_MAP, "network": STR, "locality": STR, "weight": INT,
                              "serviceAccount": STR})),
    }, ("hosts",))),
    ("networking.istio.io/v1", "VirtualService"): resource(obj({
        "hosts": arr(STR), "gateways": arr(STR), "exportTo": arr(STR),
        "http": arr(obj({
            "name": STR, "match": arr(FREE), "timeout": STR,
            "route": arr(obj({
                "destination": obj({"host": STR, "subset": STR, "port": obj({"number": INT})}, ("host",)),
                "weight": INT, "headers": FREE,
            }, ("destination",))),
            "retries": obj({"attempts": INT, "perTryTimeout": STR, "retryOn": STR, "retryRemoteLocalities": BOOL}),
        })),
    })),
    ("gateway.networking.k8s.io/v1", "Gateway"): resource(obj({
        "gatewayClassName": STR,
        "infrastructure": obj({"labels": STR_MAP, "annotations": STR_MAP,
                               "parametersRef": obj({"group": STR, "kind": STR, "name": STR}, ("group", "kind", "name"))}),
        "listeners": arr(obj({"name": STR, "hostname": STR, "port": INT,
                              "protocol": STR, "tls": FREE, "allowedRoutes": FREE},
                             ("name", "port", "protocol")), 1),
    }, ("gatewayClassName", "listeners"))),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): resource(obj({
        "parentRefs": arr(GW_API_PARENT), "hostnames": arr(STR),
        "rules": arr(obj({
            "name": STR,
            "matches": arr(obj({
                "path": obj({"type": enum("Exact", "PathPrefix", "RegularExpression"), "value": STR}),
                "headers": arr(FREE), "queryParams": arr(FREE), "method": STR,
            })),
            "backendRefs": arr(obj({"group": STR, "kind": STR, "name": STR, "namespace": STR,
                                    "port": INT, "weight": INT, "filters": arr(FREE)}, ("name",))),
            "timeouts": obj({"request": STR, "backendRequest": STR}),
            "filters": arr(FREE),
        })),
    })),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"): resource(obj({
        "targetRef": TARGET_REF, "priority": INT, "type": enum("JSONPatch"),
        "jsonPatches": arr(obj({
            "type": ENVOY_RESOURCE_TYPES, "name": STR,
            "operation": obj({"op": enum("add", "remove", "replace", "move", "copy", "test"),
                              "path": STR, "jsonPath": STR, "from": STR, "value": {}}, ("op",)),
        }, ("type", "name", "operation"))),
    }, ("targetRef", "type"))),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"): resource(obj({
        "concurrency": INT, "routingType": enum("Service", "Endpoint"),
        "bootstrap": obj({"type": enum("Merge", "Replace", "JSONPatch"), "value": STR, "jsonPatches": arr(FREE)}),
        "provider": obj({
            "type": enum("Kubernetes", "Custom"),
            "kubernetes": obj({"envoyDeployment": obj({
                "replicas": INT,
                "pod": obj({"annotations": STR_MAP, "labels": STR_MAP,
                            "volumes": arr(core("io.k8s.api.core.v1.Volume")),
                            "nodeSelector": STR_MAP, "tolerations": arr(core("io.k8s.api.core.v1.Toleration"))}),
                "container": obj({"env": arr(core("io.k8s.api.core.v1.EnvVar")),
                                  "resources": core("io.k8s.api.core.v1.ResourceRequirements"),
                                  "volumeMounts": arr(core("io.k8s.api.core.v1.VolumeMount")),
                                  "image": STR}),
            })}),
        }, ("type",)),
    })),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): resource(obj({
        "targetRefs": arr(TARGET_REF, 1),
        "routingType": enum("Service", "Endpoint"),
        "loadBalancer": obj({
            "type": enum("ConsistentHash", "LeastRequest", "Random", "RoundRobin", "BackendUtilization", "DynamicModule"),
            "endpointOverride": obj({"extractFrom": arr(obj({"header": STR}), 1)}, ("extractFrom",)),
            "slowStart": FREE, "zoneAware": FREE, "consistentHash": FREE,
        }, ("type",)),
        "connection": obj({"bufferLimit": QUANTITY, "socketBufferLimit": QUANTITY}),
        "circuitBreaker": obj({"maxConnections": INT, "maxPendingRequests": INT, "maxParallelRequests": INT,
                               "maxParallelRetries": INT, "maxRequestsPerConnection": INT}),
        "timeout": obj({"tcp": obj({"connectTimeout": STR}),
                        "http": obj({"connectionIdleTimeout": STR, "maxConnectionDuration": STR,
                                     "requestTimeout": STR})}),
        "retry": FREE,
    })),
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): resource(obj({
        "targetRefs": arr(TARGET_REF, 1),
        "connection": obj({"bufferLimit": QUANTITY, "socketBufferLimit": QUANTITY, "connectionLimit": FREE}),
        "timeout": FREE,
    })),
}


def k8s_registry() -> Registry:
    defs = package_files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{kubernetes_validate.latest_version()}-local-strict/_definitions.json"
    )
    return Resource.from_contents(json.loads(defs.read_text())) @ Registry()


def check_schemas(manifests: Manifests) -> list[str]:
    errors = []
    registry = k8s_registry()
    for path, doc in manifests.docs:
        where = f"{path.relative_to(ROOT)}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        crd = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        if crd is not None:
            validator = jsonschema.Draft202012Validator(crd, registry=registry)
            for e in validator.iter_errors(doc):
                errors.append(f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{where}: {e.message}, and none in CRD_SCHEMAS")
                break
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{where}: Kubernetes {version}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
                break
    return errors


# ------------------------------------------------------------------------------------------------
# Envoy configuration of each deployment

WASM_FILTER = "envoy.filters.http.wasm"
HCM = "envoy.filters.network.http_connection_manager"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
ROUTER = "envoy.filters.http.router"


def typed(name: str, type_url: str, **config: Any) -> dict:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def router(**config: Any) -> dict:
    return typed(ROUTER, "envoy.extensions.filters.http.router.v3.Router", **config)


def hcm(stat_prefix: str, route_config: dict, http_filters: list, **extra: Any) -> dict:
    return typed(HCM, "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                 stat_prefix=stat_prefix, route_config=route_config, http_filters=http_filters, **extra)


def lb_endpoints(hosts: list[tuple[str, int]]) -> list:
    return [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in hosts]


def quantity_bytes(q: str | int) -> int:
    m = re.fullmatch(r"([0-9]+)([KMGTPE]i?|k)?", str(q))
    if not m:
        raise CheckError(f"unsupported quantity {q!r}")
    scale = {None: 1, "k": 1000, "K": 1000, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "M": 1000**2, "G": 1000**3}
    return int(m.group(1)) * scale[m.group(2)]


def kubernetes_bootstrap(m: Manifests) -> dict:
    """deploy/kubernetes: the ConfigMap's envoy.yaml, as Envoy loads it."""
    cm = m.one("ConfigMap", "v1", "kubernetes", "kv-router-envoy")
    return yaml.safe_load(cm["data"]["envoy.yaml"])


def istio_bootstrap(m: Manifests) -> dict:
    """deploy/istio: what istiod generates for the gateway (listener per Gateway server port,
    route from the VirtualService, a STRICT_DNS cluster `outbound|port||host` from the DNS
    ServiceEntry), with the EnvoyFilter's patches applied. Routes are inline here (RDS in Istio)."""
    gw = m.one("Gateway", "networking.istio.io/", "istio")
    vs = m.one("VirtualService", "networking.istio.io/", "istio")
    port = gw["spec"]["servers"][0]["port"]["number"]
    http = vs["spec"]["http"][0]
    dest = http["route"][0]["destination"]
    host, dest_port = dest["host"], dest["port"]["number"]
    entries = [se for se in m.of("ServiceEntry", "networking.istio.io/", "istio") if host in se["spec"]["hosts"]]
    if len(entries) != 1 or entries[0]["spec"].get("resolution") != "DNS":
        raise CheckError(f"the checker models {host} as one ServiceEntry with resolution DNS")
    cluster_name = f"outbound|{dest_port}||{host}"
    route: dict = {"cluster": cluster_name}
    if "timeout" in http:
        route["timeout"] = http["timeout"]
    if "retries" in http:
        route["retry_policy"] = {"retry_on": http["retries"]["retryOn"], "num_retries": http["retries"]["attempts"]}
    bootstrap = {
      # istio-proxy's admin: loopback only, inside the gateway pod.
      "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
      "static_resources": {
        "listeners": [{
            "name": f"0.0.0.0_{port}",
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
            "filter_chains": [{"filters": [hcm(
                f"outbound_0.0.0.0_{port}",
                {"name": f"http.{port}", "virtual_hosts": [{"name": f"*:{port}", "domains": ["*"], "routes": [
                    {"name": http.get("name", "default"), "match": {"prefix": "/"}, "route": route}]}]},
                [typed("envoy.filters.http.cors", "envoy.extensions.filters.http.cors.v3.Cors"),
                 typed("envoy.filters.http.fault", "envoy.extensions.filters.http.fault.v3.HTTPFault"),
                 router()],
                use_remote_address=True,
            )]}],
        }],
        "clusters": [{
            "name": cluster_name,
            "type": "STRICT_DNS",
            "connect_timeout": "10s",
            "lb_policy": "LEAST_REQUEST",
            "dns_lookup_family": "V4_ONLY",
            # Istio's defaults (DestinationRule connectionPool): 2^32-1 for every threshold.
            "circuit_breakers": {"thresholds": [{
                "max_connections": 4294967295, "max_pending_requests": 4294967295,
                "max_requests": 4294967295, "max_retries": 4294967295, "track_remaining": True}]},
            "respect_dns_ttl": True,
            "load_assignment": {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": lb_endpoints(
                [(ep["address"], dest_port) for ep in entries[0]["spec"]["endpoints"]])}]},
        }],
    }}
    gateway = m.one("Deployment", "apps/", "istio")
    proxy_config = yaml.safe_load(gateway["spec"]["template"]["metadata"].get("annotations", {})
                                  .get("proxy.istio.io/config", "")) or {}
    bootstrap["stats_config"] = istio_stats_config(proxy_config.get("proxyStatsMatcher", {}))
    override = istio_bootstrap_override(m, gateway)
    if override:
        # istio-agent hands the file to Envoy as --config-yaml: a proto merge (lists appended).
        proto_merge(bootstrap, override)
    for ef in m.of("EnvoyFilter", "networking.istio.io/", "istio"):
        for i, patch in enumerate(ef["spec"]["configPatches"]):
            apply_envoy_filter_patch(bootstrap, patch, f"EnvoyFilter {ef['metadata']['name']} configPatches[{i}]")
    return bootstrap


# Istio's bootstrap stats_config (tools/packaging/common/envoy_bootstrap.json, Istio 1.2x): its own
# tags instead of Envoy's defaults, and an inclusion list that drops every stat the proxy config's
# proxyStatsMatcher does not add.
ISTIO_STATS_TAGS = [
    {"tag_name": "cluster_name", "regex": r"^cluster\.((.+?(\..+?\.svc\.cluster\.local)?)\.)"},
    {"tag_name": "tcp_prefix", "regex": r"^tcp\.((.*?)\.)\w+?$"},
    {"tag_name": "response_code", "regex": r"_rq(_(\d{3}))$"},
    {"tag_name": "response_code_class", "regex": r"_rq(_(\dxx))$"},
    {"tag_name": "http_conn_manager_listener_prefix",
     "regex": r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"},
    {"tag_name": "http_conn_manager_prefix",
     "regex": r"^http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"},
    {"tag_name": "listener_address",
     "regex": r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"},
    {"tag_name": "mongo_prefix", "regex": r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"},
    {"tag_name": "cache", "regex": r"(cache\.(.+?)\.)"},
    {"tag_name": "component", "regex": r"(component\.(.+?)\.)"},
    {"tag_name": "tag", "regex": r"(tag\.(.+?);\.)"},
    {"tag_name": "wasm_filter", "regex": r"(wasm_filter\.(.+?)\.)"},
    {"tag_name": "authz_enforce_result", "regex": r"rbac(\.(allowed|denied))"},
    {"tag_name": "authz_dry_run_action", "regex": r"(\.istio_dry_run_(allow|deny)_)"},
    {"tag_name": "authz_dry_run_result", "regex": r"(\.shadow_(allowed|denied))"},
]


def istio_stats_config(matcher: dict) -> dict:
    patterns = [{"prefix": "reporter="}]
    patterns += [{"prefix": p} for p in matcher.get("inclusionPrefixes", [])]
    patterns += [{"suffix": p} for p in matcher.get("inclusionSuffixes", [])]
    patterns += [{"safe_regex": {"regex": p}} for p in matcher.get("inclusionRegexps", [])]
    patterns += [{"prefix": "component"}, {"prefix": "istio"}]
    return {"use_all_default_tags": False, "stats_tags": copy.deepcopy(ISTIO_STATS_TAGS),
            "stats_matcher": {"inclusion_list": {"patterns": patterns}}}


def istio_bootstrap_override(m: Manifests, gateway: dict) -> dict | None:
    """The istio-proxy container's ISTIO_BOOTSTRAP_OVERRIDE file, read from the ConfigMap volume
    mounted at its directory."""
    spec = gateway["spec"]["template"]["spec"]
    proxy = next((c for c in spec["containers"] if c["name"] == "istio-proxy"), {})
    path = next((e.get("value") for e in proxy.get("env", []) if e["name"] == "ISTIO_BOOTSTRAP_OVERRIDE"), None)
    if not path:
        return None
    directory, key = os.path.split(path)
    mount = next((vm for vm in proxy.get("volumeMounts", []) if vm["mountPath"].rstrip("/") == directory), None)
    volume = mount and next((v for v in spec.get("volumes", []) if v["name"] == mount["name"]), None)
    if not volume or "configMap" not in volume:
        raise CheckError(f"ISTIO_BOOTSTRAP_OVERRIDE {path}: no ConfigMap volume mounted at {directory}")
    namespace = gateway["metadata"].get("namespace", "default")
    cms = [cm for cm in m.of("ConfigMap", "v1") if cm["metadata"]["name"] == volume["configMap"]["name"]
           and cm["metadata"].get("namespace", "default") == namespace]
    if len(cms) != 1 or key not in cms[0].get("data", {}):
        raise CheckError(f"ISTIO_BOOTSTRAP_OVERRIDE {path}: ConfigMap {namespace}/"
                         f"{volume['configMap']['name']} with key {key} not in deploy/")
    return yaml.safe_load(cms[0]["data"][key])


def envoy_gateway_bootstrap(m: Manifests) -> dict:
    """deploy/envoy-gateway: what Envoy Gateway generates for the Gateway and HTTPRoute with the
    traffic policies in the manifests (names as in its default xDS naming, EDS endpoints inline as
    routingType Service delivers them), with the EnvoyPatchPolicy's JSON patches applied."""
    gw = m.one("Gateway", "gateway.networking.k8s.io/", "envoy-gateway")
    ns, gw_name = gw["metadata"]["namespace"], gw["metadata"]["name"]
    listener_spec = gw["spec"]["listeners"][0]
    route = m.one("HTTPRoute", "gateway.networking.k8s.io/", "envoy-gateway")
    route_ns = route["metadata"]["namespace"]
    port = listener_spec["port"] + (10000 if listener_spec["port"] < 1024 else 0)
    listener_name = f"{ns}/{gw_name}/{listener_spec['name']}"
    cluster_name = f"httproute/{route_ns}/{route['metadata']['name']}/rule/0"

    def policy(kind: str, target_kind: str, target: str) -> dict:
        found = [p for p in m.of(kind, "gateway.envoyproxy.io/", "envoy-gateway")
                 if any(r["kind"] == target_kind and r["name"] == target for r in p["spec"]["targetRefs"])]
        return found[0]["spec"] if found else {}

    btp = policy("BackendTrafficPolicy", "HTTPRoute", route["metadata"]["name"])
    ctp = policy("ClientTrafficPolicy", "Gateway", gw_name)
    if btp.get("routingType") != "Service":
        raise CheckError("the checker models routingType Service (cluster hosts = Service clusterIPs)")
    rule = route["spec"]["rules"][0]
    localities = []
    for ref in rule["backendRefs"]:
        svc = m.service(ref["name"], ref.get("namespace", route_ns))
        localities.append({"lb_endpoints": lb_endpoints([(svc["spec"]["clusterIP"], ref["port"])]),
                           "load_balancing_weight": ref.get("weight", 1)})
    least_request = {"policies": [{"typed_extension_config": typed(
        "envoy.load_balancing_policies.least_request",
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
        locality_lb_config={"locality_weighted_lb_config": {}})}]}
    lb_policy = least_request
    override = btp.get("loadBalancer", {}).get("endpointOverride")
    if override:
        lb_policy = {"policies": [{"typed_extension_config": typed(
            "envoy.load_balancing_policies.override_host",
            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            override_host_sources=[{"header": s["header"]} for s in override["extractFrom"]],
            fallback_policy=least_request)}]}
    route_action: dict = {"cluster": cluster_name}
    if "timeouts" in rule and "request" in rule["timeouts"]:
        route_action["timeout"] = rule["timeouts"]["request"]
    cluster_extra: dict = {}
    breaker = btp.get("circuitBreaker")
    if breaker:
        fields = {"maxConnections": "max_connections", "maxPendingRequests": "max_pending_requests",
                  "maxParallelRequests": "max_requests", "maxParallelRetries": "max_retries"}
        cluster_extra["circuit_breakers"] = {"thresholds": [
            {envoy: breaker[k] for k, envoy in fields.items() if k in breaker}]}
        if "maxRequestsPerConnection" in breaker:
            cluster_extra.setdefault("typed_extension_protocol_options", {}).setdefault(
                HTTP_OPTIONS, {"@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                               "explicit_http_config": {"http_protocol_options": {}}}
            ).setdefault("common_http_protocol_options", {})["max_requests_per_connection"] = \
                breaker["maxRequestsPerConnection"]
    idle = btp.get("timeout", {}).get("http", {}).get("connectionIdleTimeout")
    if idle:
        cluster_extra.setdefault("typed_extension_protocol_options", {}).setdefault(
            HTTP_OPTIONS, {"@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                           "explicit_http_config": {"http_protocol_options": {}}}
        ).setdefault("common_http_protocol_options", {})["idle_timeout"] = idle
    bootstrap = {
      # Envoy Gateway's bootstrap: admin on loopback only, inside the proxy pod.
      "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 19000}}},
      "static_resources": {
        "listeners": [{
            "name": listener_name,
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
            "per_connection_buffer_limit_bytes": quantity_bytes(ctp.get("connection", {}).get("bufferLimit", 32768)),
            "default_filter_chain": {"name": listener_name, "filters": [hcm(
                f"http-{port}",
                {"name": listener_name, "virtual_hosts": [{"name": f"{listener_name}/*", "domains": ["*"], "routes": [
                    {"name": f"{cluster_name}/match/0/*", "match": {"prefix": "/"}, "route": route_action}]}]},
                [router(suppress_envoy_headers=True)],
                use_remote_address=True, normalize_path=True, merge_slashes=True,
                common_http_protocol_options={"headers_with_underscores_action": "REJECT_REQUEST"},
            )]},
        }],
        "clusters": [{
            "name": cluster_name,
            "type": "STATIC",
            "connect_timeout": "10s",
            "per_connection_buffer_limit_bytes": quantity_bytes(btp.get("connection", {}).get("bufferLimit", 32768)),
            "ignore_health_on_host_removal": True,
            "load_balancing_policy": lb_policy,
            "load_assignment": {"cluster_name": cluster_name, "endpoints": localities},
            **cluster_extra,
        }],
    }}
    for epp in m.of("EnvoyPatchPolicy", "gateway.envoyproxy.io/", "envoy-gateway"):
        target = epp["spec"]["targetRef"]
        if (target["kind"], target["name"]) != ("Gateway", gw_name):
            raise CheckError(f"EnvoyPatchPolicy {epp['metadata']['name']} targets {target}, not Gateway {gw_name}")
        for i, patch in enumerate(epp["spec"]["jsonPatches"]):
            apply_xds_json_patch(bootstrap, patch, f"EnvoyPatchPolicy {epp['metadata']['name']} jsonPatches[{i}]")
    for ep in m.of("EnvoyProxy", "gateway.envoyproxy.io/", "envoy-gateway"):
        custom = ep["spec"].get("bootstrap")
        if custom is None:
            continue
        if custom.get("type") != "Merge":
            raise CheckError(f"EnvoyProxy {ep['metadata']['name']}: the checker models bootstrap type Merge only")
        # "add or override a value within a map, or add a new value to a list"
        proto_merge(bootstrap, yaml.safe_load(custom["value"]))
    return bootstrap


# --- Istio EnvoyFilter semantics (the subset the manifests use; anything else is an error) ------


def proto_merge(dst: dict, src: dict, replace_lists: bool = False) -> None:
    """Proto merge on the JSON form: scalars replace, messages merge, repeated fields append."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            if "@type" in value and value.get("@type") != dst[key].get("@type"):
                dst[key] = copy.deepcopy(value)
            else:
                proto_merge(dst[key], value, replace_lists)
        elif isinstance(value, list) and isinstance(dst.get(key), list) and not replace_lists:
            dst[key].extend(copy.deepcopy(value))
        else:
            dst[key] = copy.deepcopy(value)


def listener_port(listener: dict) -> int:
    return listener["address"]["socket_address"]["port_value"]


def apply_envoy_filter_patch(bootstrap: dict, patch: dict, where: str) -> None:
    apply_to = patch["applyTo"]
    match = patch.get("match", {})
    op = patch["patch"]["operation"]
    value = patch["patch"].get("value", {})
    # The bootstrap is a gateway's: a patch for sidecars (or for another workload) matches nothing.
    if match.get("context", "ANY") not in ("ANY", "GATEWAY"):
        raise CheckError(f"{where}: context {match['context']} matches nothing on a gateway")
    resources = bootstrap["static_resources"]
    applied = 0
    if apply_to == "CLUSTER":
        if op == "ADD":
            resources["clusters"].append(copy.deepcopy(value))
            return
        want = match.get("cluster", {})
        for cluster in resources["clusters"]:
            parts = cluster["name"].split("|")
            fields = dict(zip(("direction", "portNumber", "subset", "service"), parts)) if len(parts) == 4 else {}
            if want.get("name") not in (None, cluster["name"]):
                continue
            if any(k in want and str(want[k]) != fields.get(k) for k in ("portNumber", "subset", "service")):
                continue
            if op in ("MERGE", "MERGE_AND_REPLACE_LIST"):
                proto_merge(cluster, value, op == "MERGE_AND_REPLACE_LIST")
                applied += 1
            else:
                raise CheckError(f"{where}: the checker does not model {op} on CLUSTER")
    elif apply_to in ("LISTENER", "HTTP_FILTER", "NETWORK_FILTER"):
        lmatch = match.get("listener", {})
        unsupported = set(lmatch) - {"portNumber", "name", "filterChain"}
        unsupported |= set(lmatch.get("filterChain", {})) - {"filter"}
        if unsupported:
            raise CheckError(f"{where}: the checker does not model listener match fields {sorted(unsupported)}")
        if apply_to == "LISTENER" and op == "ADD":
            resources["listeners"].append(copy.deepcopy(value))
            return
        for listener in resources["listeners"]:
            if lmatch.get("portNumber") not in (None, listener_port(listener)):
                continue
            if lmatch.get("name") not in (None, listener["name"]):
                continue
            if apply_to == "LISTENER":
                if op != "MERGE":
                    raise CheckError(f"{where}: the checker does not model {op} on LISTENER")
                proto_merge(listener, value)
                applied += 1
                continue
            fmatch = lmatch.get("filterChain", {}).get("filter", {})
            if apply_to == "NETWORK_FILTER":
                if op != "MERGE" or fmatch.get("name") != HCM:
                    raise CheckError(f"{where}: the checker models NETWORK_FILTER only as MERGE into {HCM}")
                for chain in listener.get("filter_chains", []):
                    for net_filter in chain["filters"]:
                        if net_filter["name"] == HCM:
                            proto_merge(net_filter, value)
                            applied += 1
                continue
            if fmatch.get("name") not in (None, HCM):
                raise CheckError(f"{where}: HTTP_FILTER patches need the {HCM} filter")
            for chain in listener.get("filter_chains", []):
                for net_filter in chain["filters"]:
                    if net_filter["name"] != HCM:
                        continue
                    applied += insert_http_filter(net_filter["typed_config"]["http_filters"], op, value,
                                                  fmatch.get("subFilter", {}).get("name"), where)
    else:
        raise CheckError(f"{where}: the checker does not model applyTo {apply_to}")
    if applied == 0:
        raise CheckError(f"{where}: matches nothing in the gateway configuration (istiod would skip it silently)")


def insert_http_filter(filters: list, op: str, value: dict, sub_filter: str | None, where: str) -> int:
    names = [f["name"] for f in filters]
    if sub_filter is not None and sub_filter not in names:
        return 0
    at = names.index(sub_filter) if sub_filter is not None else None
    if op == "INSERT_BEFORE":
        filters.insert(at if at is not None else 0, copy.deepcopy(value))
    elif op == "INSERT_AFTER":
        filters.insert(at + 1 if at is not None else len(filters), copy.deepcopy(value))
    elif op == "INSERT_FIRST":
        filters.insert(0, copy.deepcopy(value))
    elif op == "ADD":
        filters.append(copy.deepcopy(value))
    else:
        raise CheckError(f"{where}: the checker does not model {op} on HTTP_FILTER")
    return 1


# --- Envoy Gateway EnvoyPatchPolicy semantics: RFC 6902 on the resource's proto JSON ------------


def pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise CheckError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, op: dict, where: str) -> Any:
    if "jsonPath" in op:
        raise CheckError(f"{where}: the checker does not model jsonPath")
    kind, tokens = op["op"], pointer(op.get("path", ""))

    def parent(tokens: list[str], create: bool) -> tuple[Any, str]:
        node = doc
        for t in tokens[:-1]:
            if isinstance(node, list):
                node = node[int(t)]
            elif t in node:
                node = node[t]
            elif create:  # Envoy Gateway applies patches with EnsurePathExistsOnAdd
                node[t] = {}
                node = node[t]
            else:
                raise CheckError(f"{where}: path {op['path']} does not exist")
        return node, tokens[-1]

    def get(tokens: list[str]) -> Any:
        node = doc
        for t in tokens:
            try:
                node = node[int(t)] if isinstance(node, list) else node[t]
            except (KeyError, IndexError, ValueError):
                raise CheckError(f"{where}: path /{'/'.join(tokens)} does not exist") from None
        return node

    def add(tokens: list[str], value: Any) -> None:
        node, last = parent(tokens, create=True)
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if not 0 <= index <= len(node):
                raise CheckError(f"{where}: index {index} out of range")
            node.insert(index, value)
        else:
            node[last] = value

    def remove(tokens: list[str]) -> Any:
        get(tokens)
        node, last = parent(tokens, create=False)
        return node.pop(int(last)) if isinstance(node, list) else node.pop(last)

    if not tokens:
        raise CheckError(f"{where}: the whole-resource form is only for adding a resource")
    if kind == "add":
        add(tokens, copy.deepcopy(op["value"]))
    elif kind == "remove":
        remove(tokens)
    elif kind == "replace":
        remove(tokens)
        add(tokens, copy.deepcopy(op["value"]))
    elif kind == "test":
        if get(tokens) != op["value"]:
            raise CheckError(f"{where}: test failed at {op['path']}")
    elif kind in ("move", "copy"):
        value = get(pointer(op["from"]))
        if kind == "move":
            remove(pointer(op["from"]))
        add(tokens, copy.deepcopy(value))
    return doc


def apply_xds_json_patch(bootstrap: dict, patch: dict, where: str) -> None:
    kinds = {
        "type.googleapis.com/envoy.config.listener.v3.Listener": "listeners",
        "type.googleapis.com/envoy.config.cluster.v3.Cluster": "clusters",
    }
    if patch["type"] not in kinds:
        raise CheckError(f"{where}: the checker does not model {patch['type']} patches")
    collection = bootstrap["static_resources"][kinds[patch["type"]]]
    op = patch["operation"]
    if op["op"] == "add" and op.get("path", "") == "" and "jsonPath" not in op:
        collection.append(copy.deepcopy(op["value"]))
        return
    targets = [r for r in collection if r["name"] == patch["name"]]
    if not targets:
        raise CheckError(f"{where}: no {kinds[patch['type']][:-1]} named {patch['name']!r} "
                         "(Envoy Gateway would report ResourceNotFound and skip the patch)")
    json_patch(targets[0], op, where)


# --- Checks on the rendered configuration -------------------------------------------------------


def walk(node: Any) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def kv_router_filters(bootstrap: dict) -> list[tuple[dict, dict]]:
    """(listener, wasm filter config) for every kv_router Wasm filter."""
    found = []
    for listener in bootstrap["static_resources"].get("listeners", []):
        for node in walk(listener):
            if node.get("name") == WASM_FILTER and "typed_config" in node:
                found.append((listener, node["typed_config"].get("config", {})))
    return found


def routed_clusters(listener: dict) -> set[str]:
    return {n["cluster"] for n in walk(listener) if isinstance(n.get("cluster"), str) and "match" not in n}


def cluster_hosts(cluster: dict, m: Manifests) -> set[str]:
    """ip:port of the cluster's hosts; Kubernetes Service names resolve to their clusterIP."""
    hosts = set()
    for ep in walk(cluster.get("load_assignment", {})):
        sa = ep.get("socket_address")
        if not sa:
            continue
        address = sa["address"]
        svc_dns = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", address)
        if svc_dns:
            address = m.service(svc_dns.group(1), svc_dns.group(2))["spec"]["clusterIP"]
        hosts.add(f"{address}:{sa['port_value']}")
    return hosts


def override_header(cluster: dict) -> str | None:
    for node in walk(cluster.get("load_balancing_policy", {})):
        if node.get("name") == "envoy.load_balancing_policies.override_host":
            sources = node["typed_config"].get("override_host_sources", [])
            return sources[0].get("header") if sources else None
    return None


def check_rendered(bootstrap: dict, m: Manifests, scenario: str) -> list[str]:
    errors = []
    clusters = {c["name"]: c for c in bootstrap["static_resources"].get("clusters", [])}
    filters = kv_router_filters(bootstrap)
    if not filters:
        return [f"{scenario}: no {WASM_FILTER} filter in the rendered configuration"]
    for listener, wasm in filters:
        where = f"{scenario}: listener {listener['name']}: kv_router filter"
        if wasm.get("allow_on_headers_stop_iteration") is not True:
            errors.append(f"{where}: allow_on_headers_stop_iteration must be true (the filter reads the body first)")
        if not wasm.get("vm_config", {}).get("vm_id"):
            errors.append(f"{where}: vm_config.vm_id must be set (shared data is scoped by it)")
        if wasm.get("failure_policy") != "FAIL_RELOAD":
            errors.append(f"{where}: failure_policy should be FAIL_RELOAD")
        chain = next(n["http_filters"] for n in walk(listener) if "http_filters" in n)
        names = [f["name"] for f in chain]
        if ROUTER in names and names.index(WASM_FILTER) > names.index(ROUTER):
            errors.append(f"{where}: must come before {ROUTER}")
        try:
            config = json.loads(wasm["configuration"]["value"])
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            errors.append(f"{where}: configuration is not a JSON string value: {e}")
            continue
        header = config.get("destination_header", FILTER_DEFAULTS["destination_header"]).lower()
        fmt = config.get("destination_format", FILTER_DEFAULTS["destination_format"])
        workers = {w.get("address") for w in config.get("workers", [])}
        for name in sorted(routed_clusters(listener)):
            cluster = clusters.get(name)
            if cluster is None:
                errors.append(f"{where}: routes to cluster {name!r}, which is not defined")
                continue
            if fmt == "override_host":
                steer = override_header(cluster)
                if steer is None or steer.lower() != header:
                    errors.append(f"{where}: cluster {name} must steer by override_host on header {header!r} "
                                  f"(its override_host header: {steer!r})")
                missing = workers - cluster_hosts(cluster, m)
                if missing:
                    errors.append(f"{where}: workers {sorted(missing)} are not hosts of cluster {name} "
                                  f"({sorted(cluster_hosts(cluster, m))}); override_host would ignore them")
        for w in config.get("workers", []):
            for key in ("address", "events_address"):
                address = w.get(key, w.get("address"))
                ip, _, port = str(address).rpartition(":")
                svc = m.service_by_ip(ip)
                if svc is None:
                    errors.append(f"{where}: worker {w.get('id')} {key} {address}: no Service with clusterIP {ip}")
                elif int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                    errors.append(f"{where}: worker {w.get('id')} {key} {address}: Service "
                                  f"{svc['metadata']['name']} has no port {port}")
        events = clusters.get(config.get("events", {}).get("cluster", FILTER_DEFAULTS["events_cluster"]))
        if events is None or events.get("type") != "ORIGINAL_DST" or \
                not events.get("original_dst_lb_config", {}).get("use_http_header"):
            errors.append(f"{where}: needs the event cluster {FILTER_DEFAULTS['events_cluster']!r} "
                          "(ORIGINAL_DST, original_dst_lb_config.use_http_header: true)")
        if "membership" in config:
            errors += check_membership(config["membership"], bootstrap, clusters, listener, where)
        # `engine: vllm` presets the block size (core/src/config/preset.rs) unless it is written.
        default_block = 16 if config.get("engine") == "vllm" else FILTER_DEFAULTS["block_size"]
        errors += check_block_sizes(config.get("block_size", default_block), m, where)
        filename = wasm.get("vm_config", {}).get("code", {}).get("local", {}).get("filename", "")
        if os.path.dirname(filename) not in wasm_mount_paths(m, scenario):
            errors.append(f"{where}: {filename} is not in a mounted {WASM_CONFIGMAP} ConfigMap "
                          f"(mounts: {sorted(wasm_mount_paths(m, scenario))})")
    return errors


def check_membership(membership: dict, bootstrap: dict, clusters: dict, listener: dict,
                     where: str) -> list[str]:
    """The filter's `membership`: it follows a cluster this listener routes to, and reads admin
    through a cluster that reaches this Envoy's own (loopback) admin and that the listener does
    not route to (clients must never reach admin)."""
    errors = []
    followed = membership.get("cluster")
    if followed not in routed_clusters(listener):
        errors.append(f"{where}: membership.cluster {followed!r} is not a cluster this listener routes to")
    name = membership.get("admin_cluster", "envoy_admin")
    admin_cluster = clusters.get(name)
    if admin_cluster is None:
        errors.append(f"{where}: membership.admin_cluster {name!r} is not defined")
        return errors
    if name in routed_clusters(listener):
        errors.append(f"{where}: membership.admin_cluster {name!r} is routed by the client listener: "
                      "clients could reach Envoy's admin")
    admin = bootstrap.get("admin", {}).get("address", {})
    targets = [n.get("address") for n in walk(admin_cluster.get("load_assignment", {})) if "address" in n]
    if admin not in targets:
        errors.append(f"{where}: membership.admin_cluster {name!r} does not point at this Envoy's admin "
                      f"address {admin}")
    sa = admin.get("socket_address")
    if sa and sa.get("address") not in ("127.0.0.1", "::1"):
        errors.append(f"{where}: admin is bound to {sa.get('address')}: bind it to loopback or a pipe")
    return errors


def check_block_sizes(filter_block_size: int, m: Manifests, where: str) -> list[str]:
    errors = []
    for sts in m.of("StatefulSet", "apps/", "kubernetes"):
        for c in sts["spec"]["template"]["spec"]["containers"]:
            for arg in c.get("args", []):
                b = re.fullmatch(r"--block-size=(\d+)", str(arg))
                if b and int(b.group(1)) != filter_block_size:
                    errors.append(f"{where}: block_size {filter_block_size} but container {c['name']} "
                                  f"runs with {arg}")
    return errors


def wasm_mount_paths(m: Manifests, scenario: str) -> set[str]:
    """mountPaths of volumes made from the kv-router-wasm ConfigMap, in the scenario's workloads."""
    paths = set()
    pod_specs = [d["spec"]["template"]["spec"] for d in m.of("Deployment", "apps/", scenario)]
    for ep in m.of("EnvoyProxy", "gateway.envoyproxy.io/", scenario):
        deployment = ep["spec"].get("provider", {}).get("kubernetes", {}).get("envoyDeployment", {})
        pod_specs.append({"volumes": deployment.get("pod", {}).get("volumes", []),
                          "containers": [deployment.get("container", {})]})
    for spec in pod_specs:
        wasm_volumes = {v["name"] for v in spec.get("volumes", [])
                        if v.get("configMap", {}).get("name") == WASM_CONFIGMAP}
        for c in spec.get("containers", []):
            paths |= {vm["mountPath"] for vm in c.get("volumeMounts", []) if vm["name"] in wasm_volumes}
    return paths


def for_envoy(bootstrap: dict) -> dict:
    """The copy Envoy validates: the .wasm at its path here, and DNS lookups kept on loopback
    (validate mode resolves STRICT_DNS names; *.svc.cluster.local exists only in a cluster)."""
    out = copy.deepcopy(bootstrap)
    for node in walk(out):
        local = node.get("vm_config", {}).get("code", {}).get("local")
        if local and "filename" in local:
            local["filename"] = str(WASM)
    for cluster in out["static_resources"].get("clusters", []):
        if cluster.get("type") in ("STRICT_DNS", "LOGICAL_DNS") and "typed_dns_resolver_config" not in cluster:
            cluster["typed_dns_resolver_config"] = typed(
                "envoy.network.dns_resolver.cares",
                "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                resolvers=[{"socket_address": {"address": "127.0.0.1", "port_value": 53}}])
    return out


def envoy_validate(bootstrap: dict, label: str) -> list[str]:
    if not WASM.is_file():
        return [f"{label}: {WASM} is missing: build it with `bash scripts/build-wasm.sh`"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="check-deploy-") as f:
        json.dump(for_envoy(bootstrap), f)
        f.flush()
        try:
            run = subprocess.run([str(ENVOY), "--mode", "validate", "-c", f.name, "-l", "error",
                                  "--disable-hot-restart"], capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            return [f"{label}: envoy --mode validate timed out"]
    if run.returncode != 0:
        # After a parse error Envoy echoes the whole configuration: cut it off.
        lines = [line.split('{"static_resources"')[0][:1000] for line in (run.stdout + run.stderr).strip().splitlines()]
        tail = "\n    ".join(lines[-6:])
        return [f"{label}: envoy --mode validate failed:\n    {tail}"]
    return []


SCENARIOS: dict[str, Callable[[Manifests], dict]] = {
    "kubernetes": kubernetes_bootstrap,
    "istio": istio_bootstrap,
    "envoy-gateway": envoy_gateway_bootstrap,
}


def check_scenario(m: Manifests, scenario: str, run_envoy: bool = True) -> list[str]:
    try:
        bootstrap = SCENARIOS[scenario](m)
    except CheckError as e:
        return [f"{scenario}: {e}"]
    errors = check_rendered(bootstrap, m, scenario)
    if run_envoy and not errors:
        errors += envoy_validate(bootstrap, scenario)
    return errors


# ------------------------------------------------------------------------------------------------
# Metric names: src/ <-> docs/METRICS.md <-> the dashboard


def prometheus_name(stat: str) -> str:
    """Envoy's /stats/prometheus name of a Wasm stat (wasmcustom namespace stripped) once its tags
    are extracted; `<x>` placeholders are kept."""
    return "".join(part if part.startswith("<") else re.sub(r"[^a-zA-Z0-9_:]", "_", part)
                   for part in re.split(r"(<\w+>)", stat))


# --- Stats tags: the filter's per-worker and per-reason stats as Prometheus labels --------------

PLAIN_ENVOY_CONFIGS = ["envoy/envoy.yaml", "envoy/envoy-original-dst.yaml", "envoy/envoy-compose.yaml"]
# Labels Prometheus itself adds to every series of a target (a dashboard may group by them).
TARGET_LABELS = {"instance", "job", "pod", "namespace", "kubernetes_pod_name", "kubernetes_namespace"}


def stats_tags(bootstrap: dict) -> list[tuple[str, str]]:
    """(tag_name, regex) of every regex tag specifier of a bootstrap."""
    return [(t["tag_name"], t["regex"]) for t in bootstrap.get("stats_config", {}).get("stats_tags", [])
            if "regex" in t]


def filter_stats_tags(bootstrap: dict) -> list[tuple[str, str]]:
    """The tag specifiers written for the filter's stats (their regex names kv_router)."""
    return [(name, rx) for name, rx in stats_tags(bootstrap) if "kv_router" in rx]


def reference_stats_tags() -> list[tuple[str, str]]:
    """envoy/envoy.yaml's tag specifiers for the filter's stats: what every shipped configuration
    carries (tests/metrics_tags.rs holds the test harness's to the same text)."""
    tags = filter_stats_tags(yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text()))
    if not tags:
        raise CheckError("envoy/envoy.yaml has no stats_config.stats_tags for the filter's stats")
    return tags


def python_regex(envoy_regex: str) -> re.Pattern | None:
    """An Envoy tag regex (std::regex, ECMAScript) for Python's re; None if it does not compile."""
    try:
        return re.compile(envoy_regex.replace("[:digit:]", "0-9"))
    except re.error:
        return None


def extract_tags(tags: list[tuple[str, str]], name: str) -> tuple[str, list[tuple[str, str]]]:
    """Envoy's tag extraction (source/common/stats/tag_extractor_impl.cc): each regex is searched
    in the full name; its first group is cut from the name, its second (else its first) is the
    tag's value."""
    cut, found = [], []
    for tag, rx in tags:
        pattern = python_regex(rx)
        m = pattern.search(name) if pattern is not None and pattern.groups else None
        if m and m.group(1) is not None:
            value = m.group(2) if pattern.groups >= 2 and m.group(2) is not None else m.group(1)
            found.append((tag, value))
            cut.append(m.span(1))
    kept = "".join(c for i, c in enumerate(name) if not any(a <= i < b for a, b in cut))
    return kept, found


def exported(tags: list[tuple[str, str]], stat: str) -> tuple[str, list[tuple[str, str]]]:
    """Prometheus name and labels of the filter's stat `stat` (`kv_router.…`, as after
    `wasmcustom.` in /stats)."""
    kept, found = extract_tags(tags, f"wasmcustom.{stat}")
    return prometheus_name(kept.removeprefix("wasmcustom.")), found


def documented_exported(tags: list[tuple[str, str]], stat: str) -> str:
    """The Prometheus column docs/METRICS.md must show for a documented stat template:
    `kv_router_worker_active_requests{worker="<id>",rank="<rank>"}`."""
    placeholders = re.findall(r"<(\w+)>", stat)
    sentinels = {ph: f"9{i}9" for i, ph in enumerate(placeholders)}
    concrete = stat
    for ph, v in sentinels.items():
        concrete = concrete.replace(f"<{ph}>", v)
    name, labels = exported(tags, concrete)
    back = {v: f"<{ph}>" for ph, v in sentinels.items()}
    for v, ph in back.items():
        name = name.replace(v, ph)
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{back.get(v, v)}"' for k, v in labels) + "}"


def stats_matcher_accepts(matcher: dict, name: str) -> bool:
    def hit(patterns: list) -> bool:
        for p in patterns:
            if ("prefix" in p and name.startswith(p["prefix"])) or ("suffix" in p and name.endswith(p["suffix"])) \
                    or ("exact" in p and name == p["exact"]) or ("contains" in p and p["contains"] in name) \
                    or ("safe_regex" in p and re.fullmatch(p["safe_regex"]["regex"], name)):
                return True
        return False
    if "reject_all" in matcher:
        return not matcher["reject_all"]
    if "inclusion_list" in matcher:
        return hit(matcher["inclusion_list"].get("patterns", []))
    if "exclusion_list" in matcher:
        return not hit(matcher["exclusion_list"].get("patterns", []))
    return True


def check_stats_tags(bootstrap: dict, label: str, reference: list[tuple[str, str]], src: Path) -> list[str]:
    """The bootstrap carries envoy/envoy.yaml's tag specifiers for the filter's stats, no other
    specifier of it (Istio's own, say) also matches them, and its stats matcher keeps them."""
    errors = []
    tags = filter_stats_tags(bootstrap)
    if tags != reference:
        errors.append(f"{label}: stats_config.stats_tags for the filter's stats are {tags or 'missing'}, "
                      f"not envoy/envoy.yaml's {reference} (docs/METRICS.md, Tags)")
        return errors
    everything = stats_tags(bootstrap)
    for template in sorted(set(src_metric_templates(src))):
        stat = "kv_router." + re.sub(r"\{[^}]*\}", "1", template)
        if exported(everything, stat) != exported(reference, stat):
            errors.append(f"{label}: another stats tag also matches wasmcustom.{stat}: "
                          f"{exported(everything, stat)} instead of {exported(reference, stat)}")
        matcher = bootstrap.get("stats_config", {}).get("stats_matcher")
        if matcher and not stats_matcher_accepts(matcher, f"wasmcustom.{stat}"):
            errors.append(f"{label}: stats_config.stats_matcher drops wasmcustom.{stat}")
    return errors


def check_plain_configs(reference: list[tuple[str, str]], src: Path) -> list[str]:
    errors = []
    for rel in PLAIN_ENVOY_CONFIGS:
        errors += check_stats_tags(yaml.safe_load((ROOT / rel).read_text()), rel, reference, src)
    return errors


# --- docs/METRICS.md and src/ ---------------------------------------------------------------------


def documented_metrics(doc: str) -> list[tuple[str, str]]:
    """(stat, Prometheus name) of every table row whose first two cells are code."""
    return [(stat, prom) for stat, prom, _ in documented_rows(doc)]


def documented_rows(doc: str) -> list[tuple[str, str, str]]:
    """(stat, Prometheus name, type) of every table row whose first two cells are code."""
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (\w+) \|", doc, re.M)
    if not rows:
        raise CheckError("docs/METRICS.md has no metric table rows")
    return rows


def placeholder_values(doc: str) -> dict[str, list[str]]:
    """`<name>`: `a`, `b`, ... paragraphs listing a placeholder's values."""
    values = {}
    for name, body in re.findall(r"^`<(\w+)>`: (.*?)(?:\n\n|\Z)", doc, re.M | re.S):
        values[name] = re.findall(r"`([^`<>]+)`", re.sub(r"\([^)]*\)", "", body))
    return values


def expand(template: str, values: dict[str, list[str]]) -> list[str]:
    """Every concrete name of a documented template; free placeholders (<id>, <rank>) as 0."""
    names = [template]
    for ph in re.findall(r"<(\w+)>", template):
        names = [n.replace(f"<{ph}>", v, 1) for n in names for v in values.get(ph, ["0"])]
    return names


def core_src(src: Path) -> Path:
    """The routing core's sources (kv-router-core, `core/src/`) next to the filter's `src/` (the
    proxy-wasm adapter), which re-exports them: the metric names are in both."""
    return src.parent / "core" / "src"


def filter_sources(src: Path) -> str:
    """The Rust text of the filter: the adapter (`src/`) and the core (`core/src/`)."""
    return "\n".join(p.read_text() for d in (src, core_src(src)) for p in sorted(d.rglob("*.rs")))


def src_metrics(src: Path) -> list[tuple[str, str]]:
    """(name, type) of every name passed to the metrics API in src/, `{...}` interpolations kept
    as they are."""
    text = filter_sources(src)
    # `host.count*`/`host.histogram`: the request path's `Host` (core/src/request_path/host.rs).
    found = re.findall(r"(?:metrics|self|host)\s*\.\s*(inc|add|add_later|count|count_later|gauge|gauge_add|histogram|histogram_id)\(\s*"
                       r"(?:&format!\(\s*)?\"([^\"]+)\"", text)
    nested = re.findall(r"let name = format!\(\"([^\"]+)\"", text)  # worker gauges: {name}.field
    kinds = {"gauge": "gauge", "gauge_add": "gauge", "histogram": "histogram", "histogram_id": "histogram"}
    out = []
    for method, t in found:
        kind = kinds.get(method, "counter")
        out += [(t.replace("{name}", n), kind) for n in nested] if "{name}" in t else [(t, kind)]
    # The request path's per-reason counters are static names picked by a `match`
    # (core/src/request_path/counters.rs, `... => "routed.kv"`): each family once, as `family.{}`.
    families = re.findall(r"=> \"([a-z_.]+)\.[a-z_-]+\"", counters_rs(src))
    out += [(f + ".{}", "counter") for f in dict.fromkeys(families)]
    return out


def counters_rs(src: Path) -> str:
    path = core_src(src) / "request_path" / "counters.rs"
    return path.read_text() if path.exists() else ""


def src_metric_templates(src: Path) -> list[str]:
    return [t for t, _ in src_metrics(src)]


def src_exported(src: Path, tags: list[tuple[str, str]]) -> list[tuple[re.Pattern, str, set[str]]]:
    """(Prometheus name pattern, type, labels) of every metric src/ defines, as Envoy exports it
    with `tags`; what src/ interpolates into a name and no tag takes out stays a `.+`."""
    out = []
    for template, kind in src_metrics(src):
        name, labels = exported(tags, "kv_router." + re.sub(r"\{[^}]*\}", "1", template))
        pattern = re.sub(r"(?<=_)1(?=_|$)", ".+", re.escape(name))
        out.append((re.compile(pattern), kind, {k for k, _ in labels}))
    return out


def src_enumerations(src: Path) -> dict[str, set[str]]:
    text = filter_sources(src)
    reasons = set(re.findall(r"Reason::\w+ => \"([a-z-]+)\"", text))
    whys = set(re.findall(r"self\.fallback\([^;]*?\"([a-z_]+)\"\)", text))
    whys |= set(re.findall(r"Fallback::\w+ => \"fallback\.([a-z_]+)\"", counters_rs(src)))
    for block in re.findall(r"let why = match .*?\};", text, re.S):
        whys |= set(re.findall(r"=> \"([a-z_]+)\"", block))
    kinds = set(re.findall(r"RouteError::\w+(?: \{ \.\. \})? => \"([a-z_]+)\"", text))
    kinds |= {t.split(".", 1)[1] for t in src_metric_templates(src) if re.fullmatch(r"rejected\.[a-z_]+", t)}
    # A RouteError that is also a fallback cause is routed by the fallback rule, never rejected.
    return {"reason": reasons, "why": whys, "kind": kinds - whys}


def check_metrics_doc(doc: str, src: Path, tags: list[tuple[str, str]]) -> list[str]:
    errors = []
    rows = documented_metrics(doc)
    values = placeholder_values(doc)
    filter_rows = [(s, p) for s, p in rows if s.startswith("kv_router.")]
    for stat, prom in rows:
        want = documented_exported(tags, stat) if stat.startswith("kv_router.") else prometheus_name(f"envoy.{stat}")
        if prom != want:
            errors.append(f"docs/METRICS.md: {stat} is exported as {want}, not {prom}")
    concrete = {n for s, _ in filter_rows for n in expand(s.removeprefix("kv_router."), values)}
    templates = src_metric_templates(src)
    if len(templates) < 10:
        errors.append(f"found only {len(templates)} metric names in src/: the extraction in {__file__} needs updating")
    for t in templates:
        rx = re.compile(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(t)))
        if not any(rx.fullmatch(n) for n in concrete):
            errors.append(f"docs/METRICS.md: src/ defines metric {t!r}, which is not documented")
    src_rx = [re.compile(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(t))) for t in templates]
    for stat, _ in filter_rows:
        if not any(rx.fullmatch(n) for rx in src_rx for n in expand(stat.removeprefix("kv_router."), values)):
            errors.append(f"docs/METRICS.md: {stat} is documented but src/ defines no such metric")
    for ph, src_values in src_enumerations(src).items():
        doc_values = set(values.get(ph, []))
        for v in sorted(src_values - doc_values):
            errors.append(f"docs/METRICS.md: <{ph}> value {v!r} (from src/) is not listed")
        for v in sorted(doc_values - src_values):
            errors.append(f"docs/METRICS.md: <{ph}> value {v!r} is listed but src/ has no such value")
    return errors


# --- The dashboard --------------------------------------------------------------------------------


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in walk(dashboard) for t in p.get("targets", []) if "expr" in t]


GRAFANA_VARIABLES = re.compile(r"\$__(rate_interval|interval|range)\b")


def parse_promql(expr: str) -> Any:
    return promql_parser.parse(GRAFANA_VARIABLES.sub("5m", expr))


def selectors_in(node: Any) -> list[Any]:
    found: list[Any] = []

    def visit(n: Any) -> bool:
        if isinstance(n, promql_parser.VectorSelector):
            found.append(n)
        return True

    promql_parser.walk(node, visit)
    return found


def selector_names(sel: Any) -> list[tuple[str, str]]:
    """("name", metric) or ("regex", pattern) of one series selector."""
    found = [("name", sel.name)] if sel.name else []
    for m in sel.matchers.matchers:
        if m.name == "__name__":
            found.append(("regex" if m.op == promql_parser.MatchOp.Re else "name", m.value))
    return found


def metric_selectors(expr: str) -> list[tuple[str, str]]:
    """("name", metric) or ("regex", pattern) of every series selector in a PromQL expression."""
    return [n for sel in selectors_in(parse_promql(expr)) for n in selector_names(sel)]


def grouping_labels(expr: str) -> list[tuple[list[Any], list[str]]]:
    """(selectors aggregated, labels) of every `by (...)` aggregation, and (selector, label
    matchers) of every selector: the labels each selected series must carry."""
    uses: list[tuple[list[Any], list[str]]] = []

    def visit(n: Any) -> bool:
        if isinstance(n, promql_parser.AggregateExpr) and n.modifier is not None \
                and n.modifier.type == promql_parser.AggModifierType.By:
            uses.append((selectors_in(n.expr), list(n.modifier.labels)))
        if isinstance(n, promql_parser.VectorSelector):
            uses.append(([n], [m.name for m in n.matchers.matchers if m.name != "__name__"]))
        return True

    promql_parser.walk(parse_promql(expr), visit)
    return uses


def check_dashboard(dashboard_text: str, doc: str, src: Path, tags: list[tuple[str, str]]) -> list[str]:
    """Every query parses, selects only metrics docs/METRICS.md lists and src/ defines (as Envoy
    exports them with the stats tags), and groups or filters only by labels those series carry."""
    try:
        dashboard = json.loads(dashboard_text)
    except json.JSONDecodeError as e:
        return [f"{DASHBOARD.relative_to(ROOT)}: not valid JSON: {e}"]
    errors = []
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dashboard:
            errors.append(f"{DASHBOARD.relative_to(ROOT)}: no {key!r}")
    # name -> (labels, type) as docs/METRICS.md lists them
    documented: dict[str, tuple[set[str], str]] = {}
    for _, prom, kind in documented_rows(doc):
        name, _, labels = prom.partition("{")
        documented[name] = ({k for k in re.findall(r"(\w+)=", labels)}, kind)
    defined = src_exported(src, tags)
    exprs = dashboard_exprs(dashboard)
    if not exprs:
        errors.append(f"{DASHBOARD.relative_to(ROOT)}: no Prometheus queries")

    def series(value: str) -> tuple[str, set[str]] | None:
        """The documented metric a series name belongs to, and the labels its series carry."""
        if value in documented:
            return value, documented[value][0]
        base = re.sub(r"_(bucket|sum|count)$", "", value)
        if documented.get(base, (set(), ""))[1] == "histogram":
            return base, documented[base][0] | ({"le"} if value.endswith("_bucket") else set())
        return None

    for expr in exprs:
        try:
            selectors = metric_selectors(expr)
            uses = grouping_labels(expr)
        except ValueError as e:
            errors.append(f"dashboard: PromQL does not parse ({e}): {expr}")
            continue
        for kind, value in selectors:
            if kind == "regex":
                if not any(re.fullmatch(value, n) for n in documented):
                    errors.append(f"dashboard: {value!r} matches no metric in docs/METRICS.md")
                continue
            found = series(value)
            if found is None:
                errors.append(f"dashboard: {value} is not in docs/METRICS.md")
                continue
            base = found[0]
            if base.startswith("kv_router_"):
                want = "histogram" if base != value else None
                if not any(rx.fullmatch(base) and (want is None or kind_ == want) for rx, kind_, _ in defined):
                    errors.append(f"dashboard: {value}: src/ defines no metric Envoy exports under that name "
                                  "(with the stats tags of envoy/envoy.yaml)")
        for sels, labels in uses:
            for sel in sels:
                for kind, value in selector_names(sel):
                    found = series(value) if kind == "name" else None
                    if found is None:
                        continue
                    for label in labels:
                        if label not in found[1] | TARGET_LABELS:
                            errors.append(f"dashboard: {value} has no label {label!r} "
                                          f"(its labels: {sorted(found[1]) or 'none'}): {expr}")
    return errors


# ------------------------------------------------------------------------------------------------
# Main and self-test


def check_all(m: Manifests, doc: str, dashboard: str) -> list[str]:
    src = ROOT / "src"
    errors = check_schemas(m)
    try:
        tags = reference_stats_tags()
    except CheckError as e:
        return errors + [str(e)]
    for scenario in SCENARIOS:
        errors += check_scenario(m, scenario)
        errors += check_scenario_tags(m, scenario, tags, src)
    errors += check_plain_configs(tags, src)
    errors += check_metrics_doc(doc, src, tags)
    errors += check_dashboard(dashboard, doc, src, tags)
    return errors


def check_scenario_tags(m: Manifests, scenario: str, tags: list[tuple[str, str]], src: Path) -> list[str]:
    try:
        bootstrap = SCENARIOS[scenario](m)
    except CheckError as e:
        return [f"{scenario}: {e}"]
    return check_stats_tags(bootstrap, scenario, tags, src)


def mutate(m: Manifests, kind: str, under: str, edit: Callable[[dict], None]) -> Manifests:
    out = Manifests(copy.deepcopy(m.docs))
    doc = out.of(kind, "", under)[0]
    edit(doc)
    return out


def wasm_config(doc: dict) -> dict:
    return next(n for n in walk(doc) if n.get("name") == WASM_FILTER)["typed_config"]["config"]


def self_test(m: Manifests, doc: str, dashboard: str) -> list[str]:
    """Each case breaks one thing; the check named must fail with the expected words."""
    tags = reference_stats_tags()

    def configmap_filter_config(cm: dict, edit: Callable[[dict], None]) -> None:
        boot = yaml.safe_load(cm["data"]["envoy.yaml"])
        cfg = wasm_config(boot)
        value = json.loads(cfg["configuration"]["value"])
        edit(value)
        cfg["configuration"]["value"] = json.dumps(value)
        cm["data"]["envoy.yaml"] = yaml.safe_dump(boot)

    def mesh_filter_config(doc: dict, edit: Callable[[dict], None]) -> None:
        cfg = wasm_config(doc)
        value = json.loads(cfg["configuration"]["value"])
        edit(value)
        cfg["configuration"]["value"] = json.dumps(value)

    def envoy_only(scenario: str) -> Callable[[Manifests], list[str]]:
        return lambda mm: envoy_validate(SCENARIOS[scenario](mm), scenario)

    def set_(path: str, value: Any) -> Callable[[dict], None]:
        def edit(d: dict) -> None:
            keys = path.split(".")
            node = d
            for k in keys[:-1]:
                node = node[int(k)] if isinstance(node, list) else node[k]
            node[keys[-1]] = value
        return edit

    cases: list[tuple[str, Callable[[], list[str]], str]] = [
        ("Kubernetes schema: unknown container field",
         lambda: check_schemas(mutate(m, "Deployment", "kubernetes",
                                      lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolice="Always"))),
         "imagePullPolice"),
        ("Kubernetes schema: port as a string",
         lambda: check_schemas(mutate(m, "Service", "kubernetes", set_("spec.ports.0.port", "http"))),
         "is not of type 'integer'"),
        ("CRD structure: unknown applyTo",
         lambda: check_schemas(mutate(m, "EnvoyFilter", "istio", set_("spec.configPatches.0.applyTo", "HTTP_FILTERS"))),
         "HTTP_FILTERS"),
        ("CRD structure: misspelled EnvoyPatchPolicy field",
         lambda: check_schemas(mutate(m, "EnvoyPatchPolicy", "envoy-gateway",
                                      lambda d: d["spec"].update(jsonPatch=d["spec"].pop("jsonPatches")))),
         "jsonPatch"),
        ("Envoy: allow_on_headers_stop_iteration of the wrong type (EnvoyFilter)",
         lambda: envoy_only("istio")(mutate(m, "EnvoyFilter", "istio",
                                            lambda d: wasm_config(d).update(allow_on_headers_stop_iteration="maybe"))),
         "config.allow_on_headers_stop_iteration"),
        ("Envoy: invalid Envoy field (EnvoyPatchPolicy)",
         lambda: envoy_only("envoy-gateway")(mutate(m, "EnvoyPatchPolicy", "envoy-gateway",
                                                    lambda d: wasm_config(d).update(allow_on_headers_stop_iterations=True))),
         "allow_on_headers_stop_iterations"),
        ("Envoy: the filter rejects an unknown configuration field (ConfigMap)",
         lambda: envoy_only("kubernetes")(mutate(m, "ConfigMap", "kubernetes",
                                                 lambda cm: configmap_filter_config(cm, lambda c: c.update(block_sise=16)))),
         "block_sise"),
        ("rendered: allow_on_headers_stop_iteration missing",
         lambda: check_scenario(mutate(m, "EnvoyPatchPolicy", "envoy-gateway",
                                       lambda d: wasm_config(d).pop("allow_on_headers_stop_iteration")),
                                "envoy-gateway", run_envoy=False),
         "allow_on_headers_stop_iteration must be true"),
        ("rendered: patch for a listener that does not exist",
         lambda: check_scenario(mutate(m, "EnvoyPatchPolicy", "envoy-gateway",
                                       set_("spec.jsonPatches.0.name", "llm/other-gateway/http")), "envoy-gateway", False),
         "no listener named"),
        ("rendered: EnvoyFilter for sidecars on a gateway",
         lambda: check_scenario(mutate(m, "EnvoyFilter", "istio",
                                       set_("spec.configPatches.0.match.context", "SIDECAR_OUTBOUND")), "istio", False),
         "matches nothing"),
        ("rendered: worker address that is no host of the cluster",
         lambda: check_scenario(mutate(m, "ConfigMap", "kubernetes", lambda cm: configmap_filter_config(
             cm, lambda c: c.update(workers=[{"id": 100, "address": "10.96.0.199:8000"}]))), "kubernetes", False),
         "not hosts of cluster"),
        ("rendered: membership follows a cluster the listener does not route to",
         lambda: check_scenario(mutate(m, "ConfigMap", "kubernetes", lambda cm: configmap_filter_config(
             cm, lambda c: c["membership"].update(cluster="kv_events"))), "kubernetes", False),
         "is not a cluster this listener routes to"),
        ("rendered: membership reads admin through a cluster that is not the admin",
         lambda: check_scenario(mutate(m, "ConfigMap", "kubernetes", lambda cm: configmap_filter_config(
             cm, lambda c: c["membership"].update(admin_cluster="kv_events"))), "kubernetes", False),
         "does not point at this Envoy's admin"),
        ("rendered: Istio membership follows a cluster the gateway does not route to",
         lambda: check_scenario(mutate(m, "EnvoyFilter", "istio", lambda d: mesh_filter_config(
             d, lambda c: c["membership"].update(cluster="outbound|8000||other.internal"))), "istio", False),
         "is not a cluster this listener routes to"),
        ("rendered: Istio membership admin cluster that is not the pod's admin",
         lambda: check_scenario(mutate(m, "EnvoyFilter", "istio", lambda d: mesh_filter_config(
             d, lambda c: c["membership"].update(admin_cluster="kv_events"))), "istio", False),
         "does not point at this Envoy's admin"),
        ("rendered: Istio membership admin cluster missing",
         lambda: check_scenario(mutate(m, "EnvoyFilter", "istio", lambda d: d["spec"]["configPatches"].pop()),
                                "istio", False),
         "membership.admin_cluster 'kv_router_admin' is not defined"),
        ("rendered: Envoy Gateway membership admin cluster routed by the listener",
         lambda: check_scenario(mutate(m, "EnvoyPatchPolicy", "envoy-gateway", lambda d: mesh_filter_config(
             d, lambda c: c["membership"].update(admin_cluster="httproute/llm/vllm/rule/0"))), "envoy-gateway", False),
         "is routed by the client listener"),
        ("rendered: Envoy Gateway membership admin cluster on another port",
         lambda: check_scenario(mutate(m, "EnvoyPatchPolicy", "envoy-gateway", set_(
             "spec.jsonPatches.3.operation.value.load_assignment.endpoints.0.lb_endpoints.0.endpoint.address"
             ".socket_address.port_value", 15000)), "envoy-gateway", False),
         "does not point at this Envoy's admin"),
        ("rendered: block size differs from vLLM's",
         lambda: check_scenario(mutate(m, "ConfigMap", "kubernetes", lambda cm: configmap_filter_config(
             cm, lambda c: c.update(block_size=32))), "kubernetes", False),
         "--block-size=16"),
        ("metrics: a src metric missing from docs/METRICS.md",
         lambda: check_metrics_doc(re.sub(r"^\| `kv_router\.events\.gaps`.*\n", "", doc, flags=re.M), ROOT / "src", tags),
         "'events.gaps', which is not documented"),
        ("metrics: docs/METRICS.md shows the untagged Prometheus name",
         lambda: check_metrics_doc(doc.replace('`kv_router_routed{reason="<reason>"}`', "`kv_router_routed_<reason>`"),
                                   ROOT / "src", tags),
         'exported as kv_router_routed{reason="<reason>"}'),
        ("stats tags: a shipped configuration without them (ConfigMap)",
         lambda: check_scenario_tags(mutate(m, "ConfigMap", "kubernetes", lambda cm: cm["data"].update(
             {"envoy.yaml": yaml.safe_dump({k: v for k, v in yaml.safe_load(cm["data"]["envoy.yaml"]).items()
                                            if k != "stats_config"})})), "kubernetes", tags, ROOT / "src"),
         "stats_tags for the filter's stats are missing"),
        ("stats tags: Istio's custom bootstrap not passed to the gateway",
         lambda: check_scenario_tags(mutate(m, "Deployment", "istio", lambda d: d["spec"]["template"]["spec"][
             "containers"][0].pop("env")), "istio", tags, ROOT / "src"),
         "stats_tags for the filter's stats are missing"),
        ("stats tags: Istio's stats matcher drops the filter's stats",
         lambda: check_scenario_tags(mutate(m, "Deployment", "istio", lambda d: d["spec"]["template"]["metadata"][
             "annotations"].update({"proxy.istio.io/config": "concurrency: 4"})), "istio", tags, ROOT / "src"),
         "stats_matcher drops wasmcustom.kv_router."),
        ("stats tags: a regex that differs from envoy/envoy.yaml's (EnvoyProxy)",
         lambda: check_scenario_tags(mutate(m, "EnvoyProxy", "envoy-gateway", lambda d: d["spec"]["bootstrap"].update(
             value=d["spec"]["bootstrap"]["value"].replace("rank\\.(\\d+)", "rank\\.(\\w+)"))),
             "envoy-gateway", tags, ROOT / "src"),
         "not envoy/envoy.yaml's"),
        ("stats tags: another tag regex also matches the filter's stats",
         lambda: check_stats_tags({"stats_config": {"stats_tags": [{"tag_name": "r", "regex": r"(\.rank\.)"}] + [
             {"tag_name": t, "regex": r} for t, r in tags]}}, "extra tag", tags, ROOT / "src"),
         "another stats tag also matches"),
        ("dashboard: a metric that is not documented",
         lambda: check_dashboard(dashboard.replace("kv_router_events_gaps", "kv_router_events_gap"), doc, ROOT / "src", tags),
         "kv_router_events_gap is not in docs/METRICS.md"),
        ("dashboard: the untagged name of a per-worker gauge",
         lambda: check_dashboard(dashboard.replace("kv_router_worker_decode_blocks", "kv_router_worker_1_rank_0_decode_blocks"),
                                 doc, ROOT / "src", tags),
         "kv_router_worker_1_rank_0_decode_blocks is not in docs/METRICS.md"),
        ("dashboard: a documented metric src/ does not define",
         lambda: check_dashboard(dashboard.replace("kv_router_events_gaps", "kv_router_events_holes"),
                                 doc.replace("`kv_router.events.gaps` | `kv_router_events_gaps`",
                                             "`kv_router.events.holes` | `kv_router_events_holes`"), ROOT / "src", tags),
         "kv_router_events_holes: src/ defines no metric"),
        ("dashboard: grouping by a label the metric does not carry",
         lambda: check_dashboard(dashboard.replace("sum by (reason) (rate(kv_router_routed[", "sum by (worker) (rate(kv_router_routed["),
                                 doc, ROOT / "src", tags),
         "kv_router_routed has no label 'worker'"),
        ("dashboard: a query that is not PromQL",
         lambda: check_dashboard(dashboard.replace("sum(rate(kv_router_events_gaps[", "sum(rate(kv_router_events_gaps(["), doc,
                                 ROOT / "src", tags),
         "PromQL does not parse"),
        ("dashboard: a name regex matching no documented metric",
         lambda: check_dashboard(dashboard.replace("sum by (worker) (kv_router_worker_decode_blocks)",
                                                   'sum({__name__=~\\"kv_router_worker_.+_decode_block\\"})'), doc, ROOT / "src", tags),
         "matches no metric in docs/METRICS.md"),
        ("dashboard: not JSON",
         lambda: check_dashboard(dashboard[:-2], doc, ROOT / "src", tags),
         "not valid JSON"),
    ]
    failures = []
    for name, run, expected in cases:
        errors = run()
        if not any(expected in e for e in errors):
            failures.append(f"self-test {name!r}: expected an error containing {expected!r}, got {errors or 'none'}")
        else:
            print(f"check-deploy: self-test caught: {name}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true", help="check that broken manifests fail")
    args = parser.parse_args()
    manifests = Manifests.load(DEPLOY)
    doc = METRICS_DOC.read_text()
    dashboard = DASHBOARD.read_text()
    errors = self_test(manifests, doc, dashboard) if args.self_test else check_all(manifests, doc, dashboard)
    for e in errors:
        print(f"check-deploy: {e}", file=sys.stderr)
    if errors:
        print(f"check-deploy: {len(errors)} problem(s)", file=sys.stderr)
    elif args.self_test:
        print("check-deploy: every broken variant was caught")
    else:
        print(f"check-deploy: {len(manifests.docs)} manifests, {len(SCENARIOS)} Envoy configurations, "
              "docs/METRICS.md and the dashboard: ok")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
