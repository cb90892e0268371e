"""Frozen dataclasses that cost what a plain class costs to build.

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__``,
which checks the type's ``__setattr__`` chain and looks the name up again for every field:
on the request path that was ~2 µs of a 9-field ``Decision`` and ~15% of the instructions
the gateway's ext_proc spends beyond a do-nothing one (docs/gateway.md, "Speed").
``fast_init`` gives a frozen, slotted dataclass an ``__init__`` with the same signature
(defaults and default factories included) that stores each field through its slot's
member descriptor, as ``object.__setattr__`` ends up doing, with none of the lookups.
Everything else (equality, hashing, ``repr``, ``FrozenInstanceError`` on assignment,
``dataclasses.replace``) is the dataclass's own.
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

__all__ = ["fast_init"]

T = TypeVar("T", bound=type)


def fast_init(cls: T) -> T:
    """Decorate (outermost, above ``@dataclass(frozen=True, slots=True)``)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs a frozen dataclass with slots")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: fast_init does not call __post_init__")
    namespace: dict[str, object] = {"_FACTORY": object()}   # the marker of "use the factory"
    args, lines = [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes plain init fields only")
        namespace[f"_set{i}"] = cls.__dict__[f.name].__set__
        if f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            args.append(f"{f.name}=_default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{i}"] = f.default_factory
            args.append(f"{f.name}=_FACTORY")
            lines.append(f"if {f.name} is _FACTORY: {f.name} = _factory{i}()")
        else:
            args.append(f.name)
        lines.append(f"_set{i}(self, {f.name})")
    source = f"def __init__(self, {', '.join(args)}):\n    " + "\n    ".join(lines or ["pass"])
    exec(source, namespace)   # as dataclasses builds its own __init__
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls
