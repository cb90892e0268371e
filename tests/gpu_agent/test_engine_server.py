"""The builtin engine over HTTP on an ephemeral loopback port (in-process and as a CLI)."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from gpu_agent.engine import Engine, EngineSettings, serve
from gpu_agent.fixtures import make_fixtures
from tests.support import procs
from tests.support.wait import async_wait_until, scaled

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx")
    make_fixtures(out)
    return out


def run_with_server(fx: Path, scenario, **settings):
    """Start an engine + server in a fresh loop, run ``scenario(client, engine)``, stop both."""
    async def main():
        settings.setdefault("pool_bytes", 4 << 20)
        engine = Engine.create(EngineSettings(catalog=fx / "catalog.yaml", **settings))
        runner, port = await serve(engine, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                return await scenario(client, engine)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_chat_usage_and_adapter_headers(fx):
    async def scenario(c, engine):
        r = await c.post("/v1/completions", json={"model": "code-sql", "prompt": "SELECT name FROM",
                                                  "max_tokens": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "code-sql"
        prompt_ids = engine.tokenizer.encode("SELECT name FROM")
        assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                                 "total_tokens": len(prompt_ids) + 5}
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
        assert r.headers["x-ace-adapter-tier"] == "disk"  # cold: read from its directory
        cold_ms = float(r.headers["x-ace-adapter-wait-ms"])
        assert cold_ms > 0
        r2 = await c.post("/v1/completions", json={"model": "code-sql", "prompt": "SELECT name FROM",
                                                   "max_tokens": 5, "lora_prefetch": True,
                                                   "prefetch_adapter_id": "x", "vram_allocated_mb": 3})
        assert r2.headers["x-ace-adapter-tier"] == "device"
        assert float(r2.headers["x-ace-adapter-wait-ms"]) < cold_ms
        assert r2.json()["choices"][0]["text"] == body["choices"][0]["text"]  # greedy is deterministic
        base = await c.post("/v1/completions", json={"model": "ace-tiny-llama", "prompt": "SELECT name FROM",
                                                     "max_tokens": 5})
        assert base.headers["x-ace-adapter-tier"] == "none"
        assert base.json()["choices"][0]["text"] != body["choices"][0]["text"]

        chat = await c.post("/v1/chat/completions", json={
            "model": "med-triage", "messages": [{"role": "user", "content": "chest pain"}],
            "max_completion_tokens": 4})
        assert chat.status_code == 200, chat.text
        cb = chat.json()
        assert cb["object"] == "chat.completion" and cb["choices"][0]["message"]["role"] == "assistant"
        chat_ids = engine.tokenizer.encode_chat([{"role": "user", "content": "chest pain"}])
        assert cb["usage"]["prompt_tokens"] == len(chat_ids) and cb["usage"]["completion_tokens"] == 4
        # token-id prompts are accepted like vLLM's
        ids = await c.post("/v1/completions", json={"model": "code-sql", "prompt": prompt_ids, "max_tokens": 5})
        assert ids.json()["choices"][0]["text"] == body["choices"][0]["text"]
    run_with_server(fx, scenario)


def test_streaming_chat_and_completion(fx):
    async def scenario(c, engine):
        full = await c.post("/v1/completions", json={"model": "tr-fr-en", "prompt": "Bonjour", "max_tokens": 6})
        r = await c.post("/v1/completions", json={"model": "tr-fr-en", "prompt": "Bonjour", "max_tokens": 6,
                                                  "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-ace-adapter-tier"] == "device"
        ev = sse_events(r.text)
        assert ev[-1] == "[DONE]"
        assert ev[-2]["usage"]["completion_tokens"] == 6 and ev[-2]["choices"] == []
        assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == full.json()["choices"][0]["text"]
        assert ev[-3]["choices"][0]["finish_reason"] == "length"

        r = await c.post("/v1/chat/completions", json={
            "model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True})
        ev = sse_events(r.text)
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant" and ev[-1] == "[DONE]"
        assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])
        assert ev[-2]["choices"][0]["finish_reason"] == "length"
    run_with_server(fx, scenario)


def test_streamed_timing_counts_the_loops_lag_while_the_engine_held_the_request(fx):
    """With a lag monitor on the loop (the agent starts one), ``ace_timing.loop_lag_ms`` is
    how late the loop ran between the request's arrival and its first token: here the
    loop is blocked for 60 ms after the request arrived, before its first forward pass."""
    from ace_common.loop_lag import LoopLag

    async def scenario(c, engine):
        lag = LoopLag(interval_s=0.005).start()
        real = engine.generate

        def blocked_first(*args, **kwargs):
            async def gen():
                time.sleep(0.06)          # the loop is stuck: the monitor's wake-up is overdue
                await asyncio.sleep(0.01)  # it runs now and records the lag
                async for ev in real(*args, **kwargs):
                    yield ev
            return gen()

        try:
            engine.generate = blocked_first
            r = await c.post("/v1/chat/completions", json={
                "model": "med-notes", "messages": [{"role": "user", "content": "notes"}], "max_tokens": 2,
                "stream": True, "stream_options": {"include_timing": True}})
            timing = sse_events(r.text)[-2]["ace_timing"]
            assert 50 <= timing["loop_lag_ms"] <= timing["first_token_ms"]
            assert LoopLag.running() is lag
        finally:
            await lag.close()
        assert LoopLag.running() is None

    run_with_server(fx, scenario)


def test_the_engine_pays_its_first_requests_one_off_costs_before_it_serves(fx):
    """Engine.create compiles the chat template (Jinja's import and compile, ~50 ms that
    the first chat request would otherwise spend on the event loop) and runs one base
    forward on the forward thread; none of it is counted or loads an adapter."""
    async def scenario(c, engine):
        assert engine.tokenizer.template_compiled
        assert engine.warm_up_s is not None and engine.warm_up_s > 0
        st = engine.batcher.stats
        assert (st.forward_passes, st.generated_tokens, st.prompt_tokens, st.finished) == (0, 0, 0, 0)
        assert engine.pool.resident() == []
        r = await c.post("/v1/chat/completions", json={
            "model": "med-notes", "messages": [{"role": "user", "content": "notes"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert st.generated_tokens == 2

    run_with_server(fx, scenario)


def test_streamed_timing_splits_the_time_to_the_first_token(fx):
    """stream_options.include_timing: the last chunk before [DONE] says where the engine's
    time to the first token went; a cold adapter's load shows as stall and as load work."""
    async def scenario(c, engine):
        def body(**opts):
            return {"model": "med-notes", "messages": [{"role": "user", "content": "notes"}], "max_tokens": 3,
                    "stream": True, "stream_options": opts}

        sent = time.perf_counter()
        cold = await c.post("/v1/chat/completions", json=body(include_timing=True, include_usage=True))
        assert cold.status_code == 200 and cold.headers["x-ace-adapter-tier"] != "device"
        ev = sse_events(cold.text)
        assert ev[-1] == "[DONE]" and "usage" in ev[-3]
        timing = ev[-2]["ace_timing"]
        assert ev[-2]["choices"] == []
        assert timing["stall_ms"] == float(cold.headers["x-ace-adapter-wait-ms"]) > 0
        assert timing["loads_ms"] > 0 and timing["compute_ms"] > 0 and timing["queue_ms"] >= 0
        assert timing["first_token_ms"] >= timing["stall_ms"] + timing["queue_ms"] + timing["compute_ms"] - 0.01
        # the arrival mark is on this process's perf_counter clock: between the send and the reply
        assert sent <= timing["arrived_s"] <= time.perf_counter()
        assert "loop_lag_ms" not in timing   # no lag monitor on this loop
        load = timing["load"]  # the load it waited for, by stage
        assert load["fetch_ms"] >= 0 and load["tiers_ms"] > 0 and load["paused_ms"] == 0
        assert load["fetch_ms"] + load["tiers_ms"] <= timing["stall_ms"] + 0.01
        assert load["others_loading"] == 0 and load["fetches_at_start"] == 0
        warm = sse_events((await c.post("/v1/chat/completions", json=body(include_timing=True))).text)
        assert warm[-2]["ace_timing"]["loads_ms"] == 0 and "load" not in warm[-2]["ace_timing"]
        plain = sse_events((await c.post("/v1/chat/completions", json=body())).text)
        assert not any("ace_timing" in e for e in plain[:-1])
        metrics = (await c.get("/metrics")).text
        line = next(x for x in metrics.splitlines() if x.startswith("ace_engine_adapter_load_seconds_total "))
        assert float(line.split()[1]) > 0
    run_with_server(fx, scenario)


