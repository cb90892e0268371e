"""Every Envoy config we ship parses and passes `envoy --mode validate`."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.envoy_config import render
from tests.support.envoy import validate
from tests.support.procs import REPO

ENVOY_DIR = REPO / "envoy"


def _ok(path: Path) -> None:
    result = validate(path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(p.name for p in ENVOY_DIR.glob("*.yaml")))
def test_yaml_files_parse(name):
    text = render() if name == "envoy.template.yaml" else (ENVOY_DIR / name).read_text()
    docs = list(yaml.safe_load_all(text))
    assert docs and all(isinstance(d, dict) for d in docs)


def test_dropin_example_is_the_rendered_template():
    assert (ENVOY_DIR / "envoy.yaml").read_text().split("\n", 2)[2] == render().split("\n", 2)[2]


@pytest.mark.parametrize("kw", [{}, {"failure_mode_allow": False}, {"with_extproc": False}])
def test_rendered_template_validates(tmp_path, kw):
    path = tmp_path / "envoy.yaml"
    path.write_text(render(listen_port=18080, admin_port=18081, **kw))
    _ok(path)


def test_dropin_example_validates():
    _ok(ENVOY_DIR / "envoy.yaml")


def test_istio_envoyfilter_carries_valid_envoy_config(tmp_path):
    ef = yaml.safe_load((ENVOY_DIR / "istio-envoyfilter.yaml").read_text())
    assert ef["kind"] == "EnvoyFilter" and ef["apiVersion"].startswith("networking.istio.io/")
    patches = ef["spec"]["configPatches"]
    filters = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    routes = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_ROUTE"]
    clusters = [p["patch"]["value"] for p in patches if p["applyTo"] == "CLUSTER"]
    (vhost_patch,) = [p["patch"]["value"] for p in patches if p["applyTo"] == "VIRTUAL_HOST"]
    local = yaml.safe_load(render())["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
    for key, value in vhost_patch.items():   # the mesh carries the decision like the local stack
        assert local[key] == value, key
    grpc_cluster = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")[
        "typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    bootstrap = {"static_resources": {
        "listeners": [{"name": "gw", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18090}},
                       "filter_chains": [{"filters": [{
                           "name": "envoy.filters.network.http_connection_manager",
                           "typed_config": {
                               "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                               "stat_prefix": "gw",
                               "route_config": {"virtual_hosts": [{"name": "vh", "domains": ["*"], **vhost_patch, "routes": [
                                   {"match": {"prefix": f"/r{i}"}, "route": {"cluster": "ace_upstream"}, **r}
                                   for i, r in enumerate(routes)]}]},
                               "http_filters": filters + [{
                                   "name": "envoy.filters.http.router",
                                   "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                                             "filters.http.router.v3.Router"}}]}}]}]}],
        "clusters": clusters + [{
            "name": grpc_cluster, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": grpc_cluster, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 50051}}}}]}]}}]}}
    assert len(routes) == 2 and len(clusters) == 1
    path = tmp_path / "istio-bootstrap.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    _ok(path)


def test_one_message_route_sends_every_header_the_gateway_reads():
    """On the one-message route ext_proc sees only the request_attributes Envoy sends:
    each request header the processor reads must be listed there."""
    from extproc.processor import SKILL_OVERRIDE_HEADER, TENANT_HEADER
    from extproc.speculation import SESSION_HEADER

    text = (ENVOY_DIR / "envoy.template.yaml").read_text()
    for header in ("authorization", TENANT_HEADER, SKILL_OVERRIDE_HEADER, SESSION_HEADER):
        assert f"request.headers['{header}']" in text, header
