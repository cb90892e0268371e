"""A real PostgreSQL for the tests (``tools.postgres``): skipped with a reason when the
server binaries are absent, except in CI (``CI=true``), where that fails loudly."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest

from tools.postgres import PostgresServer, find_bin_dir, postgres_server

__all__ = ["PostgresServer", "real_postgres", "require_postgres"]


def require_postgres() -> Path:
    """The server binaries' dir and psycopg, or skip (fail in CI) saying what is missing."""
    pytest.importorskip("psycopg", reason="psycopg is in the 'postgres' and 'dev' extras")
    bin_dir = find_bin_dir()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql-15)")
    return bin_dir


@contextlib.contextmanager
def real_postgres() -> Iterator[PostgresServer]:
    with postgres_server(require_postgres()) as server:
        yield server