def test_openai_client_streams(fx):
    openai = pytest.importorskip("openai")

    async def scenario(c, engine):
        client = openai.AsyncOpenAI(base_url=str(c.base_url) + "/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model="legal-review", messages=[{"role": "user", "content": "review"}], max_tokens=5,
            stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        once = await client.chat.completions.create(
            model="legal-review", messages=[{"role": "user", "content": "review"}], max_tokens=5)
        assert text == once.choices[0].message.content and once.usage.completion_tokens == 5
        listed = await client.models.list()
        assert {m.id for m in listed.data} >= {"ace-tiny-llama", "legal-review"}
        await client.close()
    run_with_server(fx, scenario)


def test_concurrent_requests_with_different_adapters_share_forward_passes(fx):
    names = ["code-python", "med-notes", "legal-review", "fin-reports", "tr-de-en", "ace-tiny-llama"]

    async def scenario(c, engine):
        for n in names[:-1]:
            await engine.adapters.prefetch(n)
        before = engine.batcher.stats.forward_passes
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "model": n, "prompt": f"Hello {n}", "max_tokens": 4}) for n in names])
        assert all(r.status_code == 200 for r in rs)
        assert all(r.headers["x-ace-adapter-tier"] in ("device", "none") for r in rs)
        passes = engine.batcher.stats.forward_passes - before
        # alone: 4 passes per request (24 in all); batched: far fewer
        assert passes < len(names) * 4
        assert engine.batcher.stats.max_adapters_in_pass >= 3
        m = (await c.get("/metrics")).text
        assert f"ace_engine_forward_passes_total {engine.batcher.stats.forward_passes}" in m
        assert "ace_engine_batch_adapters_max" in m and 'vllm:lora_requests_info{' in m
        assert 'ace_engine_http_requests_total{route="completions",status="200"} 6' in m
    run_with_server(fx, scenario, batch_window_ms=50)


