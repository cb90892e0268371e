"""``python -m extproc.admin``: administrative changes to the gateway's runtime state.

    python -m extproc.admin create-key  --tenant T [--name N] [--role developer|tenant-admin] [--expires ISO]
    python -m extproc.admin list-keys   [--tenant T] [--json]
    python -m extproc.admin rotate-key  --key-id ID
    python -m extproc.admin revoke-key  --key-sha256 HEX | --key-id ID
    python -m extproc.admin restore-key --key-sha256 HEX | --key-id ID

    common: [--config state.yaml] [--catalog FILE] [--database-url URL | --db PATH]

``create-key`` and ``rotate-key`` print the new secret once, alone on stdout (so
``KEY=$(python -m extproc.admin create-key ...)`` captures it) and its id on stderr; only
its SHA-256 is stored. A key is named by its id (the first 12 hex digits of its SHA-256, as
``list-keys`` and the settings page show it) or its whole SHA-256 (``printf %s "$KEY" |
sha256sum``). Rotation revokes the old key at once, no grace period (docs/gateway.md, "Key
lifecycle"). ``--config`` (env ``ACE_EXTPROC_CONFIG``, the gateway's state file) is needed
by every command but ``revoke-key``/``restore-key --key-sha256``: it says which tenants
exist and holds the state file's keys.

The change is written to the state database the gateways use (``--database-url`` /
``ACE_EXTPROC_DATABASE_URL``, else ``--db`` / ``ACE_EXTPROC_DB``). On PostgreSQL every
replica applies it on the write's NOTIFY; a gateway on a SQLite file applies it at its
next version check (every 2 s).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from extproc.errors import AceError
from extproc.domain.key_lifecycle import ROLE_NAMES, find_key, issue, key_listing, parse_expiry, rotation
from extproc.state.db import open_state_db

__all__ = ["main"]

_NEEDS_CONFIG = ("create-key", "list-keys", "rotate-key")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m extproc.admin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("create-key", "list-keys", "rotate-key", "revoke-key", "restore-key"))
    p.add_argument("--key-sha256", help="hex SHA-256 of the key (never the key)")
    p.add_argument("--key-id", help="the key's id: the first 12 hex digits of its SHA-256 (list-keys shows it)")
    p.add_argument("--tenant", help="create-key: the key's tenant (in the state file); list-keys: only its keys")
    p.add_argument("--name", default="", help="create-key: a name for people (the settings page, list-keys)")
    p.add_argument("--role", default="developer", choices=tuple(ROLE_NAMES),
                   help="create-key: developer, or tenant-admin (alias admin): also the tenant's defaults and keys")
    p.add_argument("--expires", help="create-key: ISO 8601 time after which the key is refused "
                                     "(401 expired_api_key); no zone: UTC. Default: never")
    p.add_argument("--json", action="store_true", help="list-keys: one JSON object per line")
    p.add_argument("--config", default=os.environ.get("ACE_EXTPROC_CONFIG"),
                   help="the gateway's state file (env ACE_EXTPROC_CONFIG)")
    p.add_argument("--catalog", default=os.environ.get("ACE_EXTPROC_CATALOG"),
                   help="the gateway's extra catalog, if it has one (env ACE_EXTPROC_CATALOG)")
    p.add_argument("--database-url", default=os.environ.get("ACE_EXTPROC_DATABASE_URL"),
                   help="postgresql:// URL of the shared state (env ACE_EXTPROC_DATABASE_URL)")
    p.add_argument("--db", default=os.environ.get("ACE_EXTPROC_DB", "ace-gateway.sqlite3"),
                   help="SQLite file of a single gateway (env ACE_EXTPROC_DB), without --database-url")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.key_sha256 is not None:
        digest = a.key_sha256.strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            p.error("--key-sha256 must be the hex SHA-256 of the key (never the key)")
        a.key_sha256 = digest
    if a.command in ("revoke-key", "restore-key") and (a.key_sha256 is None) == (a.key_id is None):
        p.error(f"{a.command} needs --key-sha256 or --key-id")
    if a.command == "rotate-key" and a.key_id is None and a.key_sha256 is None:
        p.error("rotate-key needs --key-id (or --key-sha256)")
    if a.command == "create-key" and not a.tenant:
        p.error("create-key needs --tenant")
    if (a.command in _NEEDS_CONFIG or a.key_id is not None) and not a.config:
        p.error(f"{a.command} needs --config (the gateway's state file: its tenants and keys)")
    target = a.database_url or a.db
    try:
        if a.config is None:      # revoke/restore by SHA-256: the database alone
            db = open_state_db(target)
            try:
                overlay = db.set_revoked(a.key_sha256, a.command == "revoke-key")
            finally:
                db.close()
            state = "revoked" if a.key_sha256 in overlay.revoked else "not revoked"
            print(f"key {a.key_sha256[:12]}: {state} (state version {overlay.version})")
            return 0
        return _with_store(a, target)
    except AceError as exc:
        print(f"extproc.admin: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1


def _with_store(a: argparse.Namespace, target: Path | str) -> int:
    from extproc.state.store import Store
    store = Store(Path(a.config), target, Path(a.catalog) if a.catalog else None, watch=False,
                  upstreams_required=False)
    try:
        snap = store.snapshot
        everyone = {**snap.revoked_keys, **snap.keys}
        now = time.time()
        if a.command == "list-keys":
            for key in sorted(everyone.values(), key=lambda k: (k.tenant, k.name, k.sha256)):
                if a.tenant is None or key.tenant == a.tenant:
                    row = key_listing(key, key.sha256 in snap.revoked_keys, now)
                    print(json.dumps(row) if a.json else "  ".join(
                        f"{k}={'-' if v is None else v}" for k, v in row.items()))
            return 0
        if a.command == "create-key":
            if a.tenant not in snap.tenants:
                print(f"extproc.admin: unknown tenant {a.tenant} (not in {a.config})", file=sys.stderr)
                return 1
            secret, new = issue(a.tenant, a.name, ROLE_NAMES[a.role], parse_expiry(a.expires, now), now)
            store.add_key(new)
            _announce(secret, new.sha256, "created", store.version)
            return 0
        old = find_key(everyone, a.key_id or a.key_sha256)
        if a.command == "rotate-key":
            if old.sha256 in snap.revoked_keys:
                print(f"extproc.admin: key {old.id} is revoked: create a new key instead", file=sys.stderr)
                return 1
            secret, new = rotation(old, now)
            store.add_key(new, revoke=old.sha256)
            _announce(secret, new.sha256, f"replaces {old.id} (revoked now)", store.version)
            return 0
        snap = store.revoke_key(old.sha256, a.command == "revoke-key")
        state = "revoked" if old.sha256 in snap.revoked_keys else "not revoked"
        print(f"key {old.id}: {state} (state version {store.version})")
        return 0
    finally:
        store.close()


def _announce(secret: str, digest: str, what: str, version: int) -> None:
    print(secret)      # the only time the secret is shown: stdout, alone, for a script to capture
    print(f"key {digest[:12]} {what} (state version {version}); the secret above is not stored: "
          "keep it now", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
