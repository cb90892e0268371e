"""OpenAI-compatible HTTP front of the builtin engine (aiohttp).

Thin: parse the body into plain values, resolve the model, hold the adapter resident,
stream tokens from the batcher, write JSON or SSE. Every error goes through
:func:`gpu_agent.engine.errors.http_error` (one status + OpenAI-style body).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(each with ``stream: true``; the Responses API's shapes in ``gpu_agent.engine.responses``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, and vLLM's
runtime ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from ace_common.engine_fields import EVICT_FIRST, MAX_EVICT_FIRST
from ace_common.loop_lag import LoopLag
from gpu_agent.engine.core import Engine
from gpu_agent.engine.errors import EngineError, InvalidRequest, error_body, http_error
from gpu_agent.engine.metrics import render_metrics
from gpu_agent.engine.responses import (ResponseStream, chat_messages, response_object, responses_param,
                                        sampling_body)

__all__ = ["build_app", "serve", "ENGINE_KEY"]

log = logging.getLogger("gpu_agent.engine")
ENGINE_KEY = web.AppKey("engine", Engine)
STATS_KEY = web.AppKey("http_stats", object)
TIER_HEADER = "x-ace-adapter-tier"
WAIT_HEADER = "x-ace-adapter-wait-ms"


@dataclass
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    include_timing: bool = False


def _num(body: dict, key: str, kind: type, default: Any, lo: float | None = None,
         hi: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            kind is int and isinstance(v, float) and not v.is_integer()):
        raise InvalidRequest(f"`{key}` must be {'an integer' if kind is int else 'a number'}", param=key)
    if isinstance(v, float) and not math.isfinite(v):   # json.loads takes NaN and Infinity, and
        raise InvalidRequest(f"`{key}` must be a finite number", param=key)   # they fail the batch
    try:
        v = kind(v)
    except OverflowError:   # an integer beyond a double's range where a number is asked for
        raise InvalidRequest(f"`{key}` is out of range", param=key) from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"`{key}` must be in [{lo}, {hi}], got {v}", param=key)
    return v


def parse_sampling(body: dict, *, chat: bool) -> Sampling:
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    n = _num(body, "n", int, 1, 1, 1)
    del n  # only n=1 is served
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("`stop` must be a string or a list of strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("`stream` must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise InvalidRequest("`stream_options` must be an object", param="stream_options")
    return Sampling(
        max_tokens=_num(body, max_key, int, 16, 1, None),
        temperature=_num(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=_num(body, "top_p", float, 1.0, 0.0, 1.0) or 1.0,
        seed=_num(body, "seed", int, None, -(2 ** 63), 2 ** 64 - 1),   # what torch.Generator takes
        stop=[s for s in stop if s],
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        ignore_eos=bool(body.get("ignore_eos", False)),
        include_timing=bool(opts.get("include_timing", False)),
    )


class StopText:
    """Cuts the output at the first stop string; holds back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        self.text += delta
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out, True
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


def _prompt_ids(engine: Engine, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= engine.model.cfg.vocab_size for t in prompt):
            raise InvalidRequest("prompt token id out of range", param="prompt")
        ids = list(prompt)
    else:
        raise InvalidRequest("`prompt` must be a string or a list of token ids (batches of one)",
                             param="prompt")
    if not ids:
        raise InvalidRequest("`prompt` is empty", param="prompt")
    return ids


