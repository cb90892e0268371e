"""extproc.frozen.fast_init: the same objects as the dataclass's own __init__, still frozen."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from extproc.domain.auth import Principal
from extproc.domain.decision import Decision, InferenceRequest
from extproc.frozen import fast_init
from extproc.app.outcomes import Continue, Reply, RequestHead
from extproc.rewrite import Rewrite
from extproc.domain.selection import Selection

HOT = (Decision, InferenceRequest, Principal, Selection, RequestHead, Continue, Reply, Rewrite)


def _plain_twin(cls: type) -> type:
    """The same fields as a frozen slotted dataclass with the generated __init__."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
              for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__ + "Twin", fields, frozen=True, slots=True)


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_hot_classes_are_built_by_fast_init(cls):
    names = cls.__init__.__code__.co_names   # fast_init's, not the dataclass's object.__setattr__
    assert "_set0" in names and "__dataclass_builtins_object__" not in names
    assert [p for p in inspect.signature(cls.__init__).parameters] == \
        ["self"] + [f.name for f in dataclasses.fields(cls)]


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    a: int
    b: str = "b"
    c: tuple = dataclasses.field(default_factory=tuple)


Twin = _plain_twin(Sample)


@pytest.mark.parametrize("args,kwargs", [((1,), {}), ((1, "x"), {}), ((1, "x", (2,)), {}), ((), {"a": 3, "c": (4,)}),
                                         ((5,), {"b": "y"})])
def test_same_values_as_the_generated_init(args, kwargs):
    ours, theirs = Sample(*args, **kwargs), Twin(*args, **kwargs)
    assert dataclasses.astuple(ours) == dataclasses.astuple(theirs)
    assert repr(ours).removeprefix("Sample") == repr(theirs).removeprefix("SampleTwin")
    assert ours == Sample(*args, **kwargs) and hash(Sample(1)) == hash(Sample(1))


def test_default_factory_is_called_per_object():
    calls = []

    @fast_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Counted:
        a: object = dataclasses.field(default_factory=lambda: calls.append(1) or len(calls))

    assert (Counted().a, Counted().a, Counted(9).a) == (1, 2, 9)


@pytest.mark.parametrize("args,kwargs", [((), {}), ((1, "x", (), 4), {}), ((1,), {"a": 2}), ((1,), {"d": 1})])
def test_bad_arguments_are_refused_like_the_generated_init(args, kwargs):
    with pytest.raises(TypeError):
        Twin(*args, **kwargs)
    with pytest.raises(TypeError):
        Sample(*args, **kwargs)


def test_still_frozen():
    s = Sample(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.a = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        del s.b
    assert dataclasses.replace(s, a=7) == Sample(7)


def test_refuses_classes_it_would_get_wrong():
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self):
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class KwOnly:
        a: int = dataclasses.field(kw_only=True)

    for cls in (NoSlots, NotFrozen, PostInit, KwOnly):
        with pytest.raises(TypeError):
            fast_init(cls)
