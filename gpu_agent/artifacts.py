"""Adapter identity (the catalog) and the two outer tiers: remote source and disk cache.

An adapter is known only through the catalog (docs/contracts.md): a name, a content
digest (SHA-256 of `adapter_model.safetensors`) and a `uri`. Names are never joined into
paths: files land in the disk cache under their digest, and a catalog `uri` that is a
local path must stay inside the catalog's directory.

Sources (`uri`):
- relative path or `file://` URL: a local directory. It already is "disk"; its digest is
  verified once, the first time the agent uses it (the file enters from outside).
- `http(s)://` URL of a directory: `adapter_config.json` and `adapter_model.safetensors`
  are fetched with aiohttp (one pooled session, keep-alive), hashed while streaming, and
  renamed into the cache only when the digest matches. aiohttp, not httpx: its parser is
  native, and the GETs cost about a third of the CPU (0.9 vs 2.5-2.9 ms per adapter of
  ~260 KB against ``python -m http.server``: ``python -m bench.fetch_cost``), which on a
  host whose engine shares the CPU is time its forward passes get back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import logging
import os
import re
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlparse

import aiohttp

from ace_common.catalog import Adapter
from ace_common.catalog_schema import CatalogBaseModel, SchemaError, read_catalog_file
from gpu_agent.errors import AdapterNotFound, AgentError, DigestMismatch
from gpu_agent.eviction import EvictReason, Shortfall, ordered, plan_evictions

log = logging.getLogger(__name__)

__all__ = ["Catalog", "CatalogError", "DiskCache", "ArtifactStore",
           "FetchError", "valid_adapter_name", "sha256_file"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class CatalogError(AgentError):
    """catalog.yaml is malformed or names an unsafe location."""


class FetchError(AgentError):
    """The remote source did not deliver the adapter files."""


def valid_adapter_name(name: str) -> bool:
    """A name the agent accepts: letters, digits, `._-`, no path parts, not `.`/`..`."""
    return bool(_NAME.match(name or "")) and ".." not in name


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Catalog:
    """The adapters this agent may load, by name; immutable once built."""

    def __init__(self, base_model: str, adapters: Iterable[Adapter], root: Path,
                 base_model_path: Path | None = None):
        self.base_model = base_model
        self.root = root.resolve()
        self.base_model_path = base_model_path
        self._by_name = {a.name: a for a in adapters}

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Catalog":
        """The catalog at ``path`` (``ace_common.catalog_schema``), with what the agent needs
        on top: safe names and a 64-hex digest per adapter."""
        path = Path(path)
        try:
            doc = read_catalog_file(path)
        except SchemaError as exc:
            raise CatalogError(str(exc)) from None
        base = doc.base_model
        base_path = (path.parent / base.path).resolve() if isinstance(base, CatalogBaseModel) and base.path else None
        specs = []
        for i, raw in enumerate(doc.adapters):
            if not valid_adapter_name(raw.name):
                raise CatalogError(f"{path}: adapters[{i}].name: unsafe adapter name {raw.name!r}")
            digest = (raw.sha256 or "").lower()
            if not _HEX64.match(digest):
                raise CatalogError(f"{path}: adapters[{i}].sha256: must be 64 hex digits")
            specs.append(dataclasses.replace(Adapter.from_entry(raw, doc.base_model_of(raw)), sha256=digest))
        return cls(doc.base_model_name, specs, path.parent, base_path)

    def get(self, name: str) -> Adapter | None:
        if not valid_adapter_name(name):
            return None
        return self._by_name.get(name)

    def __iter__(self):
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def local_dir(self, spec: Adapter) -> Path:
        """The directory of a local-source adapter, refused if it leaves the catalog root."""
        candidate = spec.local_dir(self.root)
        if candidate is None:
            raise CatalogError(f"adapter {spec.name}: {spec.uri} is not a local path")
        resolved = candidate.resolve()
        if urlparse(spec.uri).scheme == "" and not resolved.is_relative_to(self.root):
            raise AdapterNotFound(f"adapter {spec.name}: {spec.uri} leaves the catalog directory")
        return resolved


class DiskCache:
    """Verified adapter directories under `root/<sha256>/`, bounded by bytes, LRU.

    Entries named in `protected` (pinned or on a higher tier) are skipped by eviction;
    if nothing else can go, the cache refuses the new entry rather than grow.

    A budget of 0 is *resident-only*: no byte bound, but the cache keeps nothing for
    later. Every fetch first drops every entry not protected (so only adapters that are
    resident, being loaded or pinned keep their files), and the store drops an adapter's
    files as soon as it leaves the device (:meth:`ArtifactStore.left_device`): an adapter
    that comes back is fetched and verified again (a cold benchmark's setting).
    """

    def __init__(self, root: Path, budget_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[str, int] = OrderedDict()  # digest -> bytes
        for entry in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime):
            weights = entry / WEIGHTS
            if _HEX64.match(entry.name) and weights.is_file() and (entry / CONFIG).is_file():
                self._lru[entry.name] = weights.stat().st_size
            elif entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)  # a torn download from a crash

    @property
    def used_bytes(self) -> int:
        return sum(self._lru.values())

    @property
    def resident_only(self) -> bool:
        """Budget 0: keep only the files of adapters that are resident or loading."""
        return self.budget_bytes == 0

    def path(self, digest: str) -> Path | None:
        """The entry's directory, for a use of its files: it becomes the most recently
        used. A question that reads nothing asks ``digest in cache`` instead."""
        if digest in self._lru:
            self._lru.move_to_end(digest)
            return self.root / digest
        return None

    def __contains__(self, digest: str) -> bool:
        return digest in self._lru

    def make_room(self, nbytes: int, protected: set[str]) -> list[str]:
        """Evict LRU entries until `nbytes` more fit; returns the evicted digests.
        Resident-only (budget 0): evict every entry not `protected`, never refuse."""
        if self.resident_only:
            evicted = [d for d in self._lru if d not in protected]
            for digest in evicted:
                self.remove(digest)
            return evicted
        if nbytes > self.budget_bytes:
            raise FetchError(f"adapter of {nbytes} bytes exceeds the disk budget {self.budget_bytes}")
        short = Shortfall(size=self.used_bytes + nbytes - self.budget_bytes)
        evicted = plan_evictions(ordered(self._lru, self._lru.__getitem__, lambda d: d not in protected), short)
        for digest in evicted:
            self.remove(digest)
        if self.used_bytes + nbytes > self.budget_bytes:
            raise FetchError("disk cache full of pinned or resident adapters")
        return evicted

    def remove(self, digest: str) -> bool:
        if self._lru.pop(digest, None) is None:
            return False
        shutil.rmtree(self.root / digest, ignore_errors=True)
        return True

    def _complete(self, digest: str) -> bool:
        """`root/<digest>/` holds both files and its weights hash to `digest`."""
        final = self.root / digest
        if digest in self._lru:
            return True  # admitted by us, hence verified
        weights = final / WEIGHTS
        return weights.is_file() and (final / CONFIG).is_file() and sha256_file(weights) == digest

    def admit(self, digest: str, staged: Path) -> Path:
        """Rename the verified `staged` directory to `root/<digest>/`.

        A complete verified copy already there (another fetch of the same digest won the
        race, in this process or another one sharing the cache) is success: `staged` is
        dropped and the existing copy kept. A torn or wrong copy there is replaced.
        """
        final = self.root / digest
        try:
            os.replace(staged, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR) and not final.exists():
                raise
            if self._complete(digest):
                log.info("disk cache: %s already present and verified; keeping it", digest[:12])
                shutil.rmtree(staged, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(staged, final)
        self._lru[digest] = (final / WEIGHTS).stat().st_size
        self._lru.move_to_end(digest)
        return final


class ArtifactStore:
    """Brings an adapter's files to a verified local directory, from wherever they live."""

    def __init__(self, catalog: Catalog, cache: DiskCache, timeout_s: float = 60.0):
        self.catalog = catalog
        self.cache = cache
        self._session: aiohttp.ClientSession | None = None  # made on the first fetch, in its loop
        self._timeout = timeout_s
        self._verified_local: set[str] = set()  # digests of local sources already hashed
        # One fetch per digest (one first hash per local adapter) at a time: concurrent
        # callers (a prefetch and the engine's on-demand load of one adapter) await one task.
        self._inflight: dict[str, asyncio.Task] = {}
        # Extra digests no disk eviction may remove (given by the residency manager and the
        # builtin connector through `protect_with`: adapters being loaded, pinned or on a
        # higher tier).
        self._protect_providers: list[Callable[[], set[str]]] = []
        # Told of every disk eviction the store decides itself (`on_eviction`).
        self._eviction_listeners: list[Callable[[Adapter, EvictReason], None]] = []

    def protect_with(self, provider: Callable[[], set[str]]) -> None:
        """``provider()``: more digests the disk tier must keep, asked at each eviction."""
        self._protect_providers.append(provider)

    def on_eviction(self, listener: Callable[[Adapter, EvictReason], None]) -> None:
        """``listener(spec, reason)`` for every disk eviction the store decides itself, reason
        BUDGET (room for a fetch) or LEFT_DEVICE (a resident-only cache); the residency
        manager counts them. An operator's `forget_local` is counted by its caller."""
        self._eviction_listeners.append(listener)

    def _evicted(self, digests: Iterable[str], reason: EvictReason) -> None:
        by_digest = {spec.sha256: spec for spec in self.catalog}
        for digest in digests:
            spec = by_digest.get(digest)
            if spec is None:
                continue
            for listener in self._eviction_listeners:
                listener(spec, reason)

    def protected(self, extra: set[str] = frozenset()) -> set[str]:
        """Digests the disk tier must keep now: `extra`, every provider's, and in-flight fetches."""
        out = set(extra) | {k for k in self._inflight if not k.startswith("local:")}
        for provider in self._protect_providers:
            out |= provider()
        return out

    async def aclose(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def fetches_in_flight(self) -> int:
        """Fetches (downloads or local verifications) under way now."""
        return len(self._inflight)

    def has_local(self, spec: Adapter) -> bool:
        """Whether a verified local copy of ``spec`` is on disk now: a question only (the
        disk cache's LRU order is not touched; ``local_path`` is for using the files)."""
        if spec.is_remote:
            return spec.sha256 in self.cache
        return spec.sha256 in self._verified_local

    def local_path(self, spec: Adapter) -> Path | None:
        """The verified local directory if the adapter is on disk now (no I/O beyond stat),
        to read its files: a cache entry becomes the most recently used (``has_local``
        asks without that)."""
        if spec.is_remote:
            return self.cache.path(spec.sha256)
        if spec.sha256 in self._verified_local:
            return self.catalog.local_dir(spec)
        return None

    async def ensure_local(self, spec: Adapter, protected: set[str]) -> tuple[Path, bool]:
        """A verified directory for `spec`; returns (path, fetched_from_remote)."""
        if (path := self.local_path(spec)) is not None:
            return path, False
        # remote: one cache entry per digest; local: one directory per catalog entry
        key = spec.sha256 if spec.is_remote else f"local:{spec.name}"
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._bring_local(spec, protected))
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._fetch_done(k, t))
        # shield: one waiter giving up (a client that went away) does not cancel the
        # download the other waiters share
        return await asyncio.shield(task)

    def _fetch_done(self, key: str, task: asyncio.Task) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: a failure nobody awaited any more is not logged as lost

    async def _bring_local(self, spec: Adapter, protected: set[str]) -> tuple[Path, bool]:
        if (path := self.local_path(spec)) is not None:  # another path finished it meanwhile
            return path, False
        if spec.is_remote:
            return await self._fetch(spec, protected), True
        directory = self.catalog.local_dir(spec)
        weights = directory / WEIGHTS
        if not weights.is_file() or not (directory / CONFIG).is_file():
            raise AdapterNotFound(f"adapter {spec.name}: no adapter files at {spec.uri}")
        digest = await asyncio.to_thread(sha256_file, weights)
        if digest != spec.sha256:
            raise DigestMismatch(f"adapter {spec.name}: sha256 {digest} != catalog {spec.sha256}")
        self._verified_local.add(spec.sha256)
        return directory, False

    def forget_local(self, spec: Adapter) -> bool:
        """Drop the disk tier of `spec` (cache entry, or the verified mark of a local source)."""
        if spec.is_remote:
            return self.cache.remove(spec.sha256)
        if spec.sha256 in self._verified_local:
            self._verified_local.discard(spec.sha256)
            return True
        return False

    def left_device(self, spec: Adapter, keep: set[str] = frozenset()) -> bool:
        """`spec` left the device tier. A resident-only disk cache (budget 0) drops its files
        now, unless `keep` names its digest or a fetch of it is under way; any other cache
        keeps them (LRU). True when files were dropped."""
        if not self.cache.resident_only or not spec.is_remote:
            return False
        if spec.sha256 in keep or spec.sha256 in self._inflight:
            return False
        if not self.cache.remove(spec.sha256):
            return False
        self._evicted([spec.sha256], EvictReason.LEFT_DEVICE)
        return True

    async def _fetch(self, spec: Adapter, protected: set[str]) -> Path:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        base = spec.uri.rstrip("/") + "/"
        evicted = self.cache.make_room(max(spec.size_bytes, 1), self.protected(protected))
        self._evicted(evicted, EvictReason.LEFT_DEVICE if self.cache.resident_only else EvictReason.BUDGET)
        staged = self.cache.root / f".partial-{spec.sha256}-{time.monotonic_ns()}"
        staged.mkdir()
        # both files at once: a remote store's first byte costs a round trip per object
        gets = [asyncio.ensure_future(self._download(base + CONFIG, staged / CONFIG, None)),
                asyncio.ensure_future(self._download(base + WEIGHTS, staged / WEIGHTS, spec.size_bytes))]
        try:
            try:
                _, digest = await asyncio.gather(*gets)
            except BaseException:  # the first failure (or a cancel) stops the other GET too
                for get in gets:
                    get.cancel()
                await asyncio.gather(*gets, return_exceptions=True)
                raise
            if digest != spec.sha256:
                raise DigestMismatch(f"adapter {spec.name}: fetched sha256 {digest} != catalog {spec.sha256}")
            return self.cache.admit(spec.sha256, staged)  # in the loop: the LRU is not thread-safe
        finally:
            if staged.exists():
                shutil.rmtree(staged, ignore_errors=True)

    async def _download(self, url: str, dest: Path, expect_bytes: int | None) -> str:
        h = hashlib.sha256()
        limit = (expect_bytes or 0) + (1 << 20) if expect_bytes else 64 << 20
        got = 0
        try:
            async with self._session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise FetchError(f"GET {url}: HTTP {resp.status}")
                with open(dest, "wb") as out:
                    async for block in resp.content.iter_chunked(1 << 20):
                        got += len(block)
                        if got > limit:
                            raise FetchError(f"GET {url}: more than {limit} bytes")
                        h.update(block)
                        out.write(block)
        except aiohttp.ClientError as exc:
            raise FetchError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise FetchError(f"GET {url}: no answer within {self._timeout:g} s") from exc
        return h.hexdigest()
