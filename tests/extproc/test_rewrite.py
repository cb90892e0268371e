from __future__ import annotations

import json
from dataclasses import replace

import pytest

from extproc.auth import Principal
from extproc.catalog import Upstream
from extproc.decision import InferenceRequest, decide
from extproc.residency import AdapterResidency, ResidencySnapshot
from extproc.rewrite import rewrite_request

BODY = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "lora_name": "code-python"}


def _decision(snapshot, flavour, hints, skills=None, residency=None):
    up = Upstream("u", "127.0.0.1:1", flavour, "ace-tiny-llama", hints)
    snap = replace(snapshot, upstreams=(up,))
    key = snap.keys[next(iter(snap.keys))]
    p = Principal(key=replace(key, skills={}), tenant=snap.tenants["acme"])
    return decide(snap, residency or ResidencySnapshot(), InferenceRequest(p, BODY, skills or {}))


# flavour -> the model the upstream must see
MODEL = [("vllm", "code-python"), ("builtin", "code-python"), ("sglang", "ace-tiny-llama:code-python")]


@pytest.mark.parametrize("flavour,model", MODEL)
def test_flavour_model_table(snapshot, flavour, model):
    rw = rewrite_request(BODY, _decision(snapshot, flavour, "off"))
    assert json.loads(rw.body) == {**BODY, "model": model}
    assert rw.header_hints == ()


@pytest.mark.parametrize("flavour,model", MODEL)
def test_hints_in_body(snapshot, flavour, model):
    d = _decision(snapshot, flavour, "body", {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"})
    sent = json.loads(rewrite_request(BODY, d).body)
    assert sent["model"] == model
    assert sent["lora_name"] == sent["lora_adapter"] == "code-python"
    assert sent["lora_prefetch"] is sent["enable_lora_prefetch"] is True
    assert sent["prefetch_adapter_id"] == "a" * 64
    assert sent["prefetch_status"] == "unknown"
    assert "vram_allocated_mb" not in sent     # unknown: not invented
    assert list(sent)[:3] == ["model", "messages", "lora_name"]   # client order kept


def test_hints_in_headers(snapshot):
    res = ResidencySnapshot.build({"u": {"code-python": AdapterResidency("pool", 40.0, 2 << 20)}})
    d = _decision(snapshot, "vllm", "headers", residency=res)
    rw = rewrite_request(BODY, d)
    assert json.loads(rw.body) == {**BODY, "model": "code-python"}
    assert dict(rw.header_hints) == {
        "lora_name": "code-python", "lora_adapter": "code-python",
        "lora_prefetch": "false", "enable_lora_prefetch": "false",
        "vram_allocated_mb": "2.0", "prefetch_status": "pool"}


def test_body_untouched_when_nothing_changes(snapshot):
    body = dict(BODY, model="code-python")
    assert rewrite_request(body, _decision(snapshot, "vllm", "off")).body is None


@pytest.mark.parametrize("skills", [{"multi_lora": "shadow"}, {"multi_lora": "off"}])
def test_shadow_and_off_never_rewrite(snapshot, skills):
    assert rewrite_request(BODY, _decision(snapshot, "sglang", "body", skills)).body is None
