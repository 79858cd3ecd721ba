"""Small data helpers shared by the test modules: id arrays, random ids and gradients."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

F32 = np.float32
U64_MAX = np.iinfo(np.uint64).max


def u64(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """``values`` as a uint64 array."""
    return np.asarray(values, dtype=np.uint64)


def random_ids(rng: np.random.Generator, n: int, avoid: Iterable[int] = ()) -> np.ndarray:
    """``n`` distinct ids over the whole uint64 range (ids >= 2**63 too), none in ``avoid``."""
    ids = rng.integers(0, U64_MAX, size=2 * n + 16, dtype=np.uint64, endpoint=True)
    ids = np.setdiff1d(np.unique(ids), u64(list(avoid)))
    return rng.permutation(ids)[:n]


def grads(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """``n`` standard normal float32 gradient rows of ``dim`` columns."""
    return rng.standard_normal((n, dim)).astype(F32)


def mix64(x: int) -> int:
    """The placement hash of an id (the splitmix64 finaliser), as docs/FORMAT.md gives it."""
    m = (1 << 64) - 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)