def _chat_ids(engine: Engine, body: dict) -> list[int]:
    from gpu_agent.engine.tokenizer import ChatTemplateError

    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("`messages` must be a non-empty list", param="messages")
    norm = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest("each message needs a string `role`", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            try:
                content = "".join(p["text"] for p in content if p.get("type") == "text")
            except (TypeError, KeyError, AttributeError) as exc:
                raise InvalidRequest("unsupported message content parts", param="messages") from exc
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest("message `content` must be a string", param="messages")
        norm.append({"role": m["role"], "content": content})
    try:
        return engine.tokenizer.encode_chat(norm)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc


def _error_response(exc: BaseException) -> web.Response:
    status, body = http_error(exc)
    if status >= 500 and not isinstance(exc, EngineError):
        log.exception("request failed", exc_info=exc)
    return web.json_response(body, status=status)


class _Completion:
    """One request's run: hold the adapter, generate, release."""

    def __init__(self, engine: Engine, model: str, adapter: str | None, ids: list[int], sp: Sampling,
                 body: dict | None = None):
        self.engine, self.model, self.adapter, self.ids, self.sp = engine, model, adapter, ids, sp
        self.body = body or {}      # the request, when its answer repeats fields of it
        self.tier, self.wait_ms = "none", 0.0
        self.held = False
        # the TTFT split (``timing``): perf_counter() marks and the engine's load seconds
        self.arrived, self.loads_at_arrival = time.perf_counter(), engine.adapters.load_seconds
        self.loop_lag = LoopLag.running()   # this loop's lag monitor (the agent's), if any
        self.lag_at_arrival = self.loop_lag.sum_s if self.loop_lag is not None else None
        self.lag_at_first_token: float | None = None
        self.queued = self.first_pass = None
        self.loads_at_first_token = None
        self.load = None  # the load this request waited for (its LoadTicket), if any

    async def acquire(self) -> None:
        if self.adapter is not None:
            adapters = self.engine.adapters
            before = adapters.load_stages.get(self.adapter)
            self.tier, self.wait_ms = await adapters.ensure_resident(self.adapter, hold=True)
            self.held = True
            after = adapters.load_stages.get(self.adapter)
            if after is not before:
                self.load = after

    def release(self) -> None:
        if self.held:
            self.held = False
            self.engine.adapters.release(self.adapter)

    def headers(self) -> dict[str, str]:
        return {TIER_HEADER: self.tier, WAIT_HEADER: f"{self.wait_ms:.3f}"}

    def timing(self) -> dict[str, float | None]:
        """Where the engine's time to the first token went, in ms: ``stall`` (waiting for the
        adapter), ``queue`` (until the first forward pass over this sequence started),
        ``compute`` (that pass), their sum ``first_token``, and ``loads``: the engine's
        load work (any adapter, prefetch or demand) that ended in that window. When the stall
        was a load from the source, ``load``: its ``fetch_ms`` (the source's download or
        check), ``tiers_ms`` (read, parse, copy into the pool), ``paused_ms`` (a prefetch's
        load yielding before this request joined it), and what else was loading or
        downloading when it started. ``arrived_s``: when the engine had the request, on
        ``time.perf_counter()``'s clock (CLOCK_MONOTONIC on Linux, shared by the processes of
        one machine: a client there subtracts its own send time to get the way in).
        ``loop_lag_ms``: how late the event loop ran its lag monitor's wake-ups between the
        arrival and the first token (``ace_common.loop_lag``; absent where none runs): time
        this request lost to a late loop, whatever its adapter."""
        out: dict = {"stall_ms": round(self.wait_ms, 3), "arrived_s": round(self.arrived, 6)}
        if self.load is not None:
            t = self.load
            out["load"] = {"fetch_ms": round(t.fetch_s * 1e3, 3), "tiers_ms": round(t.tiers_s * 1e3, 3),
                           "paused_ms": round(t.paused_s * 1e3, 3), "others_loading": t.others_loading,
                           "fetches_at_start": t.fetches_at_start}
        if self.first_pass is None or self.queued is None:
            return out
        start, end = self.first_pass
        if self.lag_at_arrival is not None and self.lag_at_first_token is not None:
            out["loop_lag_ms"] = round((self.lag_at_first_token - self.lag_at_arrival) * 1e3, 3)
        return {**out, "queue_ms": round((start - self.queued) * 1e3, 3),
                "compute_ms": round((end - start) * 1e3, 3), "first_token_ms": round((end - self.arrived) * 1e3, 3),
                "loads_ms": round((self.loads_at_first_token - self.loads_at_arrival) * 1e3, 3)}

    async def text_deltas(self) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text delta, finish_reason or None, completion tokens so far)."""
        from gpu_agent.engine.tokenizer import IncrementalDecoder

        dec = IncrementalDecoder(self.engine.tokenizer, self.ids)
        stop = StopText(self.sp.stop)
        n = 0
        self.queued = time.perf_counter()
        gen = self.engine.generate(self.adapter, self.ids, max_tokens=self.sp.max_tokens,
                                   temperature=self.sp.temperature, top_p=self.sp.top_p,
                                   seed=self.sp.seed, ignore_eos=self.sp.ignore_eos)
        try:
            async for ev in gen:
                if ev.finish_reason == "abort":
                    raise EngineError("generation was aborted (engine stopping or a forward pass failed)")
                if self.first_pass is None and ev.pass_start is not None:
                    self.first_pass = (ev.pass_start, ev.pass_end)
                    self.loads_at_first_token = self.engine.adapters.load_seconds
                    if self.loop_lag is not None:
                        self.lag_at_first_token = self.loop_lag.sum_s
                delta = ""
                if ev.token_id is not None:
                    n += 1
                    if ev.finish_reason != "stop" or ev.token_id not in self.engine.stop_ids:
                        delta = dec.push(ev.token_id)
                out, hit = stop.feed(delta)
                if hit:
                    yield out, "stop", n
                    return
                if ev.finish_reason is not None:
                    yield out + stop.flush(), ev.finish_reason, n
                    return
                if out:
                    yield out, None, n
        finally:
            await gen.aclose()


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _model(engine: Engine, body: dict) -> tuple[str, str | None]:
    """The request's ``model`` and the adapter it names (None: the base model)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("`model` is required", param="model")
    return model, engine.adapter_for(model)