def test_models_health_and_errors(fx):
    async def scenario(c, engine):
        assert (await c.get("/health")).json() == {"status": "ok"}
        data = (await c.get("/v1/models")).json()["data"]
        ids = [m["id"] for m in data]
        assert ids[0] == "ace-tiny-llama" and len(ids) == 11
        sql = next(m for m in data if m["id"] == "code-sql")
        assert sql["parent"] == "ace-tiny-llama" and sql["root"] == "adapters/code-sql"

        r = await c.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        bad = [
            ({"model": "code-sql"}, "prompt"),
            ({"model": "code-sql", "prompt": "x", "max_tokens": 0}, "max_tokens"),
            ({"model": "code-sql", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
            ({"model": "code-sql", "prompt": "x", "temperature": -1}, "temperature"),
            ({"model": "code-sql", "prompt": "x", "max_tokens": 100000}, "max_tokens"),
            ({"model": "code-sql", "prompt": [1, 99999]}, "prompt"),
            ({"prompt": "x"}, "model"),
            # json.loads takes these; sampling with a NaN temperature failed the whole batch
            ({"model": "code-sql", "prompt": "x", "temperature": float("nan")}, "temperature"),
            ({"model": "code-sql", "prompt": "x", "top_p": float("inf")}, "top_p"),
            ({"model": "code-sql", "prompt": "x", "temperature": 10 ** 400}, "temperature"),
            ({"model": "code-sql", "prompt": "x", "seed": 2 ** 64}, "seed"),
        ]
        for body, param in bad:   # json.dumps: writes NaN and Infinity, as some clients do
            r = await c.post("/v1/completions", content=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/chat/completions", json={"model": "code-sql", "messages": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        # a header line as long as Envoy lets through (aiohttp's own limit is 8 KiB: plain text 400)
        r = await c.post("/v1/completions", json={"model": "code-sql", "prompt": "x", "max_tokens": 1},
                         headers={"x-long": "h" * 50_000})
        assert r.status_code == 200, r.text
    run_with_server(fx, scenario)


def test_residency_seam_and_runtime_adapters(fx):
    async def scenario(c, engine):
        res = engine.adapters
        assert res.tier("fin-risk") == "disk"
        assert await res.prefetch("fin-risk", tier="host") == "disk"
        assert res.tier("fin-risk") == "host"
        tier, ms = await res.ensure_resident("fin-risk")
        assert tier == "host" and ms >= 0 and res.tier("fin-risk") == "device"
        assert res.evict("fin-risk") and res.tier("fin-risk") == "host"
        assert res.evict("fin-risk", tier="host") and res.tier("fin-risk") == "disk"
        m = (await c.get("/metrics")).text
        assert 'ace_engine_adapter_evictions_total{reason="operator",tier="device"} 1.0' in m
        assert 'ace_engine_adapter_evictions_total{reason="operator",tier="host"} 1.0' in m
        r = await c.post("/v1/completions", json={"model": "fin-risk", "prompt": "risk", "max_tokens": 2})
        assert r.headers["x-ace-adapter-tier"] == "disk"
        # vLLM-style runtime registration of a directory under a new name
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "my-sql",
                                                        "lora_path": str(fx / "adapters/code-sql")})
        assert r.status_code == 200, r.text
        again = await c.post("/v1/load_lora_adapter", json={"lora_name": "my-sql",
                                                            "lora_path": str(fx / "adapters/code-sql")})
        assert again.status_code == 400
        a = await c.post("/v1/completions", json={"model": "my-sql", "prompt": "SELECT", "max_tokens": 4})
        b = await c.post("/v1/completions", json={"model": "code-sql", "prompt": "SELECT", "max_tokens": 4})
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "my-sql"})).status_code == 200
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})).status_code == 404
    run_with_server(fx, scenario)


