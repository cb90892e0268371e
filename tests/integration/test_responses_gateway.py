"""The Responses API with the official openai SDK (``client.responses.create``, and with
``stream=True``) through real Envoy, the ext_proc gateway and the agent's builtin engine
(tools.localstack.gateway_stack): the adapter chosen by ``model`` or ``extra_body``, the
trace headers, the events, and another tenant's adapter refused as chat refuses it."""
from __future__ import annotations

import openai
import pytest

from tests.support.fixtures import fixtures_dir

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tools import demo
    from tools.localstack import gateway_stack

    catalog = fixtures_dir(tmp_path_factory) / "catalog.yaml"
    with gateway_stack(tmp_path_factory.mktemp("responses"), catalog,
                       lambda path, engine, agent: demo.write_state(path, catalog, engine, agent),
                       token=demo.TOKEN, agent_args=["--pool-mb", "2"]) as st:
        yield st


def _client(stack, tenant: str = "acme") -> openai.OpenAI:
    from tools import demo

    return openai.OpenAI(base_url=stack["gateway"] + "/v1", api_key=demo.KEYS[tenant], max_retries=0, timeout=120)


def test_sdk_responses_create_selects_the_adapter_and_carries_the_trace(stack):
    client = _client(stack)
    raw = client.responses.with_raw_response.create(model="code-python", input="def add(a, b):",
                                                    max_output_tokens=4)
    resp = raw.parse()
    assert resp.model == "code-python" and resp.status == "incomplete" and resp.usage.output_tokens == 4
    assert resp.output_text
    assert raw.headers["x-ace-served-by"] == "agent-0"
    assert "adapter=code-python" in raw.headers["x-ace-trace-multi-lora"]
    assert "adapter=code-python" in raw.headers["x-ace-trace-dynamic-lora-prefetch"]
    # the adapter by extra_body, the model naming the base: the same greedy answer
    again = client.responses.create(model="ace-tiny-llama", input="def add(a, b):", max_output_tokens=4,
                                    extra_body={"lora_name": "code-python"})
    assert again.model == "code-python" and again.output_text == resp.output_text


def test_sdk_responses_stream_events_through_envoy(stack):
    client = _client(stack)
    once = client.responses.create(model="code-python", input="SELECT", max_output_tokens=5)
    with client.responses.with_streaming_response.create(model="code-python", input="SELECT",
                                                         max_output_tokens=5, stream=True) as raw:
        assert "adapter=code-python" in raw.headers["x-ace-trace-multi-lora"]
        events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == once.output_text == events[-1].response.output_text


def test_sdk_responses_another_tenants_adapter_is_not_found(stack):
    client = _client(stack, "acme")
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="ace-tiny-llama", input="x", extra_body={"lora_name": "med-triage"})
    assert exc.value.body["code"] == "adapter_not_found"
    owner = _client(stack, "medco").responses.create(model="med-triage", input="x", max_output_tokens=2)
    assert owner.model == "med-triage"
