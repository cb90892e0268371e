"""API keys issued at runtime: create, rotate, revoke, list (docs/gateway.md, "Key lifecycle").

The one owner of what a key operation means, for both doors to it: the admin CLI
(``python -m extproc.admin``, any tenant) and the settings API (a tenant admin's key, its
own tenant only). A secret is made here, shown to its caller once and never kept: the
state database stores its SHA-256 (``extproc.state.db.IssuedKey``).

- **create**: a new secret ``sk-ace-<43 url-safe chars>`` (256 random bits) for a tenant, a
  name, a role (``developer``, or ``admin`` for a tenant admin: ``tenant-admin`` is accepted
  for it, stored and listed as the state file's ``admin``) and an
  optional expiry (a future ISO 8601 time; past it the key is 401 ``expired_api_key``).
- **rotate**: a new secret with the old key's tenant, name, role, expiry and skills, and the
  old key revoked in the same transaction: **immediately**, no grace period (a client with
  the old secret gets 401 as soon as its replica applies the change). To overlap, create a
  second key, move the clients, then revoke the first.
- **revoke** / **restore**: ``Store.revoke_key`` (any key, a state file's too).

Who may grant what: ``may_grant`` (a role no higher than the caller's own).
"""
from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any, Mapping

from extproc.domain.auth import hash_key
from extproc.state.catalog import ADMIN, DEVELOPER, DevKey
from extproc.errors import Forbidden, InvalidField, NotFound
from extproc.state.db import IssuedKey

__all__ = ["ROLE_NAMES", "check_grant", "find_key", "issue", "key_listing", "may_grant", "parse_expiry", "parse_role",
           "rotation"]

#: the spellings a caller may use for a role -> the role as the state file stores it
ROLE_NAMES: Mapping[str, str] = {"developer": DEVELOPER, "tenant-admin": ADMIN, "admin": ADMIN}
_RANK = {DEVELOPER: 0, ADMIN: 1}
_SECRET_PREFIX = "sk-ace-"
_ID_HEX = 12


def parse_role(text: Any) -> str:
    role = ROLE_NAMES.get(text) if isinstance(text, str) else None
    if role is None:
        raise InvalidField(f"role must be one of {', '.join(ROLE_NAMES)}", param="role")
    return role


def may_grant(caller_role: str, role: str) -> bool:
    """A caller issues keys of its own role or a lower one, never a higher one."""
    return _RANK[role] <= _RANK[caller_role]


def parse_expiry(text: Any, now: float) -> float | None:
    """``None``/empty: never. Else an ISO 8601 date or time (no zone: UTC) after ``now``."""
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise InvalidField("expires must be an ISO 8601 time, e.g. 2027-01-31T00:00:00Z", param="expires")
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidField(f"expires: {text!r} is not an ISO 8601 time, e.g. 2027-01-31T00:00:00Z",
                           param="expires") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    at = when.timestamp()
    if at <= now:
        raise InvalidField(f"expires: {text} is not in the future", param="expires")
    return at


def _secret() -> tuple[str, str]:
    secret = _SECRET_PREFIX + secrets.token_urlsafe(32)
    return secret, hash_key(secret)


def issue(tenant: str, name: str, role: str, expires_at: float | None, now: float,
          skills: Mapping[str, str] | None = None) -> tuple[str, IssuedKey]:
    """A new key: its secret (to show once) and what is stored (its SHA-256)."""
    secret, digest = _secret()
    return secret, IssuedKey(sha256=digest, tenant=tenant, name=name, role=role, created_at=now,
                             expires_at=expires_at, skills=dict(skills or {}))


def rotation(old: DevKey, now: float) -> tuple[str, IssuedKey]:
    """The key that replaces ``old``: same tenant, name, role, expiry and current skills."""
    return issue(old.tenant, old.name, old.role, old.expires_at, now, old.skills)


def find_key(keys: Mapping[str, DevKey], key_id: str, tenant: str | None = None) -> DevKey:
    """The key whose SHA-256 starts with ``key_id`` (the 12-hex id, or the whole digest),
    among ``keys``; ``tenant``: only that tenant's (another tenant's key is not found)."""
    wanted = key_id.strip().lower() if isinstance(key_id, str) else ""
    if len(wanted) < _ID_HEX or any(c not in "0123456789abcdef" for c in wanted):
        raise InvalidField(f"a key id is the first {_ID_HEX} (or all 64) hex digits of the key's SHA-256",
                           param="id")
    found = [k for d, k in keys.items() if d.startswith(wanted) and (tenant is None or k.tenant == tenant)]
    if not found:
        raise NotFound(f"no key {wanted}" + (f" in tenant {tenant}" if tenant else ""), param="id",
                       code="key_not_found")
    if len(found) > 1:
        raise InvalidField(f"key id {wanted} names {len(found)} keys: give the whole SHA-256", param="id")
    return found[0]


def check_grant(caller: DevKey, tenant: str, role: str) -> None:
    """A tenant admin acts on its own tenant, and grants no role above its own."""
    if tenant != caller.tenant:
        raise Forbidden("a tenant admin manages its own tenant's keys only", param="tenant")
    if not may_grant(caller.role, role):
        raise Forbidden(f"a key of role {caller.role} cannot issue keys of role {role}",
                        param="role", code="role_escalation")


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")


def key_listing(key: DevKey, revoked: bool, now: float) -> dict[str, Any]:
    """What a listing shows of a key: never the secret, nor the whole digest."""
    return {"id": key.id, "name": key.name, "tenant": key.tenant, "role": key.role,
            "origin": str(key.origin), "created": _iso(key.created_at), "expires": _iso(key.expires_at),
            "expired": key.expires_at is not None and now >= key.expires_at, "revoked": revoked}
