"""The gateway's /metrics: what the request path counts, what the collector reads at
scrape time, and that counting stays off prometheus_client and locks per request."""
from __future__ import annotations

import socket

import sys
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.errors import ConfigError
from extproc.observe.metrics import GatewayCollector, propagation_histogram, serve_metrics
from extproc.app.outcomes import Reply, RequestHead
from extproc.app.context import Gateway
from extproc.state.residency import ResidencyBoard, ResidencySnapshot
from extproc.settings import Settings
from tests.extproc.builders import KEYS, sha


def _head(key: str | None, path: str = "/v1/chat/completions", **headers) -> RequestHead:
    h = {":path": path, ":method": "POST", **headers}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    return RequestHead("POST", path, h, False)


def _send(gw: Gateway, key: str | None, body: bytes, **headers):
    ex = gw.exchange()
    first = ex.on_request_headers(_head(key, **headers))
    return first if isinstance(first, Reply) else ex.on_request_body(body)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _registry(gw: Gateway, **kw) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(GatewayCollector(gw.metrics, **kw))
    return reg


CHAT = b'{"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}'
LEGAL = b'{"model": "acme-legal", "messages": [{"role": "user", "content": "hi"}]}'


def test_requests_are_counted_by_tenant_adapter_action_and_mode(store):
    gw = Gateway(store)
    for _ in range(3):
        _send(gw, KEYS["alice"], LEGAL)         # acme's adapter, multi_lora prod
    _send(gw, KEYS["carol"], LEGAL)             # acme, multi_lora shadow
    _send(gw, KEYS["bob"], CHAT)                # globex: the base model, no adapter
    got = _samples(_registry(gw))
    req = "ace_gateway_requests_total"
    assert got[(req, (("action", "adapter_applied"), ("adapter", "acme-legal"), ("mode", "prod"),
                      ("tenant", "acme")))] == 3
    assert got[(req, (("action", "shadow"), ("adapter", "acme-legal"), ("mode", "shadow"),
                      ("tenant", "acme")))] == 1
    assert got[(req, (("action", "passthrough"), ("adapter", ""), ("mode", "prod"), ("tenant", "globex")))] == 1
    assert got[("ace_gateway_decision_seconds_count", ())] == 5
    assert got[("ace_gateway_decision_seconds_bucket", (("le", "+Inf"),))] == 5
    assert got[("ace_gateway_decision_seconds_sum", ())] > 0


def test_refusals_count_as_errors_with_bounded_labels(store):
    """Neither the client's tenant header nor its model name becomes a label: an unknown
    key counts as tenant "", an unknown adapter as adapter "" with the error's code."""
    gw = Gateway(store)
    _send(gw, "sk-nobody", CHAT, **{"x-ace-tenant-id": "evil-tenant-1"})
    _send(gw, KEYS["alice"], b'{"lora_name": "no-such-adapter-xyz", "messages": []}')
    _send(gw, KEYS["alice"], b"not json")
    out = gw.exchange().on_request_headers(RequestHead("GET", "/v1/models", {":path": "/v1/models"}, True))
    assert out.status == 401
    got = _samples(_registry(gw))
    assert got[("ace_gateway_errors_total", (("code", "invalid_api_key"), ("status", "401")))] == 1
    assert got[("ace_gateway_errors_total", (("code", "missing_api_key"), ("status", "401")))] == 1
    assert got[("ace_gateway_errors_total", (("code", "adapter_not_found"), ("status", "404")))] == 1
    assert got[("ace_gateway_errors_total", (("code", "invalid_json"), ("status", "400")))] == 1
    req = "ace_gateway_requests_total"
    # /v1/models is not an inference request: an error, not a request
    assert got[(req, (("action", "invalid_api_key"), ("adapter", ""), ("mode", ""), ("tenant", "")))] == 1
    assert got[(req, (("action", "adapter_not_found"), ("adapter", ""), ("mode", ""), ("tenant", "acme")))] == 1
    assert got[(req, (("action", "invalid_json"), ("adapter", ""), ("mode", ""), ("tenant", "acme")))] == 1
    labels = {v for (_, ls) in got for _, v in ls}
    assert "evil-tenant-1" not in labels and "no-such-adapter-xyz" not in labels


class CountingLock:
    """A lock that counts how often it is taken."""

    def __init__(self) -> None:
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self):
        self.taken += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)

    def acquire(self, *args, **kw):
        self.taken += 1
        return self.lock.acquire(*args, **kw)

    def release(self):
        self.lock.release()


def test_request_path_takes_no_lock_and_never_calls_prometheus(store):
    """After a thread's first request (which registers its shard under the lock), a
    request's counting is plain dict and list updates: the lock is not taken again and no
    prometheus_client code runs (a Counter's labels().inc() would run both)."""
    gw = Gateway(store)
    gw.metrics._register = lock = CountingLock()
    _send(gw, KEYS["alice"], LEGAL)
    assert lock.taken == 1
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        out = _send(gw, KEYS["alice"], LEGAL)
    finally:
        sys.setprofile(None)
    assert not isinstance(out, Reply)
    assert any(c.endswith("extproc/observe/metrics.py") for c in calls)      # counted, and seen counting
    assert not [c for c in calls if "prometheus_client" in c]
    assert lock.taken == 1
    assert _samples(_registry(gw))[("ace_gateway_decision_seconds_count", ())] == 2