def test_pool_smaller_than_one_adapter_answers_503(fx):
    async def scenario(c, engine):
        r = await c.post("/v1/completions", json={"model": "tr-fr-en", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["param"] == "model"
        ok = await c.post("/v1/completions", json={"model": "ace-tiny-llama", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    run_with_server(fx, scenario, pool_bytes=64 << 10)


def test_cli_serves_on_a_port(fx, tmp_path):
    port = procs.free_port()
    cmd = [procs.python(), "-m", "gpu_agent.engine", "--model", str(fx / "model"),
           "--catalog", str(fx / "catalog.yaml"), "--host", "127.0.0.1", "--port", str(port),
           "--pool-bytes", str(4 << 20), "--threads", "1"]
    log = tmp_path / "engine.log"
    with procs.running(cmd, log) as proc:
        procs.wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc, log=log)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "fin-reports", "prompt": "Revenue", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-ace-adapter-tier"] == "disk"


def test_stop_strings_sampling_seed_and_client_disconnect(fx):
    async def scenario(c, engine):
        full = (await c.post("/v1/completions", json={"model": "code-python", "prompt": "def f(x):",
                                                      "max_tokens": 12})).json()["choices"][0]["text"]
        stop = full[3:6]
        cut = (await c.post("/v1/completions", json={"model": "code-python", "prompt": "def f(x):",
                                                     "max_tokens": 12, "stop": [stop]})).json()
        assert cut["choices"][0]["text"] == full[:full.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        r = await c.post("/v1/completions", json={"model": "code-python", "prompt": "def f(x):",
                                                  "max_tokens": 12, "stop": [stop], "stream": True})
        ev = sse_events(r.text)
        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == full[:full.index(stop)]

        def sampled(seed):
            return c.post("/v1/completions", json={"model": "med-notes", "prompt": "note", "max_tokens": 10,
                                                   "temperature": 1.5, "seed": seed})
        a, b, other = await asyncio.gather(sampled(7), sampled(7), sampled(8))
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
        assert a.json()["choices"][0]["text"] != other.json()["choices"][0]["text"]

        # a client that goes away mid-stream frees its sequence and its hold on the adapter
        async with c.stream("POST", "/v1/completions", json={
                "model": "fin-risk", "prompt": "risk", "max_tokens": 200, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        await async_wait_until(lambda: engine.batcher.num_running == 0 and engine.adapters.held("fin-risk") == 0,
                               what="the abandoned sequence freed")
        assert engine.batcher.stats.generated_tokens < 200 + 60
    run_with_server(fx, scenario)


def test_cold_load_waits_for_room_when_the_pool_is_full_of_running_adapters(fx):
    # 1.5 MiB holds one rank-128 adapter (2,048 pages of 512 B), not two
    async def scenario(c, engine):
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "model": n, "prompt": "Translate", "max_tokens": 6}) for n in ("tr-fr-en", "legal-review")])
        assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
        waits = sorted(float(r.headers["x-ace-adapter-wait-ms"]) for r in rs)
        assert waits[1] > waits[0]
        assert engine.pool.stats()["evictions"] >= 1
        # directly: a held adapter makes the next cold load wait until it is released
        res = engine.adapters
        await res.ensure_resident("legal-review", hold=True)
        waits = res.room_waits
        waiting = asyncio.ensure_future(res.ensure_resident("tr-fr-en"))
        await async_wait_until(lambda: res.room_waits > waits, what="the load waiting for room")
        seen = time.perf_counter()
        assert not waiting.done()
        await asyncio.sleep(0)   # still waiting after a turn of the loop: only a release wakes it
        assert not waiting.done()
        released = time.perf_counter()
        res.release("legal-review")
        tier, ms = await asyncio.wait_for(waiting, scaled(10))
        # its wait began before we saw it waiting and ended after the release
        assert tier in ("host", "disk") and ms >= (released - seen) * 1e3 and res.tier("legal-review") != "device"
    run_with_server(fx, scenario, pool_bytes=3 << 19)


def test_small_host_to_pool_swap_runs_on_the_loop_unless_a_load_holds_the_tiers(fx):
    """CPU pool: a small adapter already parsed in host memory is copied into the pool on
    the event loop (no worker-thread round trip); while another load holds the tiers it
    takes the worker thread as before. Both count as loads from ``host``."""
    import threading

    from gpu_agent.engine import adapters as engine_adapters

    async def scenario(c, engine):
        res = engine.adapters
        await res.ensure_resident("code-sql")
        res.evict("code-sql")
        assert res.tier("code-sql") == "host"
        threads = []
        ensure = res.tiers.ensure

        def spy(*a, **kw):
            threads.append(threading.current_thread() is threading.main_thread())
            return ensure(*a, **kw)

        res.tiers.ensure = spy
        assert (await res.ensure_resident("code-sql"))[0] == "host"
        assert threads == [True] and res.loads["host"] == 1
        res.evict("code-sql")
        held = threading.Event()
        done = threading.Event()

        def hold_tiers():
            with res.tiers.lock:
                held.set()
                done.wait(scaled(5))

        t = threading.Thread(target=hold_tiers)
        t.start()
        assert held.wait(scaled(5))
        waiter = asyncio.ensure_future(res.ensure_resident("code-sql"))
        await async_wait_until(lambda: len(threads) == 2, what="the swap called")
        assert threads[1] is False           # from the worker thread, which waits for the lock
        assert not waiter.done()
        done.set()
        assert (await waiter)[0] == "host"
        t.join()
        assert threads == [True, False] and res.loads["host"] == 2
        assert engine_adapters.INLINE_SWAP_BYTES >= 1 << 20
    run_with_server(fx, scenario)
