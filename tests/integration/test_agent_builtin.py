"""The agent process with the builtin engine in-process: `python -m gpu_agent serve --engine builtin`.

A prefetched adapter and a cold one side by side: the engine's own response headers say
where each adapter was when its request arrived (`x-ace-adapter-tier`) and how long the
request waited for it (`x-ace-adapter-wait-ms`).
"""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from ace_common.stack_dump import DUMP_MARKER
from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.agent import AUTH, agent_process
from tests.support.procs import free_port, wait_http
from tests.support.fixtures import fixtures_dir
from tests.support.wait import wait_until

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    fixtures = fixtures_dir(tmp_path_factory)
    work = tmp_path_factory.mktemp("agent-builtin")
    port = free_port()
    with agent_process(fixtures / "catalog.yaml", work, "builtin",
                       extra=["--engine-port", str(port), "--reconcile-interval-s", "0.2"]) as proc:
        proc.engine_url = f"http://127.0.0.1:{port}"
        wait_http(proc.engine_url + "/health", timeout=60)
        yield proc


def rpc(agent, method, request):
    async def call():
        async with grpc.aio.insecure_channel(agent.target) as ch:
            return await getattr(pb_grpc.AgentStub(ch), method)(request, metadata=AUTH, timeout=30)
    return asyncio.run(call())


def on_device(agent, adapter: str) -> bool:
    return rpc(agent, "Status", pb.StatusRequest(adapter=adapter)).tier == pb.TIER_DEVICE


def complete(agent, model):
    r = httpx.post(agent.engine_url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "SELECT name FROM", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_prefetched_and_cold_adapters_side_by_side(agent):
    reply = rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="code-sql", priority=1, reason="predicted"))
    assert reply.outcome == pb.PrefetchReply.ACCEPTED
    wait_until(lambda: on_device(agent, "code-sql"), what="code-sql on the device")
    st = rpc(agent, "Status", pb.StatusRequest(adapter="code-sql"))
    assert st.loaded_by == "prefetch" and st.cold_load_ms > 0
    hot = complete(agent, "code-sql")
    cold = complete(agent, "legal-review")
    assert hot.headers["x-ace-adapter-tier"] == "device"
    assert cold.headers["x-ace-adapter-tier"] in ("disk", "host")
    hot_wait, cold_wait = (float(r.headers["x-ace-adapter-wait-ms"]) for r in (hot, cold))
    assert hot_wait < cold_wait
    print(f"\nprefetched code-sql waited {hot_wait:.2f} ms; cold legal-review waited {cold_wait:.2f} ms "
          f"(agent cold load of code-sql {st.cold_load_ms:.1f} ms)")
    # the engine's own on-demand load is noticed by the agent
    wait_until(lambda: on_device(agent, "legal-review"), what="legal-review adopted")
    assert rpc(agent, "Status", pb.StatusRequest(adapter="legal-review")).loaded_by == "engine"


def test_metrics_endpoint_reports_tiers_and_pool_pages(agent):
    """Alone or after the other tests: it makes the events whose series it reads, an
    accepted prefetch (a cold load) and a request for an adapter not on the device (a miss)."""
    assert rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="tr-de-en")).outcome == pb.PrefetchReply.ACCEPTED
    wait_until(lambda: on_device(agent, "tr-de-en"), what="tr-de-en on the device")
    assert complete(agent, "code-python").headers["x-ace-adapter-tier"] != "device"
    text = agent.metrics()
    for series in ('ace_agent_tier_misses_total{tier="device"}', "ace_agent_pool_pages_used",
                   "ace_agent_pool_pages_free", 'ace_agent_load_seconds_bucket{le="+Inf",stage="cold"}',
                   'ace_agent_prefetch_total{outcome="accepted"}'):
        assert series in text, series
    assert agent.metric("ace_agent_pool_pages_used") > 0
    # the event loop's lag, measured from the end of start-up on (ace_common.loop_lag)
    wait_until(lambda: agent.metric("ace_agent_event_loop_lag_seconds_count") > 0, what="a loop-lag wake-up")
    assert agent.metric("ace_agent_event_loop_lag_seconds_max") >= 0


