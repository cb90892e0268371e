"""How long one thread may hold the GIL while another waits for it, set once per process.

Both deployables run pure-Python work beside latency-sensitive work in one process: the
gateway's speculation thread beside its request path, the agent's loads beside the builtin
engine's forward steps. At CPython's default (5 ms) the waiting side may wait that long at
each switch; ``--gil-switch-ms`` of the ext_proc and of the agent sets it (docs/gateway.md,
*The request path and the speculation thread*; docs/agent.md).
"""
from __future__ import annotations

import sys

__all__ = ["set_switch_interval"]


def set_switch_interval(ms: float) -> None:
    """``sys.setswitchinterval`` in milliseconds; 0 leaves Python's default as it is."""
    if ms:
        sys.setswitchinterval(ms / 1000.0)
