"""Gateway state: a YAML file (GitOps) plus an embedded SQLite database for runtime changes.

The YAML file is the source of truth for adapters, tenants, keys and upstreams; it is
read at start-up. Changes made at runtime (a developer key's skills, set through
``POST /api/v1/dev_key/skills``) are written to SQLite and overlay the file's values, so
they survive a restart. Every change builds a new immutable ``Snapshot`` and swaps one
reference: the request path only ever reads ``Store.snapshot``.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from extproc.catalog import Adapter, DevKey, Tenant, Upstream
from extproc.errors import ConfigError, GatewayError
from extproc.skills import validate_skills

__all__ = ["Snapshot", "Store", "load_state_file"]

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Snapshot:
    adapters: Mapping[str, Adapter]
    base_models: frozenset[str]
    tenants: Mapping[str, Tenant]
    keys: Mapping[str, DevKey]          # sha256(plaintext key) -> key
    upstreams: tuple[Upstream, ...]
    default_skills: Mapping[str, str]
    max_body_bytes: int


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def _skills(raw: Any, where: str) -> Mapping[str, str]:
    try:
        return validate_skills(raw or {}, where)
    except GatewayError as exc:
        raise ConfigError(f"{where}: {exc.message}") from exc


def load_state_file(path: Path, catalog: Path | None = None) -> dict[str, Any]:
    """Read the state file and its catalog(s) into plain values (validated)."""
    data = _read_yaml(path)
    adapters_raw: list[Any] = []
    base_models: set[str] = set()
    includes = data.get("include") or []
    if isinstance(includes, str):
        includes = [includes]
    catalogs = [path.parent / inc for inc in includes] + ([catalog] if catalog else [])
    for cat_path in catalogs:
        cat = _read_yaml(Path(cat_path))
        adapters_raw += cat.get("adapters") or []
        if isinstance(cat.get("base_model"), dict) and "name" in cat["base_model"]:
            base_models.add(str(cat["base_model"]["name"]))
    adapters_raw += data.get("adapters") or []
    if isinstance(data.get("base_model"), dict):
        base_models.add(str(data["base_model"]["name"]))
    adapters = {}
    for raw in adapters_raw:
        a = Adapter.from_dict(raw)
        adapters[a.name] = a
        base_models.add(a.base_model)
    tenants = {}
    for raw in data.get("tenants") or []:
        t = Tenant(id=str(raw["id"]), default_adapter=raw.get("default_adapter"),
                   skills=_skills(raw.get("skills"), f"tenants.{raw['id']}.skills"))
        if t.default_adapter and t.default_adapter not in adapters:
            raise ConfigError(f"tenant {t.id}: default_adapter {t.default_adapter} not in catalog")
        tenants[t.id] = t
    keys = {}
    for raw in data.get("keys") or []:
        digest = str(raw.get("sha256", "")).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError("keys[].sha256 must be the hex SHA-256 of the key (never the key)")
        if raw.get("tenant") not in tenants:
            raise ConfigError(f"key {raw.get('name', digest[:8])}: unknown tenant {raw.get('tenant')}")
        keys[digest] = DevKey(sha256=digest, tenant=str(raw["tenant"]), name=str(raw.get("name", "")),
                              skills=_skills(raw.get("skills"), "keys[].skills"))
    upstreams = []
    for raw in data.get("upstreams") or []:
        try:
            upstreams.append(Upstream(
                name=str(raw["name"]), address=str(raw["address"]), flavour=str(raw["flavour"]),
                base_model=str(raw["base_model"]), hints=str(raw.get("hints", "body")),
                agent=raw.get("agent")))
        except KeyError as exc:
            raise ConfigError(f"upstream entry missing {exc}") from exc
    if not upstreams:
        raise ConfigError(f"{path}: at least one upstream is required")
    limits = data.get("limits") or {}
    max_body = int(limits.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))
    if max_body <= 0:
        raise ConfigError("limits.max_body_bytes must be positive")
    return dict(adapters=adapters, base_models=frozenset(base_models), tenants=tenants, keys=keys,
                upstreams=tuple(upstreams), default_skills=_skills(data.get("skills"), "skills"),
                max_body_bytes=max_body)


class Store:
    """Owns the SQLite database and publishes snapshots."""

    def __init__(self, state_file: Path, db_path: Path | str, catalog: Path | None = None) -> None:
        self._file_state = load_state_file(Path(state_file), catalog)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS dev_key_skills ("
                         " key_sha256 TEXT PRIMARY KEY, skills TEXT NOT NULL, updated_at REAL NOT NULL)")
        self.snapshot = self._build()

    def _build(self) -> Snapshot:
        keys = dict(self._file_state["keys"])
        for digest, skills_json in self._db.execute("SELECT key_sha256, skills FROM dev_key_skills"):
            if digest in keys:
                merged = {**keys[digest].skills, **json.loads(skills_json)}
                keys[digest] = replace(keys[digest], skills=MappingProxyType(merged))
        s = self._file_state
        return Snapshot(adapters=MappingProxyType(dict(s["adapters"])), base_models=s["base_models"],
                        tenants=MappingProxyType(dict(s["tenants"])), keys=MappingProxyType(keys),
                        upstreams=s["upstreams"], default_skills=s["default_skills"],
                        max_body_bytes=s["max_body_bytes"])

    def set_key_skills(self, key_sha256: str, skills: Mapping[str, str]) -> Snapshot:
        """Persist a developer key's skills (merged over earlier runtime changes)."""
        with self._lock:
            row = self._db.execute("SELECT skills FROM dev_key_skills WHERE key_sha256=?",
                                   (key_sha256,)).fetchone()
            merged = {**(json.loads(row[0]) if row else {}), **skills}
            self._db.execute("INSERT OR REPLACE INTO dev_key_skills VALUES (?, ?, ?)",
                             (key_sha256, json.dumps(merged, sort_keys=True), time.time()))
            self.snapshot = self._build()
            return self.snapshot

    def close(self) -> None:
        self._db.close()
