"""The trace claims a prefetch only when this request's prefetch skill is prod."""
from __future__ import annotations

import pytest

from extproc.domain.auth import Principal
from extproc.domain.decision import InferenceRequest, decide
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.app.trace import trace_entries


def _trace(snapshot, tier, prefetched, pf_mode, ml_mode="prod"):
    res = ResidencySnapshot.build({"local-vllm": {"code-python": TierReport(tier, 20.0, 1, prefetched)}})
    key = next(k for k in snapshot.keys.values() if k.name == "alice")
    req = InferenceRequest(Principal(key=key, tenant=snapshot.tenants["acme"]), {"model": "code-python"},
                           {"multi_lora": ml_mode, "dynamic_lora_prefetch": pf_mode})
    ml, _ = trace_entries(decide(snapshot, res, SentCounts(), req), None)
    return ml


@pytest.mark.parametrize("tier,prefetched,pf_mode,action,hit", [
    # the bug: prefetch off, the agent says loaded_by=prefetch (or host memory) -> no prefetch claimed
    ("device", True, "off", "adapter_resident_applied", "false"),
    ("host", False, "off", "adapter_staged_applied", "false"),
    ("device", True, "shadow", "adapter_resident_applied", "false"),
    ("host", False, "shadow", "adapter_staged_applied", "false"),
    # prod: a prefetch put it there
    ("device", True, "prod", "adapter_prefetched_applied", "true"),
    ("device", False, "prod", "adapter_resident_applied", "false"),
    ("host", False, "prod", "adapter_prefetched_applied", "false"),
])
def test_prefetch_claims_need_prod(snapshot, tier, prefetched, pf_mode, action, hit):
    ml = _trace(snapshot, tier, prefetched, pf_mode)
    assert (ml["action"], ml["is_prefetch_hit"]) == (action, hit)


def test_shadow_multi_lora_would_follows_the_same_rule(snapshot):
    ml = _trace(snapshot, "device", True, "off", ml_mode="shadow")
    assert (ml["action"], ml["would"], ml["is_prefetch_hit"]) == ("shadow", "adapter_resident_applied", "false")
    ml = _trace(snapshot, "device", True, "prod", ml_mode="shadow")
    assert (ml["would"], ml["is_prefetch_hit"]) == ("adapter_prefetched_applied", "true")