def _check_length(engine: Engine, ids: list[int], sp: Sampling, what: str, param: str) -> None:
    if len(ids) + sp.max_tokens > engine.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {engine.max_model_len} tokens; the request "
            f"has {len(ids)} {what} tokens and {param}={sp.max_tokens}.", param=param)


async def _collect(run: _Completion) -> tuple[str, str, int]:
    """The whole answer: (text, finish_reason, completion tokens)."""
    text, finish, n = "", "length", 0
    async with contextlib.aclosing(run.text_deltas()) as deltas:
        async for delta, fin, n in deltas:
            text += delta
            finish = fin or finish
    return text, finish, n


Prepare = Callable[[Engine, dict], _Completion]
Answer = Callable[[_Completion, str, str, int], dict]
Events = Callable[[_Completion], tuple[AsyncIterator[bytes], Callable[[dict], bytes]]]


def _evict_first(engine: Engine, adapter: str | None, body: dict) -> None:
    """The gateway's victims for this request's load (``EVICT_FIRST``, ace_common.
    engine_fields: a client's copy never gets past the gateway): that load evicts them
    first where it needs room, as with a Prefetch's ``evict``. A hint: a value that is not
    a list of names is ignored, and at most ``MAX_EVICT_FIRST`` names are read."""
    names = body.get(EVICT_FIRST)
    if adapter is None or not isinstance(names, list) or not names:
        return
    victims = [n for n in names[:MAX_EVICT_FIRST] if isinstance(n, str) and n != adapter]
    if victims:
        engine.adapters.prefer_victims(adapter, victims)


async def _serve(request: web.Request, route: str, prepare: Prepare, answer: Answer,
                 events: Events) -> web.StreamResponse:
    """A generation route: ``prepare`` the run from the body, hold its adapter, then the
    whole ``answer`` as JSON or, with ``stream``, the SSE ``events`` (their chunks, and how
    an error after the headers is written in-band). Errors become HTTP here."""
    engine: Engine = request.app[ENGINE_KEY]
    stats = request.app[STATS_KEY]
    try:
        body = await _json_body(request)
        run = prepare(engine, body)
        _evict_first(engine, run.adapter, body)
        await run.acquire()
    except Exception as exc:  # noqa: BLE001 - the one boundary that maps errors to HTTP
        stats.count(route, http_error(exc)[0])
        return _error_response(exc)
    try:
        if run.sp.stream:
            return await _sse(request, route, run, *events(run))
        text, finish, n = await _collect(run)
        stats.count(route, 200)
        return web.json_response(answer(run, text, finish, n), headers=run.headers())
    except Exception as exc:  # noqa: BLE001
        stats.count(route, http_error(exc)[0])
        return _error_response(exc)
    finally:
        run.release()


async def _sse(request: web.Request, route: str, run: _Completion, chunks: AsyncIterator[bytes],
               failure: Callable[[dict], bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **run.headers()})
    await resp.prepare(request)
    stats = request.app[STATS_KEY]
    try:
        async for chunk in chunks:
            await resp.write(chunk)
        stats.count(route, 200)
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        status, body = http_error(exc)
        stats.count(route, status)
        try:
            await resp.write(failure(body))
        except ConnectionError:
            return resp  # the client is gone
    try:
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


