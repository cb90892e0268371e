"""The tier vocabulary, one for the whole project: gateway, agent, protos, trace headers, docs.

Best first: ``device`` (the engine holds the adapter: its pages are in the paged pool of
the builtin engine, or vLLM/SGLang has it loaded) > ``host`` (its bytes in the agent's
memory) > ``disk`` (a verified local copy) > ``remote`` (only at its catalog URL).
``absent``: not in the catalog (the gateway's published word for it, in trace headers,
``/v1/execute``, the wire hints and the settings API, is ``none``: mapped at that edge,
``extproc.state.residency.TierReport.public_tier``). The protos' ``Tier`` enum has the
same members (``TIER_DEVICE`` ...); the gateway's view adds ``unknown`` (no agent report
yet). A ``StrEnum``: a member is its word wherever it is written (headers, JSON, labels).

No imports beyond the standard library: the gateway imports this module (it never imports
torch or the agent's runtime).
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["Tier", "ORDER"]


class Tier(StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"
    ABSENT = "absent"


ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE)   # best first
