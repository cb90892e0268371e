"""The request fields the gateway adds for the builtin engine, read by that engine.

``EVICT_FIRST``: the adapters the load of this request's adapter evicts first where it
needs device room (the gateway's model of that pool: the lowest predicted use), in order.
The gateway sets it when it sends a request whose adapter is not resident on a builtin
upstream (``extproc.rewrite``), and strips a client's copy from every request; the engine
hands it to its own load (``gpu_agent.engine.server``), as the agent does with a
Prefetch's ``evict``. It travels with the request instead of a Prefetch RPC: that RPC,
handled on the engine's event loop, delayed the fetch of the very files it named
(docs/agent.md, "The builtin engine gets a request's victims with the request"). At most
``MAX_EVICT_FIRST`` names are read, here and from a Prefetch's ``evict`` list.

No imports: both the gateway and the agent read it.
"""
from __future__ import annotations

__all__ = ["EVICT_FIRST", "MAX_EVICT_FIRST"]

EVICT_FIRST = "ace_evict_first"
MAX_EVICT_FIRST = 16
