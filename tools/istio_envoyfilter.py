"""Render envoy/istio-envoyfilter.yaml from the drop-in Envoy config.

``python -m tools.istio_envoyfilter --out envoy/istio-envoyfilter.yaml [--listener-port 8080
--vhost ace.example.com:80 --extproc HOST:PORT --upstream IP:PORT]``

No value of the drop-in is retyped here: each is taken from
``extproc.envoy_config.render(...)`` (envoy/envoy.template.yaml), so the mesh gateway runs
the same filters, ext_proc settings, routes, local replies and clusters as the drop-in
config. What Istio's EnvoyFilter API cannot express the same way is adapted, and only that:

* The mesh gateway also serves other applications, so the three ace HTTP filters are
  inserted ``disabled: true`` and switched on by the ace routes only. The drop-in's
  catch-all route (default deny) is not copied: the ace host's other paths are its
  VirtualService's.
  A route that carries no per-route config for one of them gets a neutral one, which
  enables the filter without changing its settings (``ENABLE``).
* The drop-in's routes are inserted at the top of the ace virtual host (the VirtualService
  for the ace host supplies the virtual host; its own routes come after ours). Istio
  prepends each ``INSERT_FIRST`` route, so the patches list them in reverse order.
* Routes get names (``ace-<n>``), for stats and for later patches.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml

from extproc.envoy_config import BODY_LIMIT_FILTERS, render

__all__ = ["DEFAULTS", "ENABLE", "ROUTER", "ace_routes", "dropin", "envoyfilter", "render_envoyfilter"]

HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
EXT_PROC = "envoy.filters.http.ext_proc"
BUFFER = "envoy.filters.http.buffer"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
BODY_DRAIN, BODY_LIMIT = BODY_LIMIT_FILTERS      # Lua: an oversize body is read, then 413
ENABLE = (HEADER_MUTATION, BODY_DRAIN, BODY_LIMIT, EXT_PROC, BUFFER)   # the drop-in's filters before the router

# Defaults of the committed file. The listener port is the gateway pod's port (the Service
# targetPort: 8080 for `port: 80` on the default istio-ingressgateway); the virtual host
# is Istio's name for the ace host on the Gateway server ("<host>:<server port>"); the
# default upstream (first upstream of the state file; where requests go if rendered fail-open) is an
# RFC 5737 documentation address: replace it with your engine Service's ClusterIP:port.
DEFAULTS: dict[str, Any] = {
    "listener_port": 8080,
    "vhost": "ace.example.com:80",
    "extproc": "ace-extproc.ace.svc.cluster.local:50051",
    "default_upstream": "192.0.2.80:8000",
    "namespace": "istio-system",
    "selector": {"istio": "ingressgateway"},
}


def _neutral(name: str, filters: dict[str, dict]) -> dict:
    """A per-route config that switches a disabled-by-default filter on for a route and
    changes none of its settings."""
    if name == EXT_PROC:
        return {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": {}}
    if name == BUFFER:
        limit = filters[BUFFER]["typed_config"]["max_request_bytes"]
        return {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
                "buffer": {"max_request_bytes": limit}}
    if name in (BODY_DRAIN, BODY_LIMIT):   # the filter's own script, an empty context
        return {"@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute",
                "filter_context": {}}
    if name == HEADER_MUTATION:
        return {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3."
                         "HeaderMutationPerRoute"}
    raise ValueError(f"no neutral per-route config for {name}")


def dropin(**render_kw) -> dict:
    """The drop-in config (envoy/envoy.template.yaml rendered) as a dict."""
    return yaml.safe_load(render(**render_kw))


def _hcm(config: dict) -> tuple[dict, dict]:
    listener = config["static_resources"]["listeners"][0]
    (chain,) = listener["filter_chains"]
    (hcm,) = [f for f in chain["filters"] if f["name"] == HCM]
    return listener, hcm["typed_config"]


def ace_routes(config: dict) -> list[dict]:
    """The drop-in's routes without its catch-all (default deny, 404 for the paths ace has no
    route for: in the mesh, the ace host's other paths are its VirtualService's own, guarded
    by the mesh's AuthorizationPolicy, docs/gateway.md), named, each switching on the ace
    filters it does not configure."""
    _, hcm = _hcm(config)
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    *routes, catch_all = copy.deepcopy(vhost["routes"])
    assert catch_all["match"] == {"prefix": "/"}, "the drop-in's last route must be its catch-all"
    filters = {f["name"]: f for f in hcm["http_filters"]}
    out = []
    for i, route in enumerate(routes):
        per_filter = route.setdefault("typed_per_filter_config", {})
        for name in ENABLE:
            per_filter.setdefault(name, _neutral(name, filters))
        out.append({"name": f"ace-{i}", **route})
    return out


def envoyfilter(*, listener_port: int = DEFAULTS["listener_port"], vhost: str = DEFAULTS["vhost"],
                extproc: str = DEFAULTS["extproc"], default_upstream: str = DEFAULTS["default_upstream"],
                namespace: str = DEFAULTS["namespace"], selector: dict | None = None,
                name: str = "ace-ext-proc", **render_kw) -> dict:
    """The EnvoyFilter resource as a dict; ``render_kw`` go to extproc.envoy_config.render."""
    config = dropin(extproc=extproc, default_upstream=default_upstream, **render_kw)
    listener, hcm = _hcm(config)
    *filters, router = hcm["http_filters"]
    assert router["name"] == ROUTER, "the drop-in's last HTTP filter must be the router"
    assert [f["name"] for f in filters] == list(ENABLE), "ENABLE must list the drop-in's filters"
    (dvhost,) = hcm["route_config"]["virtual_hosts"]
    on_listener = {"context": "GATEWAY", "listener": {
        "portNumber": listener_port,
        "filterChain": {"filter": {"name": HCM}}}}
    before_router = copy.deepcopy(on_listener)
    before_router["listener"]["filterChain"]["filter"]["subFilter"] = {"name": ROUTER}
    on_vhost = {"context": "GATEWAY", "routeConfiguration": {"vhost": {"name": vhost}}}

    patches: list[dict] = [
        {"applyTo": "LISTENER",
         "match": {"context": "GATEWAY", "listener": {"portNumber": listener_port}},
         "patch": {"operation": "MERGE", "value": {
             "per_connection_buffer_limit_bytes": listener["per_connection_buffer_limit_bytes"]}}},
        {"applyTo": "NETWORK_FILTER", "match": on_listener,
         "patch": {"operation": "MERGE", "value": {"name": HCM, "typed_config": {
             "@type": hcm["@type"], "local_reply_config": hcm["local_reply_config"]}}}},
    ]
    for f in filters:   # each goes right before the router: they keep the drop-in's order
        patches.append({"applyTo": "HTTP_FILTER", "match": before_router,
                        "patch": {"operation": "INSERT_BEFORE",
                                  "value": {"name": f["name"], "disabled": True, **f}}})
    patches.append({"applyTo": "VIRTUAL_HOST", "match": on_vhost, "patch": {"operation": "MERGE", "value": {
        k: v for k, v in dvhost.items() if k not in ("name", "domains", "routes")}}})
    for route in reversed(ace_routes(config)):   # INSERT_FIRST prepends: last route first
        patches.append({"applyTo": "HTTP_ROUTE", "match": on_vhost,
                        "patch": {"operation": "INSERT_FIRST", "value": route}})
    for cluster in config["static_resources"]["clusters"]:
        patches.append({"applyTo": "CLUSTER", "match": {"context": "GATEWAY"},
                        "patch": {"operation": "ADD", "value": cluster}})
    return {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"workloadSelector": {"labels": selector or DEFAULTS["selector"]},
                     "configPatches": patches}}


HEADER = """\
# Istio: ace's gateway filters in an existing ingress gateway. GENERATED from the drop-in
# config (envoy/envoy.template.yaml) by tools/istio_envoyfilter.py: do not edit by hand;
#   python -m tools.istio_envoyfilter --out envoy/istio-envoyfilter.yaml \\
#       --listener-port {listener_port} --vhost {vhost} \\
#       --extproc {extproc} --upstream {default_upstream}
#
# Same behaviour as the drop-in (docs/gateway.md, "Istio"): ONE ext_proc message for an
# OpenAI POST with a content-length (request_attributes + buffer filter, decision as
# dynamic metadata -> headers), headers-first where errors need the headers, client
# x-ace-* headers stripped, ORIGINAL_DST routing on x-ace-destination-endpoint, and
# Envoy's own local replies (413/503/504) as OpenAI JSON errors.
#
# Placeholders (set them with the flags above):
#   --listener-port  the gateway pod's listener port (Service targetPort; 8080 for port 80
#                    on the default istio-ingressgateway). Buffer limit, local replies and
#                    the filters apply to every route on that listener: best a Gateway
#                    server used by ace only.
#   --vhost          Istio's virtual host for the ace host, "<host>:<Gateway server port>".
#                    A VirtualService must bind that host to the Gateway (its routes come
#                    after ace's; other hosts are untouched: the filters stay disabled).
#   --extproc        the ext_proc Service (plain h2c gRPC from the gateway); best a headless
#                    Service, so that every replica is an endpoint (health-checked, a stream
#                    a dying replica breaks is retried on another).
#   --upstream       the default upstream (first in the state file; where requests go
#                    unauthenticated if rendered --fail-open): an IP:port, e.g. the engine
#                    Service's ClusterIP. 192.0.2.80 is a documentation address.
# Fail-closed (the default): with no ext_proc answer, the OpenAI routes answer 503.
# The ace_upstream and ace_extproc clusters connect in plaintext (no mesh mTLS).
"""


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):   # the drop-in's YAML anchors become plain copies
        return True


def render_envoyfilter(**kw) -> str:
    values = {**DEFAULTS, **kw}
    head = HEADER.format(**{k: values[k] for k in ("listener_port", "vhost", "extproc", "default_upstream")})
    return head + yaml.dump(envoyfilter(**kw), Dumper=_NoAliases, sort_keys=False, width=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--listener-port", type=int, default=DEFAULTS["listener_port"])
    p.add_argument("--vhost", default=DEFAULTS["vhost"], help='"<host>:<Gateway server port>"')
    p.add_argument("--extproc", default=DEFAULTS["extproc"], help="ext_proc host:port")
    p.add_argument("--upstream", default=DEFAULTS["default_upstream"], help="default upstream IP:port")
    p.add_argument("--namespace", default=DEFAULTS["namespace"])
    p.add_argument("--fail-open", action="store_true",
                   help="failure_mode_allow: true. RISK: while no ext_proc answers, OpenAI "
                        "requests reach the default upstream UNAUTHENTICATED (default: 503)")
    a = p.parse_args()
    kw: dict[str, Any] = {}
    if a.fail_open:
        kw["failure_mode_allow"] = True
    a.out.write_text(render_envoyfilter(listener_port=a.listener_port, vhost=a.vhost, extproc=a.extproc,
                                        default_upstream=a.upstream, namespace=a.namespace, **kw))


if __name__ == "__main__":
    main()
