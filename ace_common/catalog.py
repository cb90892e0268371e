"""The catalog entry: one adapter of a catalog file, resolved (its base model filled in).

The one model of a catalog entry: the gateway (``extproc.state``), the agent
(``gpu_agent.artifacts.Catalog``) and the builtin engine (``gpu_agent.engine.adapters``)
all hold these. ``ace_common.catalog_schema`` parses and checks the file
(``CatalogAdapter`` is the entry as written, its base model optional); ``from_entry``
resolves it. Each reader adds only its own checks (the agent: a safe name and a 64-hex
digest, lower-cased).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from ace_common.catalog_schema import CatalogAdapter

__all__ = ["Adapter", "PUBLIC"]

PUBLIC = "public"   # an adapter's owner when every tenant may use it


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    base_model: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    owner: str          # a tenant id or PUBLIC
    uri: str            # relative path (to the catalog file's folder), file:// or http(s):// URL of the directory
    sha256: str         # hex digest of adapter_model.safetensors; "" when the catalog gives none
    alpha: float | None = None
    domain: str | None = None

    def visible_to(self, tenant_id: str) -> bool:
        return self.owner == PUBLIC or self.owner == tenant_id

    @property
    def is_remote(self) -> bool:
        return urlparse(self.uri).scheme in ("http", "https")

    def local_dir(self, root: Path | None = None) -> Path | None:
        """The adapter's local directory: a file:// URL's path, or the path ``uri`` under
        ``root`` (the catalog file's folder; an absolute path needs none), resolved. None
        when ``uri`` is not a local path (a URL), or is relative and no ``root`` is given."""
        parsed = urlparse(self.uri)
        if parsed.scheme == "file":
            return Path(unquote(parsed.path))
        if parsed.scheme != "":
            return None
        if root is None and not Path(self.uri).is_absolute():
            return None
        return ((root or Path("/")) / self.uri).resolve()

    @classmethod
    def from_entry(cls, entry: CatalogAdapter, base_model: str) -> "Adapter":
        """A checked catalog entry; ``base_model``: its own, else its file's."""
        return cls(name=entry.name, base_model=base_model, rank=entry.rank,
                   target_modules=entry.target_modules, size_bytes=entry.size_bytes, owner=entry.owner,
                   uri=entry.uri, sha256=entry.sha256 or "", alpha=entry.alpha, domain=entry.domain)
