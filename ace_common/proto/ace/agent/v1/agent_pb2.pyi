from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_ABSENT: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_ABSENT: Tier
TIER_REMOTE: Tier
TIER_DISK: Tier
TIER_HOST: Tier
TIER_DEVICE: Tier

class PrefetchRequest(_message.Message):
    __slots__ = ("adapter", "digest", "priority", "reason", "evict", "probability", "victim_reuse_probability", "keep", "room_only")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    VICTIM_REUSE_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    ROOM_ONLY_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    digest: str
    priority: int
    reason: str
    evict: _containers.RepeatedScalarFieldContainer[str]
    probability: float
    victim_reuse_probability: float
    keep: _containers.RepeatedScalarFieldContainer[str]
    room_only: bool
    def __init__(self, adapter: _Optional[str] = ..., digest: _Optional[str] = ..., priority: _Optional[int] = ..., reason: _Optional[str] = ..., evict: _Optional[_Iterable[str]] = ..., probability: _Optional[float] = ..., victim_reuse_probability: _Optional[float] = ..., keep: _Optional[_Iterable[str]] = ..., room_only: _Optional[bool] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("outcome", "reason")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PrefetchReply.Outcome]
        ACCEPTED: _ClassVar[PrefetchReply.Outcome]
        ALREADY_RESIDENT: _ClassVar[PrefetchReply.Outcome]
        REJECTED: _ClassVar[PrefetchReply.Outcome]
    OUTCOME_UNSPECIFIED: PrefetchReply.Outcome
    ACCEPTED: PrefetchReply.Outcome
    ALREADY_RESIDENT: PrefetchReply.Outcome
    REJECTED: PrefetchReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: PrefetchReply.Outcome
    reason: str
    def __init__(self, outcome: _Optional[_Union[PrefetchReply.Outcome, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class AdapterStatus(_message.Message):
    __slots__ = ("adapter", "tier", "cold_load_ms", "bytes", "pinned", "digest", "loading", "loaded_by")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    COLD_LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    LOADED_BY_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    tier: Tier
    cold_load_ms: float
    bytes: int
    pinned: bool
    digest: str
    loading: bool
    loaded_by: str
    def __init__(self, adapter: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., cold_load_ms: _Optional[float] = ..., bytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., digest: _Optional[str] = ..., loading: _Optional[bool] = ..., loaded_by: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running", "waiting", "measured_unix_ms")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    measured_unix_ms: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., measured_unix_ms: _Optional[int] = ...) -> None: ...

class ResidencyEvent(_message.Message):
    __slots__ = ("kind", "status", "seq", "engine_up", "base_model_bytes", "load", "device_slots", "prefetch_waste_share", "request_signals_redundant")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ResidencyEvent.Kind]
        INITIAL: _ClassVar[ResidencyEvent.Kind]
        SYNC: _ClassVar[ResidencyEvent.Kind]
        CHANGE: _ClassVar[ResidencyEvent.Kind]
        LOAD: _ClassVar[ResidencyEvent.Kind]
    KIND_UNSPECIFIED: ResidencyEvent.Kind
    INITIAL: ResidencyEvent.Kind
    SYNC: ResidencyEvent.Kind
    CHANGE: ResidencyEvent.Kind
    LOAD: ResidencyEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENGINE_UP_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SIGNALS_REDUNDANT_FIELD_NUMBER: _ClassVar[int]
    kind: ResidencyEvent.Kind
    status: AdapterStatus
    seq: int
    engine_up: bool
    base_model_bytes: int
    load: EngineLoad
    device_slots: int
    prefetch_waste_share: float
    request_signals_redundant: bool
    def __init__(self, kind: _Optional[_Union[ResidencyEvent.Kind, str]] = ..., status: _Optional[_Union[AdapterStatus, _Mapping]] = ..., seq: _Optional[int] = ..., engine_up: _Optional[bool] = ..., base_model_bytes: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., device_slots: _Optional[int] = ..., prefetch_waste_share: _Optional[float] = ..., request_signals_redundant: _Optional[bool] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("adapter", "down_to")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DOWN_TO_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    down_to: Tier
    def __init__(self, adapter: _Optional[str] = ..., down_to: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted", "reason", "status")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    reason: str
    status: AdapterStatus
    def __init__(self, evicted: _Optional[bool] = ..., reason: _Optional[str] = ..., status: _Optional[_Union[AdapterStatus, _Mapping]] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("ok", "reason", "status")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    status: AdapterStatus
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., status: _Optional[_Union[AdapterStatus, _Mapping]] = ...) -> None: ...
