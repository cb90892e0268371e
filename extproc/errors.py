"""Every error of the gateway (one root, ``AceError``), and every error a client can see,
with its HTTP status and OpenAI-shaped JSON body.

    AceError                         any error of extproc (catch this for "the gateway's own")
    ├── ConfigError                  the gateway's configuration is invalid (start-up only)
    ├── DiscoveryError               a discovery source failed (extproc.fleet.discovery)
    ├── ProtocolError                an HTTP/2 peer broke the protocol (extproc.transport.h2frames)
    ├── InvalidMessage               an ext_proc message the protocol does not allow
    │                                (the gRPC stream ends with INVALID_ARGUMENT)
    └── GatewayError                 (500, internal: never raised on purpose)
        ├── BadRequest               400  malformed JSON, missing body
        ├── Unauthorized             401  missing or unknown API key
        ├── Forbidden                403  x-ace-tenant-id inconsistent with the key
        ├── NotFound                 404  unknown adapter, or another tenant's adapter
        ├── MethodNotAllowed         405  wrong HTTP method on a gateway route
        ├── PayloadTooLarge          413  body over the configured limit
        ├── UnsupportedMediaType     415  a settings write without Content-Type: application/json
        ├── InvalidField             422  a field with a value we cannot accept
        ├── TooManyRequests          429  every eligible engine host is over its load (endpoint picker)
        ├── NoUpstream               503  no engine host to send the request to: none is known
        │                                 (``no_upstream``: discovery found none), or none in
        │                                 the endpoint picker's subset hint (``no_endpoint``)
        └── StoreUnavailable         503  a runtime change could not be stored (state database
                                          down): nothing was changed, retry

``GatewayError`` s are raised anywhere in the request path and turned into a response at
exactly one boundary per protocol: ``extproc.app.exchange.Exchange`` (via ``GatewayError.to_json``),
and ``epp.EppStream`` for what the endpoint picker protocol refuses before a handler runs.
"""
from __future__ import annotations

import json

__all__ = [
    "AceError", "BadRequest", "ConfigError", "Forbidden", "GatewayError", "InvalidField",
    "InvalidMessage", "MethodNotAllowed", "NoUpstream", "NotFound", "PayloadTooLarge",
    "StoreUnavailable", "TooManyRequests", "Unauthorized", "UnsupportedMediaType",
]


class AceError(Exception):
    """The root of every error the gateway raises on purpose."""


class ConfigError(AceError):
    """The gateway's own configuration is invalid (start-up only, never per request).

    ``field``: the path of the value to blame in its file (``tenants[1].id``), when one is."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidMessage(AceError):
    """An ext_proc message the protocol does not allow (no request phase): the servers end
    the gRPC stream with INVALID_ARGUMENT and this message."""


class GatewayError(AceError):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_json(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type,
                                     "param": self.param, "code": self.code}}).encode()


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "bad_request"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "tenant_mismatch"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "adapter_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class InvalidField(GatewayError):
    status = 422
    type = "invalid_request_error"
    code = "invalid_value"


class TooManyRequests(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"


class NoUpstream(GatewayError):
    """No engine host to send the request to. ``code``: ``no_upstream`` (none is known),
    ``no_endpoint`` (none in the endpoint picker's subset hint)."""

    status = 503
    type = "service_unavailable"
    code = "no_upstream"


class StoreUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "store_unavailable"
