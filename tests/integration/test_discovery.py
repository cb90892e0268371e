"""Hosts added and removed while traffic flows: real Envoy, the ext_proc process with a
``file:`` discovery source the test rewrites, and three recording upstreams.

Requests run in two threads the whole time and none may fail. A host added receives
traffic (round-robin routing, so every known host gets its share); a host removed
receives none once the gateway says it is gone: its log line is the positive signal,
then each traffic thread finishes a request begun after it, then more requests follow,
and the removed host's count must not move. The removed host keeps running, as a Pod
being deleted drains, so requests already sent there still complete."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from tests.extproc.builders import KEYS, write_state
from tests.support.upstream import RecordingUpstream
from tests.support.wait import wait_until
from tools.localstack import gateway_front

CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


class Traffic:
    """``threads`` loops of chat requests through the gateway until ``stop``."""

    def __init__(self, base: str, threads: int = 2) -> None:
        self.base = base
        self.done = [0] * threads
        self.errors: list[str] = []
        self.served: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as http:
            while not self._stop.is_set() and self.done[i] < 5000:
                try:
                    r = http.post("/v1/chat/completions", json=CHAT,
                                  headers={"authorization": f"Bearer {KEYS['bob']}"})
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        self.served.append(r.headers.get("x-ace-served-by", "?"))
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.done[i] += 1

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def total(self) -> int:
        return sum(self.done)

    def each_finished_one_more(self) -> None:
        """Every thread has completed a request begun after this call."""
        marks = list(self.done)
        wait_until(lambda: all(d >= m + 2 for d, m in zip(self.done, marks)), what="a request begun after the mark")


def write_hosts(path: Path, ups: dict[str, RecordingUpstream]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"address": u.address, "name": name} for name, u in ups.items()]))
    tmp.replace(path)        # atomic: the source never reads half a file


def test_hosts_come_and_go_while_traffic_flows(tmp_path):
    with RecordingUpstream() as a, RecordingUpstream() as b, RecordingUpstream() as c:
        hosts = tmp_path / "hosts.json"
        write_hosts(hosts, {"host-a": a})
        state = write_state(tmp_path, [])          # no upstreams: discovery gives them
        args = ["--discovery", f"file:{hosts}", "--discovery-interval-s", "0.05",
                "--discovery-base-model", "ace-tiny-llama", "--discovery-flavour", "vllm",
                "--routing-policy", "extproc.policy.routing:round_robin"]
        log = tmp_path / "extproc.log"
        with gateway_front(tmp_path, state, a.address, extproc_args=args) as port:
            wait_until(lambda: "discovery: 1 hosts" in log.read_text(), what="host-a discovered")
            with Traffic(f"http://127.0.0.1:{port}") as traffic:
                wait_until(lambda: len(a.requests) >= 5, what="traffic on host-a")

                write_hosts(hosts, {"host-a": a, "host-b": b, "host-c": c})
                wait_until(lambda: len(b.requests) >= 5 and len(c.requests) >= 5, what="traffic on b and c")

                write_hosts(hosts, {"host-b": b, "host-c": c})
                wait_until(lambda: "removed ['host-a']" in log.read_text(), what="host-a removed")
                traffic.each_finished_one_more()
                at_a, total = len(a.requests), traffic.total()
                wait_until(lambda: traffic.total() >= total + 40, what="40 requests after the removal")
                assert len(a.requests) == at_a, "a removed host got traffic"

                write_hosts(hosts, {"host-a": a, "host-c": c})     # a back, b gone at once
                wait_until(lambda: "removed ['host-b']" in log.read_text(), what="host-b removed")
                wait_until(lambda: len(a.requests) >= at_a + 5, what="traffic on host-a again")
                traffic.each_finished_one_more()
                at_b, total = len(b.requests), traffic.total()
                wait_until(lambda: traffic.total() >= total + 40, what="40 requests after b's removal")
                assert len(b.requests) == at_b, "a removed host got traffic"
            assert traffic.errors == [], traffic.errors[:5]
            assert traffic.total() > 100
            assert {"host-a", "host-b", "host-c"} <= set(traffic.served)


def test_no_host_is_a_503_until_one_is_discovered(tmp_path):
    with RecordingUpstream() as a:
        hosts = tmp_path / "hosts.json"
        hosts.write_text("[]")
        state = write_state(tmp_path, [])
        args = ["--discovery", f"file:{hosts}", "--discovery-interval-s", "0.05",
                "--discovery-base-model", "ace-tiny-llama"]
        with gateway_front(tmp_path, state, a.address, extproc_args=args) as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                send = lambda: http.post("/v1/chat/completions", json=CHAT,   # noqa: E731
                                         headers={"authorization": f"Bearer {KEYS['bob']}"})
                r = send()
                # Envoy's local reply mapper gives every 503 its OpenAI-shaped body
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"   # the gateway's own answer
                assert a.requests == type(a.requests)()
                write_hosts(hosts, {"host-a": a})
                r = wait_until(lambda: (r := send()).status_code == 200 and r, what="host-a serving")
                assert r.headers["x-ace-served-by"] == "host-a" and len(a.requests) == 1
