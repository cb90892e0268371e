"""The agent's /metrics text (prometheus_client): one registry per AgentMetrics, label
values escaped, series with different label sets under one family."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.metrics import AgentMetrics


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_label_values_are_escaped_and_read_back():
    m = AgentMetrics()
    odd = 'Os"Err\\or\nline two'
    m.inc("ace_agent_load_failures_total", reason=odd)
    text = m.render()
    assert 'ace_agent_load_failures_total{reason="Os\\"Err\\\\or\\nline two"} 1.0' in text
    assert _samples(text)[("ace_agent_load_failures_total", (("reason", odd),))] == 1


def test_each_instance_has_its_own_registry():
    a, b = AgentMetrics(), AgentMetrics()
    a.inc("ace_agent_engine_resets_total")
    assert _samples(a.render())[("ace_agent_engine_resets_total", ())] == 1
    assert ("ace_agent_engine_resets_total", ()) not in _samples(b.render())
    assert "# TYPE ace_agent_engine_resets_total counter" in b.render()   # declared all the same


def test_counters_histograms_gauges_and_collected_counters():
    m = AgentMetrics()
    m.inc("ace_agent_evictions_total", tier="device", reason="budget")
    m.inc("ace_agent_evictions_total", tier="device", reason="hint")
    m.observe("ace_agent_load_seconds", 0.003, stage="cold")
    engine = {"copy": 2}
    m.add_collector(lambda: m.set_counter("ace_agent_prefetch_preemptions_total", engine["copy"], stage="copy"))
    m.add_gauges(lambda: [("ace_agent_tier_adapters", "Adapters resident per tier.", {"tier": "device"}, 3),
                          ("ace_agent_engine_up", "1 when the engine answered.", {}, 1.0)])
    got = _samples(m.render())
    assert got[("ace_agent_evictions_total", (("reason", "budget"), ("tier", "device")))] == 1
    assert got[("ace_agent_evictions_total", (("reason", "hint"), ("tier", "device")))] == 1
    assert got[("ace_agent_load_seconds_bucket", (("le", "0.0025"), ("stage", "cold")))] == 0
    assert got[("ace_agent_load_seconds_bucket", (("le", "0.005"), ("stage", "cold")))] == 1
    assert got[("ace_agent_load_seconds_count", (("stage", "cold"),))] == 1
    assert got[("ace_agent_prefetch_preemptions_total", (("stage", "copy"),))] == 2
    assert got[("ace_agent_tier_adapters", (("tier", "device"),))] == 3
    assert got[("ace_agent_engine_up", ())] == 1
    engine["copy"] = 5
    assert m.counter("ace_agent_prefetch_preemptions_total", stage="copy") == 5
