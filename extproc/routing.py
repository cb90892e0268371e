"""Which upstream serves a request: the seam for residency-aware policies.

A policy is a plain function ``(upstreams, adapter, residency) -> Upstream``. The default,
``choose_upstream``, picks the first upstream serving the adapter's base model (or the
first upstream). A better policy (``extproc.policy.routing``) is plugged in by name with
``--routing-policy module:function`` without touching this file.
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence

from extproc.catalog import Adapter, Upstream
from extproc.errors import ConfigError
from extproc.residency_view import ResidencySnapshot

__all__ = ["RoutePolicy", "choose_upstream", "load_policy"]

RoutePolicy = Callable[[Sequence[Upstream], "Adapter | None", ResidencySnapshot], Upstream]


def choose_upstream(upstreams: Sequence[Upstream], adapter: Adapter | None,
                    residency: ResidencySnapshot) -> Upstream:
    if adapter is not None:
        for upstream in upstreams:
            if upstream.base_model == adapter.base_model:
                return upstream
    return upstreams[0]


def load_policy(spec: str | None) -> RoutePolicy:
    """``None`` -> ``choose_upstream``; ``"pkg.mod:func"`` -> that function."""
    if not spec:
        return choose_upstream
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"routing policy must be module:function, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load routing policy {spec}: {exc}") from exc
