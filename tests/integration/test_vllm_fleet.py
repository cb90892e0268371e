"""A short fleet on real vLLM: 2 hosts behind Envoy + one ext_proc, 40 requests.

Each host is one vLLM (CPU build) started as a user deploys it (``--enable-lora
--max-loras 2 --max-cpu-loras 2 --max-lora-rank 32``, runtime updating on, filesystem
resolver) and one agent with the vLLM connector (``tools.vllm_fleet``). The trace: 10
sessions of 4 steps over 5 adapters tenant ``acme`` may use, more than either host's
cache; the gateway routes with residency and prefetches (``dynamic_lora_prefetch=prod``).

Requests go one at a time, each once the fleet is settled (no agent load queued or
running, every agent's device tier equal to its vLLM's ``/v1/models``), so each request
meets a registry that stays put until it arrives. The accounting is then exact and
counted from the engines' side: per host, the requests vLLM served (its
``vllm:request_success_total``) equal the requests the gateway sent there, and equal
the requests whose adapter vLLM listed beforehand (hits) plus the cold ones: vLLM's own
on-demand loads (its filesystem resolver's log lines), or, when the agent's load on the
gateway's ingress signal reached vLLM first, that load (vLLM serializes the two per
adapter, so the request waited for it). Every adapter the agents loaded into vLLM
(vLLM's "Loaded new LoRA adapter" lines) is an accepted prefetch. No timing is asserted.
"""
from __future__ import annotations

import asyncio
import hashlib
import re

import grpc
import httpx
import pytest
import yaml

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tests.support.agent import AUTH, TOKEN
from tests.support.fixtures import fixtures_dir
from tests.support.vllm import BASE_MODEL, vllm_python
from tests.support.wait import wait_until
from tools.vllm_fleet import VLLMFlags, peak_rss_mb, vllm_fleet
from tools.vllm_measure.ace_vllm_measure import MARK as CPU_CACHE_READ_MARK, REGISTERED as MEASURE_REGISTERED

pytestmark = pytest.mark.vllm

KEY = "sk-fleet-acme-0001"
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
FLAGS = VLLMFlags(max_loras=2, max_cpu_loras=2, max_lora_rank=32)
#: the adapters acme may use with rank <= 32: code-python, code-sql (acme's), the rest public
ADAPTERS = ("code-python", "code-sql", "legal-contracts", "fin-reports", "tr-de-en")
WORKFLOWS = (("code-python", "code-sql", "code-python", "tr-de-en"),
             ("legal-contracts", "fin-reports", "legal-contracts", "fin-reports"),
             ("code-sql", "tr-de-en", "code-python", "code-sql"))
SESSIONS = 10


