"""The shared vocabulary's one error root.

    CommonError
    └── SchemaError   (ace_common.catalog_schema; also a ValueError) a YAML file does not
                      match its schema

Each deployable turns these into its own errors at its boundary: the gateway into a
``ConfigError`` (extproc.state.schema), the agent into a ``CatalogError``
(gpu_agent.artifacts). A state-file error in the gateway is therefore never an agent error.
"""
from __future__ import annotations

__all__ = ["CommonError"]


class CommonError(Exception):
    """Base of every error ``ace_common`` raises on purpose."""
