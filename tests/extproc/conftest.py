from __future__ import annotations

import pytest

from extproc.state.store import Store
from tests.extproc.builders import upstream, write_state


@pytest.fixture
def state_file(tmp_path):
    return write_state(tmp_path, [upstream("local-vllm", "127.0.0.1:8000", "vllm", "body")])


@pytest.fixture
def store(tmp_path, state_file):
    s = Store(state_file, tmp_path / "gw.sqlite3")
    yield s
    s.close()


@pytest.fixture
def snapshot(store):
    return store.snapshot
