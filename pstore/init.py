"""Initialisers: the value of a row before its first update.

A sparse row's initial value is a pure function of (table seed, id): the same whatever the shard
count, thread timing or call order. A dense tensor is filled from one stream of its seed, in C
order.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any, ClassVar

__all__ = ["Constant", "Initializer", "Normal", "TruncatedNormal", "Uniform", "Zeros"]


@dataclass(frozen=True)
class _Init:
    """What the initialisers share: their serde form, the one schema of the core's
    ``Initializer`` (``"zeros"``, ``{"constant": value}``, ``{kind: {field: value}}``;
    ``tests/test_schema.py`` checks the classes against it)."""

    _kind: ClassVar[str]

    def _spec(self) -> str | dict[str, Any]:
        names = [f.name for f in fields(self)]
        if not names:
            return self._kind
        if names == ["value"]:
            return {self._kind: astuple(self)[0]}
        return {self._kind: {n: getattr(self, n) for n in names}}


def _from_spec(spec: str | dict[str, Any]) -> Initializer:
    """The initialiser of a serde form (``_Init._spec``)."""
    if isinstance(spec, str):
        return _KINDS[spec]()  # type: ignore[call-arg]
    ((kind, body),) = spec.items()
    cls = _KINDS[kind]
    init: Initializer = cls(**body) if isinstance(body, dict) else cls(body)  # type: ignore[call-arg]
    return init


@dataclass(frozen=True)
class Zeros(_Init):
    """All zeros."""

    _kind: ClassVar[str] = "zeros"


@dataclass(frozen=True)
class Constant(_Init):
    """Every element equals ``value``."""

    _kind: ClassVar[str] = "constant"
    value: float


@dataclass(frozen=True)
class Uniform(_Init):
    """Uniform on ``[low, high)``."""

    _kind: ClassVar[str] = "uniform"
    low: float
    high: float


@dataclass(frozen=True)
class Normal(_Init):
    """Normal with mean ``mean`` and standard deviation ``std``."""

    _kind: ClassVar[str] = "normal"
    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class TruncatedNormal(_Init):
    """Normal restricted to ``[mean - 2 std, mean + 2 std]`` (draws outside are redrawn)."""

    _kind: ClassVar[str] = "truncated_normal"
    mean: float = 0.0
    std: float = 1.0


Initializer = Zeros | Constant | Uniform | Normal | TruncatedNormal

_KINDS: dict[str, type[Initializer]] = {
    c._kind: c for c in (Zeros, Constant, Uniform, Normal, TruncatedNormal)
}
