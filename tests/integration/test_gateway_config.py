"""Every Envoy config we ship parses and passes `envoy --mode validate` (the Istio
EnvoyFilter: tests/test_deploy_files.py, tests/integration/test_istio_envoyfilter.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.envoy_config import render, render_epp
from tests.support.envoy import validate
from tests.support.procs import REPO

ENVOY_DIR = REPO / "envoy"


def _ok(path: Path) -> None:
    result = validate(path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(p.name for p in ENVOY_DIR.glob("*.yaml")))
def test_yaml_files_parse(name):
    rendered = {"envoy.template.yaml": render, "epp.template.yaml": render_epp}
    text = rendered[name]() if name in rendered else (ENVOY_DIR / name).read_text()
    docs = list(yaml.safe_load_all(text))
    assert docs and all(isinstance(d, dict) for d in docs)


def test_dropin_example_is_the_rendered_template():
    assert (ENVOY_DIR / "envoy.yaml").read_text().split("\n", 2)[2] == render().split("\n", 2)[2]


@pytest.mark.parametrize("kw", [{}, {"failure_mode_allow": True}, {"with_extproc": False},
                                {"extproc": ["127.0.0.1:50051", "ace-extproc-1:50051", "10.0.0.7:9000"]}])
def test_rendered_template_validates(tmp_path, kw):
    path = tmp_path / "envoy.yaml"
    path.write_text(render(listen_port=18080, admin_port=18081, **kw))
    _ok(path)


@pytest.mark.parametrize("kw", [{}, {"tls": False}, {"body_mode": "BUFFERED"}, {"subset_header": "x-subset"}])
def test_rendered_epp_template_validates(tmp_path, kw):
    path = tmp_path / "epp.yaml"
    path.write_text(render_epp(listen_port=18080, admin_port=18081, **kw))
    _ok(path)


def test_dropin_example_validates():
    _ok(ENVOY_DIR / "envoy.yaml")


def test_one_message_route_sends_every_header_the_gateway_reads():
    """On the one-message route ext_proc sees only the request_attributes Envoy sends:
    each request header the processor reads must be listed there."""
    from extproc.domain.headers import SESSION_HEADER, SKILL_OVERRIDE_HEADER, TENANT_HEADER

    text = (ENVOY_DIR / "envoy.template.yaml").read_text()
    for header in ("authorization", TENANT_HEADER, SKILL_OVERRIDE_HEADER, SESSION_HEADER):
        assert f"request.headers['{header}']" in text, header


@pytest.mark.parametrize("name", ["envoy.yaml", "compose.envoy.yaml", "istio-envoyfilter.yaml"])
def test_shipped_configs_fail_closed(name):
    """Authentication is never bypassed by default: every ext_proc filter we ship has
    failure_mode_allow false, its ext_proc cluster is health-checked and its stream retried."""
    text = (ENVOY_DIR / name).read_text()
    assert "failure_mode_allow: true" not in text
    assert text.count("failure_mode_allow: false") >= 3      # the filter, /v1/execute, dev-key
    assert "grpc_health_check" in text and "retry_policy" in text and "outlier_detection" in text
