"""A real PostgreSQL for the tests (``tools.postgres``): skipped with a reason when the
server binaries are absent, except in CI (``CI=true``), where that fails loudly."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest

from tools.postgres import PostgresServer, find_bin_dir, postgres_server

__all__ = ["PostgresServer", "real_postgres"]


@contextlib.contextmanager
def real_postgres() -> Iterator[PostgresServer]:
    pytest.importorskip("psycopg", reason="psycopg is in the 'postgres' and 'dev' extras")
    bin_dir = find_bin_dir()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql-15)")
    with postgres_server(bin_dir) as server:
        yield server
