"""The builtin engine and a real vLLM give the same greedy text on the same fixtures.

Checks the plain-torch Llama (RoPE convention, GQA, RMSNorm), the tokenizer / chat
template handling and the LoRA scaling (incl. rsLoRA) against vLLM's own implementation.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.support.vllm import BASE_MODEL, VLLMServer, vllm_python

pytestmark = pytest.mark.vllm
torch.set_num_threads(1)

ADAPTERS = ["code-python", "tr-de-en", "legal-review", "med-notes"]  # r8, r16, r128 rsLoRA, r64
PROMPTS = ["def fibonacci(n):", "Patient presents with chest pain", "The Supplier shall"]


@pytest.fixture(scope="module")
def vllm(fixtures, tmp_path_factory):
    server = VLLMServer(vllm_python(), fixtures / "model", tmp_path_factory.mktemp("vllm-logs"),
                        max_loras=2, max_cpu_loras=4, max_lora_rank=128)
    server.start()
    try:
        for name in ADAPTERS:
            r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": name, "lora_path": str(fixtures / "adapters" / name)})
            assert r.status_code == 200, r.text
        yield server
    finally:
        server.stop()


def _ours(fixtures, requests):
    from gpu_agent.engine import Engine, EngineSettings, serve

    async def main():
        engine = Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", pool_bytes=8 << 20))
        runner, port = await serve(engine)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                rs = await asyncio.gather(*[c.post(path, json=body) for path, body in requests])
            return [r.json() for r in rs]
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_greedy_completions_match_vllm(vllm, fixtures):
    reqs = [("/v1/completions", {"model": m, "prompt": p, "max_tokens": 8, "temperature": 0})
            for m in [BASE_MODEL, *ADAPTERS] for p in PROMPTS]
    ours = _ours(fixtures, reqs)  # all at once: one mixed batch
    for (path, body), mine in zip(reqs, ours):
        theirs = httpx.post(vllm.url + path, json=body, timeout=60).json()
        assert mine["choices"][0]["text"] == theirs["choices"][0]["text"], body
        assert mine["usage"] == {k: theirs["usage"][k] for k in mine["usage"]}, body


def test_chat_template_and_usage_match_vllm(vllm, fixtures):
    reqs = [("/v1/chat/completions", {"model": m, "max_tokens": 6, "temperature": 0,
                                      "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Summarize the risk."}]})
            for m in [BASE_MODEL, "tr-de-en"]]
    ours = _ours(fixtures, reqs)
    for (path, body), mine in zip(reqs, ours):
        theirs = httpx.post(vllm.url + path, json=body, timeout=60).json()
        assert mine["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
        assert mine["usage"] == {k: theirs["usage"][k] for k in mine["usage"]}
