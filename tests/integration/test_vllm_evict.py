"""ace's evicting plugin in a real vLLM (CPU build): an unload drops the adapter from
vLLM's CPU cache, so the agent's named victims leave it instead of vLLM's LRU.

One vLLM for the module, `--max-loras 2 --max-cpu-loras 2 --max-lora-rank 16`, with
`VLLM_PLUGINS=ace_evict,ace_measure` (tools/vllm_evict, tools/vllm_measure: the measuring
plugin logs every read into the CPU cache, which is what these tests count). Without the
evicting plugin the unload's answer has no mark and the LRU adapter is read again: both
tests fail; without its ranking route (plugin 1.0) the ranking test does.
"""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.agent import AUTH, agent_process
from tests.support.fixtures import fixtures_dir
from tests.support.vllm import VLLMServer, vllm_python
from tests.support.wait import wait_until
from tools.vllm_evict.ace_vllm_evict import (CACHE_PATH, DROP_PATH, DROPPED, EVICTED, NOT_REGISTERED, RANK_PATH,
                                             RANKED, RANKED_MARK, READ, READ_MARK, READ_PATH, REGISTERED)
from tools.vllm_measure.ace_vllm_measure import MARK as CPU_CACHE_READ

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return fixtures_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def vllm(fixtures, tmp_path_factory):
    server = VLLMServer(vllm_python(), fixtures / "model", tmp_path_factory.mktemp("vllm-logs"),
                        plugins=("ace_evict", "ace_measure"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def reads(vllm, name: str) -> int:
    """How many times vLLM read ``name``'s weights into its CPU cache so far."""
    return sum(1 for line in vllm.log.read_text(errors="replace").splitlines()
               if CPU_CACHE_READ in line and line.rstrip().endswith(f" {name}"))


def load(vllm, fixtures, name: str) -> None:
    resp = httpx.post(vllm.url + "/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(fixtures / "adapters" / name)})
    assert resp.status_code == 200, resp.text


def unload(vllm, name: str) -> str:
    resp = httpx.post(vllm.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.text


def cached(vllm) -> list[str]:
    resp = httpx.get(vllm.url + CACHE_PATH, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["cached"]


def clear(vllm) -> None:
    for name in list(vllm.adapters()):
        unload(vllm, name)


def test_an_unload_drops_the_adapter_from_vllms_cpu_cache(vllm, fixtures):
    """Cache of 2: A and B read, A used (B is now the LRU), A unloaded, C loaded. With
    the plugin A's place is free, so C evicts nothing and B is served without a read;
    without it A's weights stay cached and C's read evicts B."""
    clear(vllm)
    assert REGISTERED in vllm.log.read_text(errors="replace")
    a, b, c = "code-python", "fin-reports", "med-triage"
    load(vllm, fixtures, a)
    load(vllm, fixtures, b)
    vllm.complete(a, "def f(x):", max_tokens=1)
    b_reads = reads(vllm, b)
    assert EVICTED in unload(vllm, a)
    assert a not in vllm.adapters()
    load(vllm, fixtures, c)
    vllm.complete(b, "Quarterly revenue", max_tokens=1)
    assert reads(vllm, b) == b_reads
    # the unloaded adapter comes back as any other: registered and read again
    load(vllm, fixtures, a)
    assert vllm.complete(a, "def f(x):", max_tokens=1) is not None


def test_vllms_full_cache_evicts_the_ranked_victim_before_its_lru(vllm, fixtures):
    """Cache of 2: A and B read, A used (B is now the LRU), A ranked coldest, C read into
    the full cache. With the ranking the cache evicts A, not its LRU B: B is served
    without a read, A (still registered) is read again when used. This is the read a
    request's resolver makes before an unload sent beside it arrives."""
    clear(vllm)
    a, b, c = "code-python", "fin-reports", "med-triage"
    load(vllm, fixtures, a)
    load(vllm, fixtures, b)
    vllm.complete(a, "def f(x):", max_tokens=1)
    resp = httpx.post(vllm.url + RANK_PATH, json={"lora_names": [a, "not-registered"]}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.text.startswith(RANKED) and "1 of 2" in resp.text
    marks = vllm.log.read_text(errors="replace").count(RANKED_MARK)
    a_reads, b_reads = reads(vllm, a), reads(vllm, b)
    load(vllm, fixtures, c)
    wait_until(lambda: vllm.log.read_text(errors="replace").count(RANKED_MARK) == marks + 1)
    vllm.complete(b, "Quarterly revenue", max_tokens=1)
    assert reads(vllm, b) == b_reads
    assert set(vllm.adapters()) == {a, b, c}   # the names stay; only the weights left
    assert cached(vllm) == [b, c]              # the plugin's listing says which
    vllm.complete(a, "def f(x):", max_tokens=1)
    assert reads(vllm, a) == a_reads + 1
    bad = httpx.post(vllm.url + RANK_PATH, json={"lora_names": "a"}, timeout=60)
    assert bad.status_code == 400 and "lora_names" in bad.json()["error"]["message"]


def test_the_plugin_drops_and_reads_weights_while_the_name_stays_registered(vllm, fixtures):
    """Cache of 2: A and B read; A's weights dropped (``DROP_PATH``), its name kept: C is
    read into the freed place without evicting B, a request for A re-reads A (no
    registration), and ``READ_PATH`` reads a registered adapter back ahead of a request."""
    clear(vllm)
    a, b, c = "code-python", "fin-reports", "med-triage"
    load(vllm, fixtures, a)
    load(vllm, fixtures, b)
    resp = httpx.post(vllm.url + DROP_PATH, json={"lora_name": a}, timeout=60)
    assert resp.status_code == 200 and resp.text.startswith(DROPPED), resp.text
    assert set(vllm.adapters()) == {a, b} and cached(vllm) == [b]
    b_reads, a_reads = reads(vllm, b), reads(vllm, a)
    load(vllm, fixtures, c)
    assert cached(vllm) == [b, c]
    vllm.complete(b, "Quarterly revenue", max_tokens=1)
    assert reads(vllm, b) == b_reads
    resp = httpx.post(vllm.url + DROP_PATH, json={"lora_name": c}, timeout=60)
    assert resp.status_code == 200 and cached(vllm) == [b]
    vllm.complete(a, "def f(x):", max_tokens=1)   # registered, not cached: vLLM re-reads it
    assert reads(vllm, a) == a_reads + 1 and cached(vllm) == [a, b]
    resp = httpx.post(vllm.url + READ_PATH, json={"lora_name": c}, timeout=60)
    assert resp.status_code == 200 and resp.text.startswith(READ), resp.text
    assert f"{READ_MARK} {c}" in vllm.log.read_text(errors="replace")
    assert c in cached(vllm) and len(cached(vllm)) == 2
    gone = httpx.post(vllm.url + DROP_PATH, json={"lora_name": "not-registered"}, timeout=60)
    assert gone.status_code == 200 and gone.text.startswith(NOT_REGISTERED)
    unknown = httpx.post(vllm.url + READ_PATH, json={"lora_name": "not-registered"}, timeout=60)
    assert unknown.status_code == 404 and NOT_REGISTERED in unknown.json()["error"]["message"]
    bad = httpx.post(vllm.url + READ_PATH, json={"lora_names": [a]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name"


def rpc(agent, method, request):
    async def call():
        async with grpc.aio.insecure_channel(agent.target) as ch:
            return await getattr(pb_grpc.AgentStub(ch), method)(request, metadata=AUTH, timeout=30)
    return asyncio.run(call())


def evicting_agent(vllm, fixtures, tmp_path, *extra: str):
    """An agent for this vLLM with ``--vllm-unload-evicts``, its registry at vLLM's cache size."""
    return agent_process(fixtures / "catalog.yaml", tmp_path, "vllm", engine_url=vllm.url,
                         extra=["--max-cpu-loras", str(vllm.max_cpu_loras), "--vllm-unload-evicts",
                                "--reconcile-interval-s", "0.5", *extra])


def resident(agent, *names: str) -> None:
    """Prefetch ``names`` through the agent, one after the other (the first is its LRU)."""
    for name in names:
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=name))
        wait_until(lambda n=name: rpc(agent, "Status", pb.StatusRequest(adapter=n)).tier == pb.TIER_DEVICE)


def test_the_agent_evicts_the_victim_the_gateway_names(vllm, fixtures, tmp_path):
    """``--vllm-unload-evicts``: a prefetch that names a victim unloads that one, not the
    agent's LRU, and vLLM's cache follows: the LRU adapter is served without a read."""
    clear(vllm)
    with evicting_agent(vllm, fixtures, tmp_path) as agent:
        lru, named, incoming = "code-python", "fin-reports", "tr-de-en"
        resident(agent, lru, named)
        lru_reads = reads(vllm, lru)
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=incoming, evict=[named]))
        wait_until(lambda: rpc(agent, "Status", pb.StatusRequest(adapter=incoming)).tier == pb.TIER_DEVICE)
        assert set(vllm.adapters()) == {lru, incoming}
        assert rpc(agent, "Status", pb.StatusRequest(adapter=named)).tier != pb.TIER_DEVICE
        assert agent.metric('ace_agent_evictions_total{reason="hint",tier="device"}') >= 1
        vllm.complete(lru, "def f(x):", max_tokens=1)
        assert reads(vllm, lru) == lru_reads


def test_the_agent_unregisters_the_adapter_whose_weights_vllms_cache_dropped(vllm, fixtures, tmp_path):
    """A read into vLLM's full cache that the agent did not steer (here a registration
    made beside the agent, as the resolver makes one) took B's weights, not those of the
    agent's least recently used A. The shrink after the reconcile adopts C unregisters B,
    whose weights are gone, and keeps A, whose weights are cached: A is served without a
    read. (Before the plugin's listing the agent unloaded its LRU A, leaving B registered
    without weights and both A and B to be read again.)"""
    clear(vllm)
    with evicting_agent(vllm, fixtures, tmp_path) as agent:
        a, b, c = "code-python", "fin-reports", "med-triage"
        resident(agent, a, b)
        resp = httpx.post(vllm.url + RANK_PATH, json={"lora_names": [b]}, timeout=60)
        assert resp.status_code == 200 and "1 of 1" in resp.text, resp.text
        load(vllm, fixtures, c)
        assert cached(vllm) == [a, c]
        wait_until(lambda: set(vllm.adapters()) == {a, c}, timeout=60)
        assert rpc(agent, "Status", pb.StatusRequest(adapter=b)).tier != pb.TIER_DEVICE
        wait_until(lambda: agent.metric('ace_agent_evictions_total{reason="engine_dropped",tier="device"}') == 1)
        a_reads = reads(vllm, a)
        vllm.complete(a, "def f(x):", max_tokens=1)
        assert reads(vllm, a) == a_reads


def test_an_agent_that_keeps_names_registered_moves_only_weights(vllm, fixtures, tmp_path):
    """``--vllm-keep-registered``: the victim of a prefetch keeps its registration and
    leaves vLLM's cache only, so a request for it later is a re-read, not a registration;
    a prefetch of a registered name whose weights left reads them back; a read vLLM makes
    itself (that request's) into the full cache is a device tier lost, not an engine reset.
    (Without the flag the victim is unregistered: the first assertion fails.)"""
    clear(vllm)
    with evicting_agent(vllm, fixtures, tmp_path, "--vllm-keep-registered") as agent:
        a, b, c = "code-python", "fin-reports", "med-triage"
        resident(agent, a, b)
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=c, evict=[a]))
        wait_until(lambda: rpc(agent, "Status", pb.StatusRequest(adapter=c)).tier == pb.TIER_DEVICE)
        assert set(vllm.adapters()) == {a, b, c}
        assert cached(vllm) == [b, c]
        assert rpc(agent, "Status", pb.StatusRequest(adapter=a)).tier != pb.TIER_DEVICE
        # a prefetch of the dropped (still registered) name reads its weights back
        reads_a = reads(vllm, a)
        rpc(agent, "Prefetch", pb.PrefetchRequest(adapter=a, evict=[b]))
        wait_until(lambda: rpc(agent, "Status", pb.StatusRequest(adapter=a)).tier == pb.TIER_DEVICE)
        assert reads(vllm, a) == reads_a + 1 and cached(vllm) == [a, c]
        assert f"{READ_MARK} {a}" in vllm.log.read_text(errors="replace")
        # a request for B (registered, not cached) is vLLM's own re-read: the agent adopts
        # B and loses what that read evicted, with no engine reset and no reload
        resolved = vllm.log.read_text(errors="replace").count("Resolved and loaded")
        vllm.complete(b, "Quarterly revenue", max_tokens=1)
        wait_until(lambda: rpc(agent, "Status", pb.StatusRequest(adapter=b)).tier == pb.TIER_DEVICE, timeout=60)
        wait_until(lambda: agent.metric('ace_agent_evictions_total{reason="engine_gone",tier="device"}') == 1)
        assert agent.metric("ace_agent_engine_resets_total") == 0
        assert set(vllm.adapters()) == {a, b, c}
        assert len(cached(vllm)) == 2
        assert vllm.log.read_text(errors="replace").count("Resolved and loaded") == resolved
