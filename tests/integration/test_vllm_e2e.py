"""The whole vLLM path: client -> Envoy -> ext_proc -> vLLM (CPU), with the GPU agent.

One stack per module: a real vLLM (`--max-loras 2 --max-cpu-loras 2`, filesystem LoRA
resolver over the fixtures so it can load on demand when no agent did), the agent
process driving it, the ext_proc process whose upstream names that agent, and Envoy.
A prefetched adapter and a cold one side by side in the trace headers; outputs equal
vLLM's when called directly; eviction unloads; with the agent down requests still flow
and the gateway reconnects when it returns.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib

import grpc
import httpx
import pytest
import yaml

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tools.localstack import gateway_front
from tests.support.agent import AUTH, TOKEN, agent_process
from tests.support.procs import free_port
from tests.support.fixtures import fixtures_dir
from tests.support.vllm import BASE_MODEL, VLLMServer, vllm_python
from tests.support.wait import wait_until

pytestmark = pytest.mark.vllm

KEY = "sk-e2e-alice-0001"
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}


def write_state(tmp, catalog, vllm_address, agent_address):
    state = {
        "include": [str(catalog)],
        "tenants": [{"id": "acme", "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}}],
        "keys": [{"name": "alice", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "acme",
                  "skills": {}}],
        "upstreams": [{"name": "vllm-1", "address": vllm_address, "flavour": "vllm",
                       "base_model": BASE_MODEL, "hints": "headers", "agent": agent_address}],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
    }
    path = tmp / "state.yaml"
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return path


class AgentSlot:
    """The agent process on a fixed port, stopped and started again by a test."""

    def __init__(self, catalog, work, engine_url):
        self.catalog, self.work, self.engine_url = catalog, work, engine_url
        self.port = free_port()
        self._stack: contextlib.ExitStack | None = None
        self.proc = None

    def start(self):
        self._stack = contextlib.ExitStack()
        self.proc = self._stack.enter_context(agent_process(
            self.catalog, self.work, "vllm", engine_url=self.engine_url, grpc_port=self.port,
            extra=["--max-cpu-loras", "2", "--reconcile-interval-s", "0.3"]))

    def stop(self):
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def rpc(self, method, request):
        async def call():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
                return await getattr(pb_grpc.AgentStub(ch), method)(request, metadata=AUTH, timeout=30)
        return asyncio.run(call())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    fixtures = fixtures_dir(tmp_path_factory)
    vllm = VLLMServer(vllm_python(), fixtures / "model", tmp / "vllm", resolver_dir=fixtures / "adapters")
    vllm.start()
    agent = AgentSlot(fixtures / "catalog.yaml", tmp, vllm.url)
    try:
        agent.start()
        state = write_state(tmp, fixtures / "catalog.yaml", f"127.0.0.1:{vllm.port}", f"127.0.0.1:{agent.port}")
        # the pool starts empty (no start-up fill): these tests watch adapters go from cold to resident
        with gateway_front(tmp, state, f"127.0.0.1:{vllm.port}", env={"ACE_AGENT_TOKEN": TOKEN},
                           extproc_args=["--startup-fill", "off"]) as port:
            yield {"vllm": vllm, "agent": agent, "base": f"http://127.0.0.1:{port}", "log": tmp / "extproc.log"}
    finally:
        agent.stop()
        vllm.stop()


def through_gateway(stack, model, prompt="def fibonacci(n):"):
    r = httpx.post(stack["base"] + "/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def trace(r):
    return dict(kv.split("=", 1) for kv in r.headers["x-ace-trace-multi-lora"].split(","))


def test_prefetched_and_cold_adapters_side_by_side(stack):
    vllm, agent = stack["vllm"], stack["agent"]
    assert "fin-reports" not in vllm.adapters()
    # the prefetch (as the gateway's predictor sends it) makes the adapter listed first
    reply = agent.rpc("Prefetch", pb.PrefetchRequest(adapter="fin-reports", priority=1, reason="predicted"))
    assert reply.outcome == pb.PrefetchReply.ACCEPTED
    wait_until(lambda: "fin-reports" in vllm.adapters())
    wait_until(lambda: trace(through_gateway(stack, "fin-reports"))["action"] == "adapter_prefetched_applied",
               timeout=10)
    hot = through_gateway(stack, "fin-reports")
    cold = through_gateway(stack, "code-python")          # never prefetched: vLLM loads it on demand
    t_hot, t_cold = trace(hot), trace(cold)
    print(f"\nprefetched: {hot.headers['x-ace-trace-multi-lora']}\ncold:       {cold.headers['x-ace-trace-multi-lora']}")
    assert t_hot["action"] == "adapter_prefetched_applied" and t_hot["is_prefetch_hit"] == "true"
    status = agent.rpc("Status", pb.StatusRequest(adapter="fin-reports"))
    assert float(t_hot["swap_ms_saved"]) == pytest.approx(status.cold_load_ms, rel=1e-3)
    assert float(t_hot["vram_mb_saved"]) > 0
    assert t_cold["action"] == "adapter_cold_loaded" and t_cold["is_prefetch_hit"] == "false"
    assert t_cold["swap_ms_saved"] == "0"
    pf = cold.headers["x-ace-trace-dynamic-lora-prefetch"]
    assert "action=prefetch_signalled" in pf and "queued=true" in pf
    # outputs through the gateway equal vLLM's own answers for the same adapters
    for model, r in (("fin-reports", hot), ("code-python", cold)):
        assert r.json()["choices"][0]["text"] == vllm.complete(model, "def fibonacci(n):")
    assert hot.json()["choices"][0]["text"] != cold.json()["choices"][0]["text"]


def test_eviction_unloads_least_recently_used(stack):
    vllm, agent = stack["vllm"], stack["agent"]
    through_gateway(stack, "fin-reports")
    through_gateway(stack, "code-python")
    through_gateway(stack, "tr-de-en")      # a third adapter over --max-cpu-loras 2
    wait_until(lambda: rpc_tier(agent, "tr-de-en") == pb.TIER_DEVICE)
    wait_until(lambda: len(vllm.adapters()) <= 2)
    assert "tr-de-en" in vllm.adapters()
    reply = agent.rpc("Evict", pb.EvictRequest(adapter="tr-de-en"))
    assert reply.evicted and "tr-de-en" not in vllm.adapters()


def rpc_tier(agent, name):
    return agent.rpc("Status", pb.StatusRequest(adapter=name)).tier


def test_agent_down_requests_flow_and_gateway_reconnects(stack):
    vllm, agent = stack["vllm"], stack["agent"]
    agent.stop()
    try:
        wait_until(lambda: trace(through_gateway(stack, "tr-de-en"))["residency"] == "unknown", timeout=15)
        r = through_gateway(stack, "tr-de-en")                 # vLLM still answers (on-demand load)
        t = trace(r)
        assert t["action"] == "adapter_applied" and t["swap_ms_saved"] == "unknown"
        assert r.json()["choices"][0]["text"] == vllm.complete("tr-de-en", "def fibonacci(n):")
    finally:
        agent.start()
    # the gateway's link reconnects (backoff <= 5 s) and residency is known again
    wait_until(lambda: trace(through_gateway(stack, "tr-de-en"))["residency"] == "device", timeout=30)


def test_responses_api_through_the_gateway_selects_the_adapter_on_vllm(stack):
    """``/v1/responses`` on the real vLLM: ace rewrites it as chat (the adapter by ``model``,
    the trace headers); the answer equals vLLM's own for the same adapter. With the openai SDK."""
    import openai

    client = openai.OpenAI(base_url=stack["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
    raw = client.responses.with_raw_response.create(model="fin-reports", input="quarterly revenue",
                                                    max_output_tokens=6, temperature=0)
    via_gateway = raw.parse()
    assert via_gateway.model == "fin-reports" and via_gateway.output_text
    assert trace(raw)["adapter"] == "fin-reports" and raw.headers["x-ace-served-by"] == "vllm-1"
    direct = httpx.post(stack["vllm"].url + "/v1/responses", timeout=120,
                        json={"model": "fin-reports", "input": "quarterly revenue", "max_output_tokens": 6,
                              "temperature": 0})
    assert direct.status_code == 200, direct.text
    assert via_gateway.output_text == "".join(
        part["text"] for item in direct.json()["output"] if item["type"] == "message"
        for part in item["content"] if part["type"] == "output_text")
    with client.responses.with_streaming_response.create(model="fin-reports", input="quarterly revenue",
                                                         max_output_tokens=6, temperature=0, stream=True) as s:
        assert trace(s)["adapter"] == "fin-reports"
        events = list(s.parse())
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == via_gateway.output_text
