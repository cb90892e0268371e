"""Where the gateway's runtime changes live: SQLite (one node, the default) or PostgreSQL
(several replicas sharing them).

A runtime change is a developer key's skills (``POST /api/v1/dev_key/skills``), a
tenant's default skills (``POST /api/v1/tenant/skills``, a tenant admin's key), a key
issued (``python -m extproc.admin create-key`` or ``rotate-key``, ``POST
/api/v1/tenant/keys``: only its SHA-256 is stored) or a key revocation (``python -m
extproc.admin revoke-key``). Both backends keep the same five tables and one version
counter that every write increments in the write's own transaction; ``read`` returns an
``Overlay``, the tables at one version.

PostgreSQL: every write also sends ``NOTIFY ace_state, '<version>'`` in that transaction.
``watch`` (a background thread of ``extproc.state.store.Store``) LISTENs on a dedicated
connection, re-reads on a notification and, as a fallback for a missed one, compares the
version every ``poll_s``; it reconnects with backoff and resyncs after an outage.
SQLite: ``watch`` compares the version every ``poll_s`` (another process, such as the
admin CLI, may have written the file).

A write either commits or raises ``StoreUnavailable`` (503): it is never dropped silently.
Writes are idempotent (a merge, a revocation), so a client may retry one whose answer it
did not get.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from extproc.errors import StoreUnavailable

__all__ = ["IssuedKey", "Overlay", "PostgresStateDB", "SQLiteStateDB", "StateDB", "is_postgres_url", "open_state_db"]

log = logging.getLogger(__name__)
CHANNEL = "ace_state"
WATCH_APP = "ace-state-watch"    # application_name of the LISTEN connections (pg_stat_activity)


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key issued at runtime: its SHA-256 only, never the secret."""

    sha256: str
    tenant: str
    name: str
    role: str
    created_at: float                  # epoch s
    expires_at: float | None = None    # epoch s; None: never
    skills: Mapping[str, str] = field(default_factory=dict)   # a rotated key's, carried over


@dataclass(frozen=True, slots=True)
class Overlay:
    """The runtime changes at one version."""

    version: int = 0
    key_skills: Mapping[str, Mapping[str, str]] = field(default_factory=dict)   # sha256 -> skills
    revoked: frozenset[str] = frozenset()                                       # sha256 of revoked keys
    changed_at: float = 0.0    # wall time (epoch s) of the write that made this version; 0: unknown
    tenant_skills: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # tenant id -> skills
    keys: Mapping[str, IssuedKey] = field(default_factory=dict)                  # sha256 -> issued key


class StateDB(Protocol):
    def read(self) -> Overlay: ...
    def set_key_skills(self, key_sha256: str, skills: Mapping[str, str | None]) -> Overlay: ...
    def set_revoked(self, key_sha256: str, revoked: bool) -> Overlay: ...
    def set_tenant_skills(self, tenant: str, skills: Mapping[str, str | None]) -> Overlay: ...
    def add_key(self, key: IssuedKey, revoke: str | None = None) -> Overlay: ...
    def watch(self, apply: Callable[[Overlay], None], current: Callable[[], int],
              stop: threading.Event, poll_s: float) -> None: ...
    def close(self) -> None: ...


def is_postgres_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def open_state_db(target: str | Path) -> StateDB:
    """``postgresql://...`` -> PostgreSQL; anything else is a SQLite file path."""
    return PostgresStateDB(target) if is_postgres_url(target) else SQLiteStateDB(Path(target))


