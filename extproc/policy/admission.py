"""Admission: whether a request is let in at all, before anything is decided or signalled.

Load shedding (``--shed-load N``, the endpoint picker protocol today): a 429 when every
eligible host already carries ``N`` or more requests, counted as routing counts them
(``extproc.state.residency.host_load``: its agent's last measurement plus the requests
routed there since). A host without a fresh measurement counts as 0: unknown load never
sheds. ``N`` = 0: never shed.
"""
from __future__ import annotations

from typing import Sequence

from extproc.errors import TooManyRequests
from extproc.state.catalog import Upstream
from extproc.state.residency import ResidencySnapshot, SentCounts, host_load

__all__ = ["admit"]


def admit(eligible: Sequence[Upstream], residency: ResidencySnapshot, sent: SentCounts, bound: int) -> None:
    """Raise ``TooManyRequests`` when every eligible host is at ``bound`` (0: never)."""
    if not bound:
        return
    if all((host_load(residency, sent, u.name) or 0) >= bound for u in eligible):
        raise TooManyRequests(f"every eligible endpoint has {bound} or more requests in flight")
