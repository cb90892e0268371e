"""Host discovery: the DNS and file sources (resolver injected, plus one real lookup of
localhost), the polling loop's keep-the-last-good-set rule, applying a set to the store's
snapshot, the settings, and the 503 when no host is known."""
from __future__ import annotations

import json
import logging
import socket

import pytest

from extproc.fleet.discovery import (DiscoveryError, Endpoint, HostDiscovery, PollingSource, UpstreamTemplate,
                               dns_lookup, file_lookup, make_source, parse_discovery)
from extproc.errors import ConfigError
from extproc.app.outcomes import Continue, Reply, RequestHead
from extproc.app.context import Gateway
from extproc.settings import Settings
from extproc.state.store import Store
from tests.extproc.builders import KEYS, write_state

TEMPLATE = UpstreamTemplate(flavour="vllm", base_model="ace-tiny-llama", agent_port=50061)


class FakeDNS:
    """getaddrinfo over a mapping the test changes; a missing name fails as DNS does."""

    def __init__(self, records: dict[str, list[str]]):
        self.records = records
        self.calls = 0

    def __call__(self, name, port, type=0):
        self.calls += 1
        if name not in self.records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in self.records[name]]


def test_dns_gives_each_record_at_the_port():
    dns = FakeDNS({"ace-engine-pods": ["10.1.0.11", "10.1.0.12", "fd00::c"]})
    assert dns_lookup("ace-engine-pods", 8000, dns)() == {
        Endpoint("10.1.0.11:8000"), Endpoint("10.1.0.12:8000"), Endpoint("[fd00::c]:8000")}
    dns.records["ace-engine-pods"] = []
    assert dns_lookup("ace-engine-pods", 8000, dns)() == frozenset()     # an empty answer: no hosts
    with pytest.raises(DiscoveryError, match="cannot resolve nope"):
        dns_lookup("nope", 8000, dns)()


def test_dns_resolves_localhost_for_real():
    found = dns_lookup("localhost", 8000)()
    assert found and {ep.address for ep in found} <= {"127.0.0.1:8000", "[::1]:8000"}


