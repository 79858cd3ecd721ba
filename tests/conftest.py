"""Shared fixtures for the pstore test suite.

The tests drive pstore only through its public Python API (docs/API_SPEC.md).
"""

import contextlib
import os
import warnings
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _netutil import ServerProcess, start_servers, stop_all

import pstore
from pstore import init, optim

# When a @given test fails, hypothesis's pytest plugin imports libcst to print a patch. Old libcst
# releases subclass the deprecated mypy_extensions.TypedDict, and filterwarnings=error turns that
# warning into a pytest INTERNALERROR that hides the real failure. Import it once, quietly, here.
with warnings.catch_warnings(), contextlib.suppress(ImportError):
    warnings.filterwarnings("ignore", "mypy_extensions.TypedDict", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401


# The suite's traffic stays on this machine: Ray (tests/ray_cases.py) would otherwise report usage
# statistics to its makers' server, and every Ray process inherits this.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


@pytest.fixture
def cluster() -> Iterator[Callable[[int], list[str]]]:
    """Starts n in-memory store servers per call (`python -m pstore serve` on loopback); all are
    stopped at the end of the test. Their addresses in the order started."""
    procs: list[ServerProcess] = []

    def start(n: int) -> list[str]:
        new = start_servers(n)
        procs.extend(new)
        return [p.address for p in new]

    yield start
    stop_all(procs)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy generator seeded from the test id, so every test is reproducible."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def store() -> pstore.Store:
    """A small store with several shards and a two-thread pool."""
    return pstore.Store(num_shards=4, threads=2)


@pytest.fixture
def sgd_table(store: pstore.Store):
    """A sparse table (dim 4) with plain SGD, lr 1, whose rows start at 0.5."""
    return store.create_sparse_table(
        "emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(0.5), seed=0
    )
