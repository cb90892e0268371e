"""InferencePoolSource with the real ``kubernetes`` client against an HTTP server that
answers the API server's list and watch calls (no cluster here): the pool watch, the Pod
list and watch with the pool's selector, resuming from the list's resourceVersion, a
410 Gone answered by a fresh list, and a selector change listing again with the new one.
The events are the recorded ones of tests/extproc/fixtures/inferencepool_watch.json."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402

from extproc.fleet.discovery import Endpoint  # noqa: E402
from extproc.fleet.inferencepool import InferencePoolSource  # noqa: E402
from tests.support.wait import scaled, wait_until  # noqa: E402

STREAM = json.loads((Path(__file__).parents[1] / "extproc" / "fixtures" / "inferencepool_watch.json")
                    .read_text())["steps"]
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/ace/inferencepools"
PODS = "/api/v1/namespaces/ace/pods"
END = object()


class FakeApiServer:
    """Lists answer ``pod_list``; each watch streams what ``push`` sends to its kind until
    ``end``. Every request's path and query is kept in ``calls``."""

    def __init__(self) -> None:
        self.pod_list: dict = {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []}
        self.calls: list[tuple[str, dict]] = []
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending: dict[str, list] = {}
        self.every_queue: list[asyncio.Queue] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.calls.append((request.path, query))
        kind = "pool" if request.path == POOLS else "pods"
        if query.get("watch") not in ("true", "True", "1"):
            return web.json_response(self.pod_list)
        queue = self.queues[kind] = asyncio.Queue()     # events go to the newest watch
        self.every_queue.append(queue)
        for event in self.pending.pop(kind, []):
            queue.put_nowait(event)
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        try:
            while True:
                event = await queue.get()
                if event is END:
                    break
                await resp.write(json.dumps(event).encode() + b"\n")
            await resp.write_eof()
        except ConnectionResetError:     # the client ended this watch
            pass
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def push(self, kind: str, event) -> None:
        """To the newest watch of ``kind`` (one that ended meanwhile loses it, as a dropped
        connection would), or to the next one when none has started."""
        def put() -> None:
            if kind in self.queues:
                self.queues[kind].put_nowait(event)
            else:
                self.pending.setdefault(kind, []).append(event)
        self.loop.call_soon_threadsafe(put)

    def watches(self, kind: str) -> list[dict]:
        path = POOLS if kind == "pool" else PODS
        return [q for p, q in self.calls if p == path and q.get("watch")]

    def lists(self) -> list[dict]:
        return [q for p, q in self.calls if p == PODS and not q.get("watch")]

    def __enter__(self) -> "FakeApiServer":
        self.thread.start()
        assert self.ready.wait(scaled(10))
        return self

    def __exit__(self, *exc) -> None:
        def end_all() -> None:
            for queue in self.every_queue:      # every watch handler returns
                queue.put_nowait(END)
            self.loop.stop()
        self.loop.call_soon_threadsafe(end_all)
        self.thread.join(10)


def addresses(endpoints) -> set[str]:
    return {ep.address for ep in endpoints}


def test_the_source_follows_the_pool_and_its_pods_through_the_real_client():
    with FakeApiServer() as api:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{api.port}"
        published: list[frozenset[Endpoint]] = []
        api.pod_list = STREAM[1]["list"]
        source = InferencePoolSource("ace-engine", "ace", api=client.ApiClient(cfg), backoff_s=0.05)
        source.start(published.append)
        try:
            api.push("pool", STREAM[0]["event"])                           # pool ADDED
            wait_until(lambda: published and addresses(published[-1]) == {"10.1.0.11:8000"}, what="the first list")
            assert api.lists()[0]["labelSelector"] == "app.kubernetes.io/name=ace-engine"
            assert api.watches("pool")[0]["fieldSelector"] == "metadata.name=ace-engine"
            wait_until(lambda: api.watches("pods"), what="the pod watch")
            assert api.watches("pods")[0]["resourceVersion"] == STREAM[1]["list"]["metadata"]["resourceVersion"]
            assert api.watches("pods")[0]["allowWatchBookmarks"] == "true"

            for step in STREAM[2:7]:                                       # c comes up, b turns Ready
                api.push("pods", step["event"])
            wait_until(lambda: addresses(published[-1]) == {"10.1.0.11:8000", "10.1.0.12:8000", "10.1.0.13:8000"},
                       what="a, b and c")
            for step in STREAM[7:11]:                                      # a flaps, terminates, goes
                api.push("pods", step["event"])
            wait_until(lambda: addresses(published[-1]) == {"10.1.0.12:8000", "10.1.0.13:8000"}, what="a gone")

            api.pod_list = STREAM[12]["list"]                              # 410 Gone: list again
            api.push("pods", STREAM[11]["event"])
            wait_until(lambda: addresses(published[-1]) == {"10.1.0.12:8000", "10.1.0.14:8000"}, what="the relist")
            assert len(api.lists()) == 2
            wait_until(lambda: len(api.watches("pods")) >= 2, what="the watch again")
            assert api.watches("pods")[-1]["resourceVersion"] == STREAM[12]["list"]["metadata"]["resourceVersion"]

            api.pod_list = STREAM[15]["list"]                              # the selector changes
            api.push("pool", STREAM[14]["event"])
            wait_until(lambda: addresses(published[-1]) == {"10.1.0.15:8000"}, what="the canary pods")
            assert api.lists()[-1]["labelSelector"] == "app.kubernetes.io/name=ace-engine,track=canary"
            wait_until(lambda: api.watches("pods")[-1]["labelSelector"].endswith("track=canary"),
                       what="the pod watch with the new selector")
            assert [ep.name for ep in published[-1]] == ["ace-engine-canary-eeeee"]

            api.push("pool", STREAM[16]["event"])                          # the pool is deleted
            wait_until(lambda: published[-1] == frozenset(), what="no hosts")
            assert len(api.lists()) == 3       # one per selector and one for the 410: no more
        finally:
            source.close()
        assert not any(t.is_alive() for t in source._threads)    # close interrupts the watches
