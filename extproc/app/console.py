"""The settings page and its read API, answered by ext_proc itself (immediate responses).

    GET  /settings, /settings/app.js, /settings/app.css   the page (open, like /health)
    GET  /api/v1/me                 the calling key: id, tenant, role, skills with sources
    POST /api/v1/me/skills          set the calling key's skills (the page's write)
    GET  /api/v1/tenant/skills      the tenant's default skills        (admin key)
    POST /api/v1/tenant/skills      set them                           (admin key)
    GET  /api/v1/tenant/keys        the tenant's keys and their skills (admin key)
    GET  /api/v1/adapters           adapters this key can use, residency per engine host
    GET  /api/v1/usage?window=3600  per adapter minute series (``extproc.observe.usage``)

Same authorisation as the rest of the API (``extproc.domain.auth``): a key sees only its own
tenant; a write of tenant defaults needs ``role: admin`` (403 ``admin_required``).

Writes are browser-safe without a CSRF token: the key travels only in ``Authorization:
Bearer`` (the page keeps it in sessionStorage; no cookie, so a browser never adds it to a
request another site makes), a write must say ``Content-Type: application/json`` (which a
cross-site form cannot send, and which makes a cross-site ``fetch`` pre-flight, refused: we
answer no CORS) and an ``Origin`` header, when sent, must name this host (403
``cross_origin``). docs/gateway.md, "Settings page and read API".
"""
from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import parse_qs, urlsplit

from extproc.domain.auth import Principal, authenticate
from extproc.errors import Forbidden, InvalidField, MethodNotAllowed, UnsupportedMediaType
from extproc.domain.headers import TENANT_HEADER
from extproc.app.outcomes import Outcome, Reply, RequestHead
from extproc.app.handlers import Authenticated
from extproc.policy.routing import RoutePolicy
from extproc.state.residency import UNKNOWN_TIER, public_tier
from extproc.state.skill_modes import SKILLS
from extproc.domain.skills import resolve, resolve_sources
from ace_common.tiers import Tier
from extproc.state.store import Snapshot

if TYPE_CHECKING:
    from extproc.app.exchange import Gateway

__all__ = ["CONSOLE_ROUTES", "skill_sources"]