def test_counts_from_several_threads_add_up(store):
    gw = Gateway(store)

    def work():
        for _ in range(50):
            _send(gw, KEYS["bob"], CHAT)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = _samples(_registry(gw))
    assert got[("ace_gateway_requests_total", (("action", "passthrough"), ("adapter", ""), ("mode", "prod"),
                                               ("tenant", "globex")))] == 200


def test_predictions_links_and_snapshot_age_are_read_at_scrape_time(store):
    class Speculation:   # the one method the collector reads: GatewaySpeculation.counters()
        def counters(self):
            return {"predictions": 5, "predictions_used": 3, "predictions_wasted": 2, "signals_sent": 9}

    board = ResidencyBoard()
    board.published_at -= 100.0        # as if published 100 s ago
    reg = _registry(Gateway(store), speculation=Speculation(), board=board)
    got = _samples(reg)
    assert got[("ace_gateway_predictions_total", (("outcome", "used"),))] == 3
    assert got[("ace_gateway_predictions_total", (("outcome", "wasted"),))] == 2
    assert got[("ace_gateway_residency_snapshot_age_seconds", ())] >= 100
    board.publish(ResidencySnapshot())
    assert _samples(reg)[("ace_gateway_residency_snapshot_age_seconds", ())] < 100


def test_agent_links_report_up_and_prefetch_signals(store):
    """A real AgentLink towards an address nothing listens on: down, its signal fails."""
    from extproc.fleet.agent_link import AgentLink
    from extproc.domain.prefetch import PrefetchSignal
    from tests.support.procs import free_port
    from tests.support.wait import wait_until

    link = AgentLink({"gpu-0": f"127.0.0.1:{free_port()}"}, send_timeout_s=0.2).start()
    try:
        reg = _registry(Gateway(store), link=link)
        assert link.submit(PrefetchSignal("gpu-0", "acme-legal", "b" * 64, 1, "request_cold"))
        wait_until(lambda: _samples(reg)[("ace_gateway_prefetch_signals_total",
                                          (("result", "failed"), ("upstream", "gpu-0")))] == 1,
                   what="the failed prefetch counted")
        got = _samples(reg)
        assert got[("ace_gateway_prefetch_signals_total", (("result", "sent"), ("upstream", "gpu-0")))] == 0
        assert got[("ace_gateway_prefetch_signals_total", (("result", "dropped"), ("upstream", "gpu-0")))] == 0
        assert got[("ace_gateway_agent_link_up", (("upstream", "gpu-0"),))] == 0
    finally:
        link.close()


def test_store_writes_report_their_propagation(store):
    reg = CollectorRegistry()
    store.on_snapshot(propagation_histogram(reg).observe)
    store.set_key_skills(sha(KEYS["alice"]), {"multi_lora": "shadow"})
    got = _samples(reg)
    assert got[("ace_gateway_store_propagation_seconds_count", ())] == 1
    assert store.snapshot.keys[sha(KEYS["alice"])].skills["multi_lora"] == "shadow"


def test_metrics_are_served_on_their_own_port(store):
    gw = Gateway(store)
    _send(gw, KEYS["bob"], CHAT)
    server = serve_metrics(_registry(gw), "127.0.0.1:0")
    try:
        port = server.server_address[1]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'ace_gateway_requests_total{action="passthrough",adapter="",mode="prod",tenant="globex"} 1.0' in text
        with socket.socket() as other:     # a port another program holds (no SO_REUSEPORT)
            other.bind(("127.0.0.1", 0))
            other.listen()
            with pytest.raises(ConfigError, match="metrics-listen"):
                serve_metrics(_registry(gw), f"127.0.0.1:{other.getsockname()[1]}")
        successor = serve_metrics(_registry(gw), f"127.0.0.1:{port}")   # a restart binds beside it
        successor.shutdown()
        successor.server_close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("value, ok", [("127.0.0.1:9464", True), ("off", True), ("0.0.0.0:0", True),
                                       ("9464", False), ("host:port", False), ("127.0.0.1:70000", False)])
def test_metrics_listen_setting_is_validated(state_file, value, ok):
    if ok:
        assert Settings(config=state_file, metrics_listen=value).metrics_listen == value
    else:
        with pytest.raises(ConfigError, match="metrics-listen"):
            Settings(config=state_file, metrics_listen=value)


def test_epp_served_endpoints_are_counted_as_primary_fallback_or_unpicked(store):
    gw = Gateway(store)
    for served, first in [("10.0.0.1:8000", "10.0.0.1:8000"), ("10.0.0.1:8000", "10.0.0.1:8000"),
                          ("10.0.0.2:8000", "10.0.0.1:8000"), ("10.0.0.3:8000", None)]:
        gw.metrics.epp_served(served, first)
    got = {k: v for k, v in _samples(_registry(gw)).items() if k[0] == "ace_gateway_epp_served_total"}
    assert got == {("ace_gateway_epp_served_total", (("endpoint", "10.0.0.1:8000"), ("pick", "primary"))): 2,
                   ("ace_gateway_epp_served_total", (("endpoint", "10.0.0.2:8000"), ("pick", "fallback"))): 1,
                   ("ace_gateway_epp_served_total", (("endpoint", "10.0.0.3:8000"), ("pick", "unpicked"))): 1}
