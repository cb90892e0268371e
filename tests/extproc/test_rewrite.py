from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import replace

import pytest

from extproc.domain.auth import Principal
from extproc.state.catalog import Upstream
from extproc.domain.decision import InferenceRequest, decide
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.rewrite import rewrite_request
from extproc.rewrite.codec import decode, encode, loads_strict
from tests.support.seeds import SEED_EXECUTE, SEED_HINTS

BODY = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
        "lora_name": "code-python"}


def _decision(snapshot, flavour, hints, skills=None, residency=None, body=BODY):
    up = Upstream("u", "127.0.0.1:1", flavour, "ace-tiny-llama", hints)
    snap = replace(snapshot, upstreams=(up,))
    key = snap.keys[next(iter(snap.keys))]
    p = Principal(key=replace(key, skills={}), tenant=snap.tenants["acme"])
    return decide(snap, residency or ResidencySnapshot(), SentCounts(), InferenceRequest(p, body, skills or {}))


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
    res = ResidencySnapshot.build({"u": {"code-python": TierReport("device", 40.0, 2 << 20)}})
    d = _decision(snapshot, "vllm", "headers", residency=res)
    rw = rewrite_request(BODY, d)
    assert json.loads(rw.body) == {**BODY, "model": "code-python"}
    assert dict(rw.header_hints) == {
        "lora_name": "code-python", "lora_adapter": "code-python",
        "lora_prefetch": "false", "enable_lora_prefetch": "false",
        "vram_allocated_mb": "2.0", "prefetch_status": "device"}


def test_body_untouched_when_nothing_changes(snapshot):
    body = dict(BODY, model="code-python")
    assert rewrite_request(body, _decision(snapshot, "vllm", "off")).body is None


@pytest.mark.parametrize("skills", [{"multi_lora": "shadow"}, {"multi_lora": "off"}])
def test_shadow_and_off_never_rewrite(snapshot, skills):
    assert rewrite_request(BODY, _decision(snapshot, "sglang", "body", skills)).body is None


# ---------------------------------------------------------------- client copies of hint fields

PROD = {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}


