"""The embedded store and its tables."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Self, TypeVar, overload

import numpy as np
import numpy.typing as npt

from pstore import _native, init, optim
from pstore._native import MAX_DIM
from pstore.exceptions import (
    DtypeError,
    InvalidArgumentError,
    ShapeError,
    WrongTableKindError,
)

__all__ = ["BaseStore", "DenseTable", "PushHandle", "SparseTable", "StalePolicy", "Store"]

IdsLike = npt.ArrayLike
StalePolicy = Literal["apply", "drop", "scale"]


def _version(version: Sequence[int] | None) -> list[int] | None:
    """A pull's version as the binding takes it."""
    if version is None:
        return None
    return [_check_int(v, "version") for v in version]


def _as_ids(ids: IdsLike) -> np.ndarray:
    """Ids as a contiguous 1-D uint64 array; int64 is reinterpreted bit for bit, not converted."""
    a = np.asarray(ids)
    if a.dtype == np.int64:
        a = a.view(np.uint64)
    elif a.dtype != np.uint64:
        if a.size == 0 and a.dtype == np.float64:  # an empty list
            a = a.astype(np.uint64)
        else:
            raise DtypeError(f"ids must be an int64 or uint64 array, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ShapeError(f"ids must be 1-D, got shape {a.shape}")
    return np.ascontiguousarray(a)


def _as_f32(x: npt.ArrayLike, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise DtypeError(
            f"{what} must be float32, got dtype {a.dtype} (convert with .astype(np.float32))"
        )
    return np.ascontiguousarray(a)


class PushHandle:
    """A pending asynchronous push, returned by ``push_async``."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _native.PushHandle) -> None:
        self._inner = inner

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the push has been applied.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; ``None`` waits as long as it takes.

        Raises
        ------
        TimeoutError
            If the push is still pending after ``timeout`` seconds.
        PstoreError
            The push's own error, if applying it failed.
        """
        if not self._inner.wait(timeout):
            raise TimeoutError(f"push still pending after {timeout} s")

    def done(self) -> bool:
        """True once the push has been applied (or has failed)."""
        return self._inner.done()

    def __repr__(self) -> str:
        return f"<PushHandle {'done' if self.done() else 'pending'}>"


class _Table:
    """What sparse and dense tables share: name, seed, optimizer, initialiser, learning rate."""

    __slots__ = ("_inner",)

    def __init__(self, inner: _native.SparseTable | _native.DenseTable) -> None:
        self._inner = inner

    @property
    def name(self) -> str:
        """The table's name."""
        return self._inner.name

    @property
    def seed(self) -> int:
        """The initialiser's seed."""
        return self._inner.seed

    @property
    def optimizer(self) -> optim.Optimizer:
        """The optimizer, with the learning rate it was created with."""
        return optim._from_spec(self._inner.optimizer_spec())

    @property
    def initializer(self) -> init.Initializer:
        """The initialiser."""
        return init._from_spec(self._inner.initializer_spec())

    @property
    def lr(self) -> float:
        """The learning rate in force (``alpha`` for Ftrl); assign to change it at run time."""
        return self._inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._inner.set_lr(_check_float(value, "lr"))

    def set_lr(self, lr: float) -> None:
        """Change the learning rate for every later push."""
        self._inner.set_lr(_check_float(lr, "lr"))


class SparseTable(_Table):
    """A sparse embedding table: u64 id -> float32 row of ``dim`` values.

    Rows are created on first touch (a pull or a push) with the table's initialiser. Do not
    create it directly: use :meth:`Store.create_sparse_table` or :meth:`Store.table`.

    The same class holds a table of this process's store or of store servers
    (:func:`pstore.connect`), where the rows are spread over the servers by id (a table of
    hash slots). On servers, ``num_shards`` is the number of servers; ``len``, ``seq`` and
    ``stats()`` add up the servers' numbers (``stats()`` also lists each server's under
    ``"servers"`` and the staleness of pushes under ``"staleness"``); and
    ``evict(not_updated_for_steps=n)`` counts each server's own pushes.

    Ids may be uint64 or int64 arrays (int64 is reinterpreted bit for bit, so ``-1`` is
    ``2**64 - 1``) or lists of ints. While a call runs, other Python threads keep running: do not
    modify the arrays you passed until it returns (``push_async`` copies its inputs).
    """

    __slots__ = ()
    _inner: _native.SparseTable

    @property
    def dim(self) -> int:
        """The row width."""
        return self._inner.dim

    @property
    def num_shards(self) -> int:
        """Number of shards (of servers, for a table on store servers)."""
        return self._inner.num_shards

    def __len__(self) -> int:
        return len(self._inner)

    def __repr__(self) -> str:
        # A repr asks no server: a table on store servers shows how many there are.
        if not self._inner.in_process:
            return f"<SparseTable {self.name!r} dim={self.dim} servers={self.num_shards}>"
        return f"<SparseTable {self.name!r} dim={self.dim} rows={len(self)}>"

    @overload
    def pull(self, ids: IdsLike, *, return_version: Literal[False] = False) -> np.ndarray: ...
    @overload
    def pull(
        self, ids: IdsLike, *, return_version: Literal[True]
    ) -> tuple[np.ndarray, tuple[int, ...]]: ...
    def pull(
        self, ids: IdsLike, *, return_version: bool = False
    ) -> np.ndarray | tuple[np.ndarray, tuple[int, ...]]:
        """The rows of ``ids``, as a new ``(len(ids), dim)`` float32 array.

        Rows that do not exist yet are created with their initial value. A result of 64 KiB or
        more starts on a 64-byte boundary: it is a view into a new array 15 floats longer (its
        ``base``), which nothing else refers to.

        On store servers a pull reads the table's *version* (the pushes each server received),
        the clock staleness is counted on: the push of the same ids (the batch's gradients)
        carries it without being told, so several pulls may be in flight (prefetching). With
        ``return_version=True`` the answer is ``(rows, version)``, and ``push(..., version=v)``
        carries it explicitly. The version of an embedded table is ``()``: it has no stale pushes.
        """
        if return_version:
            rows, version = self._inner.pull_versioned(_as_ids(ids))
            return rows, tuple(version)
        return self._inner.pull(_as_ids(ids))

    def _args(self, ids: IdsLike, grads: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        i = _as_ids(ids)
        g = _as_f32(grads, "grads")
        if g.ndim != 2 or g.shape[0] != i.shape[0]:
            raise ShapeError(
                f"table {self.name!r}: grads must have shape (len(ids), dim) = "
                f"({i.shape[0]}, {self.dim}), got {g.shape}"
            )
        return i, g

    def push(
        self, ids: IdsLike, grads: npt.ArrayLike, *, version: Sequence[int] | None = None
    ) -> None:
        """Apply gradients with the table's optimizer; returns once they are applied.

        Duplicate ids are coalesced: their gradient rows are summed and the optimizer is applied
        once per unique id. Every later pull, from any thread, sees the update. A bad input
        (dtype, shape, NaN or Inf) raises and changes nothing.

        Parameters
        ----------
        ids : array of int64 or uint64, shape (n,)
        grads : float32 array, shape (n, dim)
        version : the version ``pull(..., return_version=True)`` returned for the rows the
            gradients were computed from (store servers count the push's staleness from it);
            by default, the version the last pull of the same ids read.
        """
        self._inner.push(*self._args(ids, grads), _version(version))

    def push_async(
        self, ids: IdsLike, grads: npt.ArrayLike, *, version: Sequence[int] | None = None
    ) -> PushHandle:
        """Queue a push and return at once.

        The inputs are copied. Pushes apply in the order they were queued, so pushes from one
        thread apply in the order they were made. When the store's in-flight budget
        (``max_inflight_bytes``) is used up, this call blocks until room frees (backpressure).
        Input errors raise here; :meth:`PushHandle.wait` raises errors of the application.
        ``version`` is that of :meth:`push`.
        """
        return PushHandle(self._inner.push_async(*self._args(ids, grads), _version(version)))

    def contains(self, ids: IdsLike) -> np.ndarray:
        """A bool array: which ids have a row. Creates nothing."""
        return self._inner.contains(_as_ids(ids))

    def remove(self, ids: IdsLike) -> int:
        """Remove the rows of ``ids`` (absent ids are ignored); returns how many were removed."""
        return self._inner.remove(_as_ids(ids))

    def initial_rows(self, ids: IdsLike) -> np.ndarray:
        """The values the rows of ``ids`` have before any update. Creates nothing."""
        return self._inner.initial_rows(_as_ids(ids))

    @property
    def seq(self) -> int:
        """The update sequence number: pushes applied over the table's life.

        A row's ``version`` (in snapshots) is the ``seq`` of its last update.
        """
        return self._inner.seq

    @property
    def admit_after(self) -> int:
        """Pushes an id needs before it gets a row (0 or 1: at once)."""
        return self._inner.lifecycle[0]

    @property
    def max_rows(self) -> int | None:
        """The row budget, or None."""
        return self._inner.lifecycle[1]

    @property
    def evict_policy(self) -> str:
        """Which rows the ``max_rows`` budget evicts first: ``"lru"`` or ``"lfu"``."""
        return self._inner.lifecycle[2]

    def evict(
        self,
        *,
        not_updated_for_steps: int | None = None,
        not_updated_for_seconds: float | None = None,
    ) -> int:
        """Remove the rows not updated lately; returns how many were removed.

        Parameters
        ----------
        not_updated_for_steps : int, optional
            Remove rows that none of the last ``not_updated_for_steps`` pushes (of this table)
            updated: rows whose version is at most ``seq - not_updated_for_steps``.
        not_updated_for_seconds : float, optional
            Remove rows whose last update is older than this many seconds.

        A row created by a pull and never pushed counts as updated when it was created. Evicted
        ids become tombstones of the next incremental snapshot. With both arguments, a row is
        removed if either applies. On store servers, the steps are each server's pushes to its
        part of the table and the seconds are measured by the servers' clocks.
        """
        if not_updated_for_steps is None and not_updated_for_seconds is None:
            raise InvalidArgumentError(
                "evict needs not_updated_for_steps or not_updated_for_seconds"
            )
        steps = None
        if not_updated_for_steps is not None:
            steps = _check_int(not_updated_for_steps, "not_updated_for_steps")
        secs = None
        if not_updated_for_seconds is not None:
            secs = float(not_updated_for_seconds)
            if not secs >= 0:
                raise InvalidArgumentError(
                    f"not_updated_for_seconds must be >= 0, got {not_updated_for_seconds}"
                )
        return self._inner.evict(steps, secs)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes.

        Keys: ``rows`` (including ``rows_unloaded``), ``dim``, ``bytes_used`` (arena, state and
        index), ``huge_page_bytes`` (the part of ``bytes_used`` the kernel accepted
        ``MADV_HUGEPAGE`` for: full row chunks and large indexes; 0 where the OS has no
        transparent huge pages), ``pushes``, ``pulls``, ``ids_pushed``, ``ids_pulled``
        (duplicates included), ``rows_updated`` (optimizer applications), ``rows_created``,
        ``rows_evicted``, ``rows_unloaded`` (rows of a durable store's replica not loaded into
        memory yet), ``seq``, ``num_shards``, ``lr``, ``optimizer``.
        """
        s = self._inner.stats()
        s.update(dim=self.dim, num_shards=self.num_shards, optimizer=self._inner.optimizer_name)
        return s


class DenseTable(_Table):
    """A dense float32 tensor with its own optimizer, updated as a whole by each push.

    On store servers, the table lives whole on the server its name routes to.
    """

    __slots__ = ()
    _inner: _native.DenseTable

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self._inner.shape)

    @property
    def step(self) -> int:
        """Number of pushes applied (by its server, for a table on store servers)."""
        return self._inner.step

    def __repr__(self) -> str:
        return f"<DenseTable {self.name!r} shape={self.shape}>"

    @overload
    def pull(self, *, return_version: Literal[False] = False) -> np.ndarray: ...
    @overload
    def pull(self, *, return_version: Literal[True]) -> tuple[np.ndarray, tuple[int, ...]]: ...
    def pull(
        self, *, return_version: bool = False
    ) -> np.ndarray | tuple[np.ndarray, tuple[int, ...]]:
        """A copy of the tensor.

        With ``return_version=True`` the answer is ``(value, version)``: on store servers the
        table's version (the pushes its server received, one int), which ``push(...,
        version=v)`` carries so that the push's staleness is counted from this pull; ``()`` for
        an embedded table. Without it a push carries the version of this client's last pull.
        """
        if return_version:
            value, version = self._inner.pull_versioned()
            return value, tuple(version)
        return self._inner.pull()

    def push(self, grad: npt.ArrayLike, *, version: Sequence[int] | None = None) -> None:
        """Apply one gradient of the whole tensor (float32, the table's shape).

        ``version``: what ``pull(return_version=True)`` returned for the value the gradient was
        computed from (see :meth:`pull`).
        """
        self._inner.push(_as_f32(grad, "grad"), _version(version))

    def push_async(
        self, grad: npt.ArrayLike, *, version: Sequence[int] | None = None
    ) -> PushHandle:
        """Queue one gradient and return at once (see :meth:`SparseTable.push_async`)."""
        return PushHandle(self._inner.push_async(_as_f32(grad, "grad"), _version(version)))

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (``pushes``, ``pulls``, ``bytes_used``, ``lr``, ...)."""
        s = self._inner.stats()
        s.update(shape=self.shape, step=self.step, optimizer=self._inner.optimizer_name)
        return s


class BaseStore:
    """What every store has: creating, finding and dropping tables, flushing, closing.

    :class:`Store` (in this process) and :class:`pstore.client.RemoteStore` (store servers) are
    the two kinds; both hand out the same :class:`SparseTable` and :class:`DenseTable` classes.
    """

    _inner: _native.StoreApi

    def create_sparse_table(
        self,
        name: str,
        dim: int,
        *,
        optimizer: optim.Optimizer | None = None,
        initializer: init.Initializer | None = None,
        seed: int = 0,
        admit_after: int = 0,
        max_rows: int | None = None,
        evict_policy: Literal["lru", "lfu"] = "lru",
        stale_policy: StalePolicy | None = None,
        max_staleness: int | None = None,
        refuse_nonfinite: bool = False,
    ) -> SparseTable:
        """Create a sparse table.

        On store servers it is created on every server, or returned when a table of that name
        and config exists (so every worker may call it).

        Parameters
        ----------
        name : str
            A new table name.
        dim : int
            Row width, 1 to 4096.
        optimizer : pstore.optim.SGD | Adagrad | Adam | Ftrl, optional
            Applied by pushes; default ``SGD(lr=0.01)``.
        initializer : pstore.init.*, optional
            Value of new rows, a function of (seed, id); default ``Normal(0.0, 0.01)``.
        seed : int
            Seed of the initialiser, 0 to 2**64 - 1.
        admit_after : int
            An id gets a trainable row only once it has been pushed this many times (duplicates
            in one push count each); until then pulls return its initial value without storing
            a row, and pushes only count it. 0 or 1 admits at once. Counts of ids not yet
            admitted are kept in memory only.
        max_rows : int, optional
            A row budget (per server, on store servers): when a push or pull takes the table
            past it, rows are evicted by ``evict_policy`` down to 99% of the budget.
        evict_policy : "lru" or "lfu"
            ``"lru"`` evicts the least recently updated rows, ``"lfu"`` the least often pushed
            (then the least recently updated).
        stale_policy : "apply", "drop" or "scale", optional
            Store servers only (an embedded store applies every push when it is made). What a
            stale push does: its staleness is the number of pushes of the table the servers
            received between the pull its gradients were computed from and the push.
            ``"apply"`` applies it, ``"drop"`` drops pushes staler than ``max_staleness``,
            ``"scale"`` divides the learning rate by the staleness. Left unset (with
            ``max_staleness``), an existing table keeps its own and a new one gets ``"apply"``;
            given, declaring an existing table with another policy raises
            :class:`TableExistsError` naming the field (a declaration never changes a table).
        max_staleness : int, optional
            Store servers only: the bound of ``"drop"`` (default 0: no bound).
        refuse_nonfinite : bool
            Refuse a push whose update would leave a NaN or infinite weight (finite gradients
            can still overflow a weight): it raises :class:`NonFiniteError` and changes nothing.
            Such a table's pushes run one at a time. Off (the default), the update is applied
            and counted in ``stats()["rows_nonfinite"]``.
        """
        opt, ini = _configs(optimizer, initializer, init.Normal(0.0, 0.01))
        d = _check_int(dim, "dim", lo=-(2**63))
        if not 1 <= d <= MAX_DIM:
            raise InvalidArgumentError(f"dim must be in 1..={MAX_DIM}, got {d}")
        return SparseTable(
            self._inner.create_sparse_table(
                name,
                d,
                opt._spec(),
                ini._spec(),
                _seed(seed),
                _check_int(admit_after, "admit_after", 2**32),
                None if max_rows is None else _check_int(max_rows, "max_rows"),
                evict_policy,
                stale_policy,
                None if max_staleness is None else _check_int(max_staleness, "max_staleness"),
                _check_bool(refuse_nonfinite, "refuse_nonfinite"),
            )
        )

    def create_dense_table(
        self,
        name: str,
        shape: int | Sequence[int],
        *,
        optimizer: optim.Optimizer | None = None,
        initializer: init.Initializer | None = None,
        seed: int = 0,
        stale_policy: StalePolicy | None = None,
        max_staleness: int | None = None,
    ) -> DenseTable:
        """Create a dense table: a float32 tensor of ``shape``.

        ``optimizer`` defaults to ``SGD(lr=0.01)`` and ``initializer`` to ``Zeros()``;
        ``stale_policy`` and ``max_staleness`` are those of :meth:`create_sparse_table`. On
        store servers, the table lives on the server its name routes to.
        """
        dims = [shape] if isinstance(shape, int) else list(shape)
        opt, ini = _configs(optimizer, initializer, init.Zeros())
        return DenseTable(
            self._inner.create_dense_table(
                name,
                [_check_int(d, "shape") for d in dims],
                opt._spec(),
                ini._spec(),
                _seed(seed),
                stale_policy,
                None if max_staleness is None else _check_int(max_staleness, "max_staleness"),
            )
        )

    def table(self, name: str) -> SparseTable | DenseTable:
        """The table called ``name``; raises :class:`UnknownTableError` if there is none."""
        t = self._inner.table(name)
        return SparseTable(t) if isinstance(t, _native.SparseTable) else DenseTable(t)

    def sparse_table(self, name: str) -> SparseTable:
        """The sparse table called ``name``."""
        t = self.table(name)
        if not isinstance(t, SparseTable):
            raise WrongTableKindError(f"table {name!r} is dense, not sparse")
        return t

    def tables(self) -> list[str]:
        """The names of all tables, sorted."""
        return self._inner.tables()

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._inner.tables()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables())

    def __getitem__(self, name: str) -> SparseTable | DenseTable:
        return self.table(name)

    def drop_table(self, name: str) -> None:
        """Remove a table (from every server, on store servers)."""
        self._inner.drop_table(name)

    def flush(self) -> None:
        """Wait until every ``push_async`` of every table has been applied.

        A durable store then commits everything to disk (a failed write raises
        :class:`StorageError`); store servers make themselves durable.
        """
        self._inner.flush()

    def close(self) -> None:
        """Apply (send) what is queued.

        An embedded store then refuses further asynchronous pushes, and a durable one writes
        everything to disk and releases its directory, so another ``Store`` may open it. Calling
        it again does nothing. The connections to store servers close when the store is
        collected.
        """
        self._inner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(BaseStore):
    """An embedded parameter store, in this process.

    Parameters
    ----------
    num_shards : int, optional
        Shards per sparse table (default 64). Results do not depend on it.
    threads : int, optional
        Threads that work on one batch at once (default: the number of cores): the calling
        thread and ``threads - 1`` helper threads, which take the batch's shards from a shared
        counter. The store keeps a pool of ``threads`` threads besides, for server calls,
        snapshots and flushes.
    max_inflight_bytes : int, optional
        Bytes of queued ``push_async`` data before ``push_async`` blocks (default 256 MiB).
    path : str or os.PathLike, optional
        A directory: the store is durable. Tables, configs, rows, optimizer state and counters
        are kept in an LMDB replica there, and opening the directory again restores them (rows
        are loaded when first touched, so opening is fast for any size). Without a path the
        store lives in memory only.
    durability : "sync", "async" or "none"
        With a path: ``"sync"``, a push returns once the transaction holding its rows has
        committed to disk; ``"async"`` (default), a background flusher commits every
        ``flush_interval`` seconds, so a crash loses at most the pushes of the last interval
        plus the commit in progress (see the README's durability notes for busy machines);
        ``"none"``, rows reach disk only on :meth:`flush`, :meth:`close` and snapshots.
    flush_interval : float
        Seconds between commits in ``"async"`` mode (default 1.0). Where background writes run
        at idle CPU priority and cannot keep up with training, the flusher stretches the
        interval, up to 16 times, and shrinks it back once they can
        (``storage_info()["current_flush_interval"]``).
    map_size : int, optional
        Bytes of address space each LMDB map starts with (default 64 GiB; it doubles whenever
        a write fills it, and only what is written takes disk space).
    environments : int, optional
        With a path, for a new store: the number of LMDB environments (1 to 16, default 1) its
        replica is split into by key range, each written by a thread of its own, so flushes and
        ``"sync"`` commits use several cores. With more than one, a crash during a flush can
        leave that flush's rows committed in some environments and not in others: every row
        is still whole, and every acknowledged ``"sync"`` push is present, but a push in flight
        at the crash may be on disk for part of its rows (docs/FORMAT.md, "Several
        environments"). An existing store keeps the number it was created with.

    A store must be used in the process that created it (its threads do not survive ``fork``).
    One process at a time may open a store directory.
    """

    _inner: _native.Store

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        durability: Literal["sync", "async", "none"] = "async",
        flush_interval: float = 1.0,
        num_shards: int | None = None,
        threads: int | None = None,
        max_inflight_bytes: int | None = None,
        map_size: int | None = None,
        environments: int | None = None,
    ) -> None:
        self._inner = _native.Store(
            *_store_args(
                num_shards,
                threads,
                max_inflight_bytes,
                path,
                durability,
                flush_interval,
                map_size,
                environments,
            )
        )

    @property
    def path(self) -> str | None:
        """The store directory of a durable store, else None."""
        p = self._inner.path
        return None if p is None else str(p)

    @property
    def durability(self) -> str | None:
        """``"sync"``, ``"async"`` or ``"none"`` for an open durable store, else None."""
        return self._inner.durability

    def storage_info(self) -> dict[str, Any] | None:
        """The LMDB replica of an open durable store, else None.

        Keys: ``path``, ``cycle`` (flush cycles completed over the store's life),
        ``file_bytes`` and ``map_bytes`` (over all environments), ``environments`` (LMDB
        environments of the replica), ``flush_interval``, ``current_flush_interval`` (the
        interval ``"async"`` mode uses now: ``flush_interval``, or up to 16 times it while idle
        writes cannot keep up), ``last_error`` (the message of the
        last failed flush, or None once a flush succeeds again), ``flush_lag`` (seconds since
        the last successful cycle started: what was applied before then is on disk),
        ``idle_writes`` (True when the background writes of ``"async"`` mode run at idle CPU
        priority; see the README's durability notes) and ``idle_lifts`` (how often such a write
        was put back to normal priority because something waited for it or it ran too long),
        ``superseded_writes`` (how often ``flush()`` found such a write in progress and had its
        rows written by its own cycle instead, so they are not written twice).
        """
        return self._inner.storage_info()

    @property
    def num_shards(self) -> int:
        """Shards per sparse table."""
        return self._inner.num_shards

    @property
    def threads(self) -> int:
        """Threads of the store's pool."""
        return self._inner.threads

    def snapshot(
        self,
        dir: str | os.PathLike[str],
        *,
        incremental: bool = False,
        progress: Callable[[int], object] | None = None,
    ) -> dict[str, Any]:
        """Write a snapshot of every table into the new directory ``dir``; returns its manifest.

        ``dir`` is a local path (its missing parents are created), ``file://DIR``, or an
        object-store prefix ``s3://BUCKET/PREFIX`` (credentials and endpoint from the
        environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
        ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``; docs/CLUSTER.md). A remote snapshot is written
        into a local staging directory (``PSTORE_STAGING_DIR``, else the temporary directory)
        and uploaded with its manifest last; a prefix that holds objects already is refused,
        and an increment goes into the bucket of the snapshot it builds on.

        A full snapshot holds every row; with ``incremental=True`` only the rows changed since
        this store's previous snapshot, plus tombstones for ids removed or evicted since then
        (its manifest names that snapshot as its parent). Each table is written as Arrow IPC
        files (readable by pyarrow, pandas and duckdb) with the ids, weights, optimizer state and
        row metadata as columns; the manifest is written last, and the directory appears only
        when complete. Training may go on meanwhile: every row's weights and optimizer state
        belong to one update. Pushes queued with ``push_async`` before the call are included.

        The manifest gains a ``bytes`` key: bytes written, manifest included. ``progress``, if
        given, is called from this thread with the rows written so far, every 0.1 s or so; if it
        raises, the snapshot still completes (it cannot be stopped midway), then the error is
        raised.
        """
        counter = _native.Counter()
        target = os.fspath(dir)
        manifest_json, nbytes = _with_progress(
            lambda: self._inner.snapshot(target, incremental, counter), counter, progress
        )
        manifest: dict[str, Any] = json.loads(manifest_json)
        manifest["bytes"] = nbytes
        return manifest

    @classmethod
    def restore(
        cls,
        snapshot_dir: str | os.PathLike[str],
        path: str | os.PathLike[str] | None = None,
        *,
        num_shards: int | None = None,
        durability: Literal["sync", "async", "none"] = "async",
        flush_interval: float = 1.0,
        threads: int | None = None,
        max_inflight_bytes: int | None = None,
        map_size: int | None = None,
        environments: int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> Store:
        """Rebuild a store from a snapshot and its chain of increments.

        ``snapshot_dir`` is a full snapshot or an increment; its parents are followed back to the
        base. It is a directory, ``file://DIR`` or an ``s3://BUCKET/PREFIX`` URI, which is
        downloaded with its chain into a staging directory (removed afterwards) and checked like a
        local one. The result is an in-memory store, or a durable one at ``path`` (a directory that
        holds no store yet), with any ``num_shards``. Every file is checked against the size and
        checksum its manifest records: a truncated or altered file raises :class:`CorruptError`
        naming it, and no store is left behind. ``progress``, if given, is called from this thread
        with the rows loaded so far, every 0.1 s or so.
        """
        counter = _native.Counter()
        args = (
            os.fspath(snapshot_dir),
            *_store_args(
                num_shards,
                threads,
                max_inflight_bytes,
                path,
                durability,
                flush_interval,
                map_size,
                environments,
            ),
            counter,
        )
        self = cls.__new__(cls)
        self._inner = _with_progress(lambda: _native.Store.restore(*args), counter, progress)
        return self

    def __repr__(self) -> str:
        where = f" path={self.path!r} durability={self.durability}" if self.path else ""
        return (
            f"<Store tables={self.tables()} shards={self.num_shards} threads={self.threads}{where}>"
        )


_T = TypeVar("_T")


def _store_args(
    num_shards: int | None,
    threads: int | None,
    max_inflight_bytes: int | None,
    path: str | os.PathLike[str] | None,
    durability: str,
    flush_interval: float,
    map_size: int | None,
    environments: int | None = None,
) -> tuple[int | None, int | None, int | None, str | None, str, float, int | None, int | None]:
    """The native store's arguments, checked and converted (the order of its signature)."""

    def opt(v: int | None, what: str) -> int | None:
        return None if v is None else _check_int(v, what)

    return (
        opt(num_shards, "num_shards"),
        opt(threads, "threads"),
        opt(max_inflight_bytes, "max_inflight_bytes"),
        None if path is None else os.fspath(path),
        durability,
        float(flush_interval),
        opt(map_size, "map_size"),
        opt(environments, "environments"),
    )


def _with_progress(
    call: Callable[[], _T], counter: _native.Counter, progress: Callable[[int], object] | None
) -> _T:
    """Run ``call`` (a native call that releases the GIL), reporting ``counter`` to ``progress``."""
    if progress is None:
        return call()
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # handed to the caller's thread below
            error.append(e)

    worker = threading.Thread(target=run, name="pstore-progress", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
            progress(counter.value)
    except BaseException:
        # The native work cannot be stopped midway: let it finish, so nothing goes on behind
        # the caller's back, then raise the callback's error (Ctrl-C included).
        worker.join()
        raise
    if error:
        raise error[0]
    return result[0]


def _check_int(v: object, what: str, hi: int = 2**63, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise DtypeError(f"{what} must be an int, got {type(v).__name__}")
    if not lo <= int(v) < hi:
        raise InvalidArgumentError(f"{what} must be a non-negative int below {hi}, got {v}")
    return int(v)


def _check_bool(v: object, what: str) -> bool:
    if not isinstance(v, bool | np.bool_):
        raise DtypeError(f"{what} must be a bool, got {type(v).__name__}")
    return bool(v)


def _check_float(v: object, what: str) -> float:
    """A real number (an int or float, numpy's included; not a bool or a string)."""
    if isinstance(v, bool | np.bool_) or not isinstance(v, int | float | np.integer | np.floating):
        raise DtypeError(f"{what} must be a number, got {type(v).__name__} {v!r:.40}")
    return float(v)


def _configs(
    optimizer: object, initializer: object, default_init: init.Initializer
) -> tuple[optim.Optimizer, init.Initializer]:
    opt = optim.SGD(lr=0.01) if optimizer is None else optimizer
    ini = default_init if initializer is None else initializer
    if not isinstance(opt, optim.SGD | optim.Adagrad | optim.Adam | optim.Ftrl):
        raise DtypeError(
            f"optimizer must be a pstore.optim.SGD, Adagrad, Adam or Ftrl, got {type(opt).__name__}"
        )
    if not isinstance(
        ini, init.Zeros | init.Constant | init.Uniform | init.Normal | init.TruncatedNormal
    ):
        raise DtypeError(
            f"initializer must be one of pstore.init's classes, got {type(ini).__name__}"
        )
    return opt, ini


def _seed(seed: object) -> int:
    return _check_int(seed, "seed", 2**64)
