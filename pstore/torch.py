"""PyTorch modules whose embeddings live in a pstore table (``pip install 'pstore[torch]'``).

>>> emb = pstore.torch.EmbeddingBag(store.table("item"), mode="sum")  # doctest: +SKIP
>>> out = emb(ids, offsets)          # like torch.nn.EmbeddingBag; rows pulled from the store
>>> loss.backward()                  # the rows' gradients are pushed to the store  # doctest: +SKIP

The forward pass pulls the rows of the batch's unique ids (each id once) and computes exactly what
``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` compute on them; the backward pass pushes the
gradient of each unique row to the table, whose optimizer applies it. The dense part of the
model keeps its own ``torch.optim`` optimizer (or lives in a dense table of the store, pulled
and pushed by hand, if you want it there). Tables of the embedded :class:`pstore.Store` and of
a remote store from :func:`pstore.connect` work alike.

**Staleness.** Pushes are queued (``push_async``) so that the store applies them while the
training loop goes on. ``staleness`` bounds how far behind a forward pass may be: before pulling,
a module waits until every push older than its last ``staleness`` backward passes has been
applied. ``staleness=0`` is the synchronous mode: each forward pass sees every earlier push, as
``torch.nn.EmbeddingBag`` with an optimizer step per batch would. The default ``staleness=1``
lets the pushes of the previous batch overlap with the next forward pass, so a row that two
consecutive batches share may be read before the first batch's update to it lands. Call
:meth:`flush` before evaluating or snapshotting to wait for everything.

**Prefetching.** With ``staleness >= 1``, ``module.prefetch(next_ids)`` starts pulling the rows
of the next batch on a background thread, so that the store's work overlaps the current batch's
forward and backward passes instead of holding up the next forward pass (the pipelining of
TorchRec's training pipelines). Call it once the previous batch's backward pass is done and
before the current one's; the next forward pass whose ids equal ``next_ids`` uses the rows. The
prefetch first waits for every push that forward pass would have waited for, so the staleness
bound holds as it is: with ``staleness=1``, rows that the current batch updates are read
before that update lands (the bound allows it; without a prefetch it happens only when the push
is slow), which costs accuracy where consecutive batches share most of their rows (a small id
space; see :mod:`pstore.apps.ctr`). With ``staleness=0``, under ``torch.no_grad()``, or when
the ids differ, the forward pass pulls as it would have.

**Sharing torch's threads.** With the embedded store, a module's store calls (the pull and
the push) run their batch on the training thread's OpenMP team, the threads torch itself
computes with, instead of on the store's own pool. On a machine whose cores torch's team already
fills, the two pools would otherwise fight for them: after each of its parallel regions, torch's
OpenMP workers spin for a while before they sleep, and a store call made then shares a core with
a spinning thread. On the shared team the store's work runs on those very workers, so the store
and the model take turns on the cores, and the push is applied synchronously in the backward
pass (there is no idle core for an asynchronous one to use; every forward pass then sees every
earlier push, which ``staleness`` allows). ``share_threads=False`` keeps the store's pool and
the asynchronous pushes. Nothing is shared when torch runs on one thread
(``torch.set_num_threads(1)``: the other cores are the store's), with a remote store (its work
runs on the servers), or where no OpenMP runtime torch loaded can be found (only Linux's
``/proc/self/maps`` is searched).

**Evaluation.** Under ``torch.no_grad()`` a forward pass creates no rows: ids the table lacks
get their initial value (what a training pull would create) without being stored, so evaluating
on new ids does not grow the tables.

Importing :mod:`pstore` never imports torch; this module does.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, NamedTuple, Protocol, overload

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pstore import _native
from pstore.exceptions import DtypeError, InvalidArgumentError
from pstore.store import SparseTable

__all__ = ["Embedding", "EmbeddingBag"]


_last = threading.local()


def _torch_openmp() -> str | None:
    """The path of the OpenMP runtime loaded in this process (torch's), bound for the store's
    use; None where there is none or it cannot be found."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return None
    # torch's own copy first (its wheels bring one in torch/lib), should others be loaded too.
    here = os.path.dirname(torch.__file__) + os.sep
    for path in sorted(
        (p for p in paths if p.startswith("/")), key=lambda p: (not p.startswith(here), p)
    ):
        try:
            _native.openmp_bind(path)
        except ValueError:
            continue
        return path
    return None


_OPENMP = _torch_openmp()


class _Pending(Protocol):
    """A queued push (:class:`pstore.PushHandle`)."""

    def wait(self) -> None: ...


class _Table(Protocol):
    """What the modules use of a sparse table, of an embedded or a remote store."""

    @property
    def name(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @overload
    def pull(
        self, ids: npt.NDArray[np.uint64], *, return_version: Literal[False] = False
    ) -> np.ndarray: ...
    @overload
    def pull(
        self, ids: npt.NDArray[np.uint64], *, return_version: Literal[True]
    ) -> tuple[np.ndarray, tuple[int, ...]]: ...
    def contains(self, ids: npt.NDArray[np.uint64]) -> np.ndarray: ...
    def initial_rows(self, ids: npt.NDArray[np.uint64]) -> np.ndarray: ...
    def push(
        self,
        ids: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        *,
        version: Sequence[int] | None = None,
    ) -> None: ...
    def push_async(
        self,
        ids: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        *,
        version: Sequence[int] | None = None,
    ) -> _Pending: ...


class _Prefetch(NamedTuple):
    ids: Tensor  # the tensor prefetch() was given, and its version then
    version: int
    keys: np.ndarray
    inverse: Tensor
    rows: Future[tuple[np.ndarray, tuple[int, ...] | None]]  # the rows, the version read at


_prefetch_pool: ThreadPoolExecutor | None = None
_prefetch_lock = threading.Lock()


def _prefetcher() -> ThreadPoolExecutor:
    """The threads that run prefetches (created on first use; a pull releases the GIL)."""
    global _prefetch_pool
    with _prefetch_lock:
        if _prefetch_pool is None:
            _prefetch_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pstore-prefetch")
        return _prefetch_pool


def _pull_after(
    table: _Table, pushes: list[_Pending], keys: np.ndarray, versioned: bool
) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """``table.pull(keys)`` and the version it read, once ``pushes`` have been applied."""
    for handle in pushes:
        handle.wait()
    return _pull(table, keys, versioned)


def _pull(
    table: _Table, keys: np.ndarray, versioned: bool
) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """The rows of ``keys`` and the version they were read at (None: not asked)."""
    if versioned:
        return table.pull(keys, return_version=True)
    return table.pull(keys), None


def _check_ids(ids: Tensor) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise DtypeError(f"ids must be an int64 (or int32) tensor, got {ids.dtype}")


def _unique(ids: Tensor) -> tuple[np.ndarray, Tensor]:
    """The unique ids of ``ids`` (uint64) and each id's index among them. Models that look the
    same ids up in several tables (first-order weights and embeddings) pass the same tensor:
    the last result of this thread is reused while that tensor is unchanged."""
    memo = getattr(_last, "memo", None)
    if memo is not None:
        ref, version, last = memo
        if ref() is ids and version == ids._version:
            hit: tuple[np.ndarray, Tensor] = last
            return hit
    flat = ids.reshape(-1).to("cpu", torch.int64).contiguous()
    # A hash pass in the store's native code (ids in order of first appearance): 1.1 ms against
    # torch.unique's 4.0 ms for 106k Zipf ids (a third unique), measured on 2 cores.
    unique, inverse = _native.unique_inverse(flat.numpy().view(np.uint64))
    result = (unique, torch.from_numpy(inverse))
    _last.memo = (weakref.ref(ids), ids._version, result)
    return result


class _Gather(torch.autograd.Function):
    """``rows[index]`` whose backward sums each position's gradient into its row in native code:
    torch's ``index_add_`` (``index_select``'s backward) dispatches once per position, which
    took most of a DeepFM step's embedding backward."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        return torch.from_numpy(_native.sum_rows(g, index.numpy(), ctx.rows)), None


class _on_team:
    """Within it, this thread's store calls run on its OpenMP team (when ``shared``)."""

    __slots__ = ("shared",)

    def __init__(self, shared: bool) -> None:
        self.shared = shared

    def __enter__(self) -> None:
        if self.shared:
            _native.openmp_join(True)

    def __exit__(self, *exc: object) -> None:
        if self.shared:
            _native.openmp_join(False)


class _StoreRows(nn.Module):
    """What both modules share: pulling unique rows and pushing their gradients."""

    def __init__(self, table: _Table, *, staleness: int = 1, share_threads: bool = True) -> None:
        super().__init__()
        if not hasattr(table, "pull") or not hasattr(table, "push_async"):
            raise InvalidArgumentError(
                f"expected a sparse table of a pstore store, got {type(table).__name__}"
            )
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise InvalidArgumentError(f"staleness must be an int >= 0, got {staleness!r}")
        if not isinstance(share_threads, bool):
            raise InvalidArgumentError(f"share_threads must be a bool, got {share_threads!r}")
        self.table = table
        self.staleness = staleness
        self.share_threads = share_threads
        self._embedded = bool(getattr(getattr(table, "_inner", None), "in_process", False))
        # A pstore table takes the version of each pull back with its push (other objects with
        # the same methods are called without it).
        self._versioned = isinstance(table, SparseTable)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._prefetched: _Prefetch | None = None
        self.pushes = 0
        self.ids_pulled = 0
        self.prefetch_hits = 0

    @property
    def dim(self) -> int:
        """The row width (the table's dim)."""
        return int(self.table.dim)

    @property
    def shares_threads(self) -> bool:
        """Whether the store's work runs on torch's OpenMP team now (see the module's docs):
        ``share_threads``, an embedded table, a runtime found, and torch on several threads."""
        return (
            self.share_threads
            and self._embedded
            and _OPENMP is not None
            and torch.get_num_threads() > 1
        )

    def flush(self) -> None:
        """Wait until every gradient pushed so far has been applied (and forget a prefetch: the
        next forward pass reads rows with all of them)."""
        self._drop_prefetch()
        self._wait_pending(0)

    def _wait_pending(self, keep: int) -> None:
        """Wait until at most ``keep`` of this module's pushes are pending."""
        while len(self._pending) > keep:
            self._pending.popleft().wait()

    def prefetch(self, ids: Tensor) -> None:
        """Start pulling the rows of ``ids``, the next forward pass's, in the background.

        Call it after the previous batch's backward pass and before the current one's (see the
        module's docs). A no-op with ``staleness=0`` and under ``torch.no_grad()``.
        """
        _check_ids(ids)
        self._drop_prefetch()
        if self.staleness == 0 or not torch.is_grad_enabled():
            return
        keys, inverse = _unique(ids)
        # The next forward pass comes after one more push (this batch's): it would wait for all
        # but the newest `staleness` of those, that is all but the newest `staleness - 1` here.
        older = list(self._pending)[: max(0, len(self._pending) - (self.staleness - 1))]
        future = _prefetcher().submit(_pull_after, self.table, older, keys, self._versioned)
        self._prefetched = _Prefetch(ids, ids._version, keys, inverse, future)

    def _drop_prefetch(self) -> None:
        """Forget an unused prefetch, once its pull is over (it may have created rows)."""
        p, self._prefetched = self._prefetched, None
        if p is not None:
            p.rows.exception()  # waits; an error of an unused prefetch does not matter

    def _take_prefetch(
        self, ids: Tensor
    ) -> tuple[np.ndarray, Tensor, tuple[np.ndarray, tuple[int, ...] | None]] | None:
        """(keys, inverse, (rows, version)) of the prefetch of ``ids`` if there is one."""
        p = self._prefetched
        if p is None:
            return None
        same = p.ids is ids and p.version == ids._version
        if not same and p.ids.shape == ids.shape and p.ids.dtype == ids.dtype:
            same = bool(torch.equal(p.ids, ids.to(p.ids.device)))
        if not same:
            self._drop_prefetch()
            return None
        self._prefetched = None
        return p.keys, p.inverse, p.rows.result()

    def _rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The unique rows of ``ids`` (a leaf tensor whose gradient is pushed) and the index of
        each id's row among them."""
        _check_ids(ids)
        self._wait_pending(self.staleness)
        training = torch.is_grad_enabled()
        shared = self.shares_threads
        got = self._take_prefetch(ids) if training else None
        # The version the rows were read at: their push carries it, so a store server counts
        # its staleness from this pull (whatever else was pulled or prefetched meanwhile).
        version: tuple[int, ...] | None = None
        if got is not None:
            keys, inverse, (pulled, version) = got
            self.prefetch_hits += 1
        else:
            keys, inverse = _unique(ids)
            with _on_team(shared):
                if training:
                    pulled, version = _pull(self.table, keys, self._versioned)
                else:
                    pulled = self._peek(keys)
        self.ids_pulled += len(keys)
        rows = torch.from_numpy(pulled)
        if training:
            rows.requires_grad_(True)
            rows.register_hook(lambda grad: self._push(keys, grad, shared, version))
        return rows, inverse.reshape(ids.shape)

    def _peek(self, keys: np.ndarray) -> np.ndarray:
        """The rows of ``keys`` without creating any: evaluation (under ``torch.no_grad()``)
        reads the initial value of ids never trained on instead of storing rows for them."""
        have = self.table.contains(keys)
        if have.all():
            return self.table.pull(keys)
        rows = self.table.initial_rows(keys)
        if have.any():
            rows[have] = self.table.pull(keys[have])
        return rows

    def _push(
        self, keys: np.ndarray, grad: Tensor, shared: bool, version: tuple[int, ...] | None
    ) -> None:
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        # The version of this batch's pull goes with its push (only to a pstore table).
        if shared:  # applied now, on torch's team, after any push still queued
            self._wait_pending(0)
            with _on_team(True):
                if version is None:
                    self.table.push(keys, g)
                else:
                    self.table.push(keys, g, version=version)
        elif version is None:
            self._pending.append(self.table.push_async(keys, g))
        else:
            self._pending.append(self.table.push_async(keys, g, version=version))
        self.pushes += 1
        if self.staleness == 0:
            self.flush()

    def extra_repr(self) -> str:
        return (
            f"table={self.table.name!r}, dim={self.dim}, staleness={self.staleness}, "
            f"share_threads={self.share_threads}"
        )


class Embedding(_StoreRows):
    """``torch.nn.Embedding`` over a pstore table: ``forward(ids)`` -> ``(*ids.shape, dim)``.

    Parameters
    ----------
    table : pstore.SparseTable
        The table (of an embedded or a remote store) holding the rows.
    staleness : int
        How many backward passes' pushes a forward pass may run ahead of (0: synchronous); see
        the module's docs.
    share_threads : bool
        Run the embedded store's work on torch's OpenMP threads, pushes applied in the backward
        pass (see the module's docs); False keeps the store's own pool and asynchronous pushes.
    """

    def forward(self, ids: Tensor) -> Tensor:
        rows, index = self._rows(ids)
        gathered: Tensor = _Gather.apply(rows, index.reshape(-1))
        return gathered.reshape(*index.shape, rows.shape[1]).to(ids.device)


class EmbeddingBag(_StoreRows):
    """``torch.nn.EmbeddingBag`` over a pstore table.

    ``forward(input, offsets=None, per_sample_weights=None)`` takes what
    ``torch.nn.EmbeddingBag`` takes: a 2-D ``input`` of fixed-size bags, or a 1-D ``input`` with
    ``offsets``; ``mode`` ``"sum"``, ``"mean"`` or ``"max"``; ``per_sample_weights`` with
    ``"sum"``; empty bags give zeros. The result and the gradients pushed are the ones
    ``torch.nn.EmbeddingBag`` computes on the same rows.
    """

    def __init__(
        self,
        table: _Table,
        mode: str = "mean",
        *,
        staleness: int = 1,
        include_last_offset: bool = False,
        share_threads: bool = True,
    ) -> None:
        super().__init__(table, staleness=staleness, share_threads=share_threads)
        if mode not in ("sum", "mean", "max"):
            raise InvalidArgumentError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(
        self,
        input: Tensor,
        offsets: Tensor | None = None,
        per_sample_weights: Tensor | None = None,
    ) -> Tensor:
        rows, index = self._rows(input)
        if offsets is not None:
            offsets = offsets.to("cpu", torch.int64)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to("cpu", torch.float32)
        out = F.embedding_bag(
            index,
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )
        return out.to(input.device)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
