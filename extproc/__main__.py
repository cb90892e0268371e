"""``python -m extproc --config state.yaml [--catalog catalog.yaml] ...``"""
from __future__ import annotations

import asyncio
import logging
import sys

from extproc.errors import ConfigError
from extproc.prefetch import NullPrefetchSink
from extproc.processor import Gateway
from extproc.routing import load_policy
from extproc.server import serve, serve_aio
from extproc.settings import Settings
from extproc.store import Store


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_args(argv)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        store = Store(settings.config, settings.db, settings.catalog)
        gateway = Gateway(store, prefetch=NullPrefetchSink(), route=load_policy(settings.routing_policy))
    except ConfigError as exc:
        print(f"extproc: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        if settings.server == "aio":
            asyncio.run(serve_aio(gateway, settings.listen))
        else:
            serve(gateway, settings.listen, settings.workers)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
