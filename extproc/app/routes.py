"""The route table: which handler answers a path.

Handlers are registered per route path (``ROUTES``, ``PREFIX_ROUTES``); any other path is
default-deny (``extproc.state.paths``): ``GET /health`` open (``OpenPath``), an
upstream's ``allow_paths`` key-checked and routed (``extproc.app.inference.EngineRoute``),
anything else 404 after the key check.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

from extproc.app.console import CONSOLE_ROUTES
from extproc.app.dev_key_skills import DevKeySkills
from extproc.app.handlers import Handler, HeadersOnly
from extproc.app.inference import Embeddings, EngineRoute, Execute, Inference, Responses
from extproc.app.model_list import ModelList
from extproc.app.outcomes import CONTINUE, Outcome, RequestHead
from extproc.errors import MethodNotAllowed
from extproc.policy.routing import RoutePolicy
from extproc.state.paths import (CHAT, COMPLETIONS, EMBEDDINGS, EXECUTE, MODELS, MODELS_PREFIX, OPEN_PATHS,
                                 RESPONSES, normalize)

if TYPE_CHECKING:
    from extproc.app.context import Gateway

__all__ = ["ROUTES", "PREFIX_ROUTES", "OpenPath", "handler_for"]


class OpenPath(HeadersOnly):
    """``GET /health``: liveness for load balancers, no key, forwarded to the default
    upstream; headers only."""

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        return CONTINUE


ROUTES: Mapping[str, type[Handler]] = {   # every other path: handler_for's default deny
    CHAT: Inference,
    COMPLETIONS: Inference,
    RESPONSES: Responses,
    EMBEDDINGS: Embeddings,
    EXECUTE: Execute,
    MODELS: ModelList,
    "/api/v1/dev_key/skills": DevKeySkills,
    **CONSOLE_ROUTES,                       # the settings page and its read API
}
#: routes by path prefix (after ``ROUTES``): ``/v1/models/{id}``
PREFIX_ROUTES: Mapping[str, type[Handler]] = {MODELS_PREFIX: ModelList}


def handler_for(path: str) -> Callable[[Gateway, RoutePolicy], Handler]:
    """The handler of ``path``: its own, else default deny (``extproc.state.paths``)."""
    handler = ROUTES.get(path)
    if handler is not None:
        return handler
    for prefix, handler in PREFIX_ROUTES.items():
        if path.startswith(prefix):
            return handler
    return OpenPath if normalize(path) in OPEN_PATHS else EngineRoute
