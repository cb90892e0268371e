"""Translate between ext_proc protobuf messages (upb classes from xds-protos) and plain objects."""
from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf.message import DecodeError

from extproc.app.outcomes import Continue, Outcome, Reply, RequestHead
from extproc.domain.headers import SESSION_HEADER, SKILL_OVERRIDE_HEADER, TENANT_HEADER

__all__ = ["UNREADABLE", "parse_request", "request_head", "head_from_attributes", "to_response", "serialize_response", "set_headers", "pb",
           "METADATA_NAMESPACE", "SERVICE", "NO_PHASE", "HEALTH_SERVICES"]

# ImmediateResponse.details of every answer the gateway makes itself: Envoy's local-reply
# mappers (envoy/envoy.template.yaml) leave those bodies alone (they are OpenAI JSON already)
GATEWAY_REPLY_DETAILS = "ace_gateway_reply"

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"   # the gRPC service name
#: gRPC health services every flavour answers: the server, ext_proc, and the endpoint picker
#: protocol's ``liveness`` and ``readiness`` (SERVING once listening; NOT_SERVING when draining)
HEALTH_SERVICES = ("", SERVICE, "liveness", "readiness")
NO_PHASE = "ProcessingRequest without a request phase"    # INVALID_ARGUMENT, every server flavour

METADATA_NAMESPACE = "ace"
_ATTRS = "envoy.filters.http.ext_proc"
_HEADER_ATTR = "request.headers['"
_HEADER_CUT = len(_HEADER_ATTR)
_METHOD, _PATH = "request.method", "request.url_path"
#: (attribute key, header name) of the headers ace's Envoy config sends as request_attributes
_ASKED = tuple((f"{_HEADER_ATTR}{name}']", name)
               for name in ("authorization", TENANT_HEADER, SKILL_OVERRIDE_HEADER, SESSION_HEADER,
                            "content-encoding"))

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_EMPTY = {phase: pb.ProcessingResponse(**{phase: {}}) for phase in (
    "request_headers", "request_body", "response_headers", "response_body",
    "request_trailers", "response_trailers")}


#: what ``parse_request`` returns for bytes that do not parse: this one (empty) instance,
#: told apart by identity (not None: grpcio's sync server takes None as a failed parse)
UNREADABLE = pb.ProcessingRequest()


def parse_request(data: bytes) -> pb.ProcessingRequest:
    """A ``ProcessingRequest`` from its bytes, or ``UNREADABLE`` when they do not parse. A
    client reaches this: Envoy copies a header it was asked for (``request_attributes``)
    into a proto ``string``, which must be UTF-8, and HTTP/1 lets a header carry any byte
    (an ``Authorization: Bearer \\xff``). The stream answers it with a 400 (``dispatch``)."""
    try:
        return pb.ProcessingRequest.FromString(data)
    except DecodeError:
        return UNREADABLE


def request_head(msg: pb.HttpHeaders) -> RequestHead:
    headers = {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
               for h in msg.headers.headers}
    path = headers.get(":path", "")
    q = path.find("?")
    return RequestHead(method=headers.get(":method", ""), path=path if q < 0 else path[:q],
                       headers=headers, end_of_stream=msg.end_of_stream)


def head_from_attributes(msg: pb.ProcessingRequest) -> RequestHead | None:
    """The request line and the headers we asked Envoy for (request_attributes).

    The attributes ace's Envoy config asks for are looked up by key (a map lookup each);
    only a message with others (another config) takes the pass over every key."""
    attrs = msg.attributes.get(_ATTRS)
    if attrs is None:
        return None
    fields = attrs.fields
    headers = {}
    method = path = ""
    found = 0
    if _METHOD in fields:
        method = fields[_METHOD].string_value
        found = 1
    if _PATH in fields:
        path = fields[_PATH].string_value
        found += 1
    for key, name in _ASKED:
        if key in fields:
            headers[name] = fields[key].string_value
            found += 1
    if found == len(fields):
        return RequestHead(method, path, headers, False)
    headers = {}
    # one pass over the keys, then lookups: the upb map's items() is collections.abc's
    # ItemsView, in Python
    for key in fields:
        if key.startswith(_HEADER_ATTR):
            headers[key[_HEADER_CUT:-2]] = fields[key].string_value
        elif key == _METHOD:
            method = fields[key].string_value
        elif key == _PATH:
            path = fields[key].string_value
    return RequestHead(method, path, headers, False)


