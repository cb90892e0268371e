"""``python -m extproc.admin``: administrative changes to the gateway's runtime state.

    python -m extproc.admin revoke-key  --key-sha256 HEX [--database-url URL | --db PATH]
    python -m extproc.admin restore-key --key-sha256 HEX [--database-url URL | --db PATH]

A key is named by its SHA-256 (``printf %s "$KEY" | sha256sum``), as in the state file.
The change is written to the state database the gateways use (``--database-url`` /
``ACE_EXTPROC_DATABASE_URL``, else ``--db`` / ``ACE_EXTPROC_DB``). On PostgreSQL every
replica applies it on the write's NOTIFY; a gateway on a SQLite file applies it at its
next version check (every 2 s). Removing the key from the state file and rolling the
gateways works too; revocation here needs no roll-out and overrides the file.
"""
from __future__ import annotations

import argparse
import os
import sys

from extproc.errors import GatewayError
from extproc.state.db import open_state_db

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.admin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("revoke-key", "restore-key"))
    p.add_argument("--key-sha256", required=True, help="hex SHA-256 of the key (never the key)")
    p.add_argument("--database-url", default=os.environ.get("ACE_EXTPROC_DATABASE_URL"),
                   help="postgresql:// URL of the shared state (env ACE_EXTPROC_DATABASE_URL)")
    p.add_argument("--db", default=os.environ.get("ACE_EXTPROC_DB", "ace-gateway.sqlite3"),
                   help="SQLite file of a single gateway (env ACE_EXTPROC_DB), without --database-url")
    a = p.parse_args(argv)
    digest = a.key_sha256.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        p.error("--key-sha256 must be the hex SHA-256 of the key (never the key)")
    try:
        db = open_state_db(a.database_url or a.db)
        try:
            overlay = db.set_revoked(digest, a.command == "revoke-key")
        finally:
            db.close()
    except GatewayError as exc:
        print(f"extproc.admin: {exc.message}", file=sys.stderr)
        return 1
    state = "revoked" if digest in overlay.revoked else "not revoked"
    print(f"key {digest[:12]}…: {state} (state version {overlay.version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
