"""Translate between ext_proc protobuf messages (upb classes from xds-protos) and plain objects."""
from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.processor import Continue, Outcome, Reply, RequestHead

__all__ = ["request_head", "head_from_attributes", "to_response", "serialize_response", "pb",
           "METADATA_NAMESPACE", "SERVICE", "NO_PHASE"]

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"   # the gRPC service name
NO_PHASE = "ProcessingRequest without a request phase"    # INVALID_ARGUMENT, every server flavour

METADATA_NAMESPACE = "ace"
_ATTRS = "envoy.filters.http.ext_proc"
_HEADER_ATTR = "request.headers['"
_HEADER_CUT = len(_HEADER_ATTR)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_EMPTY = {phase: pb.ProcessingResponse(**{phase: {}}) for phase in (
    "request_headers", "request_body", "response_headers", "response_body",
    "request_trailers", "response_trailers")}


def request_head(msg: pb.HttpHeaders) -> RequestHead:
    headers = {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
               for h in msg.headers.headers}
    path = headers.get(":path", "")
    q = path.find("?")
    return RequestHead(method=headers.get(":method", ""), path=path if q < 0 else path[:q],
                       headers=headers, end_of_stream=msg.end_of_stream)


def head_from_attributes(msg: pb.ProcessingRequest) -> RequestHead | None:
    """The request line and the headers we asked Envoy for (request_attributes)."""
    attrs = msg.attributes.get(_ATTRS)
    if attrs is None:
        return None
    fields = attrs.fields
    # keys, then lookups: the upb map's items() is collections.abc's ItemsView, in Python
    headers = {key[_HEADER_CUT:-2]: fields[key].string_value
               for key in fields if key.startswith(_HEADER_ATTR)}
    path, method = fields.get("request.url_path"), fields.get("request.method")
    return RequestHead(method=method.string_value if method is not None else "",
                       path=path.string_value if path is not None else "",
                       headers=headers, end_of_stream=False)


def _set_headers(mutation: pb.HeaderMutation, headers) -> None:
    for key, value in headers:
        mutation.set_headers.add(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                 append_action=_OVERWRITE)


def to_response(phase: str, outcome: Outcome) -> pb.ProcessingResponse:
    """``phase`` is the ProcessingRequest oneof name the outcome answers."""
    if isinstance(outcome, Reply):
        resp = pb.ProcessingResponse()
        imm = resp.immediate_response
        imm.status.code = outcome.status
        imm.body = outcome.body
        _set_headers(imm.headers, outcome.headers)
        return resp
    if not outcome.headers and outcome.body is None and not outcome.metadata:
        return _EMPTY[phase]
    resp = pb.ProcessingResponse()
    if outcome.metadata:
        fields = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, value in outcome.metadata:
            fields[key].string_value = value
    common = getattr(resp, phase).response
    common.SetInParent()   # the phase must be set even when only metadata changes
    if outcome.headers:
        _set_headers(common.header_mutation, outcome.headers)
    if outcome.body is not None:
        common.body_mutation.body = outcome.body
    return resp


_METADATA_CACHE: dict[tuple[tuple[str, str], ...], bytes] = {}
_METADATA_CACHE_SIZE = 512


def _metadata_bytes(metadata: tuple[tuple[str, str], ...]) -> bytes:
    """A serialized ProcessingResponse holding only ``dynamic_metadata``. Requests of the same
    tenant, adapter, upstream and residency share it, and filling the Struct was a third of
    the response's cost."""
    out = _METADATA_CACHE.get(metadata)
    if out is None:
        resp = pb.ProcessingResponse()
        fields = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, value in metadata:
            fields[key].string_value = value
        out = resp.SerializeToString()
        if len(_METADATA_CACHE) >= _METADATA_CACHE_SIZE:
            _METADATA_CACHE.clear()
        _METADATA_CACHE[metadata] = out
    return out


def serialize_response(phase: str, outcome: Outcome) -> bytes:
    """``to_response(phase, outcome).SerializeToString()``, with the metadata from a cache.

    Two serialized messages concatenated parse as their merge (the protobuf encoding's
    rule), and the phase and ``dynamic_metadata`` are different fields, so the result
    parses to the same ProcessingResponse."""
    if isinstance(outcome, Reply) or not outcome.metadata:
        return to_response(phase, outcome).SerializeToString()
    resp = pb.ProcessingResponse()
    common = getattr(resp, phase).response
    common.SetInParent()
    if outcome.headers:
        _set_headers(common.header_mutation, outcome.headers)
    if outcome.body is not None:
        common.body_mutation.body = outcome.body
    return resp.SerializeToString() + _metadata_bytes(outcome.metadata)


_ = http_status_pb2  # imported so the status enum type is registered before first use