def _data_line(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _completion_route(chat: bool) -> tuple[str, Prepare, Answer, Events]:
    """``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")

    def prepare(engine: Engine, body: dict) -> _Completion:
        model, adapter = _model(engine, body)
        sp = parse_sampling(body, chat=chat)
        ids = _chat_ids(engine, body) if chat else _prompt_ids(engine, body)
        _check_length(engine, ids, sp, "prompt", "max_tokens")
        return _Completion(engine, model, adapter, ids, sp)

    def answer(run: _Completion, text: str, finish: str, n: int) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": run.model, "choices": [choice], "usage": _usage(len(run.ids), n)}

    async def chunks(run: _Completion) -> AsyncIterator[bytes]:
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage: dict | None = None, timing: dict | None = None) -> bytes:
            out: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created, "model": run.model,
                                   "choices": choices}
            if usage is not None:
                out["usage"] = usage
            if timing is not None:
                out["ace_timing"] = timing
            return _data_line(out)

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        n = 0
        if chat:
            yield chunk([choice(None, None, first=True)])
        async with contextlib.aclosing(run.text_deltas()) as deltas:
            async for delta, fin, n in deltas:
                if delta or fin:
                    yield chunk([choice(delta, fin)])
        if run.sp.include_usage:
            yield chunk([], _usage(len(run.ids), n))
        if run.sp.include_timing:  # ace's own chunk, as usage's: no choices
            yield chunk([], timing=run.timing())
        yield b"data: [DONE]\n\n"

    return "chat" if chat else "completions", prepare, answer, lambda run: (chunks(run), _data_line)


def _responses_route() -> tuple[str, Prepare, Answer, Events]:
    """``/v1/responses`` over the chat path (the shapes: ``gpu_agent.engine.responses``)."""
    def prepare(engine: Engine, body: dict) -> _Completion:
        model, adapter = _model(engine, body)
        try:
            sp = parse_sampling(sampling_body(body), chat=True)
        except InvalidRequest as exc:
            raise responses_param(exc) from exc
        ids = _chat_ids(engine, {"messages": chat_messages(body)})
        _check_length(engine, ids, sp, "input", "max_output_tokens")
        return _Completion(engine, model, adapter, ids, sp, body)

    def answer(run: _Completion, text: str, finish: str, n: int) -> dict:
        return response_object(f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", run.model, int(time.time()),
                               run.body, text=text, finish=finish, usage=(len(run.ids), n))

    async def chunks(run: _Completion, events: ResponseStream) -> AsyncIterator[bytes]:
        for event in events.opening():
            yield event
        finish, n = "length", 0
        async with contextlib.aclosing(run.text_deltas()) as deltas:
            async for delta, fin, n in deltas:
                finish = fin or finish
                if delta:
                    yield events.delta(delta)
        for event in events.closing(finish, (len(run.ids), n)):
            yield event

    def events(run: _Completion):
        stream = ResponseStream(run.model, int(time.time()), run.body)
        return chunks(run, stream), stream.failure

    return "responses", prepare, answer, events


_CHAT, _COMPLETIONS, _RESPONSES = _completion_route(True), _completion_route(False), _responses_route()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, *_COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, *_CHAT)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _serve(request, *_RESPONSES)


async def models(request: web.Request) -> web.Response:
    engine: Engine = request.app[ENGINE_KEY]
    now = int(time.time())
    data = [{"id": engine.model_name, "object": "model", "created": now, "owned_by": "ace",
             "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len}]
    res = engine.adapters
    for name in res.names():
        e = res.entry(name)
        data.append({"id": name, "object": "model", "created": now, "owned_by": e.owner,
                     "root": e.uri, "parent": engine.model_name, "ace_tier": res.tier(name)})
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    engine: Engine = request.app[ENGINE_KEY]
    text = render_metrics(engine, request.app[STATS_KEY])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's runtime route: register ``lora_name`` at ``lora_path`` and load it."""
    engine: Engine = request.app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequest("`lora_name` and `lora_path` are required")
        if engine.adapters.knows(name) and engine.adapters.tier(name) == "device":
            # vLLM answers 400 for an adapter already loaded; callers treat it as success.
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if not engine.adapters.knows(name):
            engine.adapters.register(name, path)
        await engine.adapters.ensure_resident(name)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine: Engine = request.app[ENGINE_KEY]
    try:
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not engine.adapters.knows(name):
            return web.json_response(error_body(404, f"The lora adapter '{name}' cannot be found.",
                                                "not_found_error", "lora_name"), status=404)
        engine.adapters.evict(name, tier="host")
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


class HttpStats:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}

    def count(self, route: str, status: int) -> None:
        key = (route, status)
        self.requests[key] = self.requests.get(key, 0) + 1


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:  # 404/405 of aiohttp's router, as OpenAI-style JSON
        if exc.status >= 400:
            return web.json_response(error_body(exc.status, exc.reason, "invalid_request_error"),
                                     status=exc.status)
        raise
    except Exception as exc:  # noqa: BLE001 - never a bare 500 page
        return _error_response(exc)


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=8 << 20)
    app[ENGINE_KEY] = engine
    app[STATS_KEY] = HttpStats()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)

    async def _close(app: web.Application) -> None:
        await engine.close()

    app.on_cleanup.append(_close)
    return app


async def serve(engine: Engine, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start serving in the running loop; returns the runner (``await runner.cleanup()``)
    and the bound port (``port=0`` picks a free one)."""
    # one header line up to 64 KiB (aiohttp's default is 8 KiB): what Envoy lets through (60 KiB
    # of headers; beyond, it answers 431 itself) the engine takes too, as vLLM's server does,
    # instead of a plain-text 400 and a closed connection
    runner = web.AppRunner(build_app(engine), access_log=None, max_line_size=65536, max_field_size=65536)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
start = serve  # the name the agent's builtin connector uses
