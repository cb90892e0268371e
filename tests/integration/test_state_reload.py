"""The state file changed under a running gateway (``python -m extproc`` behind a real
Envoy, fail-closed, in front of a recording upstream): no restart, no failed request.

- a tenant and a key added while two threads send requests, the state mounted as a
  Kubernetes ConfigMap is (``..data`` symlink swapped): every response is 200 and the new
  key works once the next poll has run (the time printed);
- bad edits (YAML that does not parse, a key of an unknown tenant) are refused: counted in
  ``ace_gateway_config_reload_errors_total``, one log line naming the field, the old keys
  still work and the bad edit's new key does not;
- SIGHUP reloads at once, with polling off;
- the endpoint picker (``--protocol epp``) reloads the same way.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ace_common.stack_dump import DUMP_MARKER
from tests.extproc.builders import KEYS, sha, upstream, write_state
from tests.support.envoy import run_envoy, run_epp_envoy
from tests.support.procs import extproc_process, free_port
from tests.support.upstream import RecordingUpstream
from tests.support.wait import wait_until

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
DAVE_KEY = "sk-dave-0004"
DAVE = {"authorization": f"Bearer {DAVE_KEY}"}
CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1.0


def edited(text: str, change) -> str:
    state = yaml.safe_load(text)
    change(state)
    return yaml.safe_dump(state, sort_keys=False)


def add_dave(state, tenant="initech") -> None:
    if tenant not in {t["id"] for t in state["tenants"]}:
        state["tenants"].append({"id": tenant})
    state["keys"].append({"name": "dave", "sha256": sha(DAVE_KEY), "tenant": tenant})


def replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def gateway(tmp: Path, state: Path, *args: str):
    with RecordingUpstream() as up:
        if state is None:
            state = write_state(tmp, [upstream("local-vllm", up.address)])
        mport = free_port()
        with extproc_process(tmp, state, metrics_port=mport, extproc_args=list(args)) as (address, proc):
            with run_envoy(tmp, extproc=address, default_upstream=up.address, message_timeout="5s") as port:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                    yield http, proc, mport, state


def configmap(tmp: Path, upstream_address: str) -> Path:
    """The kubelet's layout of a mounted ConfigMap: <name> -> ..data/<name>, ..data -> ..<ts>."""
    src = write_state(tmp / "src", [upstream("local-vllm", upstream_address)])
    mount = tmp / "config"
    first = mount / "..2026_12_01_00_00_00.1"
    first.mkdir(parents=True)
    for name in ("state.yaml", "catalog.yaml"):
        (first / name).write_bytes((src.parent / name).read_bytes())
        (mount / name).symlink_to(f"..data/{name}")
    (mount / "..data").symlink_to(first.name)
    return mount / "state.yaml"


def configmap_update(state: Path, text: str) -> None:
    mount = state.parent
    old = Path(os.readlink(mount / "..data"))
    new = mount / f"..2026_12_01_00_00_00.{int(old.name.rsplit('.', 1)[1]) + 1}"
    new.mkdir()
    (new / "catalog.yaml").write_bytes((mount / "catalog.yaml").read_bytes())
    (new / "state.yaml").write_text(text)
    (mount / "..data_tmp").symlink_to(new.name)
    os.replace(mount / "..data_tmp", mount / "..data")       # the swap: one rename


def test_a_tenant_and_key_added_under_load_through_a_configmap_swap_lose_no_request(tmp_path):
    with RecordingUpstream() as up:
        state = configmap(tmp_path, up.address)
        mport = free_port()
        with extproc_process(tmp_path, state, metrics_port=mport, extproc_args=["--config-poll-s", "1"]) as (
                address, _):
            with run_envoy(tmp_path, extproc=address, default_upstream=up.address, message_timeout="5s") as port:
                base = f"http://127.0.0.1:{port}"
                statuses: list[int] = []
                stop = threading.Event()

                def load() -> None:        # bounded: at most 3,000 requests per thread
                    with httpx.Client(base_url=base, timeout=10) as c:
                        for _ in range(3000):
                            if stop.is_set():
                                return
                            statuses.append(c.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code)

                threads = [threading.Thread(target=load) for _ in range(2)]
                for t in threads:
                    t.start()
                try:
                    with httpx.Client(base_url=base, timeout=10) as c:
                        wait_until(lambda: len(statuses) >= 20, what="the load is running")
                        assert c.post("/v1/chat/completions", json=CHAT, headers=DAVE).status_code == 401
                        t0 = time.monotonic()
                        configmap_update(state, edited(state.read_text(), add_dave))
                        wait_until(lambda: c.post("/v1/chat/completions", json=CHAT, headers=DAVE).status_code == 200,
                                   interval=0.02, what="the new key works")
                        print(f"new key accepted {(time.monotonic() - t0) * 1000:.0f} ms after the ConfigMap swap "
                              f"(--config-poll-s 1)")
                        assert any(q.headers.get("x-ace-tenant-id") == "initech" for q in list(up.requests))
                        seen = len(statuses)
                        wait_until(lambda: len(statuses) >= seen + 20, what="the load goes on after the reload")
                finally:
                    stop.set()
                    for t in threads:
                        t.join()
                assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
                print(f"{len(statuses)} requests during the reload, all 200")
                assert metric(mport, "ace_gateway_config_reloads_total") == 1
                assert metric(mport, "ace_gateway_config_reload_errors_total") == 0