def test_hint_fields_cover_wire_hints(snapshot):
    from extproc.rewrite.hints import HINT_FIELDS, wire_hints
    res = ResidencySnapshot.build({"u": {"code-python": TierReport("device", 40.0, 2 << 20)}})
    d = _decision(snapshot, "vllm", "body", {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
                  residency=res)
    assert set(wire_hints(d)) <= set(HINT_FIELDS)


def test_execute_seed_body_engine_sees_only_gateway_hints(snapshot):
    from extproc.app.native import chat_body_from_execute
    chat = chat_body_from_execute(SEED_EXECUTE)
    d = _decision(snapshot, "vllm", "body", body=chat)
    sent = json.loads(rewrite_request(chat, d, force=True).body)
    assert sent["model"] == "code-python"
    assert sent["lora_name"] == sent["lora_adapter"] == "code-python"
    assert sent["lora_prefetch"] is sent["enable_lora_prefetch"] is False  # prefetch in shadow
    assert sent["prefetch_status"] == "unknown"                             # no agent data
    assert "prefetch_adapter_id" not in sent and "vram_allocated_mb" not in sent
    assert sent["extra_body"] == {"lora_name": "code-python"}   # the selector, = the gateway's choice
    assert sent["skill_overrides"] == SEED_EXECUTE["skill_overrides"]


def test_sdk_top_level_client_hints_replaced(snapshot):
    body = {**BODY, **SEED_HINTS, "lora_adapter": "evil", "lora_prefetch": 1}
    res = ResidencySnapshot.build({"u": {"code-python": TierReport("device", 40.0, 2 << 20)}})
    d = _decision(snapshot, "vllm", "body", PROD, residency=res, body=body)
    sent = json.loads(rewrite_request(body, d).body)
    assert {k: sent.get(k) for k in SEED_HINTS} | {"lora_adapter": sent["lora_adapter"],
                                                     "lora_prefetch": sent["lora_prefetch"]} == {
        "lora_name": "code-python", "lora_adapter": "code-python", "lora_prefetch": False,
        "enable_lora_prefetch": False, "prefetch_adapter_id": None, "vram_allocated_mb": 2.0,
        "prefetch_status": "device"}


@pytest.mark.parametrize("hints", ["headers", "off"])
def test_client_hints_stripped_when_hints_not_in_body(snapshot, hints):
    body = {**BODY, **SEED_HINTS, "extra_body": dict(SEED_HINTS, max_tokens=8)}
    d = _decision(snapshot, "sglang", hints, PROD, body=body)
    sent = json.loads(rewrite_request(body, d).body)
    assert sent == {**BODY, "model": "ace-tiny-llama:code-python",
                    "extra_body": {"lora_name": "code-python", "max_tokens": 8}}


@pytest.mark.parametrize("skills", [{"multi_lora": "shadow"}, {"multi_lora": "off"}])
def test_shadow_and_off_still_strip_client_hints(snapshot, skills):
    body = {**BODY, **SEED_HINTS, "extra_body": dict(SEED_HINTS)}
    d = _decision(snapshot, "vllm", "body", skills, body=body)
    sent = json.loads(rewrite_request(body, d).body)
    assert sent == {**BODY, "extra_body": {"lora_name": "code-python"}}   # model untouched


def test_lora_name_other_than_the_selected_adapter_is_removed(snapshot):
    # extra_body.lora_name wins the selection; the top-level one names another adapter
    body = {**BODY, "lora_name": "acme-legal", "extra_body": {"lora_name": "code-python"}}
    d = _decision(snapshot, "vllm", "body", {"multi_lora": "shadow"}, body=body)
    sent = json.loads(rewrite_request(body, d).body)
    assert "lora_name" not in sent and sent["extra_body"] == {"lora_name": "code-python"}


# ---------------------------------------------------------------- JSON in and out (codec)

def _same(a, b) -> bool:
    """Equal, with the same types, key order and float spelling (-0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b) if isinstance(a, float) else a == b


def _outcome(fn, raw):
    try:
        return "ok", fn(raw)
    except Exception as exc:   # noqa: BLE001 - the exception is what is compared
        return type(exc), str(exc)


JSON_CORPUS = [
    b'{"a":1,"b":2,"a":3}', b'{"a":1e-400}', b'{"a":1e400}', b'{"a":-1e400}', b'{"a":NaN}',
    b'{"a":Infinity}', b'{"a":-Infinity}', b'{"a":"\x00"}', b'{"a":"\x1f"}', b'{"a":"\\a"}',
    b'{"a":"\\/"}', b'\x0c{"a":1}', b'[1,]', b'{"a":1,}', b'/*c*/{}', b'{"a":01}', b'{"a":.5}',
    b'{"a":1.}', b'{"a":+1}', b'{"a":-0}', b'{"a":-0.0}', b'{"a":0e0}', b'{"a":1E+2}',
    b'{"a":"\\ud83d\\ude00"}', b'{"a":"\\ude00"}', b'{"a":"\\ud800"}', b'{"a":"\xed\xa0\x80"}',
    b'{"a":"\xff"}', b'{"a":"\xc0\xaf"}', b'\xef\xbb\xbf{"a":1}', '{"a":1}'.encode("utf-16"),
    '{"a":1}'.encode("utf-32-le"), b'"x"', b"1", b"[]", b"{}", b"", b" ", b'{"a":1}{}',
    b'{"a" :1 , "b"\t:\n2\r}', b'{"\\u0000":1}', b'{"a":123456789012345678}',
    b'{"a":9223372036854775807}', b'{"a":-9223372036854775808}', b'{"a":18446744073709551615}',
    b'{"a":18446744073709551616}', b'{"a":123456789012345678901234567890}',
    b'{"a":0.1000000000000000055511151231257827}', b'{"a":' + b"9" * 400 + b'.0}',
    b'{"a":2.4703282292062328e-324}', b'{"a":1.7976931348623159e308}', b"[" * 255 + b"]" * 255,
    b"[" * 256 + b"]" * 256, b"[" * 2000 + b"]" * 2000, b'{"a":' + b"[" * 30000 + b"]" * 30000 + b"}",
    b'{"a":"' + "é€😀".encode() * 10 + b'"}', b'{"a":tru}', b'{"a":nul}', b'{"a":"\\u00"}',
]


@pytest.mark.parametrize("raw", JSON_CORPUS)
def test_decode_is_strict_json_loads(raw):
    """Same value (types, key order, float spelling) or the same exception and message."""
    mine, theirs = _outcome(decode, raw), _outcome(loads_strict, raw)
    assert mine[0] == theirs[0]
    assert _same(mine[1], theirs[1]) if mine[0] == "ok" else mine[1] == theirs[1]


def test_decode_is_strict_json_loads_on_mutated_bodies():
    rng = random.Random(7)
    bases = [json.dumps({"model": "code-python", "messages": [{"role": "user", "content": "Write a parser. " * 20}],
                         "temperature": 0.7, "seed": 42, "stop": None, "stream": False}).encode(),
             b'{"n":1,"t":0.7,"s":[1,2.5e-3,-0,true,null],"u":"\\u00e9\\n","o":{"a":{"b":[]}}}']
    alphabet = b'{}[]",:0123456789.eE+-\\u tnfalsr\x00\x1f\x7f\xff\xc3\xa9 '
    numbers = ["1e22", "5e-324", "-0.0", str(2 ** 64), str(-2 ** 63 - 1), "0.30000000000000004", "1e308", "1e309"]
    for _ in range(3000):
        raw = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(raw) + 1)
            op = rng.random()
            if op < 0.4 and raw:
                del raw[at % len(raw)]
            elif op < 0.8:
                raw[at:at] = bytes([rng.choice(alphabet)])
            else:
                raw[at:at] = rng.choice(numbers).encode()
        mine, theirs = _outcome(decode, bytes(raw)), _outcome(loads_strict, bytes(raw))
        assert mine[0] == theirs[0], raw
        assert _same(mine[1], theirs[1]) if mine[0] == "ok" else mine[1] == theirs[1], raw


@pytest.mark.parametrize("raw", [b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}', b'{"a":1e400}',
                                 b'{"a":[1,-1e309]}', b'{"t":NaN,"n":' + b"9" * 30 + b'}'])
def test_decode_refuses_what_is_not_a_json_number(raw):
    """``json.loads`` takes these (as nan / inf); an engine sampling with them fails its batch."""
    assert not isinstance(_outcome(json.loads, raw)[0], type)   # json itself takes them
    with pytest.raises(ValueError):
        decode(raw)


def test_decode_keeps_every_finite_number():
    raw = b'{"a":1e-400,"b":1.7976931348623157e308,"c":-0.0,"d":' + b"9" * 30 + b',"e":5e-324}'
    assert _same(decode(raw), json.loads(raw))


@pytest.mark.parametrize("obj, spelled", [
    ({"a": None, "b": 1.5}, b'{"a":null,"b":1.5}'),                 # orjson's, after the round trip
    ({"a": None, "b": float("nan")}, b'{"a":null,"b":NaN}'),        # a null from NaN: json's
    ({"b": float("inf")}, b'{"b":Infinity}'),
    ({"a": [1, 2.0, "x\u00e9"], "c": True}, b'{"a":[1,2.0,"x\xc3\xa9"],"c":true}'),
])
def test_encode_never_writes_a_non_finite_float_as_null(obj, spelled):
    assert encode(obj) == spelled


@pytest.mark.parametrize("flavour", ["builtin", "vllm", "sglang"])
def test_a_cold_requests_victims_go_with_it_to_a_builtin_engine_only(snapshot, flavour):
    """The builtin engine loads a cold request's adapter itself: the victims of the
    gateway's signal travel in the body (``EVICT_FIRST``), which its load evicts first, in
    place of a Prefetch RPC; other flavours never get the field, and a client's copy is
    stripped everywhere (top level and ``extra_body``)."""
    from ace_common.engine_fields import EVICT_FIRST

    res = dataclasses.replace(ResidencySnapshot(), victims={"u": ("acme-legal", "code-sql")})
    body = {**BODY, EVICT_FIRST: ["x"], "extra_body": {EVICT_FIRST: ["x"], "max_tokens": 8}}
    both = {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    d = _decision(snapshot, flavour, "off", both, residency=res, body=body)
    assert d.prefetch_signal is not None and d.prefetch_signal.evict
    sent = json.loads(rewrite_request(body, d).body)
    assert sent["extra_body"] == {"max_tokens": 8}
    if flavour == "builtin":
        assert sent[EVICT_FIRST] == list(d.prefetch_signal.evict)
    else:
        assert EVICT_FIRST not in sent
    warm = ResidencySnapshot.build({"u": {"code-python": TierReport("device", 40.0, 2 << 20)}})
    d = _decision(snapshot, flavour, "off", both, residency=dataclasses.replace(warm, victims=res.victims))
    assert d.prefetch_signal is None and EVICT_FIRST not in json.loads(rewrite_request(BODY, d).body)
