"""Who is calling: ``Authorization: Bearer <key>`` -> key -> tenant.

Keys are known only by their SHA-256; the plaintext never leaves this function.
``x-ace-tenant-id`` is accepted only when it names the key's own tenant (else 403). A key
past its ``expires_at`` is 401 ``expired_api_key``.
"""
from __future__ import annotations

import time

from dataclasses import dataclass

from extproc.state.catalog import DevKey, Tenant
from extproc.errors import Forbidden, Unauthorized
from extproc.frozen import fast_init
from extproc.domain.headers import TENANT_HEADER
from extproc.state.store import Snapshot

try:   # CPython's own SHA-256: the same digest as OpenSSL's, and on a cold cache (one request
    from _sha256 import sha256 as _sha256    # at a time) half the cost of OpenSSL's EVP path
except ImportError:                          # (docs/gateway.md, "Speed"); 3.12+ names it _sha2
    try:
        from _sha2 import sha256 as _sha256
    except ImportError:
        from hashlib import sha256 as _sha256

__all__ = ["Principal", "authenticate", "hash_key"]


@fast_init
@dataclass(frozen=True, slots=True)
class Principal:
    key: DevKey
    tenant: Tenant


def hash_key(plaintext: str) -> str:
    return _sha256(plaintext.encode()).hexdigest()


def authenticate(snapshot: Snapshot, authorization: str | None, tenant_header: str | None) -> Principal:
    if not authorization:
        raise Unauthorized("missing Authorization: Bearer <key>", code="missing_api_key")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("Authorization must be 'Bearer <key>'")
    key = snapshot.keys.get(hash_key(token))
    if key is None:
        raise Unauthorized("invalid API key")
    if key.expires_at is not None and time.time() >= key.expires_at:
        raise Unauthorized("this API key has expired", code="expired_api_key")
    tenant = snapshot.tenants[key.tenant]
    if tenant_header is not None and tenant_header.strip() != tenant.id:
        raise Forbidden(f"{TENANT_HEADER} does not match the tenant of this API key",
                        param=TENANT_HEADER)
    return Principal(key=key, tenant=tenant)
