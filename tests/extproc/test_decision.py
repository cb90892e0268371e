from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.domain.auth import Principal
from extproc.state.catalog import Upstream
from extproc.domain.decision import InferenceRequest, decide
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.app.trace import trace_metadata


def _decide(snapshot, residency, skills, body=None, route=None):
    key = next(k for k in snapshot.keys.values() if k.name == "alice")
    p = Principal(key=key, tenant=snapshot.tenants["acme"])
    req = InferenceRequest(p, body or {"model": "code-python"}, skills)
    sent = SentCounts()
    return decide(snapshot, residency, sent, req, route) if route else decide(snapshot, residency, sent, req)


def _res(tier, ms=None):
    return ResidencySnapshot.build({"local-vllm": {"code-python": TierReport(tier, ms, 1 << 20)}})


# tier, multi_lora action, swap_ms_saved, prefetch action (prod)
TABLE = [
    (None, "adapter_applied", "unknown", "prefetch_signalled"),
    ("device", "adapter_resident_applied", "35", "not_needed"),
    ("host", "adapter_prefetched_applied", "unknown", "not_needed"),
    ("disk", "adapter_cold_loaded", "0", "prefetch_signalled"),
    ("remote", "adapter_cold_loaded", "0", "prefetch_signalled"),
]


@pytest.mark.parametrize("tier,action,saved,pf", TABLE)
def test_actions_from_residency(snapshot, tier, action, saved, pf):
    res = _res(tier, 35.0) if tier else ResidencySnapshot()
    d = _decide(snapshot, res, {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"})
    assert d.multi_lora_action == action and d.prefetch_action == pf
    meta = dict(trace_metadata(d, None))
    assert f"swap_ms_saved={saved}" in meta["trace_multi_lora"]
    # the tier as the whole project names it (ace_common.tiers.Tier): the top one is "device"
    assert f",residency={tier or 'unknown'}," in meta["trace_multi_lora"]
    assert f",residency={tier or 'unknown'}" in meta["trace_dynamic_lora_prefetch"]
    assert meta["served_by"] == "local-vllm"
    assert (d.prefetch_signal is not None) == (pf == "prefetch_signalled")
    if d.prefetch_signal:
        assert d.prefetch_signal.digest == "a" * 64 and d.prefetch_signal.upstream == "local-vllm"


def test_shadow_decides_but_does_not_apply(snapshot):
    d = _decide(snapshot, _res("device", 10.0), {"multi_lora": "shadow", "dynamic_lora_prefetch": "shadow"})
    assert (d.multi_lora_action, d.multi_lora_would, d.applies_adapter) == (
        "shadow", "adapter_resident_applied", False)
    assert d.prefetch_action == "not_needed" and d.prefetch_signal is None


def test_route_policy_seam_gets_adapter_only_in_prod(snapshot):
    other = Upstream("other", "127.0.0.1:2", "sglang", "ace-tiny-llama", "off")
    snap = replace(snapshot, upstreams=snapshot.upstreams + (other,))
    seen = []

    def policy(upstreams, adapter, residency, sent):
        seen.append(adapter.name if adapter else None)
        return upstreams[-1]
    d = _decide(snap, ResidencySnapshot(), {"multi_lora": "prod"}, route=policy)
    assert d.upstream.name == "other"
    _decide(snap, ResidencySnapshot(), {"multi_lora": "shadow"}, route=policy)
    assert seen == ["code-python", None]


@pytest.mark.parametrize("queued", [None, True, False])
def test_trace_metadata_is_the_entries_memoised(snapshot, queued):
    """The header values are the trace entries joined, on the first call and from the memo;
    residencies that compare equal but print differently (-0.0 / 0.0 ms) keep apart."""
    from extproc.app.trace import trace_entries
    residencies = [ResidencySnapshot(), _res("device", 35.0), _res("device", -0.0), _res("device", 0.0),
                   _res("host"), _res("disk", 12.5)]
    skill_sets = [{"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
                  {"multi_lora": "shadow", "dynamic_lora_prefetch": "shadow"},
                  {"multi_lora": "off", "dynamic_lora_prefetch": "off"}]
    for _ in range(2):
        for res in residencies:
            for skills in skill_sets:
                d = _decide(snapshot, res, skills)
                ml, pf = trace_entries(d, queued)
                expected = tuple((key, ",".join(f"{k}={v}" for k, v in entry.items() if k != "skill"))
                                 for key, entry in (("trace_multi_lora", ml), ("trace_dynamic_lora_prefetch", pf)))
                assert trace_metadata(d, queued) == (*expected, ("served_by", "local-vllm"))
    def multi_lora(ms):
        d = _decide(snapshot, _res("device", ms), skill_sets[0])
        return dict(trace_metadata(d, None))["trace_multi_lora"]
    assert "swap_ms_saved=-0," in multi_lora(-0.0)
    assert "swap_ms_saved=0," in multi_lora(0.0)


def test_the_ingress_prefetch_names_the_pools_first_victims(snapshot):
    res = replace(_res("remote"), victims={"local-vllm": ("old-one", "older")})
    d = _decide(snapshot, res, {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"})
    assert d.prefetch_signal.evict == ("old-one", "older")
    d = _decide(snapshot, _res("remote"), {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"})
    assert d.prefetch_signal.evict == ()


def test_the_ingress_prefetch_names_the_whole_ranking_where_routed_victims_are_spared(snapshot):
    """On vLLM and SGLang the sender drops the just-routed adapters from ``evict``: the
    signal carries the pool model's whole ranking so that a named victim is left; the
    builtin engine, whose busy set is exact, gets the first two."""
    ranking = ("v1", "v2", "v3", "v4")
    on = {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    res = replace(_res("remote"), victims={"local-vllm": ranking})
    assert _decide(snapshot, res, on).prefetch_signal.evict == ranking
    up = snapshot.upstreams[0]
    builtin = replace(snapshot, upstreams=(replace(up, flavour="builtin"),))
    assert _decide(builtin, res, on).prefetch_signal.evict == ranking[:2]


def test_the_ingress_prefetch_carries_the_hosts_grace_for_just_routed_victims(snapshot):
    """vLLM and SGLang list a request late and fail it when its adapter goes: the signal
    tells the sender to spare what was just routed there; the builtin engine needs none."""
    on = {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    assert _decide(snapshot, _res("remote"), on).prefetch_signal.spare_s == 0.5   # local-vllm: vllm
    up = snapshot.upstreams[0]
    builtin = replace(snapshot, upstreams=(replace(up, flavour="builtin"),))
    assert _decide(builtin, _res("remote"), on).prefetch_signal.spare_s == 0.0


def test_sent_counts_remember_when_each_adapter_was_routed_and_stay_bounded():
    now = [100.0]
    sent = SentCounts(max_routes=4, clock=lambda: now[0])
    sent.record("e0", "a")
    sent.record("e0")                       # a request without an adapter counts, names nothing
    assert sent.value("e0") == 2
    assert sent.recent("e0", 10.0) == {"a": 0.0} and sent.recent("e1", 10.0) == {}
    now[0] += 2.0
    assert sent.recent("e0", 10.0) == {"a": 2.0}
    sent.record("e0", "a")                  # routed again: fresh, and the newest
    for name in "bcde":
        sent.record("e0", name)
    assert sent.recent("e0", 10.0) == {"e": 0.0, "d": 0.0, "c": 0.0}   # a, b: the older half past max_routes


def test_sent_counts_name_the_adapters_routed_to_an_upstream_lately_newest_first():
    now = [100.0]
    sent = SentCounts(clock=lambda: now[0])
    sent.record("e0", "a")
    now[0] += 1.0
    sent.record("e1", "b")
    sent.record("e0", "c")
    now[0] += 0.25
    assert sent.recent("e0", 0.5) == {"c": 0.25}
    assert sent.recent("e0", 2.0) == {"c": 0.25, "a": 1.25}
    assert list(sent.recent("e0", 2.0, limit=1)) == ["c"]
    assert sent.recent("e2", 2.0) == {}
