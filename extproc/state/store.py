"""Gateway state: a YAML file (GitOps) plus a database of runtime changes.

The YAML file is the source of truth for adapters, tenants, keys and upstreams; it is
read at start-up and again by ``reload_file`` (``extproc.state.file_watch`` calls it when
the file changes, or on SIGHUP): validated whole first, so a bad edit changes nothing. The
upstreams may come from a discovery source instead (``extproc.fleet.discovery``,
``Store.set_upstreams``). Changes made at runtime (a developer key's skills, set through
``POST /api/v1/dev_key/skills``; a tenant's default skills, set by its admin key through
``POST /api/v1/tenant/skills``; a key issued, rotated or revoked with ``python -m
extproc.admin`` or the settings API, ``extproc.domain.key_lifecycle``) are written to the state
database (``extproc.state.db``: SQLite for one node, PostgreSQL shared by several
replicas) and overlay the file's values, so they survive a restart and reach every
replica. Every change builds a new immutable
``Snapshot`` and swaps one reference: the request path only ever reads ``Store.snapshot``,
never the database. ``on_snapshot(callback)``: ``callback(seconds)`` after each swap a
write caused, here or on another replica, with the time from the write's commit to the
swap on this replica (the gateway's ``ace_gateway_store_propagation_seconds``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from extproc.state.catalog import Adapter, DevKey, KeyOrigin, Tenant, Upstream
from extproc.errors import ConfigError, GatewayError
from extproc.state.paths import check_allow_path
from extproc.state.skill_modes import validate_skills
from extproc.state.db import IssuedKey, Overlay, is_postgres_url, open_state_db
from extproc.state.schema import config_error, read_catalog, read_state
from ace_common.catalog_schema import CatalogAdapter

__all__ = ["Snapshot", "Store", "load_state_file"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    adapters: Mapping[str, Adapter]
    base_models: frozenset[str]
    tenants: Mapping[str, Tenant]
    keys: Mapping[str, DevKey]          # sha256(plaintext key) -> key: the keys that authenticate
    upstreams: tuple[Upstream, ...]
    default_skills: Mapping[str, str]
    max_body_bytes: int
    revoked_keys: Mapping[str, DevKey] = field(default_factory=dict)   # known keys revoked: listings only
    public_model_list: bool = False     # GET /v1/models without a key (extproc.app.model_list)


def _skills(raw: Mapping[str, str], source: Path, where: str) -> Mapping[str, str]:
    try:
        return validate_skills(dict(raw), where)
    except GatewayError as exc:
        path = exc.param or where
        message = exc.message.removeprefix(f"{path} ")     # the path is said once, in front
        raise config_error(source, path, message) from None


def load_state_file(path: Path, catalog: Path | None = None, *, upstreams_required: bool = True) -> dict[str, Any]:
    """Read the state file and its catalog(s) into plain values (validated: every error a
    ``ConfigError`` naming the file and the field's path). ``upstreams_required``: False
    when a discovery source gives the upstreams (``extproc.fleet.discovery``)."""
    state = read_state(path)
    adapters: dict[str, Adapter] = {}
    base_models: set[str] = set()

    def add(entries: tuple[CatalogAdapter, ...], file_base: str | None, source: Path) -> None:
        for i, entry in enumerate(entries):
            base = entry.base_model or file_base
            if base is None:
                raise config_error(source, f"adapters[{i}].base_model",
                                   "required field missing (the file names no base_model)")
            adapters[entry.name] = Adapter.from_entry(entry, base)
            base_models.add(base)

    for cat_path in [path.parent / inc for inc in state.includes] + ([catalog] if catalog else []):
        cat = read_catalog(Path(cat_path))
        base_models.add(cat.base_model_name)
        add(cat.adapters, cat.base_model_name, Path(cat_path))
    state_base = state.base_model if isinstance(state.base_model, str | None) else state.base_model.name
    if state_base:
        base_models.add(state_base)
    add(state.adapters, state_base, path)
    tenants = {}
    for i, raw in enumerate(state.tenants):
        t = Tenant(id=raw.id, default_adapter=raw.default_adapter,
                   skills=_skills(raw.skills, path, f"tenants[{i}].skills"))
        if t.default_adapter and t.default_adapter not in adapters:
            raise config_error(path, f"tenants[{i}].default_adapter", f"{t.default_adapter} not in catalog")
        tenants[t.id] = t
    keys = {}
    for i, raw in enumerate(state.keys):
        digest = raw.sha256.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise config_error(path, f"keys[{i}].sha256", "must be the hex SHA-256 of the key (never the key)")
        if raw.tenant not in tenants:
            raise config_error(path, f"keys[{i}].tenant", f"unknown tenant {raw.tenant}")
        keys[digest] = DevKey(sha256=digest, tenant=raw.tenant, name=raw.name,
                              skills=_skills(raw.skills, path, f"keys[{i}].skills"), role=raw.role)
    upstreams = []
    for i, raw in enumerate(state.upstreams):
        for j, allowed in enumerate(raw.allow_paths):
            if (problem := check_allow_path(allowed)) is not None:
                raise config_error(path, f"upstreams[{i}].allow_paths[{j}]", problem)
        try:
            upstreams.append(Upstream(name=raw.name, address=raw.address, flavour=raw.flavour,
                                      base_model=raw.base_model, hints=raw.hints, agent=raw.agent,
                                      allow_paths=frozenset(raw.allow_paths)))
        except ConfigError as exc:
            raise config_error(path, f"upstreams[{i}].{exc.field}", str(exc)) from None
    if not upstreams and upstreams_required:
        raise config_error(path, "upstreams", "at least one upstream is required "
                           "(or a --discovery source to find them)")
    if state.limits.max_body_bytes <= 0:
        raise config_error(path, "limits.max_body_bytes", "must be positive")
    return dict(adapters=adapters, base_models=frozenset(base_models), tenants=tenants, keys=keys,
                upstreams=tuple(upstreams), default_skills=_skills(state.skills, path, "skills"),
                max_body_bytes=state.limits.max_body_bytes, public_model_list=state.public_model_list,
                sources=(path, *(path.parent / inc for inc in state.includes), *([catalog] if catalog else [])))


class Store:
    """Owns the state database (``extproc.state.db``) and publishes snapshots: the state
    file's values with the database's runtime changes over them."""

    def __init__(self, state_file: Path, db: Path | str, catalog: Path | None = None, *,
                 poll_s: float = 2.0, watch: bool = True, upstreams_required: bool = True) -> None:
        """``db``: a SQLite path or a ``postgresql://`` URL. ``poll_s``: how often the
        watcher compares the database's version (PostgreSQL: the fallback behind NOTIFY).
        Start-up needs the database: a replica never serves without its revocations.
        ``upstreams_required=False``: a discovery source gives the upstreams."""
        self._state_file, self._catalog, self._upstreams_required = Path(state_file), catalog, upstreams_required
        self._file_state = load_state_file(self._state_file, catalog, upstreams_required=upstreams_required)
        self._overlay = Overlay()
        self._upstreams: tuple[Upstream, ...] = self._file_state["upstreams"]
        self._lock = threading.Lock()
        self._listeners: list[Callable[[float], None]] = []
        try:
            self._db = open_state_db(db)
            overlay = self._db.read()
        except GatewayError as exc:
            raise ConfigError(f"state database {_redact(db)}: {exc.message}") from exc
        self._version = -1
        self._apply(overlay)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if watch:
            self._watcher = threading.Thread(target=self._db.watch, name="ace-state-watch", daemon=True,
                                             args=(self._apply, lambda: self._version, self._stop, poll_s))
            self._watcher.start()

    def on_snapshot(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(seconds from the write's commit to this replica's swap)`` after
        each swap a write caused (not the first snapshot)."""
        self._listeners.append(callback)

    @property
    def version(self) -> int:
        """The database version the current snapshot reflects."""
        return self._version

    def _apply(self, overlay: Overlay) -> None:
        with self._lock:    # never step back: a slow reader must not undo a newer write
            if overlay.version <= self._version:
                return
            first = self._version < 0
            self.snapshot = self._build(overlay)
            self._overlay, self._version = overlay, overlay.version
        if not first and overlay.changed_at > 0:
            lag = max(0.0, time.time() - overlay.changed_at)
            for callback in self._listeners:
                callback(lag)

    @property
    def sources(self) -> tuple[Path, ...]:
        """The files the current state came from: the state file, then its catalogs."""
        return self._file_state["sources"]

    def reload_file(self) -> Snapshot:
        """Read the state file again and, only if all of it is valid, swap in a snapshot
        built from it and the database's runtime changes. Raises ``ConfigError`` (naming
        the file and the field) and changes nothing when it is not valid."""
        state = load_state_file(self._state_file, self._catalog, upstreams_required=self._upstreams_required)
        with self._lock:
            self._file_state = state
            if self._upstreams_required:     # static hosts; a discovery source owns them otherwise
                self._upstreams = state["upstreams"]
            self.snapshot = self._build(self._overlay)
            return self.snapshot

    def _build(self, overlay: Overlay) -> Snapshot:
        s = self._file_state
        tenants = dict(s["tenants"])
        known = {**{d: _issued_key(k) for d, k in overlay.keys.items() if k.tenant in tenants},
                 **s["keys"]}     # a runtime key of a tenant the file no longer has: gone
        for digest, skills in overlay.key_skills.items():
            if digest in known:
                known[digest] = replace(known[digest], skills=MappingProxyType({**known[digest].skills, **skills}))
        keys = {d: k for d, k in known.items() if d not in overlay.revoked}
        revoked = {d: k for d, k in known.items() if d in overlay.revoked}
        for tenant_id, skills in overlay.tenant_skills.items():
            if tenant_id in tenants:
                t = tenants[tenant_id]
                tenants[tenant_id] = replace(t, skills=MappingProxyType({**t.skills, **skills}))
        return Snapshot(adapters=MappingProxyType(dict(s["adapters"])), base_models=s["base_models"],
                        tenants=MappingProxyType(tenants), keys=MappingProxyType(keys),
                        upstreams=self._upstreams, default_skills=s["default_skills"],
                        max_body_bytes=s["max_body_bytes"], revoked_keys=MappingProxyType(revoked),
                        public_model_list=s["public_model_list"])

    def set_key_skills(self, key_sha256: str, skills: Mapping[str, str | None]) -> Snapshot:
        """Persist a developer key's skills (merged over earlier runtime changes; a ``None``
        mode removes that skill's runtime change, so the state file's value, if any, applies
        again); raises ``StoreUnavailable`` when the database cannot take the write."""
        self._apply(self._db.set_key_skills(key_sha256, skills))
        return self.snapshot

    def set_tenant_skills(self, tenant_id: str, skills: Mapping[str, str | None]) -> Snapshot:
        """Persist a tenant's default skills (merged over earlier runtime changes, over the
        file's; ``None`` removes a skill's runtime change); raises ``StoreUnavailable`` when
        the database cannot take the write."""
        self._apply(self._db.set_tenant_skills(tenant_id, skills))
        return self.snapshot

    def revoke_key(self, key_sha256: str, revoked: bool = True) -> Snapshot:
        """Revoke a key (``revoked=False``: restore it); every replica stops accepting it."""
        self._apply(self._db.set_revoked(key_sha256, revoked))
        return self.snapshot

    def add_key(self, key: IssuedKey, revoke: str | None = None) -> Snapshot:
        """Store an issued key (its SHA-256 only) and, in the same transaction, revoke
        ``revoke`` (a rotation); every replica accepts it once it applies the change."""
        self._apply(self._db.add_key(key, revoke))
        return self.snapshot

    def set_upstreams(self, upstreams: tuple[Upstream, ...]) -> Snapshot:
        """The engine hosts a discovery source found (``extproc.fleet.discovery``): a new snapshot;
        requests in flight keep the one they read."""
        with self._lock:
            self._upstreams = tuple(upstreams)
            self.snapshot = replace(self.snapshot, upstreams=self._upstreams)
            return self.snapshot

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._db.close()


def _issued_key(k: IssuedKey) -> DevKey:
    return DevKey(sha256=k.sha256, tenant=k.tenant, name=k.name, skills=MappingProxyType(dict(k.skills)),
                  role=k.role, origin=KeyOrigin.DATABASE, created_at=k.created_at, expires_at=k.expires_at)


def _redact(db: Path | str) -> str:
    """A database URL without its password, for messages."""
    text = str(db)
    if is_postgres_url(db) and "@" in text:
        scheme, _, rest = text.partition("://")
        creds, _, host = rest.rpartition("@")
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else text
    return text
