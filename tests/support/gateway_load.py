"""Load through the real Envoy that counts every response, and Envoy's view of the ext_proc
replicas (admin ``/clusters``): the failure-mode and restart tests."""
from __future__ import annotations

import json
import threading
from collections import Counter

import httpx

from tests.extproc.builders import KEYS
from tests.support.wait import scaled

__all__ = ["ALICE", "CHAT", "Load", "chunks", "replica_stats", "served"]

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


def chunks(body: dict):   # no content-length: the headers-first route (2 ext_proc messages)
    yield json.dumps(body).encode()


def replica_stats(admin: int) -> dict[str, dict[str, str]]:
    """Envoy's view of each ace_extproc endpoint (admin /clusters)."""
    out: dict[str, dict[str, str]] = {}
    text = httpx.get(f"http://127.0.0.1:{admin}/clusters", timeout=scaled(5)).text
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "ace_extproc":
            out.setdefault(parts[1], {})[parts[2]] = parts[3]
    return out


def served(admin: int, address: str) -> int:
    return int(replica_stats(admin).get(address, {}).get("rq_total", "0"))


class Load:
    """``threads`` clients posting until stopped or ``limit`` requests are done; each
    response is recorded as its status, ``decided`` when ext_proc's decision is on it."""

    def __init__(self, port: int, threads: int = 4, limit: int = 3000, chunked_every: int = 0) -> None:
        self.base, self.limit, self.chunked_every = f"http://127.0.0.1:{port}", limit, chunked_every
        self.results: Counter = Counter()
        self.failures: list[str] = []
        self.done = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=scaled(20)) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                chunked = self.chunked_every and n % self.chunked_every == 0
                try:
                    if chunked:
                        r = c.post("/v1/chat/completions", content=chunks(CHAT), headers=ALICE)
                    else:
                        r = c.post("/v1/chat/completions", json=CHAT, headers=ALICE)
                    ok = r.status_code == 200 and r.headers.get("x-ace-served-by") == "local-vllm"
                    outcome = "decided" if ok else f"{r.status_code}"
                    detail = "" if ok else r.text[:300]
                except httpx.HTTPError as exc:
                    outcome, detail = type(exc).__name__, str(exc)
                with self.lock:
                    self.results[outcome] += 1
                    if detail:
                        self.failures.append(detail)
                    self.done += 1
                    if self.done >= self.limit:
                        self.stop.set()

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=scaled(30))
