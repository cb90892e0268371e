"""``python -m extproc --config state.yaml [--catalog catalog.yaml] ...``"""
from __future__ import annotations

import asyncio
import logging
import os
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
        agents = {u.name: u.agent for u in store.snapshot.upstreams if u.agent}
        link = None
        if agents:  # upstreams with a GPU agent: prefetch to it, residency from it
            from extproc.agent_client import AgentLink
            link = AgentLink(agents, token=os.environ.get("ACE_AGENT_TOKEN") or None,
                             queue_size=settings.prefetch_queue).start()
        gateway = Gateway(store, residency=link.board if link else None,
                          prefetch=link or NullPrefetchSink(), route=load_policy(settings.routing_policy))
    except ConfigError as exc:
        print(f"extproc: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        if settings.server == "aio":
            asyncio.run(serve_aio(gateway, settings.listen))
        else:
            serve(gateway, settings.listen, settings.workers)
    finally:
        if link is not None:
            link.close()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
