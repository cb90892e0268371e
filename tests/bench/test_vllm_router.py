"""The ``vllm_router`` arms' launcher: the real ``vllm-router`` (PyPI) in front of two engines.

The engines are recording OpenAI-shaped upstreams (``tests.support.upstream``): what
is checked is the router as the arms run it. Skipped, saying why, where
``.venv-router`` has not been made (``make bench ENGINE=vllm`` and ``make bench
ARMS=...,vllm_router`` make it).
"""
from __future__ import annotations

import httpx
import pytest

from bench.vllm_router import ROUTER_ARMS, ROUTER_BIN, vllm_router
from tests.support.upstream import RecordingUpstream

ADAPTERS = ("code-python", "fin-reports", "tr-de-en")


def send(url: str, sessions: int) -> None:
    with httpx.Client(timeout=60) as client:
        for s in range(sessions):
            for adapter in ADAPTERS:
                r = client.post(url + "/v1/chat/completions", headers={"x-ace-session-id": f"acme/s{s}"}, json={
                    "model": adapter, "messages": [{"role": "user", "content": f"session {s}"}],
                    "max_tokens": 4, "user": f"acme/s{s}"})
                assert r.status_code == 200, r.text


@pytest.fixture
def engines():
    if not ROUTER_BIN.is_file():
        pytest.skip(f"{ROUTER_BIN} missing: make bench ENGINE=vllm installs vllm-router")
    with RecordingUpstream() as a, RecordingUpstream() as b:
        yield a, b


def chats(up: RecordingUpstream) -> list[dict]:
    return [r.json() for r in up.requests if r.path == "/v1/chat/completions"]


def test_consistent_hash_keeps_each_session_on_one_engine(engines, tmp_path):
    a, b = engines
    with vllm_router([f"http://{a.address}", f"http://{b.address}"], ROUTER_ARMS["vllm_router_session"],
                     tmp_path) as url:
        send(url, sessions=8)
    seen = {name: {r["user"] for r in chats(up)} for name, up in (("a", a), ("b", b))}
    assert len(chats(a)) + len(chats(b)) == 8 * len(ADAPTERS)
    assert not seen["a"] & seen["b"]                 # no session split across engines
    for up in (a, b):                                # the adapter arrives as sent, in model
        assert {r["model"] for r in chats(up)} <= set(ADAPTERS)


def test_default_policy_serves_every_request(engines, tmp_path):
    a, b = engines
    with vllm_router([f"http://{a.address}", f"http://{b.address}"], ROUTER_ARMS["vllm_router"], tmp_path) as url:
        send(url, sessions=2)
    assert len(chats(a)) + len(chats(b)) == 2 * len(ADAPTERS)


def test_missing_binary_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="vllm-router"):
        with vllm_router(["http://127.0.0.1:9"], "round_robin", tmp_path, binary=tmp_path / "none"):
            pass