def set_headers(mutation: pb.HeaderMutation, headers, metadata=(), owned=None) -> None:
    """Overwrite semantics: a client cannot smuggle a gateway-owned header in. ``owned``
    (the endpoint picker protocol): metadata key -> header name; those of ``metadata`` are
    set, the others removed."""
    if owned:
        values = dict(metadata)
        headers = (*headers, *((name, values[key]) for key, name in owned.items() if key in values))
        mutation.remove_headers.extend(name for key, name in owned.items() if key not in values)
    for key, value in headers:
        mutation.set_headers.add(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                 append_action=_OVERWRITE)


def to_response(phase: str, outcome: Outcome) -> pb.ProcessingResponse:
    """``phase`` is the ProcessingRequest oneof name the outcome answers."""
    if isinstance(outcome, Reply):
        resp = pb.ProcessingResponse()
        imm = resp.immediate_response
        imm.status.code = outcome.status
        imm.details = GATEWAY_REPLY_DETAILS
        imm.body = outcome.body
        set_headers(imm.headers, outcome.headers)
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
        set_headers(common.header_mutation, outcome.headers)
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


_SMALL = [bytes((n,)) for n in range(0x80)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited protobuf field (``tag``: the one byte field number << 3 | 2)."""
    return tag + _varint(len(payload)) + payload


# ProcessingResponse field numbers of the phases whose answer holds a CommonResponse
# (``<phase>.response``, field 1), as length-delimited tags
_PHASE_TAG = {"request_headers": b"\x0a", "response_headers": b"\x12", "request_body": b"\x1a",
              "response_body": b"\x22"}
_EMPTY_BYTES = {phase: msg.SerializeToString() for phase, msg in _EMPTY.items()}
_APPEND_OVERWRITE = b"\x18" + _varint(_OVERWRITE)   # HeaderValueOption.append_action
_KEYS: dict[str, bytes] = {}   # header name -> its HeaderValue.key field


def _header_mutation(headers: tuple[tuple[str, str], ...]) -> bytes:
    """CommonResponse.header_mutation (2): HeaderMutation{set_headers: [HeaderValueOption{
    header: HeaderValue{key, raw_value}, append_action: OVERWRITE_IF_EXISTS_OR_ADD}]}.
    Empty strings are not written (proto3 defaults), as upb does."""
    options = b""
    for key, value in headers:
        name = _KEYS.get(key)
        if name is None:
            name = _field(b"\x0a", key.encode()) if key else b""
            if len(_KEYS) < _METADATA_CACHE_SIZE:   # the exchange sets a handful of names
                _KEYS[key] = name
        raw = value.encode()
        header = name + _field(b"\x1a", raw) if raw else name
        option = b"\x0a" + _varint(len(header)) + header + _APPEND_OVERWRITE
        options += b"\x0a" + _varint(len(option)) + option
    return b"\x12" + _varint(len(options)) + options


def _continue_bytes(phase: str, outcome: Continue, metadata: bytes) -> bytes:
    """``to_response(phase, outcome)`` without its metadata, written as protobuf bytes by
    hand in field-number order as upb writes them (the same bytes), then ``metadata``.
    The body is copied once."""
    common = _header_mutation(outcome.headers) if outcome.headers else b""
    body = outcome.body
    if body is None:
        return _PHASE_TAG[phase] + _varint(len(common) + 1 + len(_varint(len(common)))) \
            + b"\x0a" + _varint(len(common)) + common + metadata
    # CommonResponse.body_mutation (3) .body (1, a oneof member: written even when empty)
    mutation = b"\x0a" + _varint(len(body))
    common += b"\x1a" + _varint(len(mutation) + len(body)) + mutation
    size = len(common) + len(body)
    response = b"\x0a" + _varint(size)   # <phase>.response (1)
    return b"".join((_PHASE_TAG[phase], _varint(len(response) + size), response, common, body, metadata))


def serialize_response(phase: str, outcome: Outcome) -> bytes:
    """``to_response(phase, outcome).SerializeToString()``: the same message, cheaper.

    The metadata comes from a cache, and two serialized messages concatenated parse as
    their merge (the protobuf encoding's rule); the phase and ``dynamic_metadata`` are
    different fields, so the result parses to the same ProcessingResponse."""
    if isinstance(outcome, Reply) or phase not in _PHASE_TAG:
        return to_response(phase, outcome).SerializeToString()
    if not outcome.headers and outcome.body is None:
        if not outcome.metadata:
            return _EMPTY_BYTES[phase]
        return _PHASE_TAG[phase] + b"\x02\x0a\x00" + _metadata_bytes(outcome.metadata)
    return _continue_bytes(phase, outcome, _metadata_bytes(outcome.metadata) if outcome.metadata else b"")


_ = http_status_pb2  # imported so the status enum type is registered before first use
