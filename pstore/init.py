"""Initialisers: the value of a row before its first update.

A sparse row's initial value is a pure function of (table seed, id): the same whatever the shard
count, thread timing or call order. A dense tensor is filled from one stream of its seed, in C
order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Constant", "Initializer", "Normal", "TruncatedNormal", "Uniform", "Zeros"]


@dataclass(frozen=True)
class Zeros:
    """All zeros."""

    def _spec(self) -> dict[str, Any]:
        return {"kind": "zeros"}


@dataclass(frozen=True)
class Constant:
    """Every element equals ``value``."""

    value: float

    def _spec(self) -> dict[str, Any]:
        return {"kind": "constant", "value": self.value}


@dataclass(frozen=True)
class Uniform:
    """Uniform on ``[low, high)``."""

    low: float
    high: float

    def _spec(self) -> dict[str, Any]:
        return {"kind": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Normal:
    """Normal with mean ``mean`` and standard deviation ``std``."""

    mean: float = 0.0
    std: float = 1.0

    def _spec(self) -> dict[str, Any]:
        return {"kind": "normal", "mean": self.mean, "std": self.std}


@dataclass(frozen=True)
class TruncatedNormal:
    """Normal restricted to ``[mean - 2 std, mean + 2 std]`` (draws outside are redrawn)."""

    mean: float = 0.0
    std: float = 1.0

    def _spec(self) -> dict[str, Any]:
        return {"kind": "truncated_normal", "mean": self.mean, "std": self.std}


Initializer = Zeros | Constant | Uniform | Normal | TruncatedNormal
