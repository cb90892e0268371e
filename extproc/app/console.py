"""The settings page and its read API, answered by ext_proc itself (immediate responses).

    GET  /settings, /settings/app.js, /settings/app.css   the page (open, like /health)
    GET  /api/v1/me                 the calling key: id, tenant, role, skills with sources
    POST /api/v1/me/skills          set the calling key's skills (the page's write)
    GET  /api/v1/tenant/skills      the tenant's default skills        (admin key)
    POST /api/v1/tenant/skills      set them                           (admin key)
    GET  /api/v1/tenant/keys        the tenant's keys, revoked ones too (admin key)
    POST /api/v1/tenant/keys        issue a key in the tenant: the secret, shown once (admin key)
    POST /api/v1/tenant/keys/rotate a new secret for a key of the tenant, the old one revoked (admin key)
    POST /api/v1/tenant/keys/revoke revoke a key of the tenant (admin key)
    GET  /api/v1/adapters           adapters this key can use, residency per engine host
    GET  /api/v1/usage?window=3600  per adapter minute series (``extproc.observe.usage``)

Same authorisation as the rest of the API (``extproc.domain.auth``): a key sees only its own
tenant; a write of tenant defaults and the key operations need ``role: admin`` (403
``admin_required``), on the caller's own tenant only, granting no role above its own
(``extproc.domain.key_lifecycle``).

Writes are browser-safe without a CSRF token: the key travels only in ``Authorization:
Bearer`` (the page keeps it in sessionStorage; no cookie, so a browser never adds it to a
request another site makes), a write must say ``Content-Type: application/json`` (which a
cross-site form cannot send, and which makes a cross-site ``fetch`` pre-flight, refused: we
answer no CORS) and an ``Origin`` header, when sent, must name this host (403
``cross_origin``). docs/gateway.md, "Settings page and read API".
"""
from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any, Mapping
from urllib.parse import parse_qs, urlsplit

from extproc.domain.auth import Principal, authenticate
from extproc.state.catalog import DevKey
from extproc.errors import Forbidden, InvalidField, MethodNotAllowed, UnsupportedMediaType
from extproc.domain.key_lifecycle import check_grant, find_key, issue, key_listing, parse_expiry, parse_role, rotation
from extproc.domain.headers import TENANT_HEADER
from extproc.app.outcomes import Outcome, Reply, RequestHead
from extproc.app.handlers import Authenticated, HeadersOnly, parse_object
from extproc.policy.routing import RoutePolicy
from extproc.state.residency import UNKNOWN_TIER, public_tier
from extproc.state.skill_modes import SKILLS
from extproc.domain.skills import resolve, resolve_sources
from ace_common.tiers import Tier
from extproc.state.store import Snapshot

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


class SettingsPage(HeadersOnly):
    """The page's static files: open without a key (they hold no tenant data)."""

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        name, content_type = _ASSETS[head.path]
        body = _asset(name)
        return Reply(200, b"" if head.method == "HEAD" else body,
                     (("content-type", content_type), *_SECURITY_HEADERS))


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


def _tenant_keys(snap: Snapshot, p: Principal) -> dict[str, Any]:
    """The tenant's keys, revoked ones last-known too: never a secret or a whole digest."""
    now = time.time()
    tenant = p.tenant
    everyone = {**snap.revoked_keys, **snap.keys}
    keys = sorted((k for k in everyone.values() if k.tenant == tenant.id), key=lambda k: (k.name, k.sha256))
    return {"tenant": tenant.id,
            "keys": [{**_key_view(snap, Principal(key=k, tenant=tenant)),
                      **key_listing(k, k.sha256 in snap.revoked_keys, now)} for k in keys]}


class TenantKeys(_ConsoleCall):
    """``GET``: the tenant's keys; ``POST {"name", "role", "expires"}``: issue one (201, with
    the secret: the only time it is shown)."""

    methods = ("GET", "POST")
    admin_only = True

    def read(self, snap: Snapshot, head: RequestHead) -> Reply:
        return _json(_tenant_keys(snap, self.principal))

    def on_request_body(self, body: bytes) -> Outcome:
        self.check_size(body)
        req = parse_object(body)
        caller = self.principal.key
        tenant = req.get("tenant", caller.tenant)
        role = parse_role(req.get("role", "developer"))
        check_grant(caller, tenant, role)
        name = req.get("name", "")
        if not isinstance(name, str) or len(name) > 200 or not name.isprintable():
            # printable: a name is shown on the settings page and written in log lines
            raise InvalidField("name must be a string of at most 200 printable characters", param="name")
        now = time.time()
        secret, new = issue(tenant, name, role, parse_expiry(req.get("expires"), now), now)
        snap = self.gw.store.add_key(new)
        return _issued_reply(snap, new.sha256, secret)


def _issued_reply(snap: Snapshot, digest: str, secret: str, **extra: Any) -> Reply:
    """201 with the new key's listing and its secret: the only time the secret is shown."""
    view = key_listing(snap.keys[digest], False, time.time())
    return _json({"key": view, "secret": secret, **extra}, status=201)


class _TenantKeyChange(_ConsoleCall):
    """``POST {"id": "<12 hex>"}`` on a key of the caller's tenant (another tenant's: 404)."""

    methods = ("POST",)
    admin_only = True

    def on_request_body(self, body: bytes) -> Outcome:
        self.check_size(body)
        req = parse_object(body)
        snap = self.gw.store.snapshot
        target = find_key({**snap.revoked_keys, **snap.keys}, req.get("id"), tenant=self.principal.tenant.id)
        check_grant(self.principal.key, target.tenant, target.role)   # an admin's key is an admin's to change
        return self.change(snap, target)

    def change(self, snap: Snapshot, target: DevKey) -> Reply:
        raise NotImplementedError


class TenantKeyRotate(_TenantKeyChange):
    """A new secret for the key, the old one revoked now (no grace: docs/gateway.md)."""

    def change(self, snap: Snapshot, target: DevKey) -> Reply:
        if target.sha256 in snap.revoked_keys:
            raise InvalidField(f"key {target.id} is revoked: issue a new key instead", param="id")
        secret, new = rotation(target, time.time())
        snap = self.gw.store.add_key(new, revoke=target.sha256)
        return _issued_reply(snap, new.sha256, secret, replaced=target.id)   # its own key too


class TenantKeyRevoke(_TenantKeyChange):
    def change(self, snap: Snapshot, target: DevKey) -> Reply:
        snap = self.gw.store.revoke_key(target.sha256)
        p = self.principal
        if target.sha256 == p.key.sha256:      # its own key: nothing more to show it
            return _json({"revoked": target.id})
        return _json({"revoked": target.id, **_tenant_keys(snap, self.current(snap))})


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
    "/api/v1/tenant/keys/rotate": TenantKeyRotate,
    "/api/v1/tenant/keys/revoke": TenantKeyRevoke,
    "/api/v1/adapters": Adapters,
    "/api/v1/usage": Usage,
}
