"""The builtin engine's Responses API (``POST /v1/responses``) with the official openai SDK,
on an ephemeral loopback port; the same answer as chat for the same messages."""
from __future__ import annotations

import json

import pytest

from tests.gpu_agent.test_engine_server import fx, run_with_server  # noqa: F401 - the fixture

openai = pytest.importorskip("openai")


def test_responses_create_streamed_and_not_with_the_sdk_match_chat(fx):  # noqa: F811
    async def scenario(c, engine):
        client = openai.AsyncOpenAI(base_url=str(c.base_url) + "/v1", api_key="unused", max_retries=0)
        try:
            once = await client.responses.create(model="legal-review", input="review", max_output_tokens=5,
                                                 instructions="be brief")
            assert once.object == "response" and once.status == "incomplete" and once.model == "legal-review"
            assert once.incomplete_details.reason == "max_output_tokens"
            assert once.usage.output_tokens == 5 and once.output_text
            chat = await client.chat.completions.create(
                model="legal-review", max_tokens=5,
                messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "review"}])
            assert once.output_text == chat.choices[0].message.content
            assert once.usage.input_tokens == chat.usage.prompt_tokens

            stream = await client.responses.create(model="legal-review", input="review", max_output_tokens=5,
                                                   instructions="be brief", stream=True)
            events = [e async for e in stream]
            kinds = [e.type for e in events]
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.incomplete"]
            assert set(kinds[4:-4]) == {"response.output_text.delta"}
            assert [e.sequence_number for e in events] == list(range(len(events)))
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == once.output_text == events[-1].response.output_text
        finally:
            await client.close()
    run_with_server(fx, scenario)


def test_responses_message_list_base_model_and_completed(fx):  # noqa: F811
    async def scenario(c, engine):
        r = await c.post("/v1/responses", json={
            "model": "ace-tiny-llama", "max_output_tokens": 200,
            "input": [{"role": "developer", "content": "answer"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] in ("completed", "incomplete") and body["output"][0]["role"] == "assistant"
        assert r.headers["x-ace-adapter-tier"] == "none"
    run_with_server(fx, scenario)


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "ace-tiny-llama"}, "input"),
    ({"model": "ace-tiny-llama", "input": []}, "input"),
    ({"model": "ace-tiny-llama", "input": [{"type": "function_call_output", "output": "1"}]}, "input"),
    ({"model": "ace-tiny-llama", "input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"model": "ace-tiny-llama", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"model": "ace-tiny-llama", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "ace-tiny-llama", "input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"model": "ace-tiny-llama", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "ace-tiny-llama", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_refuses_what_it_does_not_serve_with_400(fx, body, param):  # noqa: F811
    async def scenario(c, engine):
        r = await c.post("/v1/responses", content=json.dumps(body))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    run_with_server(fx, scenario)


def test_responses_unknown_model_is_404(fx):  # noqa: F811
    async def scenario(c, engine):
        r = await c.post("/v1/responses", json={"model": "no-such", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    run_with_server(fx, scenario)
