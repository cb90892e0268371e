"""A real OpenAI-shaped HTTP upstream (aiohttp) that records exactly what arrived.

In a test: ``with RecordingUpstream() as up: ... up.requests[-1].json()``.
As a process (benchmarks): ``python -m tests.support.upstream --port 8000``.

``/v1/chat/completions`` and ``/v1/completions`` answer in the OpenAI shape, echoing the
``model`` they were sent; ``stream: true`` answers Server-Sent Events, one chunk per
word with ``chunk_delay_s`` between chunks (so a test can see they are not buffered).
Any other path answers 200 with what it received. ``not_found[model] = n``: the next n
inference requests for ``model`` answer vLLM's 404 for a model it does not know.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.support.wait import scaled

__all__ = ["Recorded", "RecordingUpstream"]

WORDS = ["Hello", " from", " the", " recording", " upstream"]


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]     # lower-case names
    body: bytes
    at: float

    def json(self) -> Any:
        return json.loads(self.body)


def _completion(kind: str, model: str, text: str) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        obj = "text_completion"
    return {"id": "cmpl-rec", "object": obj, "created": 0, "model": model, "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(WORDS), "total_tokens": 1 + len(WORDS)}}


class RecordingUpstream:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, chunk_delay_s: float = 0.0,
                 keep: int = 10_000) -> None:
        self.host, self.port = host, port
        self.chunk_delay_s = chunk_delay_s
        self.requests: collections.deque[Recorded] = collections.deque(maxlen=keep)
        # model -> how many of its next inference requests answer vLLM's 404 (its name
        # unloaded between vLLM's model check and its use)
        self.not_found: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(Recorded(request.method, request.path, request.query_string,
                                      {k.lower(): v for k, v in request.headers.items()}, body,
                                      time.time()))
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "text"}.get(request.path)
        if kind is None or request.method != "POST":
            return web.json_response({"echo": True, "path": request.path, "method": request.method})
        try:
            payload = json.loads(body)
        except ValueError:
            return web.json_response({"error": {"message": "bad json", "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=400)
        model = str(payload.get("model", ""))
        if self.not_found.get(model, 0) > 0:
            self.not_found[model] -= 1
            return web.json_response({"error": {"message": f"The model `{model}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}},
                                     status=404)
        if payload.get("stream") is True:
            return await self._stream(request, kind, model)
        return web.json_response(_completion(kind, model, "".join(WORDS)))

    async def _stream(self, request: web.Request, kind: str, model: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        for i, word in enumerate(WORDS):
            if kind == "chat":
                choice = {"index": 0, "delta": {"content": word}, "finish_reason": None}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": word, "finish_reason": None, "logprobs": None}
                obj = "text_completion"
            chunk = {"id": "cmpl-rec", "object": obj, "created": 0, "model": model, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.chunk_delay_s and i < len(WORDS) - 1:
                await asyncio.sleep(self.chunk_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- lifecycle in a background thread (tests) --
    def start(self) -> "RecordingUpstream":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._runner = web.AppRunner(self.app(), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="recording-upstream", daemon=True)
        self._thread.start()
        if not ready.wait(scaled(10)):
            raise RuntimeError("recording upstream did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> "RecordingUpstream":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunk-delay-s", type=float, default=0.0)
    a = p.parse_args()
    up = RecordingUpstream(a.host, a.port, a.chunk_delay_s, keep=1000)
    web.run_app(up.app(), host=a.host, port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