class SQLiteStateDB:
    """The embedded default: one file, one node (``dev_key_skills`` is the table name of
    the earlier releases, so their files keep working)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS dev_key_skills ("
                             " key_sha256 TEXT PRIMARY KEY, skills TEXT NOT NULL, updated_at REAL NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS revoked_keys ("
                             " key_sha256 TEXT PRIMARY KEY, revoked_at REAL NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS tenant_skills ("
                             " tenant TEXT PRIMARY KEY, skills TEXT NOT NULL, updated_at REAL NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS api_keys ("
                             " key_sha256 TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL,"
                             " role TEXT NOT NULL, skills TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS state_version ("
                             " id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO state_version (id, version) VALUES (1, 0)")
            if "changed_at" not in {row[1] for row in self._db.execute("PRAGMA table_info(state_version)")}:
                self._db.execute("ALTER TABLE state_version ADD COLUMN changed_at REAL NOT NULL DEFAULT 0")

    def _read(self) -> Overlay:
        version, changed_at = self._db.execute("SELECT version, changed_at FROM state_version").fetchone()
        skills = {k: json.loads(v) for k, v in self._db.execute("SELECT key_sha256, skills FROM dev_key_skills")}
        revoked = frozenset(k for (k,) in self._db.execute("SELECT key_sha256 FROM revoked_keys"))
        tenants = {t: json.loads(v) for t, v in self._db.execute("SELECT tenant, skills FROM tenant_skills")}
        keys = {row[0]: _issued(*row[:4], json.loads(row[4]), *row[5:]) for row in self._db.execute(
            f"SELECT {_KEY_COLUMNS} FROM api_keys")}
        return Overlay(version, skills, revoked, float(changed_at), tenants, keys)

    def read(self) -> Overlay:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                return self._read()
            finally:
                self._db.execute("COMMIT")

    def _write(self, change: Callable[[], None]) -> Overlay:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:    # locked by another writer past the timeout
                raise StoreUnavailable(f"state database busy: {exc}") from exc
            try:
                change()
                self._db.execute("UPDATE state_version SET version = version + 1, changed_at = ?", (time.time(),))
                overlay = self._read()
                self._db.execute("COMMIT")
                return overlay
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def set_key_skills(self, key_sha256: str, skills: Mapping[str, str | None]) -> Overlay:
        return self._merge_skills("dev_key_skills", "key_sha256", key_sha256, skills)

    def set_tenant_skills(self, tenant: str, skills: Mapping[str, str | None]) -> Overlay:
        return self._merge_skills("tenant_skills", "tenant", tenant, skills)

    def _merge_skills(self, table: str, column: str, row_id: str, skills: Mapping[str, str | None]) -> Overlay:
        """``skills`` merged over the row's (``table``/``column``: this module's constants)."""
        def change() -> None:
            row = self._db.execute(f"SELECT skills FROM {table} WHERE {column}=?", (row_id,)).fetchone()
            merged = {k: v for k, v in {**(json.loads(row[0]) if row else {}), **skills}.items()
                      if v is not None}   # None: that skill's runtime setting removed
            self._db.execute(f"INSERT OR REPLACE INTO {table} VALUES (?, ?, ?)",
                             (row_id, json.dumps(merged, sort_keys=True), time.time()))
        return self._write(change)

    def set_revoked(self, key_sha256: str, revoked: bool) -> Overlay:
        def change() -> None:
            if revoked:
                self._db.execute("INSERT OR IGNORE INTO revoked_keys VALUES (?, ?)", (key_sha256, time.time()))
            else:
                self._db.execute("DELETE FROM revoked_keys WHERE key_sha256=?", (key_sha256,))
        return self._write(change)

    def add_key(self, key: IssuedKey, revoke: str | None = None) -> Overlay:
        """Store an issued key and, in the same transaction, revoke ``revoke`` (a rotation)."""
        def change() -> None:
            self._db.execute(f"INSERT INTO api_keys ({_KEY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (key.sha256, key.tenant, key.name, key.role, json.dumps(dict(key.skills)),
                              key.created_at, key.expires_at))
            if revoke is not None:
                self._db.execute("INSERT OR IGNORE INTO revoked_keys VALUES (?, ?)", (revoke, time.time()))
        return self._write(change)

    def watch(self, apply, current, stop: threading.Event, poll_s: float) -> None:
        while not stop.wait(poll_s):
            try:
                with self._lock:
                    (version,) = self._db.execute("SELECT version FROM state_version").fetchone()
                if version != current():
                    apply(self.read())
            except sqlite3.Error:
                log.exception("state database: version check failed")

    def close(self) -> None:
        with self._lock:
            self._db.close()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS ace_dev_key_skills (
  key_sha256 text PRIMARY KEY, skills jsonb NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS ace_revoked_keys (
  key_sha256 text PRIMARY KEY, revoked_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS ace_tenant_skills (
  tenant text PRIMARY KEY, skills jsonb NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS ace_api_keys (
  key_sha256 text PRIMARY KEY, tenant text NOT NULL, name text NOT NULL, role text NOT NULL,
  skills jsonb NOT NULL, created_at double precision NOT NULL, expires_at double precision);
CREATE TABLE IF NOT EXISTS ace_state_version (
  id int PRIMARY KEY CHECK (id = 1), version bigint NOT NULL);
INSERT INTO ace_state_version (id, version) VALUES (1, 0) ON CONFLICT DO NOTHING;
ALTER TABLE ace_state_version ADD COLUMN IF NOT EXISTS changed_at double precision NOT NULL DEFAULT 0;
"""
_SCHEMA_LOCK = 0x616365          # pg_advisory_xact_lock: replicas starting together create it once


