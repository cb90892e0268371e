"""/v1/execute's answer: the execution id and the typed trace."""
from __future__ import annotations

import json
import re
from dataclasses import replace

from extproc.domain.auth import Principal
from extproc.state.catalog import Upstream
from extproc.domain.decision import InferenceRequest, decide
from extproc.app.native import new_execution_id, wrap_output
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.app.trace import execute_trace, trace_entries

BODY = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "lora_name": "code-python"}


def _decision(snapshot, skills, residency=None):
    up = Upstream("u", "127.0.0.1:1", "vllm", "ace-tiny-llama", "body")
    snap = replace(snapshot, upstreams=(up,))
    key = snap.keys[next(iter(snap.keys))]
    p = Principal(key=replace(key, skills={}), tenant=snap.tenants["acme"])
    return decide(snap, residency or ResidencySnapshot(), SentCounts(), InferenceRequest(p, BODY, skills))


def test_execution_id_in_output_and_top_level():
    eid = new_execution_id()
    assert re.fullmatch(r"exec-[0-9a-f]{24}", eid) and eid != new_execution_id()
    out = json.loads(wrap_output(b'{"id":"chatcmpl-1","object":"chat.completion"}', [], eid))
    assert out == {"id": eid, "output": {"id": eid, "object": "chat.completion"}, "trace": [],
                   "upstream_id": "chatcmpl-1"}
    text = json.loads(wrap_output(b"upstream broke", [], eid))
    assert (text["id"], text["output"], text["upstream_id"]) == (eid, "upstream broke", None)


SEED_KEYS = {"skill", "mode", "action", "adapter_name", "is_prefetch_hit", "swap_ms_saved",
             "vram_mb_saved"}


def test_trace_unknown_residency_is_zero_and_named(snapshot):
    ml, pf = execute_trace(_decision(snapshot, {"multi_lora": "prod"}), None)
    for entry in (ml, pf):
        assert SEED_KEYS <= set(entry)
        assert entry["adapter_name"] == "code-python"
        assert entry["is_prefetch_hit"] is False
        assert entry["swap_ms_saved"] == 0 and entry["vram_mb_saved"] == 0
    assert ml["unknown"] == ["is_prefetch_hit", "swap_ms_saved", "vram_mb_saved"]
    assert pf["unknown"] == ["is_prefetch_hit", "swap_ms_saved"]   # prefetching saves no memory


def test_trace_prefetch_hit_numbers_are_the_measured_ones(snapshot):
    res = ResidencySnapshot.build({"u": {"code-python": TierReport(
        "device", 40.5, 2 << 20, prefetched=True, base_model_bytes=300 << 20)}})
    d = _decision(snapshot, {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}, res)
    ml, pf = execute_trace(d, None)
    assert ml["action"] == "adapter_prefetched_applied"
    assert (ml["is_prefetch_hit"], ml["swap_ms_saved"], ml["vram_mb_saved"], ml["unknown"]) == (
        True, 40.5, 300.0, [])
    assert (pf["is_prefetch_hit"], pf["swap_ms_saved"], pf["vram_mb_saved"], pf["unknown"]) == (
        True, 40.5, 0, [])
    # the headers keep their string format
    hml, _ = trace_entries(d, None)
    assert (hml["is_prefetch_hit"], hml["swap_ms_saved"], hml["vram_mb_saved"]) == ("true", "40.5", "300")


def test_trace_no_adapter_saves_nothing(snapshot):
    up = Upstream("u", "127.0.0.1:1", "vllm", "ace-tiny-llama", "body")
    snap = replace(snapshot, upstreams=(up,))
    key = snap.keys[next(iter(snap.keys))]
    p = Principal(key=replace(key, skills={}), tenant=replace(snap.tenants["acme"], default_adapter=None))
    d = decide(snap, ResidencySnapshot(), SentCounts(), InferenceRequest(p, {"model": "ace-tiny-llama", "messages": []}, {}))
    for entry in execute_trace(d, None):
        assert entry["adapter_name"] is None
        assert (entry["is_prefetch_hit"], entry["swap_ms_saved"], entry["vram_mb_saved"]) == (False, 0, 0)
