"""The state file read again without a restart (extproc.state.file_watch, Store.reload_file):
a real Store on SQLite, one poll at a time (``check``), so each step is deterministic. The
same through the real process and Envoy, under load and on SIGHUP:
tests/integration/test_state_reload.py."""
from __future__ import annotations

import logging
import os
import time

import pytest
import yaml

from extproc.domain.auth import authenticate
from extproc.errors import Unauthorized
from extproc.domain.key_lifecycle import issue
from extproc.state.file_watch import StateFileWatch
from extproc.state.store import Store
from tests.extproc.builders import KEYS, sha, upstream, write_state

DAVE = "sk-dave-0004"


def _edit(path, change) -> None:
    """Change the state file as an editor that renames over it does (atomic)."""
    state = yaml.safe_load(path.read_text())
    change(state)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(state, sort_keys=False))
    os.replace(tmp, path)


def _add_dave(state, tenant="acme") -> None:
    state["keys"].append({"name": "dave", "sha256": sha(DAVE), "tenant": tenant})


def _ok(store, key) -> str:
    return authenticate(store.snapshot, f"Bearer {key}", None).tenant.id


@pytest.fixture
def watched(tmp_path, state_file):
    store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    yield store, StateFileWatch(store, poll_s=0)
    store.close()


def test_an_added_key_and_tenant_authenticate_after_the_next_poll(watched, state_file):
    store, watch = watched
    assert watch.check() is None                           # nothing changed: nothing done
    _edit(state_file, lambda s: (s["tenants"].append({"id": "initech"}), _add_dave(s, "initech")))
    with pytest.raises(Unauthorized):
        _ok(store, DAVE)                                   # not before the poll
    assert watch.check() is True
    assert _ok(store, DAVE) == "initech" and _ok(store, KEYS["alice"]) == "acme"
    assert (watch.reloads, watch.errors) == (1, 0)
    assert watch.check() is None


@pytest.mark.parametrize("bad, field", [
    ("keys: [\n  - {name: x\n", "cannot read it"),                               # YAML that does not parse
    ({"keys": [{"name": "x", "sha256": "0" * 64, "tenant": "nobody"}]}, "keys[4].tenant"),
    ({"upstreams": [{"name": "u", "address": "not-an-ip:1", "flavour": "vllm",
                     "base_model": "ace-tiny-llama"}]}, "upstreams[0].address"),
    ({"tenants": [{"id": "acme", "default_adapter": "gone"}]}, "tenants[0].default_adapter"),
    ({"limits": {"max_body_bytes": "big"}}, "limits.max_body_bytes"),
    ({"keyz": []}, "keyz"),
])
def test_a_bad_edit_is_refused_whole_counted_and_logged_once_naming_the_field(watched, state_file, caplog,
                                                                             bad, field):
    store, watch = watched
    before = store.snapshot
    if isinstance(bad, str):
        state_file.write_text(bad)
    else:      # dave added AND a bad field: nothing of it may apply (no half-applied keys list)
        _edit(state_file, lambda s: (_add_dave(s), s.__setitem__("keys", s["keys"] + bad["keys"])
                                     if "keys" in bad else s.update(bad)))
    with caplog.at_level(logging.INFO, logger="extproc.state.file_watch"):
        assert watch.check() is False
        assert watch.check() is None                       # the same bad file is not reported again
    assert store.snapshot is before
    assert (watch.reloads, watch.errors) == (0, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and field in lines[0], lines
    assert "state.yaml" in lines[0] and "last good state" in lines[0]
    with pytest.raises(Unauthorized):
        _ok(store, DAVE)
    assert _ok(store, KEYS["alice"]) == "acme" and _ok(store, KEYS["bob"]) == "globex"


def test_the_fix_after_a_bad_edit_is_applied(watched, state_file):
    store, watch = watched
    good = state_file.read_text()
    state_file.write_text("tenants: [")
    assert watch.check() is False
    state_file.write_text(good)
    _edit(state_file, _add_dave)
    assert watch.check() is True and _ok(store, DAVE) == "acme"
    assert (watch.reloads, watch.errors) == (1, 1)


def test_a_configmap_symlink_swap_is_seen_even_with_the_same_mtime_and_size(tmp_path):
    """The kubelet's layout: state.yaml -> ..data/state.yaml, ..data -> ..<timestamp>/; an
    update writes a new directory and renames a new ..data symlink over the old one."""
    mount = tmp_path / "mount"
    v1 = mount / "..2026_01_01_00_00_00.1"
    src = write_state(tmp_path / "src", [upstream()])
    v1.mkdir(parents=True)
    for name in ("state.yaml", "catalog.yaml"):
        (v1 / name).write_bytes((src.parent / name).read_bytes())
        (mount / name).symlink_to(f"..data/{name}")
    (mount / "..data").symlink_to(v1.name)
    store = Store(mount / "state.yaml", tmp_path / "gw.sqlite3", watch=False)
    watch = StateFileWatch(store, poll_s=0)
    try:
        v2 = mount / "..2026_01_01_00_01_00.2"
        v2.mkdir()
        (v2 / "catalog.yaml").write_bytes((v1 / "catalog.yaml").read_bytes())
        # carol's key becomes dave's: the same length, so the same size; and the same mtime
        text = (v1 / "state.yaml").read_text().replace(sha(KEYS["carol"]), sha(DAVE))
        (v2 / "state.yaml").write_text(text)
        st = os.stat(v1 / "state.yaml")
        os.utime(v2 / "state.yaml", ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(v2 / "state.yaml").st_size == st.st_size
        (mount / "..data_tmp").symlink_to(v2.name)
        os.replace(mount / "..data_tmp", mount / "..data")
        assert watch.check() is True
        assert _ok(store, DAVE) == "acme"
        with pytest.raises(Unauthorized):
            _ok(store, KEYS["carol"])
    finally:
        store.close()


def test_an_included_catalog_change_is_seen(watched, state_file):
    store, watch = watched
    catalog = state_file.parent / "catalog.yaml"
    data = yaml.safe_load(catalog.read_text())
    data["adapters"].append({**data["adapters"][0], "name": "code-rust"})
    catalog.write_text(yaml.safe_dump(data))
    assert watch.check() is True and "code-rust" in store.snapshot.adapters


def test_a_runtime_key_of_a_tenant_removed_from_the_file_stops_working(watched, state_file):
    store, watch = watched
    secret, key = issue("globex", "ci", "developer", None, time.time())
    store.add_key(key)
    assert _ok(store, secret) == "globex"
    _edit(state_file, lambda s: (s.__setitem__("tenants", [t for t in s["tenants"] if t["id"] != "globex"]),
                                 s.__setitem__("keys", [k for k in s["keys"] if k["tenant"] != "globex"])))
    assert watch.check() is True
    with pytest.raises(Unauthorized):
        _ok(store, secret)


def test_sighup_wake_reloads_without_a_change_and_the_thread_polls(tmp_path, state_file):
    store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    watch = StateFileWatch(store, poll_s=0).start()        # no polling: only wake() reloads
    try:
        watch.wake()
        from tests.support.wait import wait_until
        wait_until(lambda: watch.reloads == 1, what="wake() reloads")
    finally:
        watch.close()
        store.close()
