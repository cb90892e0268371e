"""Warm set: which adapters each engine host loads at start-up, before any request.

The most popular adapters, each placed on the host its requests will be routed to
(its ``routing.place`` owner over the fleet's ``adapters`` when given, as
``routing.route`` places it on an empty cluster; else the consistent-hash owner of its
digest), so the warm set and routing agree. Hosts that fill up pass the adapter on
along the ring; the hottest ``replicas_for_top`` adapters are warmed on more than one host.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from extproc.policy.routing import place, ring_walk

__all__ = ["fill_set", "warm_set"]


def warm_set(
    popularity: Mapping[str, float],
    digests: Mapping[str, str],
    hosts: Sequence[str],
    per_host: int,
    *,
    replicas_for_top: int = 0,
    replicas: int = 2,
    adapters: Iterable[str] | None = None,
) -> dict[str, list[str]]:
    """host -> adapters to prefetch at start-up, hottest first.

    ``popularity``: adapter -> request count or rate (e.g. the last day's counts, or the
    catalog's prior); ``digests``: adapter -> content digest (the routing key);
    ``per_host``: slots to fill on each host (leave room for demand); ``adapters``:
    every adapter of the fleet (what ``route`` places over).
    """
    out: dict[str, list[str]] = {h: [] for h in hosts}
    if not hosts or per_host <= 0:
        return out
    ranked = sorted(popularity, key=lambda a: (-popularity[a], a))
    host_tuple = tuple(hosts)
    owners = None if adapters is None else place([*adapters, *popularity], host_tuple)
    for rank, adapter in enumerate(ranked):
        copies = replicas if rank < replicas_for_top else 1
        if owners is None:
            walk = ring_walk(host_tuple, digests.get(adapter, adapter))
        else:
            walk = [owners[adapter], *(h for h in ring_walk(host_tuple, adapter) if h != owners[adapter])]
        for h in walk:
            if copies == 0:
                break
            if len(out[h]) < per_host:
                out[h].append(adapter)
                copies -= 1
        if all(len(v) >= per_host for v in out.values()):
            break
    return out


def fill_set(public: Mapping[str, bool], hosts: Sequence[str]) -> dict[str, list[str]]:
    """host -> adapters to offer its empty pool when nothing was learned (no popularity):
    every adapter of ``public`` (name -> visible to every tenant) on its ``routing.place``
    owner, where ``route`` sends it on an empty fleet; public ones first, then by name (the
    caller bounds how many it offers)."""
    out: dict[str, list[str]] = {h: [] for h in hosts}
    if not hosts or not public:
        return out
    owners = place(sorted(public), tuple(hosts))
    for adapter in sorted(public, key=lambda a: (not public[a], a)):
        out[owners[adapter]].append(adapter)
    return out