_STATIC = resources.files("extproc.app") / "console_static"
_SECURITY_HEADERS = (
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    # no inline script or style, nothing from another origin: an injected string stays text
    ("content-security-policy", "default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self'; form-action 'none'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
)
_ASSETS = {
    "/settings": ("index.html", "text/html; charset=utf-8"),
    "/settings/": ("index.html", "text/html; charset=utf-8"),
    "/settings/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/settings/app.css": ("app.css", "text/css; charset=utf-8"),
}
_JSON = (("content-type", "application/json"), ("cache-control", "no-store"))


def _asset(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


class SettingsPage:
    """The page's static files: open without a key (they hold no tenant data)."""

    response_body_phase = False
    headers_only = True

    def __init__(self, gw: Gateway, route: RoutePolicy) -> None:
        self.gw = gw

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        name, content_type = _ASSETS[head.path]
        body = _asset(name)
        return Reply(200, b"" if head.method == "HEAD" else body,
                     (("content-type", content_type), *_SECURITY_HEADERS))

    def on_request_body(self, body: bytes) -> Outcome:   # pragma: no cover - headers answer
        raise MethodNotAllowed("the settings page takes no body")

    def on_response_body(self, body: bytes) -> Outcome:  # pragma: no cover
        raise MethodNotAllowed("the settings page takes no body")


def skill_sources(snap: Snapshot, p: Principal) -> dict[str, dict[str, Any]]:
    """Per skill: the effective mode for a request without header or body overrides, where
    it comes from (``key`` > ``tenant`` > ``default``; ``off`` when set nowhere: ``unset``),
    and each layer's own value (None: not set there)."""
    layers = (("key", p.key.skills), ("tenant", p.tenant.skills), ("default", snap.default_skills))
    return {skill: {"effective": mode, "source": source, **{name: layer.get(skill) for name, layer in layers}}
            for skill, (mode, source) in resolve_sources(layers).items()}


def _key_view(snap: Snapshot, p: Principal) -> dict[str, Any]:
    return {"id": p.key.sha256[:12], "name": p.key.name, "role": p.key.role,
            "skills": skill_sources(snap, p)}


def _json(value: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(value).encode(), _JSON)


def _check_write(head: RequestHead) -> None:
    """A write from a browser must be same-origin and JSON (module docstring: why)."""
    h = head.headers
    content_type = h.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise UnsupportedMediaType("writes need Content-Type: application/json", param="content-type")
    origin = h.get("origin")
    if origin is not None:
        host = h.get(":authority") or h.get("host") or ""
        if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
            raise Forbidden(f"Origin {origin} is not this gateway ({host}); cross-origin writes are refused",
                            param="origin", code="cross_origin")


class _ConsoleCall(Authenticated):
    """GET answers at the headers; POST reads a JSON body after ``_check_write``."""

    methods = ("GET",)
    admin_only = False

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in self.methods:
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        snap = self.gw.store.snapshot
        self.principal = authenticate(snap, head.headers.get("authorization"), head.headers.get(TENANT_HEADER))
        if self.admin_only and not self.principal.key.is_admin:
            raise Forbidden("this needs a tenant admin key (role: admin)", code="admin_required")
        if head.method == "GET":
            return self.read(snap, head)
        _check_write(head)
        return super().after_auth(head)

    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        raise NotImplementedError

    def on_request_body(self, body: bytes) -> Outcome:
        return self.write(self.skills_write(body))

    def write(self, skills: Mapping[str, str | None]) -> Reply:
        raise MethodNotAllowed("this resource is read-only")


class Me(_ConsoleCall):
    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        p = self.principal
        return _json({"key": _key_view(snap, p), "tenant": p.tenant.id,
                      "order": ["key", "tenant", "default"]})


class MySkills(_ConsoleCall):
    methods = ("POST",)

    def write(self, skills: Mapping[str, str | None]) -> Reply:
        snap = self.gw.store.set_key_skills(self.principal.key.sha256, skills)
        p = self.current(snap)
        return _json({"key": _key_view(snap, p), "tenant": p.tenant.id})


def _tenant_view(snap: Snapshot, p: Principal) -> dict[str, Any]:
    effective = resolve(p.tenant.skills, snap.default_skills)
    return {"tenant": p.tenant.id, "skills": {s: p.tenant.skills.get(s) for s in SKILLS},
            "default": {s: snap.default_skills.get(s) for s in SKILLS}, "effective": effective}


class TenantSkills(_ConsoleCall):
    methods = ("GET", "POST")
    admin_only = True

    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        return _json(_tenant_view(snap, self.principal))

    def write(self, skills: Mapping[str, str | None]) -> Reply:
        snap = self.gw.store.set_tenant_skills(self.principal.tenant.id, skills)
        return _json(_tenant_view(snap, self.current(snap)))


class TenantKeys(_ConsoleCall):
    admin_only = True

    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        tenant = self.principal.tenant
        keys = sorted((k for k in snap.keys.values() if k.tenant == tenant.id), key=lambda k: (k.name, k.sha256))
        return _json({"tenant": tenant.id,
                      "keys": [_key_view(snap, Principal(key=k, tenant=tenant)) for k in keys]})


def _visible(snap: Snapshot, tenant_id: str) -> list[str]:
    return sorted(name for name, a in snap.adapters.items() if a.visible_to(tenant_id))


class Adapters(_ConsoleCall):
    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        board = self.gw.residency.current.by_upstream
        hosts = [{"name": u.name, "residency_known": u.name in board} for u in snap.upstreams]
        out = []
        for name in _visible(snap, self.principal.tenant.id):
            a = snap.adapters[name]
            residency = {}
            for u in snap.upstreams:
                table = board.get(u.name)
                r = table.get(name) if table is not None else None
                if table is None:          # no agent data for that host: never a guess
                    residency[u.name] = {"tier": UNKNOWN_TIER, "cold_load_ms": None, "prefetched": False}
                elif r is None:            # its agent reports it nowhere on that host
                    residency[u.name] = {"tier": public_tier(Tier.ABSENT), "cold_load_ms": None,
                                         "prefetched": False}
                else:
                    residency[u.name] = {"tier": r.public_tier, "cold_load_ms": r.cold_load_ms, "prefetched": r.prefetched}
            out.append({"name": name, "rank": a.rank, "owner": a.owner, "domain": a.domain,
                        "size_bytes": a.size_bytes, "residency": residency})
        return _json({"tenant": self.principal.tenant.id, "hosts": hosts, "adapters": out})


class Usage(_ConsoleCall):
    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        query = parse_qs(urlsplit(head.headers.get(":path", "")).query)
        raw = (query.get("window") or ["3600"])[-1]
        if not raw.isdigit() or not 60 <= int(raw) <= 3600:
            raise InvalidField("window must be whole seconds from 60 to 3600", param="window")
        tenant = self.principal.tenant.id
        return _json({"tenant": tenant, **self.gw.usage.series(tenant, _visible(snap, tenant), int(raw))})


CONSOLE_ROUTES: Mapping[str, type] = {
    **{path: SettingsPage for path in _ASSETS},
    "/api/v1/me": Me,
    "/api/v1/me/skills": MySkills,
    "/api/v1/tenant/skills": TenantSkills,
    "/api/v1/tenant/keys": TenantKeys,
    "/api/v1/adapters": Adapters,
    "/api/v1/usage": Usage,
}
