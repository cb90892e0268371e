"""ace as an endpoint picker in front of a real agent and its builtin engine: the whole
path (auth, adapter, rewrite, pick, prefetch) through Envoy configured as the inference
extension's standalone chart does (envoy/epp.template.yaml, TLS, full duplex)."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.test_agent_e2e import builtin_agent, through_gateway
from tests.integration.test_vllm_e2e import HEADERS, trace
from tests.support.agent import TOKEN
from tests.support.envoy import run_epp_envoy
from tests.support.wait import wait_until
from tools.localstack import extproc_process

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with builtin_agent(tmp_path_factory, "epp-agent") as (tmp, engine_port, _agent, state):
        with extproc_process(tmp, state, env={"ACE_AGENT_TOKEN": TOKEN},
                             extproc_args=["--protocol", "epp", "--startup-fill", "off"]) as (address, _):
            with run_epp_envoy(tmp, extproc=address) as port:
                yield {"base": f"http://127.0.0.1:{port}", "engine": f"127.0.0.1:{engine_port}"}


def test_cold_adapter_is_prefetched_by_the_gateway_and_then_resident(stack):
    first = through_gateway(stack, "legal-review")
    assert first.headers["x-ace-served-by"] == "builtin-1"
    assert first.json()["model"] == "legal-review"
    pf = dict(kv.split("=", 1) for kv in first.headers["x-ace-trace-dynamic-lora-prefetch"].split(","))
    assert pf["mode"] == "prod" and pf["action"] == "prefetch_signalled" and pf["queued"] == "true"
    assert trace(first)["action"] == "adapter_cold_loaded"
    # the engine answered from the adapter (its own tier header passes back through Envoy)
    assert first.headers["x-ace-adapter-tier"] in ("device", "host", "disk")
    wait_until(lambda: trace(through_gateway(stack, "legal-review"))["residency"] == "device",
               interval=0.05, what="the gateway sees legal-review in the agent's pool")


def test_bad_key_never_reaches_the_engine(stack):
    r = httpx.post(stack["base"] + "/v1/completions", headers={**HEADERS, "authorization": "Bearer sk-no"},
                   json={"model": "legal-review", "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"]
