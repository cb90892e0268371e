"""Errors raised by the GPU agent's memory and compute core.

One hierarchy, so callers (the engine, the agent service) map them to HTTP / gRPC
statuses at exactly one boundary::

    AgentError
    ├── AdapterInvalid          the adapter directory is not one we can serve
    │   ├── BaseModelMismatch   base_model_name_or_path names another model
    │   └── UnsupportedFeature  DoRA, modules_to_save, rank_pattern, ...
    ├── DigestMismatch          SHA-256 of adapter_model.safetensors differs
    ├── AdapterNotFound         no such adapter directory / unsafe name
    ├── PoolExhausted           a load cannot be satisfied even after eviction
    ├── AdapterNotResident      a batch names an adapter that is not in the pool
    ├── AdapterBusy             evicting an adapter that is pinned or in use
    ├── LoadYielded             a prefetch's load stopped at a checkpoint for a request's
    │                           load (internal: the engine resumes it afterwards)
    ├── PrefetchGivenUp         a priced prefetch whose hinted victims are in use (internal:
    │                           counted, not a failed load)
    ├── SettingsError           (gpu_agent.settings; also a ValueError) bad flag / env / file
    ├── ChatTemplateError       (gpu_agent.engine.tokenizer; also a ValueError)
    ├── CatalogError, FetchError  (gpu_agent.artifacts)
    ├── ConnectorError          (gpu_agent.connectors.base) the engine refused a load/unload
    │   └── EngineUnavailable   the engine cannot be reached
    └── EngineError             (gpu_agent.engine.errors) the builtin engine's HTTP errors

Every exception the package raises on purpose derives from ``AgentError``; the ones
callers (the gateway among them) catch as ``ValueError`` keep it as a second base. No
imports. A catalog that does not match its schema is ``ace_common``'s ``SchemaError``
(its own root, ``ace_common.errors.CommonError``), turned into a ``CatalogError`` here.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "AdapterInvalid",
    "BaseModelMismatch",
    "UnsupportedFeature",
    "DigestMismatch",
    "AdapterNotFound",
    "PoolExhausted",
    "AdapterNotResident",
    "AdapterBusy",
    "LoadYielded",
    "PrefetchGivenUp",
]


class AgentError(Exception):
    """Base of every error the agent core raises on purpose."""


class AdapterInvalid(AgentError):
    """The adapter files do not describe a LoRA adapter for the served base model."""


class BaseModelMismatch(AdapterInvalid):
    """The adapter was trained for another base model."""


class UnsupportedFeature(AdapterInvalid):
    """The adapter uses a PEFT feature the pool cannot represent."""


class DigestMismatch(AgentError):
    """adapter_model.safetensors does not hash to the catalog's SHA-256."""


class AdapterNotFound(AgentError):
    """No adapter directory for this name (or the name is not a safe path part)."""


class PoolExhausted(AgentError):
    """Not enough evictable pages for the requested load."""


class AdapterNotResident(AgentError):
    """A batch refers to an adapter that is not loaded in the pool."""


class AdapterBusy(AgentError):
    """The adapter is pinned or in use by a running batch and cannot be evicted."""


class LoadYielded(AgentError):
    """A prefetch's load stopped at a checkpoint (before its read, before its pool copy,
    between chunks of the copy) because a request's load is waiting; nothing of it stays
    in the pool. ``stage`` says where (``read`` or ``copy``)."""

    def __init__(self, name: str, stage: str):
        super().__init__(f"load of {name!r} yielded at {stage} to a request's load")
        self.name = name
        self.stage = stage


class PrefetchGivenUp(AgentError):
    """A priced prefetch (one that came with a probability: a bet against its hinted
    victims) whose hinted victims could not be evicted because a request is about to use
    them: it is given up rather than paid for with the LRU adapter, whose reuse nobody
    priced (``gpu_agent.residency.holdings.TierHoldings.make_device_room``)."""
