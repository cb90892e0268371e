"""The gateway's and the agent's /metrics on the real stack (agent + builtin engine,
``python -m extproc``, Envoy: tools.localstack.gateway_stack), and the Grafana dashboard
(deploy/grafana/ace.json) read against what they actually expose, so it cannot drift."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import REPO
from tests.support.fixtures import fixtures_dir
from tests.support.wait import wait_until

pytest.importorskip("torch")

DASHBOARD = REPO / "deploy" / "grafana" / "ace.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _scrape(url: str) -> str:
    return httpx.get(url, timeout=10).text


def _value(text: str, name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def _exposed(text: str) -> set[str]:
    """Every series name the text declares (a family without series yet included)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        out.update(fam.name + suffix for suffix in _SUFFIXES.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tools import demo
    from tools.localstack import gateway_stack

    fixtures = fixtures_dir(tmp_path_factory)
    catalog = fixtures / "catalog.yaml"
    with gateway_stack(tmp_path_factory.mktemp("metrics"), catalog,
                       lambda path, engine, agent: demo.write_state(path, catalog, engine, agent),
                       token=demo.TOKEN, agent_args=["--reconcile-interval-s", "0.5", "--pool-mb", "2"]) as st:
        yield st


def test_gateway_metrics_count_what_went_through_envoy(stack):
    from tools import demo

    gw = stack["gateway_metrics"]
    wait_until(lambda: _value(_scrape(gw), "ace_gateway_agent_link_up", upstream="agent-0") == 1,
               what="the gateway's link to the agent is up")
    for _ in range(3):
        r = demo.completion(stack["gateway"], "code-python")
        assert r.status_code == 200, r.text
    bad = httpx.post(stack["gateway"] + "/v1/completions", headers={"Authorization": "Bearer sk-wrong"},
                     json={"model": "code-python", "prompt": "x"}, timeout=30)
    assert bad.status_code == 401
    skills = httpx.post(stack["gateway"] + "/api/v1/dev_key/skills", timeout=30,
                        headers={"Authorization": f"Bearer {demo.KEYS['medco']}"},
                        json={"skills": {"multi_lora": "prod"}})
    assert skills.status_code == 200, skills.text

    wait_until(lambda: _value(_scrape(gw), "ace_gateway_requests_total", tenant="acme",
                              adapter="code-python", mode="prod") == 3, what="3 requests counted")
    text = _scrape(gw)
    assert _value(text, "ace_gateway_requests_total", tenant="", action="invalid_api_key") == 1
    assert _value(text, "ace_gateway_errors_total", status="401", code="invalid_api_key") == 1
    assert _value(text, "ace_gateway_decision_seconds_count") == 3
    assert _value(text, "ace_gateway_store_propagation_seconds_count") == 1
    assert "ace_gateway_predictions_total" in _exposed(text)
    assert _value(text, "ace_gateway_residency_snapshot_age_seconds") >= 0
    # the serving loop's lag (ace_common.loop_lag): measured on the h2 server's loop
    wait_until(lambda: _value(_scrape(gw), "ace_gateway_event_loop_lag_seconds_count") > 0,
               what="the gateway's loop lag measured")
    assert _value(_scrape(gw), "ace_gateway_event_loop_lag_seconds_max") >= 0
    # the first request found code-python cold (prefetch prod): a signal went to the agent
    wait_until(lambda: _value(_scrape(gw), "ace_gateway_prefetch_signals_total", upstream="agent-0",
                              result="sent") >= 1, what="a prefetch signal sent")


def test_dashboard_reads_only_metrics_the_gateway_and_agent_expose(stack):
    exposed = _exposed(_scrape(stack["gateway_metrics"])) | _exposed(_scrape(stack["metrics"]))
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    used = {name for e in exprs for name in re.findall(r"\b(ace_[a-z0-9_]+)", e)}
    assert used, "the dashboard queries no ace metric"
    assert sorted(used - exposed) == []
    for wanted in ("ace_gateway_requests_total", "ace_gateway_decision_seconds_bucket",
                   "ace_gateway_prefetch_signals_total", "ace_gateway_predictions_total",
                   "ace_gateway_agent_link_up", "ace_gateway_residency_snapshot_age_seconds",
                   "ace_gateway_store_propagation_seconds_bucket", "ace_agent_prefetch_preemptions_total",
                   "ace_agent_prefetch_cancelled_total", "ace_agent_tier_adapters"):
        assert wanted in used, wanted
