"""Client -> Envoy -> ext_proc -> builtin engine, with the agent that hosts that engine.

Runs without vLLM (part of `make test-unit`): the agent process serves the builtin engine
in-process; the gateway's upstream names the agent. A prefetched adapter and a cold one
side by side, in the gateway's trace headers and the engine's own tier header.
"""
from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import httpx
import pytest

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.test_vllm_e2e import HEADERS, trace, write_state
from tools.localstack import gateway_front
from tests.support.agent import AUTH, TOKEN, agent_process
from tests.support.procs import free_port, wait_http
from tests.support.fixtures import fixtures_dir
from tests.support.wait import wait_until

pytest.importorskip("torch")


@contextlib.contextmanager
def builtin_agent(tmp_path_factory, name: str):
    """An agent with its builtin engine on the fixtures, and a gateway state file naming it
    (flavour builtin): yields (work dir, engine port, agent, state path)."""
    tmp = tmp_path_factory.mktemp(name)
    fixtures = fixtures_dir(tmp_path_factory)
    engine_port = free_port()
    with agent_process(fixtures / "catalog.yaml", tmp, "builtin",
                       extra=["--engine-port", str(engine_port), "--reconcile-interval-s", "0.2"]) as agent:
        wait_http(f"http://127.0.0.1:{engine_port}/health", timeout=60)
        state = write_state(tmp, fixtures / "catalog.yaml", f"127.0.0.1:{engine_port}", agent.target)
        state.write_text(state.read_text().replace("flavour: vllm", "flavour: builtin")
                         .replace("vllm-1", "builtin-1"))
        yield tmp, engine_port, agent, state


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with builtin_agent(tmp_path_factory, "agent-e2e") as (tmp, engine_port, agent, state):
        # the pool starts empty (no start-up fill): these tests watch adapters go from cold to resident
        with gateway_front(tmp, state, f"127.0.0.1:{engine_port}", env={"ACE_AGENT_TOKEN": TOKEN},
                           extproc_args=["--startup-fill", "off"]) as port:
            yield {"agent": agent, "base": f"http://127.0.0.1:{port}"}


def rpc(agent, method, request):
    async def call():
        async with grpc.aio.insecure_channel(agent.target) as ch:
            return await getattr(pb_grpc.AgentStub(ch), method)(request, metadata=AUTH, timeout=30)
    return asyncio.run(call())


def through_gateway(stack, model, headers=None):
    r = httpx.post(stack["base"] + "/v1/completions", headers={**HEADERS, **(headers or {})}, timeout=60,
                   json={"model": model, "prompt": "SELECT name FROM", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_prefetched_and_cold_side_by_side_through_envoy(stack):
    agent = stack["agent"]
    assert rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="code-sql", reason="predicted")).outcome == \
        pb.PrefetchReply.ACCEPTED
    wait_until(lambda: trace(through_gateway(stack, "code-sql"))["action"] == "adapter_prefetched_applied",
               interval=0.05, what="the gateway sees code-sql prefetched")
    hot = through_gateway(stack, "code-sql")
    # no ingress prefetch for the cold one: its signal would race the request to the
    # engine (and may win: then the engine already finds it in the pool)
    cold = through_gateway(stack, "legal-review", {"x-ace-skill-override": "dynamic_lora_prefetch=off"})
    t_hot, t_cold = trace(hot), trace(cold)
    print(f"\nprefetched: {hot.headers['x-ace-trace-multi-lora']} (engine tier {hot.headers['x-ace-adapter-tier']})"
          f"\ncold:       {cold.headers['x-ace-trace-multi-lora']} (engine tier {cold.headers['x-ace-adapter-tier']})")
    assert t_hot["is_prefetch_hit"] == "true" and float(t_hot["swap_ms_saved"]) > 0
    assert hot.headers["x-ace-adapter-tier"] == "device"
    assert t_cold["action"] == "adapter_cold_loaded" and t_cold["is_prefetch_hit"] == "false"
    assert cold.headers["x-ace-adapter-tier"] in ("disk", "host")
    # the engine's own load made it resident for the next request
    wait_until(lambda: trace(through_gateway(stack, "legal-review"))["residency"] == "device",
               interval=0.05, what="the gateway sees legal-review in the pool")


def test_with_nothing_learned_the_gateway_fills_the_empty_pool_before_any_request(tmp_path_factory):
    """The start-up fill (``--startup-fill on``, the default): no popularity file, so each
    agent is offered the adapters routing places on its host, loaded only into free room;
    the first request for one of them finds it resident."""
    import yaml

    with builtin_agent(tmp_path_factory, "agent-fill") as (tmp, engine_port, agent, state):
        names = [a["name"] for a in yaml.safe_load((fixtures_dir(tmp_path_factory) / "catalog.yaml").read_text())
                 ["adapters"]]
        with gateway_front(tmp, state, f"127.0.0.1:{engine_port}", env={"ACE_AGENT_TOKEN": TOKEN}) as port:
            wait_until(lambda: agent.metric('ace_agent_tier_adapters{tier="device"}') >= 1
                       and agent.metric("ace_agent_prefetch_queue_depth") == 0,
                       interval=0.05, what="the fill loaded")
            resident = [n for n in names
                        if rpc(agent, "Status", pb.StatusRequest(adapter=n)).tier == pb.TIER_DEVICE]
            assert resident and agent.metric('ace_agent_prefetch_total{outcome="accepted"}') >= len(resident)
            assert not re.search(r"^ace_agent_evictions_total\{[^}]*\} [1-9]", agent.metrics(), re.M)  # none
            first = through_gateway({"base": f"http://127.0.0.1:{port}"}, resident[0])
            assert first.headers["x-ace-adapter-tier"] == "device"
