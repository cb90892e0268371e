"""An Istio ingress gateway's Envoy config without Istio: a static stand-in for what istiod
generates, and the EnvoyFilter patches applied to it the way istiod applies them.

No Istio control plane runs here. ``apply_envoyfilter`` follows istiod's code
(pilot/pkg/networking/core/envoyfilter: listener_patch.go, rc_patch.go, cluster_patch.go)
for the operations and match fields the ace EnvoyFilter uses, and refuses anything else,
so a patch this model does not know cannot pass silently. Proto merge is modelled on the
YAML: messages merge field by field, repeated fields append, scalars are replaced.
"""
from __future__ import annotations

import copy
from typing import Any

HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "envoy.filters.http.router"

__all__ = ["ACE_VHOST", "OTHER_VHOST", "apply_envoyfilter", "envoyfilter_values", "gateway_with_envoyfilter",
           "hcm_of", "ingress_gateway", "static_cluster"]

ACE_VHOST = "ace.example.com:80"
OTHER_VHOST = "other.example.com:80"


def static_cluster(name: str, address: str) -> dict:
    host, _, port = address.rpartition(":")
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]}}


def ingress_gateway(*, port: int, admin_port: int, app: str = "127.0.0.1:1") -> dict:
    """What istiod gives an ingress gateway with one Gateway server (port 80 -> listener
    ``port``) and two VirtualServices: ``ace.example.com`` and ``other.example.com``, each
    with one route ``/`` to an application Service (``app``). The HTTP filters are the
    ones of Istio's gateway chain that the stock Envoy binary has (fault, cors, router)."""
    app_cluster = "outbound|80||app.default.svc.cluster.local"

    def vhost(name: str) -> dict:
        host = name.split(":")[0]
        return {"name": name, "domains": [host, f"{host}:*"], "routes": [
            {"name": "app", "match": {"prefix": "/"},
             "route": {"cluster": app_cluster, "timeout": "0s"}}]}

    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": f"0.0.0.0_{port}",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{"name": HCM, "typed_config": {
                    "@type": HCM_TYPE,
                    "stat_prefix": f"outbound_0.0.0.0_{port}",
                    "use_remote_address": True,
                    "normalize_path": True,
                    "route_config": {"name": "http.80", "virtual_hosts": [vhost(ACE_VHOST), vhost(OTHER_VHOST)]},
                    "http_filters": [
                        {"name": "envoy.filters.http.fault", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
                        {"name": "envoy.filters.http.cors", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
                        {"name": ROUTER, "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                }}]}],
            }],
            "clusters": [static_cluster(app_cluster, app)],
        },
    }