def test_a_failing_lookup_keeps_the_last_set_and_logs_once(caplog):
    dns = FakeDNS({"svc": ["10.0.0.1", "10.0.0.2"]})
    source = PollingSource(dns_lookup("svc", 8000, dns), 1.0, "dns:svc")
    published = []
    source.poll(published.append)
    source.poll(published.append)                      # the same answer: nothing published
    assert published == [frozenset({Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")})]
    del dns.records["svc"]
    with caplog.at_level(logging.WARNING, logger="extproc.fleet.discovery"):
        for _ in range(3):
            source.poll(published.append)
    assert len(published) == 1 and source.current == published[0] and source.failures == 3
    assert len([r for r in caplog.records if "keeping the last 2 hosts" in r.message]) == 1
    dns.records["svc"] = ["10.0.0.2", "10.0.0.3"]
    source.poll(published.append)
    assert published[-1] == frozenset({Endpoint("10.0.0.2:8000"), Endpoint("10.0.0.3:8000")})
    dns.records["svc"] = []
    source.poll(published.append)
    assert published[-1] == frozenset()


def test_the_polling_thread_publishes_changes_and_stops(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(["127.0.0.1:9001"]))
    got = []
    source = make_source(f"file:{hosts}", interval_s=0.01).start(got.append)
    try:
        from tests.support.wait import wait_until
        wait_until(lambda: got and got[-1] == {Endpoint("127.0.0.1:9001")}, what="first set")
        hosts.write_text(json.dumps([{"address": "127.0.0.1:9002", "name": "b"}]))
        wait_until(lambda: got[-1] == {Endpoint("127.0.0.1:9002", "b")}, what="second set")
    finally:
        source.close()
    assert not source._thread.is_alive()


@pytest.mark.parametrize("text, says", [("{", "cannot read"), ('{"a": 1}', "a JSON list"), ("[5]", "not an endpoint")])
def test_a_bad_hosts_file_is_a_discovery_error(tmp_path, text, says):
    (tmp_path / "h.json").write_text(text)
    with pytest.raises(DiscoveryError, match=says):
        file_lookup(tmp_path / "h.json")()


@pytest.mark.parametrize("spec, kind, name, port, ns", [
    ("static", "static", "", 0, None),
    ("dns:ace-engine-pods:8000", "dns", "ace-engine-pods", 8000, None),
    ("dns:ace-engine-pods.ace.svc.cluster.local:8000", "dns", "ace-engine-pods.ace.svc.cluster.local", 8000, None),
    ("file:/run/hosts.json", "file", "/run/hosts.json", 0, None),
    ("inferencepool:ace/ace-engine", "inferencepool", "ace-engine", 0, "ace"),
    ("inferencepool:ace-engine", "inferencepool", "ace-engine", 0, None),
])
def test_discovery_specs(spec, kind, name, port, ns):
    parsed = parse_discovery(spec)
    assert (parsed.kind, parsed.name, parsed.port, parsed.namespace) == (kind, name, port, ns)


@pytest.mark.parametrize("spec", ["", "dns", "dns:svc", "dns:svc:http", "dns:svc:70000", "file:",
                                  "inferencepool:", "inferencepool:a/b/c", "consul:x", "static:x"])
def test_bad_discovery_specs_are_config_errors(spec):
    with pytest.raises(ConfigError, match="--discovery must be"):
        parse_discovery(spec)


def _store(tmp_path, upstreams=()) -> Store:
    return Store(write_state(tmp_path, list(upstreams)), tmp_path / "db", upstreams_required=False)


def test_applying_a_set_swaps_the_upstreams_and_the_agent_links(tmp_path):
    class Link:
        def set_agents(self, agents):
            self.agents = dict(agents)
    store, link = _store(tmp_path), Link()
    held = store.snapshot
    discovery = HostDiscovery(store, TEMPLATE, link)
    discovery.publish({Endpoint("10.1.0.12:8000", "pod-b"), Endpoint("10.1.0.11:8000", "pod-a")})
    ups = store.snapshot.upstreams
    assert [(u.name, u.address, u.agent, u.flavour, u.base_model) for u in ups] == [
        ("pod-a", "10.1.0.11:8000", "10.1.0.11:50061", "vllm", "ace-tiny-llama"),
        ("pod-b", "10.1.0.12:8000", "10.1.0.12:50061", "vllm", "ace-tiny-llama")]
    assert link.agents == {"pod-a": "10.1.0.11:50061", "pod-b": "10.1.0.12:50061"}
    assert held.upstreams == ()                        # a request in flight keeps its snapshot
    discovery.publish({Endpoint("[fd00::b]:8000")})
    [u] = store.snapshot.upstreams
    assert (u.name, u.agent) == ("[fd00::b]:8000", "[fd00::b]:50061")
    assert store.snapshot.keys == held.keys and store.snapshot.adapters == held.adapters
    # a runtime key change keeps the discovered hosts
    store.set_key_skills(next(iter(held.keys)), {"multi_lora": "off"})
    assert store.snapshot.upstreams == (u,)
    store.close()


def test_a_host_without_an_ip_is_skipped_not_fatal(tmp_path, caplog):
    store = _store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="extproc.fleet.discovery"):
        HostDiscovery(store, UpstreamTemplate(base_model="m")).publish({Endpoint("engine:8000"), Endpoint("10.0.0.1:1")})
    assert [u.address for u in store.snapshot.upstreams] == ["10.0.0.1:1"]
    assert "skipping engine:8000" in caplog.text
    store.close()


def test_no_host_known_is_a_503_in_openai_shape(tmp_path):
    store = _store(tmp_path)
    ex = Gateway(store).exchange()
    h = {":path": "/v1/chat/completions", "authorization": f"Bearer {KEYS['bob']}"}
    ex.on_request_headers(RequestHead("POST", "/v1/chat/completions", h, False))
    out = ex.on_request_body(json.dumps({"model": "code-python", "messages": []}).encode())
    assert isinstance(out, Reply) and out.status == 503
    assert json.loads(out.body)["error"] == {"message": "no engine host is available", "type": "service_unavailable",
                                             "param": None, "code": "no_upstream"}
    HostDiscovery(store, UpstreamTemplate(base_model="ace-tiny-llama")).publish({Endpoint("10.0.0.7:8000")})
    ex = Gateway(store).exchange()
    ex.on_request_headers(RequestHead("POST", "/v1/chat/completions", h, False))
    out = ex.on_request_body(json.dumps({"model": "code-python", "messages": []}).encode())
    assert isinstance(out, Continue) and dict(out.metadata)["destination"] == "10.0.0.7:8000"
    store.close()


def test_discovery_settings(tmp_path, monkeypatch):
    state = write_state(tmp_path, [])
    s = Settings.from_args(["--config", str(state)])
    assert s.discovery == "static" and not s.discovers
    monkeypatch.setenv("ACE_EXTPROC_DISCOVERY", "dns:ace-engine-pods:8000")
    monkeypatch.setenv("ACE_EXTPROC_DISCOVERY_BASE_MODEL", "qwen")
    monkeypatch.setenv("ACE_EXTPROC_DISCOVERY_AGENT_PORT", "50061")
    s = Settings.from_args(["--config", str(state), "--discovery-interval-s", "2.5", "--discovery-flavour", "sglang"])
    assert s.discovers and s.discovery_interval_s == 2.5
    assert s.upstream_template() == UpstreamTemplate("sglang", "qwen", "body", 50061)


@pytest.mark.parametrize("args, says", [
    (["--discovery", "dns:svc:8000"], "--discovery-base-model is required"),
    (["--discovery", "dns:svc:8000", "--discovery-base-model", "m", "--discovery-flavour", "tgi"], "--discovery-flavour"),
    (["--discovery", "dns:svc:8000", "--discovery-base-model", "m", "--discovery-hints", "loud"], "--discovery-hints"),
    (["--discovery", "dns:svc:8000", "--discovery-base-model", "m", "--discovery-agent-port", "70000"], "--discovery-agent-port"),
    (["--discovery", "dns:svc:8000", "--discovery-base-model", "m", "--discovery-interval-s", "0"], "--discovery-interval-s"),
    (["--discovery", "srv:x"], "--discovery must be"),
])
def test_bad_discovery_settings_are_config_errors(tmp_path, args, says):
    with pytest.raises(ConfigError, match=says):
        Settings.from_args(["--config", str(write_state(tmp_path, [])), *args])