def test_evict_and_pin_reach_the_engine_pool(agent):
    rpc(agent, "Prefetch", pb.PrefetchRequest(adapter="fin-reports"))
    wait_until(lambda: on_device(agent, "fin-reports"), what="fin-reports on the device")
    reply = rpc(agent, "Evict", pb.EvictRequest(adapter="fin-reports", down_to=pb.TIER_DISK))
    assert reply.evicted and reply.status.tier in (pb.TIER_HOST, pb.TIER_DISK)
    assert complete(agent, "fin-reports").headers["x-ace-adapter-tier"] != "device"


def pool_adapters(engine_url):
    models = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in models if m.get("ace_tier") == "device"}


def test_device_count_budget_holds_for_the_engines_own_on_demand_loads(tmp_path_factory):
    """`--device-max-adapters 2`: requests that make the engine load adapters on demand, and
    agent prefetches in between, never leave more than two adapters in the pool (LRU goes;
    a pinned one stays); concurrent requests for more adapters than the budget all succeed."""
    fixtures = fixtures_dir(tmp_path_factory)
    work = tmp_path_factory.mktemp("agent-budget")
    port = free_port()
    with agent_process(fixtures / "catalog.yaml", work, "builtin",
                       extra=["--engine-port", str(port), "--reconcile-interval-s", "0.2",
                              "--device-max-adapters", "2"]) as proc:
        proc.engine_url = f"http://127.0.0.1:{port}"
        wait_http(proc.engine_url + "/health", timeout=60)
        for name in ("code-sql", "med-triage", "fin-reports", "tr-de-en"):   # on-demand loads
            complete(proc, name)
            assert len(pool_adapters(proc.engine_url)) <= 2, pool_adapters(proc.engine_url)
        assert pool_adapters(proc.engine_url) == {"fin-reports", "tr-de-en"}   # LRU went
        assert rpc(proc, "Pin", pb.PinRequest(adapter="code-python")).ok
        wait_until(lambda: "code-python" in pool_adapters(proc.engine_url), what="pinned code-python in the pool")
        for name in ("legal-review", "med-notes", "code-sql"):                # on demand, pin held
            complete(proc, name)
            pool = pool_adapters(proc.engine_url)
            assert len(pool) <= 2 and "code-python" in pool, pool
        rpc(proc, "Unpin", pb.PinRequest(adapter="code-python"))

        async def burst():
            async with httpx.AsyncClient(base_url=proc.engine_url, timeout=60) as client:
                body = {"prompt": "SELECT", "max_tokens": 4, "temperature": 0}
                return await asyncio.gather(*(client.post("/v1/completions", json={**body, "model": m})
                                              for m in ("code-python", "fin-risk", "tr-fr-en", "legal-contracts")))
        assert [r.status_code for r in asyncio.run(burst())] == [200] * 4
        assert len(pool_adapters(proc.engine_url)) <= 2
        names = ("code-python", "fin-risk", "tr-fr-en", "legal-contracts")

        def agrees() -> bool:   # the agent's reconcile brings its view in line with the pool
            pool = pool_adapters(proc.engine_url)
            return all(on_device(proc, n) == (n in pool) for n in names)
        wait_until(agrees, interval=0.05, what="the agent's view agrees with the pool")


def test_sigusr1_dumps_every_threads_stack_and_the_agent_keeps_serving(agent):
    """``kill -USR1`` (ace_common.stack_dump): each thread's stack goes to the agent's log,
    the main thread's inside the event loop, and the agent answers as before."""
    import os
    import signal

    before = agent.log.read_text()
    os.kill(agent.pid, signal.SIGUSR1)
    dumped = lambda: agent.log.read_text()[len(before):]  # noqa: E731
    wait_until(lambda: "Current thread" in dumped() and DUMP_MARKER in dumped(),
               what="the stack dump in the agent's log")
    assert "asyncio" in dumped() or "selectors" in dumped()   # the main thread waits in its loop
    assert "ace_agent_" in agent.metrics()
    complete(agent, "code-sql")
