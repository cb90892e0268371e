"""InferencePool discovery's pure core on a recorded watch stream (no API server).

tests/extproc/fixtures/inferencepool_watch.json holds the events of one pool and its
Pods in the API server's JSON shape, with the Pod lists the watcher makes in between;
each step's expected endpoints are written here, next to what the step does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.fleet.discovery import DiscoveryError, Endpoint
from extproc.fleet.inferencepool import PoolState, WatchExpired, pod_endpoints, pool_spec

STREAM = json.loads((Path(__file__).parent / "fixtures" / "inferencepool_watch.json").read_text())["steps"]

A, B, C, D = (f"ace-engine-7d9f8c6b5-{x * 5}" for x in "abcd")
# After each step of the stream: the endpoints (address -> upstream name), or "relist".
EXPECTED = [
    {},                                                   # pool ADDED: no Pods known yet
    {"10.1.0.11:8000": A},                                # list: a ready, b not ready
    {"10.1.0.11:8000": A},                                # c ADDED, Pending, no IP
    {"10.1.0.11:8000": A},                                # c has an IP, not Ready
    {"10.1.0.11:8000": A, "10.1.0.13:8000": C},           # c Ready
    {"10.1.0.11:8000": A, "10.1.0.13:8000": C},           # BOOKMARK
    {"10.1.0.11:8000": A, "10.1.0.12:8000": B, "10.1.0.13:8000": C},   # b Ready
    {"10.1.0.12:8000": B, "10.1.0.13:8000": C},           # a not Ready
    {"10.1.0.11:8000": A, "10.1.0.12:8000": B, "10.1.0.13:8000": C},   # a Ready again
    {"10.1.0.12:8000": B, "10.1.0.13:8000": C},           # a terminating (deletionTimestamp)
    {"10.1.0.12:8000": B, "10.1.0.13:8000": C},           # a DELETED
    "relist",                                             # ERROR 410 Gone
    {"10.1.0.12:8000": B, "10.1.0.14:8000": D},           # the relist: c gone meanwhile, d new
    {"10.1.0.12:8000": f"{B}:8000", "10.1.0.12:8001": f"{B}:8001",     # two target ports
     "10.1.0.14:8000": f"{D}:8000", "10.1.0.14:8001": f"{D}:8001"},
    {},                                                   # selector now needs track=canary
    {"10.1.0.15:8000": "ace-engine-canary-eeeee"},        # the list with the new selector
    {},                                                   # pool DELETED
]


def replay(state: PoolState, step: dict):
    """One step: the endpoints after it, "relist" for a 410, and whether the selector changed."""
    if "list" in step:
        return state.relist(step["list"]["items"], step["list"]["metadata"]["resourceVersion"]), False
    if step["watch"] == "pool":
        changed = state.apply_pool(step["event"])
        return state.endpoints, changed
    try:
        return state.apply_pod(step["event"]), False
    except WatchExpired:
        return "relist", False


def as_dict(endpoints) -> dict[str, str]:
    return {ep.address: ep.upstream_name for ep in endpoints}


def test_the_recorded_stream_gives_the_ready_pods_times_the_target_ports():
    assert len(STREAM) == len(EXPECTED)
    state = PoolState()
    selector_changes = []
    for i, (step, expected) in enumerate(zip(STREAM, EXPECTED)):
        got, changed = replay(state, step)
        if changed:
            selector_changes.append(i)
        assert (got if got == "relist" else as_dict(got)) == expected, f"step {i}: {step.get('event', {}).get('type', 'list')}"
    # the pool's first spec, the new selector and the deletion restart the Pod watch;
    # a new target port does not (same Pods)
    assert selector_changes == [0, 14, 16]


def test_resource_versions_follow_the_stream_for_resuming_the_watch():
    state = PoolState()
    for step in STREAM[:6]:
        replay(state, step)
    assert state.pod_version == STREAM[5]["event"]["object"]["metadata"]["resourceVersion"]   # the bookmark's
    replay(state, STREAM[12])
    assert state.pod_version == STREAM[12]["list"]["metadata"]["resourceVersion"]
    assert state.pool_version == STREAM[0]["event"]["object"]["metadata"]["resourceVersion"]


def test_a_pod_that_stops_matching_the_selector_leaves():
    state = PoolState()
    replay(state, STREAM[0])
    replay(state, STREAM[1])
    pod = json.loads(json.dumps(STREAM[1]["list"]["items"][0]))
    pod["metadata"]["labels"] = {"app.kubernetes.io/name": "debug"}
    assert state.apply_pod({"type": "MODIFIED", "object": pod}) == frozenset()


def test_the_kubernetes_clients_event_shape_reads_raw_object():
    """kubernetes.watch.Watch yields {"type", "object": <model>, "raw_object": <dict>}."""
    state = PoolState()
    replay(state, STREAM[0])
    pod = STREAM[1]["list"]["items"][0]
    assert state.apply_pod({"type": "ADDED", "object": object(), "raw_object": pod}) == \
        frozenset({Endpoint("10.1.0.11:8000", A)})


def test_other_watch_errors_and_unknown_events_are_errors_not_silence():
    state = PoolState()
    with pytest.raises(DiscoveryError, match="watch error 500"):
        state.apply_pod({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "boom"}})
    with pytest.raises(DiscoveryError, match="unknown watch event"):
        state.apply_pod({"type": "SNAPSHOT", "object": {}})


def test_ipv6_pods_are_bracketed_and_a_malformed_pool_serves_nothing():
    spec = pool_spec(STREAM[0]["event"]["object"])
    pod = json.loads(json.dumps(STREAM[1]["list"]["items"][0]))
    pod["status"]["podIP"] = "fd00::b"
    assert pod_endpoints(pod, spec) == (Endpoint("[fd00::b]:8000", A),)
    with pytest.raises(DiscoveryError, match="targetPorts"):
        pool_spec({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}})
    state = PoolState()
    replay(state, STREAM[0])
    replay(state, STREAM[1])
    assert state.apply_pool({"type": "MODIFIED", "object": {"metadata": {}, "spec": {}}}) is True
    assert state.endpoints == frozenset()


def test_no_kubernetes_api_config_is_a_config_error(tmp_path, monkeypatch):
    from extproc.errors import ConfigError
    from extproc.fleet.inferencepool import InferencePoolSource
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no Kubernetes API config"):
        InferencePoolSource("ace-engine", "ace").start(lambda endpoints: None)