def hcm_of(bootstrap: dict) -> dict:
    (listener,) = bootstrap["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = [f for f in chain["filters"] if f["name"] == HCM]
    return hcm["typed_config"]


# ---------- istiod's patching, for what the ace EnvoyFilter uses ----------

_KNOWN_MATCH = {"context", "listener", "routeConfiguration"}
_KNOWN_LISTENER = {"portNumber", "name", "filterChain"}
_KNOWN_CHAIN = {"filter"}
_KNOWN_FILTER = {"name", "subFilter"}
_KNOWN_RC = {"vhost", "name"}
_KNOWN_VHOST = {"name", "route"}


def _merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            if "@type" in value and value["@type"] != dst[key].get("@type"):
                raise ValueError(f"merging {value['@type']} into {dst[key].get('@type')}")
            _merge(dst[key], value)
        elif isinstance(value, list) and isinstance(dst.get(key), list):
            dst[key].extend(copy.deepcopy(value))
        else:
            dst[key] = copy.deepcopy(value)


def _check(fields: dict | None, known: set[str], what: str) -> None:
    extra = set(fields or {}) - known
    if extra:
        raise NotImplementedError(f"{what} match fields not modelled: {sorted(extra)}")


def _listener_match(match: dict, listener: dict) -> bool:
    lm = match.get("listener")
    if lm is None:
        return True
    _check(lm, _KNOWN_LISTENER, "listener")
    if lm.get("name") and lm["name"] != listener["name"]:
        return False
    port = lm.get("portNumber")
    return not port or listener["address"]["socket_address"]["port_value"] == port


def _filter_match(match: dict) -> dict:
    fc = (match.get("listener") or {}).get("filterChain") or {}
    _check(fc, _KNOWN_CHAIN, "filterChain")
    f = fc.get("filter") or {}
    _check(f, _KNOWN_FILTER, "filter")
    return f


def _vhost_match(match: dict, rc: dict, vhost: dict) -> bool:
    rm = match.get("routeConfiguration")
    if rm is None:
        return True
    _check(rm, _KNOWN_RC, "routeConfiguration")
    if rm.get("name") and rm["name"] != rc.get("name"):
        return False
    vm = rm.get("vhost") or {}
    _check(vm, _KNOWN_VHOST, "vhost")
    if vm.get("route"):
        raise NotImplementedError("route-name matches are not modelled")
    return not vm.get("name") or vm["name"] == vhost["name"]


def apply_envoyfilter(envoyfilter: dict, bootstrap: dict, context: str = "GATEWAY") -> dict:
    """``bootstrap`` with ``envoyfilter``'s patches applied (a new dict)."""
    out = copy.deepcopy(bootstrap)
    by_kind: dict[str, list[tuple[dict, dict]]] = {}
    for p in envoyfilter["spec"]["configPatches"]:
        match = p.get("match") or {}
        _check(match, _KNOWN_MATCH, "patch")
        if match.get("context", "ANY") not in (context, "ANY"):
            continue
        by_kind.setdefault(p["applyTo"], []).append((match, p["patch"]))
    unknown = set(by_kind) - {"LISTENER", "NETWORK_FILTER", "HTTP_FILTER", "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER"}
    if unknown:
        raise NotImplementedError(f"applyTo not modelled: {sorted(unknown)}")

    def only(op: str, allowed: tuple[str, ...], kind: str) -> None:
        if op not in allowed:
            raise NotImplementedError(f"{kind} {op} not modelled")

    for listener in out["static_resources"]["listeners"]:
        for match, patch in by_kind.get("LISTENER", []):
            only(patch["operation"], ("MERGE",), "LISTENER")
            if _listener_match(match, listener):
                _merge(listener, patch["value"])
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for match, patch in by_kind.get("NETWORK_FILTER", []):
                    only(patch["operation"], ("MERGE",), "NETWORK_FILTER")
                    f = _filter_match(match)
                    if _listener_match(match, listener) and f.get("name", network_filter["name"]) == network_filter["name"]:
                        value = copy.deepcopy(patch["value"])
                        network_filter["name"] = value.pop("name", network_filter["name"])
                        _merge(network_filter, value)
                if network_filter["name"] != HCM:
                    continue
                http_filters = network_filter["typed_config"]["http_filters"]
                for match, patch in by_kind.get("HTTP_FILTER", []):
                    only(patch["operation"], ("INSERT_BEFORE", "INSERT_FIRST", "ADD"), "HTTP_FILTER")
                    f = _filter_match(match)
                    if not _listener_match(match, listener) or f.get("name", HCM) != HCM:
                        continue
                    value = copy.deepcopy(patch["value"])
                    sub = (f.get("subFilter") or {}).get("name")
                    if patch["operation"] == "ADD":
                        http_filters.append(value)
                    elif patch["operation"] == "INSERT_FIRST" or sub is None:
                        http_filters.insert(0, value)
                    else:   # INSERT_BEFORE the first filter of that name; nothing if absent
                        at = next((i for i, h in enumerate(http_filters) if h["name"] == sub), None)
                        if at is not None:
                            http_filters.insert(at, value)
                rc = network_filter["typed_config"].get("route_config")
                if rc is None:
                    continue
                for vhost in rc["virtual_hosts"]:
                    for match, patch in by_kind.get("VIRTUAL_HOST", []):
                        only(patch["operation"], ("MERGE",), "VIRTUAL_HOST")
                        if _vhost_match(match, rc, vhost):
                            _merge(vhost, patch["value"])
                    for match, patch in by_kind.get("HTTP_ROUTE", []):
                        # without a route-name match, INSERT_BEFORE and INSERT_FIRST prepend
                        only(patch["operation"], ("INSERT_FIRST", "INSERT_BEFORE", "ADD"), "HTTP_ROUTE")
                        if not _vhost_match(match, rc, vhost):
                            continue
                        value = copy.deepcopy(patch["value"])
                        if patch["operation"] == "ADD":
                            vhost["routes"].append(value)
                        else:
                            vhost["routes"].insert(0, value)
    for match, patch in by_kind.get("CLUSTER", []):
        only(patch["operation"], ("ADD",), "CLUSTER")
        if set(match) - {"context"}:
            raise NotImplementedError("cluster matches are not modelled")
        out["static_resources"]["clusters"].append(copy.deepcopy(patch["value"]))
    return out


def envoyfilter_values(envoyfilter: dict, apply_to: str) -> list[Any]:
    return [p["patch"]["value"] for p in envoyfilter["spec"]["configPatches"] if p["applyTo"] == apply_to]


def gateway_with_envoyfilter(*, port: int, admin_port: int, extproc: str, default_upstream: str,
                             app: str = "127.0.0.1:1", **render_kw) -> dict:
    """The stand-in ingress gateway with the ace EnvoyFilter applied, rendered for these
    addresses (the committed file is the same renderer with its defaults)."""
    from tools.istio_envoyfilter import envoyfilter

    ef = envoyfilter(listener_port=port, vhost=ACE_VHOST, extproc=extproc,
                     default_upstream=default_upstream, **render_kw)
    return apply_envoyfilter(ef, ingress_gateway(port=port, admin_port=admin_port, app=app))