def test_bad_edits_are_refused_counted_logged_once_and_the_old_keys_still_work(tmp_path):
    with gateway(tmp_path, None, "--config-poll-s", "0.2") as (http, proc, mport, state):
        good = state.read_text()
        assert metric(mport, "ace_gateway_config_reload_errors_total") == 0
        replace_file(state, "tenants: [\n  - {id: acme\n")                   # does not parse
        wait_until(lambda: metric(mport, "ace_gateway_config_reload_errors_total") == 1,
                   what="the broken YAML is counted")
        assert http.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200
        # dave added, but also a key of a tenant that does not exist: none of it applies
        bad = edited(good, lambda s: (add_dave(s), s["keys"].append(
            {"name": "eve", "sha256": "e" * 64, "tenant": "nobody"})))
        replace_file(state, bad)
        wait_until(lambda: metric(mport, "ace_gateway_config_reload_errors_total") == 2,
                   what="the unknown tenant is counted")
        r = http.post("/v1/chat/completions", json=CHAT, headers=DAVE)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200
        assert metric(mport, "ace_gateway_config_reloads_total") == 0
        refused = [line for line in (tmp_path / "extproc.log").read_text().splitlines() if "reload refused" in line]
        assert len(refused) == 2, refused
        assert "cannot read it" in refused[0] and "keys[4].tenant: unknown tenant nobody" in refused[1]
        assert proc.poll() is None
        replace_file(state, edited(good, add_dave))                          # the fix
        wait_until(lambda: http.post("/v1/chat/completions", json=CHAT, headers=DAVE).status_code == 200,
                   what="the fixed file is applied")
        assert metric(mport, "ace_gateway_config_reloads_total") == 1


def test_sighup_reloads_at_once_with_polling_off(tmp_path):
    with gateway(tmp_path, None, "--config-poll-s", "0") as (http, proc, mport, state):
        loaded = metric(mport, "ace_gateway_config_last_reload_timestamp_seconds")
        state.write_text(edited(state.read_text(), add_dave))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: http.post("/v1/chat/completions", json=CHAT, headers=DAVE).status_code == 200,
                   what="SIGHUP applied the new key")
        assert proc.poll() is None
        assert metric(mport, "ace_gateway_config_reloads_total") == 1
        assert metric(mport, "ace_gateway_config_last_reload_timestamp_seconds") > loaded


def test_the_endpoint_picker_reloads_too(tmp_path):
    with RecordingUpstream() as up:
        state = write_state(tmp_path, [upstream("one", up.address)])
        with extproc_process(tmp_path, state, extproc_args=["--protocol", "epp", "--config-poll-s", "0.2"]) as (
                address, _):
            with run_epp_envoy(tmp_path, extproc=address) as port:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                    assert http.post("/v1/chat/completions", json=CHAT, headers=DAVE).status_code == 401
                    replace_file(state, edited(state.read_text(), add_dave))
                    wait_until(lambda: http.post("/v1/chat/completions", json=CHAT,
                                                 headers=DAVE).status_code == 200, what="the picker applies the key")
                    assert up.requests[-1].headers["x-ace-tenant-id"] == "initech"


def test_sigusr1_dumps_every_threads_stack_and_the_gateway_keeps_serving(tmp_path):
    """``kill -USR1`` (ace_common.stack_dump) writes each thread's stack to the ext_proc's
    log, neither reloading nor stopping it: requests keep their answers."""
    with gateway(tmp_path, None, "--config-poll-s", "0") as (http, proc, mport, state):
        log = tmp_path / "extproc.log"
        assert http.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200
        before = len(log.read_text())
        proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: "Current thread" in log.read_text()[before:], what="the stack dump in the log")
        assert DUMP_MARKER in log.read_text()[before:]
        assert proc.poll() is None
        assert http.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200
        assert metric(mport, "ace_gateway_config_reloads_total") == 0


def test_a_stack_that_fails_asks_its_ext_proc_for_every_threads_stack_before_stopping_it(tmp_path):
    """``tools.localstack.running(dump_stacks_on_error=True)``, as the benches and the demo
    start ace's servers: an error in the block (a bench's request that timed out) leaves
    the ext_proc's stacks in its log, then the process is stopped as usual."""
    with RecordingUpstream() as up:
        state = write_state(tmp_path, [upstream("one", up.address)])
        with pytest.raises(RuntimeError, match="the block broke"):
            with extproc_process(tmp_path, state) as (_, proc):
                raise RuntimeError("the block broke")
        assert proc.poll() is not None
        log = (tmp_path / "extproc.log").read_text()
        assert "Current thread" in log and DUMP_MARKER in log
        with extproc_process(tmp_path, state) as (_, proc):   # a block that ends well: no dump
            pass
        assert proc.poll() is not None and DUMP_MARKER not in (tmp_path / "extproc.log").read_text()