def write_state(path, catalog, hosts):
    state = {
        "include": [str(catalog)],
        "tenants": [{"id": "acme", "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}}],
        "keys": [{"name": "acme", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "acme",
                  "skills": {}}],
        "upstreams": [{"name": h["name"], "address": h["engine"], "flavour": "vllm", "base_model": BASE_MODEL,
                       "hints": "off", "agent": h["agent"]} for h in hosts],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
    }
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return state


def statuses(host) -> dict[str, pb.AdapterStatus]:
    async def call():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host['grpc_port']}") as ch:
            stub = pb_grpc.AgentStub(ch)
            return {a: await stub.Status(pb.StatusRequest(adapter=a), metadata=AUTH, timeout=30) for a in ADAPTERS}
    return asyncio.run(call())


def settled(hosts) -> dict[str, set[str]] | None:
    """Each host's vLLM registry when no agent load is queued or running and every agent's
    device tier equals its vLLM's listing; None while not."""
    out = {}
    for h in hosts:
        st = statuses(h)
        listed = h["vllm"].adapters()
        device = {a for a, s in st.items() if s.tier == pb.TIER_DEVICE}
        if any(s.loading for s in st.values()) or device != listed or len(listed) > FLAGS.max_cpu_loras:
            return None
        out[h["name"]] = listed
    return out


def served(host) -> int:
    """vLLM's own count of finished requests (all finish reasons)."""
    text = httpx.get(host["engine_url"] + "/metrics", timeout=10).text
    return round(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


def log_lines(host, mark: str) -> int:
    return sum(1 for line in host["vllm"].log.read_text(errors="replace").splitlines() if mark in line)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    fixtures = fixtures_dir(tmp_path_factory)
    catalog = fixtures / "catalog.yaml"
    with vllm_fleet(tmp, catalog, fixtures / "model", fixtures / "adapters", vllm_python(), 2, FLAGS,
                    lambda path, hosts: write_state(path, catalog, hosts), token=TOKEN,
                    agent_args=["--reconcile-interval-s", "0.2"]) as st:
        yield st


def test_accounting_per_host(fleet):
    hosts = {h["name"]: h for h in fleet["hosts"]}
    before = {n: served(h) for n, h in hosts.items()}   # /v1/models probes are not completions: 0
    sent = {n: 0 for n in hosts}
    hits = {n: 0 for n in hosts}
    by_agent = {n: 0 for n in hosts}   # unregistered when sent, loaded by its agent meanwhile
    errors, prefetched = [], 0
    unregistered: list[tuple[str, str, int]] = []  # (host, vLLM's log mark, its count when sent)

    def count_agent_loads() -> None:
        """Once the fleet settled after such a request (its agent's load, if any, has
        returned, so vLLM has logged it: read right after the response, the line could
        still be on its way), whether its agent loaded it meanwhile."""
        while unregistered:
            host, mark, count = unregistered.pop()
            by_agent[host] += log_lines(hosts[host], mark) > count

    with httpx.Client(timeout=120) as client:
        for s in range(SESSIONS):
            for step, adapter in enumerate(WORKFLOWS[s % len(WORKFLOWS)]):
                own = f"Loaded new LoRA adapter: name '{adapter}'"

                def settled_after_mark():
                    # vLLM's log mark first, then the registry: a prefetch the gateway sent
                    # after the previous step reaches its agent at any moment, so an agent
                    # load of this adapter that lands between the listing and the request
                    # is still counted (by_agent), whereas a mark taken after the listing
                    # could already hold its line (2026-12-06: 15 + 6 + 0 of 22 on a host)
                    marks = {n: log_lines(h, own) for n, h in hosts.items()}
                    registry = settled(fleet["hosts"])
                    return None if registry is None else (registry, marks)

                registry, before_own = wait_until(settled_after_mark, timeout=60, interval=0.2,
                                                  what="fleet settled")
                count_agent_loads()
                r = client.post(fleet["gateway"] + "/v1/chat/completions", headers={
                    **HEADERS, "x-ace-session-id": f"acme/s{s}"}, json={
                    "model": adapter, "messages": [{"role": "user", "content": f"step {step} of s{s}"}],
                    "max_tokens": 4, "temperature": 0, "user": f"acme/s{s}"})
                if r.status_code != 200:
                    errors.append((adapter, r.status_code, r.text[:200]))
                    continue
                trace = dict(kv.split("=", 1) for kv in r.headers["x-ace-trace-multi-lora"].split(","))
                host = trace["upstream"]
                sent[host] += 1
                hits[host] += adapter in registry[host]
                # the gateway's ingress signal made the agent load it, and the agent's load
                # reached vLLM before the request did (the request waited for it: cold)
                if adapter not in registry[host]:
                    unregistered.append((host, own, before_own[host]))
                prefetched += trace["action"] == "adapter_prefetched_applied"
    wait_until(lambda: settled(fleet["hosts"]), timeout=60, interval=0.2, what="fleet settled")
    count_agent_loads()
    cold = {n: log_lines(h, "Resolved and loaded LoRA adapter") for n, h in hosts.items()}
    agent_loads = {n: log_lines(h, "Loaded new LoRA adapter") for n, h in hosts.items()}
    accepted = {n: metric(h, 'ace_agent_prefetch_total{outcome="accepted"}') for n, h in hosts.items()}
    print(f"\nsent {sent} hits {hits} vLLM on-demand loads {cold} loaded by the agent on the request's "
          f"signal {by_agent} agent loads {agent_loads} "
          f"accepted prefetches {accepted} prefetched hits {prefetched}; vLLM start-up s "
          f"{[round(h['vllm'].startup_s, 1) for h in fleet['hosts']]}, peak RSS MiB "
          f"{[round(peak_rss_mb(h['vllm'].proc.pid)[0]) for h in fleet['hosts']]}")
    assert errors == []
    assert sum(sent.values()) == SESSIONS * 4
    for n, h in hosts.items():
        assert served(h) - before[n] == sent[n], n
        assert hits[n] + cold[n] + by_agent[n] == sent[n], n
        assert agent_loads[n] <= accepted[n], n
        # ace's measuring plugin (tools/vllm_measure) runs in vLLM and sees every read into its
        # CPU cache: each registration, and any re-read of one its CPU LRU had dropped
        assert log_lines(h, MEASURE_REGISTERED) >= 1, n
        assert log_lines(h, CPU_CACHE_READ_MARK) >= cold[n] + agent_loads[n], n
    assert sum(agent_loads.values()) > 0          # the agents prefetched into vLLM
    assert prefetched <= sum(hits.values())


def metric(host, series: str) -> float:
    text = httpx.get(host["metrics"], timeout=10).text
    m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