class PostgresStateDB:
    """Several gateway replicas on one PostgreSQL. Every write opens its own short
    connection (writes are rare; a fresh connection needs no health check after an
    outage); ``watch`` holds the one long-lived connection, for LISTEN."""

    def __init__(self, url: str, connect_timeout_s: float = 2.0) -> None:
        try:
            import psycopg
        except ImportError as exc:      # pragma: no cover - the 'postgres' extra
            raise StoreUnavailable("PostgreSQL state needs psycopg: pip install 'ace[postgres]'") from exc
        self._psycopg = psycopg
        self.url = url
        self._timeout = max(1, round(connect_timeout_s))
        with self._connect() as conn:
            try:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    conn.execute(_PG_SCHEMA)
            except psycopg.Error as exc:      # e.g. a role without CREATE on the schema
                raise StoreUnavailable(f"creating the state tables failed: {_first_line(exc)}") from exc

    def _connect(self, **kw):
        try:
            # a statement waiting on a lock gives up too: a write answers 503, never hangs
            return self._psycopg.connect(self.url, connect_timeout=self._timeout,
                                         options="-c statement_timeout=5000", **kw)
        except self._psycopg.Error as exc:
            raise StoreUnavailable(f"state database unreachable: {_first_line(exc)}") from exc

    @staticmethod
    def _read(conn) -> Overlay:
        version, changed_at = conn.execute("SELECT version, changed_at FROM ace_state_version").fetchone()
        skills = dict(conn.execute("SELECT key_sha256, skills FROM ace_dev_key_skills").fetchall())
        revoked = frozenset(k for (k,) in conn.execute("SELECT key_sha256 FROM ace_revoked_keys"))
        tenants = dict(conn.execute("SELECT tenant, skills FROM ace_tenant_skills").fetchall())
        keys = {row[0]: _issued(*row) for row in conn.execute(f"SELECT {_KEY_COLUMNS} FROM ace_api_keys")}
        return Overlay(int(version), skills, revoked, float(changed_at), tenants, keys)

    def _snapshot_read(self, conn) -> Overlay:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            return self._read(conn)

    def read(self) -> Overlay:
        with self._connect(autocommit=True) as conn:
            try:
                return self._snapshot_read(conn)
            except self._psycopg.Error as exc:
                raise StoreUnavailable(f"state database read failed: {_first_line(exc)}") from exc

    def _write(self, sql: str, params: tuple | dict, *more: tuple[str, tuple | dict]) -> Overlay:
        """``sql`` (and ``more`` statements) in one transaction with the version bump."""
        with self._connect() as conn:
            try:
                with conn.transaction():
                    for statement, values in ((sql, params), *more):
                        conn.execute(statement, values)
                    # the version row's lock orders concurrent writers: the read below sees
                    # every write up to ours, and NOTIFY goes out when the transaction commits
                    (version,) = conn.execute(
                        "UPDATE ace_state_version SET version = version + 1, "
                        "changed_at = extract(epoch from clock_timestamp()) RETURNING version").fetchone()
                    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(version)))
                    return self._read(conn)
            except self._psycopg.Error as exc:   # rolled back, or the commit's outcome unknown: retry
                raise StoreUnavailable(f"state database write failed: {_first_line(exc)}") from exc

    def set_key_skills(self, key_sha256: str, skills: Mapping[str, str | None]) -> Overlay:
        return self._merge_skills("ace_dev_key_skills", "key_sha256", key_sha256, skills)

    def set_tenant_skills(self, tenant: str, skills: Mapping[str, str | None]) -> Overlay:
        return self._merge_skills("ace_tenant_skills", "tenant", tenant, skills)

    def _merge_skills(self, table: str, column: str, row_id: str, skills: Mapping[str, str | None]) -> Overlay:
        """``skills`` merged over the row's, a null removing that skill (``table``/``column``:
        this module's constants)."""
        return self._write(
            f"INSERT INTO {table} ({column}, skills) VALUES (%(id)s, jsonb_strip_nulls(%(skills)s::jsonb)) "
            f"ON CONFLICT ({column}) DO UPDATE SET skills = jsonb_strip_nulls({table}.skills || %(skills)s::jsonb), "
            "updated_at = now()", {"id": row_id, "skills": json.dumps(dict(skills))})

    def set_revoked(self, key_sha256: str, revoked: bool) -> Overlay:
        if revoked:
            return self._write("INSERT INTO ace_revoked_keys (key_sha256) VALUES (%s) ON CONFLICT DO NOTHING",
                               (key_sha256,))
        return self._write("DELETE FROM ace_revoked_keys WHERE key_sha256 = %s", (key_sha256,))

    def add_key(self, key: IssuedKey, revoke: str | None = None) -> Overlay:
        """Store an issued key and, in the same transaction, revoke ``revoke`` (a rotation)."""
        more = () if revoke is None else (
            ("INSERT INTO ace_revoked_keys (key_sha256) VALUES (%s) ON CONFLICT DO NOTHING", (revoke,)),)
        return self._write(f"INSERT INTO ace_api_keys ({_KEY_COLUMNS}) VALUES (%s, %s, %s, %s, %s::jsonb, %s, %s)",
                           (key.sha256, key.tenant, key.name, key.role, json.dumps(dict(key.skills)),
                            key.created_at, key.expires_at), *more)

    def watch(self, apply, current, stop: threading.Event, poll_s: float) -> None:
        backoff = 0.1
        while not stop.is_set():
            try:
                with self._connect(autocommit=True, application_name=WATCH_APP) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    apply(self._snapshot_read(conn))     # resync: what changed while we were away
                    if backoff > 0.1:
                        log.warning("state database: reconnected, snapshot at version %d", current())
                    backoff = 0.1
                    polled = time.monotonic()
                    while not stop.is_set():
                        # short slices so close() is prompt; poll_s is the fallback's period
                        notified = any(True for _ in conn.notifies(timeout=0.2, stop_after=1))
                        if notified or time.monotonic() - polled >= poll_s:
                            polled = time.monotonic()
                            (version,) = conn.execute("SELECT version FROM ace_state_version").fetchone()
                            if version != current():
                                apply(self._snapshot_read(conn))
            except (StoreUnavailable, self._psycopg.Error) as exc:
                if backoff == 0.1:
                    log.warning("state database: %s; serving the last snapshot (version %d), reconnecting",
                                _first_line(exc), current())
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def close(self) -> None:
        pass


_KEY_COLUMNS = "key_sha256, tenant, name, role, skills, created_at, expires_at"


def _issued(sha256: str, tenant: str, name: str, role: str, skills: Mapping[str, str], created_at: float,
            expires_at: float | None) -> IssuedKey:
    return IssuedKey(sha256, tenant, name, role, float(created_at),
                     None if expires_at is None else float(expires_at), dict(skills))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
