"""The agent driving a real vLLM (CPU build) through its runtime LoRA API.

One vLLM per module (startup is ~16 s+ on this machine), started with
`--max-loras 2 --max-cpu-loras 2 --max-lora-rank 16`; the agent mirrors
`--max-cpu-loras 2`. Only the rank-8/16 fixture adapters are used (the rank flag).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import httpx
import pytest

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.agent import AUTH, agent_process
from tests.support.fixtures import fixtures_dir
from tests.support.vllm import BASE_MODEL, VLLMServer, vllm_python
from tests.support.wait import scaled, wait_until

pytestmark = pytest.mark.vllm

PROMPTS = ["def fibonacci(n):", "Patient presents with"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return fixtures_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def vllm(fixtures, tmp_path_factory):
    server = VLLMServer(vllm_python(), fixtures / "model", tmp_path_factory.mktemp("vllm-logs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def agent(vllm, fixtures, tmp_path_factory):
    work = tmp_path_factory.mktemp("agent")
    with agent_process(fixtures / "catalog.yaml", work, "vllm", engine_url=vllm.url,
                       extra=["--max-cpu-loras", str(vllm.max_cpu_loras),
                              "--reconcile-interval-s", "0.5"]) as proc:
        yield proc


def rpc(agent, method, request):
    async def call():
        async with grpc.aio.insecure_channel(agent.target) as ch:
            return await getattr(pb_grpc.AgentStub(ch), method)(request, metadata=AUTH, timeout=30)
    return asyncio.run(call())


def unload_all(vllm, agent):
    for name in list(vllm.adapters()):
        rpc(agent, "Evict", pb.EvictRequest(adapter=name))
        httpx.post(vllm.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)


def test_prefetch_makes_adapter_listed_before_the_request(vllm, agent):
    unload_all(vllm, agent)
    assert "code-python" not in vllm.adapters()
    t0 = time.monotonic()
    reply = rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="code-python", priority=1, reason="test"))
    assert reply.outcome == pb.PrefetchReply.ACCEPTED
    wait_until(lambda: "code-python" in vllm.adapters())
    listed_ms = (time.monotonic() - t0) * 1000
    st = rpc(agent, "Status", pb.StatusRequest(adapter="code-python"))
    wait_until(lambda: rpc(agent, "Status", pb.StatusRequest(adapter="code-python")).tier == pb.TIER_DEVICE)
    st = rpc(agent, "Status", pb.StatusRequest(adapter="code-python"))
    assert st.HasField("cold_load_ms") and 0 < st.cold_load_ms < scaled(10) * 1000
    assert st.bytes > 0
    print(f"\nprefetch -> listed in /v1/models: {listed_ms:.1f} ms; agent cold load {st.cold_load_ms:.1f} ms")
    # the request that follows finds it loaded: vLLM answers with the adapter
    assert vllm.complete("code-python", PROMPTS[0])
    again = rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="code-python"))
    assert again.outcome == pb.PrefetchReply.ALREADY_RESIDENT


def test_outputs_through_agent_loaded_adapters_match_direct_loads(vllm, agent, fixtures):
    unload_all(vllm, agent)
    agent_loaded = {}
    for name in ("code-python", "med-triage"):
        assert rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=name)).outcome == pb.PrefetchReply.ACCEPTED
        wait_until(lambda n=name: n in vllm.adapters())
        agent_loaded[name] = [vllm.complete(name, p) for p in PROMPTS]
    unload_all(vllm, agent)
    base = [vllm.complete(BASE_MODEL, p) for p in PROMPTS]
    for name, outputs in agent_loaded.items():
        direct = f"direct-{name}"
        r = httpx.post(vllm.url + "/v1/load_lora_adapter", timeout=30,
                       json={"lora_name": direct, "lora_path": str(fixtures / "adapters" / name)})
        assert r.status_code == 200, r.text
        try:
            assert [vllm.complete(direct, p) for p in PROMPTS] == outputs
        finally:
            httpx.post(vllm.url + "/v1/unload_lora_adapter", json={"lora_name": direct}, timeout=10)
        assert outputs != base, f"{name} should change the greedy output"
    assert agent_loaded["code-python"] != agent_loaded["med-triage"]


def test_device_tier_mirrors_max_cpu_loras_and_evict_unloads(vllm, agent):
    unload_all(vllm, agent)
    order = ["code-python", "fin-reports", "tr-de-en"]
    for name in order:
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=name))
        wait_until(lambda n=name: rpc(agent, "Status", pb.StatusRequest(adapter=n)).tier == pb.TIER_DEVICE)
    # capacity 2: the least recently used (code-python) was unloaded through the API
    assert set(vllm.adapters()) == {"fin-reports", "tr-de-en"}
    assert rpc(agent, "Status", pb.StatusRequest(adapter="code-python")).tier == pb.TIER_DISK
    assert agent.metric('ace_agent_evictions_total{reason="budget",tier="device"}') >= 1
    # pinned adapters stay; explicit Evict unloads
    assert rpc(agent, "Pin", pb.PinRequest(adapter="fin-reports")).ok
    rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="med-triage"))
    wait_until(lambda: "med-triage" in vllm.adapters())
    assert set(vllm.adapters()) == {"fin-reports", "med-triage"}
    assert not rpc(agent, "Evict", pb.EvictRequest(adapter="fin-reports")).evicted
    rpc(agent, "Unpin", pb.PinRequest(adapter="fin-reports"))
    reply = rpc(agent, "Evict", pb.EvictRequest(adapter="med-triage"))
    assert reply.evicted and reply.status.tier == pb.TIER_DISK
    assert "med-triage" not in vllm.adapters()


def test_unknown_or_tampered_requests_never_reach_vllm(vllm, agent):
    before = set(vllm.adapters())
    r = rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="../../etc/passwd"))
    assert (r.outcome, r.reason) == (pb.PrefetchReply.REJECTED, "unknown_adapter")
    r = rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="tr-de-en", digest="00" * 32))
    assert (r.outcome, r.reason) == (pb.PrefetchReply.REJECTED, "digest_mismatch")
    assert set(vllm.adapters()) == before


def test_the_agent_publishes_the_real_vllms_load(vllm, agent):
    """vLLM's own gauges (vllm:num_requests_running/_waiting) are the names the agent
    scrapes: idle reads 0/0 (known, not unknown), requests in flight show up as running.
    Read from what the agent published (its WatchResidency stream), with requests kept in
    flight until it has published them: on a fast machine a few short requests can finish
    between two scrapes."""
    loads: list[pb.EngineLoad] = []
    stop = threading.Event()

    def requests() -> int:
        return loads[-1].running + loads[-1].waiting if loads else -1

    def keep_busy() -> None:   # one request in flight after another until told to stop
        with httpx.Client(base_url=vllm.url, timeout=scaled(120)) as client:
            while not stop.is_set():
                client.post("/v1/completions", json={"model": BASE_MODEL, "prompt": "x", "max_tokens": 200,
                                                     "temperature": 0, "ignore_eos": True})

    with grpc.insecure_channel(agent.target) as ch:
        stream = pb_grpc.AgentStub(ch).WatchResidency(pb.WatchRequest(), metadata=AUTH)

        def watch() -> None:
            with contextlib.suppress(grpc.RpcError):   # cancelled at the end
                for ev in stream:
                    if ev.HasField("load"):
                        loads.append(ev.load)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        busy = [threading.Thread(target=keep_busy, daemon=True) for _ in range(4)]
        try:
            wait_until(lambda: requests() == 0, what="the idle engine published as 0/0")
            assert loads[-1].measured_unix_ms > 0
            for t in busy:
                t.start()
            wait_until(lambda: any(ld.running + ld.waiting >= 1 for ld in loads),
                       what="requests in flight published")
            assert max(ld.running for ld in loads) >= 1
        finally:
            stop.set()
            for t in busy:
                if t.is_alive():
                    t.join(scaled(120))
        wait_until(lambda: requests() == 0, what="0/0 published again once they finished")
        stream.cancel()
        watcher.join(scaled(10))
    assert "ace_agent_engine_requests_running 0" in agent.metrics()


def test_engine_restart_is_noticed_and_residency_rebuilt(vllm, agent):
    """Last in the module: restarts vLLM (another ~16 s+)."""
    unload_all(vllm, agent)
    for name in ("code-python", "med-triage"):
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=name))
        wait_until(lambda n=name: n in vllm.adapters())
    resets = agent.metric("ace_agent_engine_resets_total")
    vllm.restart()
    # the fresh vLLM lists no adapters until the agent reloads them, unasked
    wait_until(lambda: set(vllm.adapters()) == {"code-python", "med-triage"}, timeout=60)
    assert agent.metric("ace_agent_engine_resets_total") == resets + 1
    assert rpc(agent, "Status", pb.StatusRequest(adapter="med-triage")).tier == pb.TIER_DEVICE
    assert vllm.complete("med-triage", PROMPTS[1])
