"""Read-only serving: artifacts built from snapshots, lookups, live increments, a model server.

>>> pstore.serving.export("snapshots/full-0001", "model")  # doctest: +SKIP
>>> model = pstore.serving.ServingStore("model")  # doctest: +SKIP
>>> rows = model.lookup("user", ids, default="initial")  # doctest: +SKIP

An artifact holds the weights of the tables (no optimizer state), optionally quantized
(float16, or int8 with a per-row scale): an LMDB environment of records and, per sparse table, a
read-only row file with a hashed index. Serving processes map it read-only and share one copy
of it through the page cache. A writer (:meth:`ServingStore.apply`, :func:`follow`,
``pstore serving follow``) applies newer snapshots, each committed by one transaction: a lookup
sees the old version or the new one, never a mix. The format is in docs/FORMAT.md;
:mod:`pstore.serving.torch` serves a model through ``torch.export``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from pstore import _native
from pstore.exceptions import InvalidArgumentError
from pstore.server import Server, _check_port, _net, _warnings_of, log_event
from pstore.store import IdsLike, _as_f32, _as_ids

__all__ = ["DTYPES", "ModelServer", "ServingStore", "export", "follow", "serve_model"]

Dtype = Literal["float32", "float16", "int8"]
DTYPES: tuple[str, ...] = ("float32", "float16", "int8")
Default = Literal["zeros", "initial"] | npt.ArrayLike

PathLike = str | os.PathLike[str]


def export(
    snapshot: PathLike,
    out: PathLike,
    *,
    tables: list[str] | None = None,
    dtype: Dtype = "float32",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Build a serving artifact in ``out`` (a new or empty directory) from ``snapshot``.

    The snapshot's chain (its full snapshot and increments up to it) is applied in order. Only
    the weights are kept: ``dtype`` ``"float16"`` halves a float32 row, ``"int8"`` stores one
    byte per element plus a float32 scale per row (error at most ``max|row| / 254``). Dense
    tables are kept as float32. ``tables`` selects tables by name (default: all, and tables
    that later increments add). The artifact is written beside ``out`` and renamed into place:
    on an error nothing is left.

    Returns the artifact's state (``"tables"``, ``"snapshot"``, ...) plus ``"file_bytes"``,
    ``"chain"`` (snapshots applied) and ``"bytes_per_row"`` per sparse table.
    """
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    counter = _native.Counter()
    result: dict[str, Any] = {}
    error: list[BaseException] = []

    def run() -> None:
        try:
            result["json"] = _native.export_artifact(
                os.fspath(snapshot),
                os.fspath(out),
                None if tables is None else list(tables),
                dtype,
                counter,
            )
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    if progress is None:
        run()
    else:
        t = threading.Thread(target=run, name="pstore-export")
        t.start()
        while t.is_alive():
            t.join(0.1)
            progress(counter.value)
        progress(counter.value)
    if error:
        raise error[0]
    info = json.loads(result["json"])
    state: dict[str, Any] = info.pop("state")
    rows = sum(t["rows"] for t in state["tables"] if t["kind"] == "sparse")
    state.update(info)
    state["bytes_per_row"] = state["file_bytes"] / rows if rows else 0.0
    return state


class ServingStore:
    """A serving artifact, opened read-only (or ``writable=True`` to apply snapshots).

    Many processes may open one artifact at once; they share its pages. There is no API that
    writes rows: an artifact changes only by applying snapshots training took
    (:meth:`apply`, :meth:`follow`). Opening an artifact a second time in one process shares the
    first opening.

    ``verify`` chooses how rows are checked against their checksums (every row is checked
    before it is served; decision 0119): ``"background"`` (the default) has one low-priority
    thread of the process read each row file once, whole, after it is opened; lookups check the
    rows it has not reached on their first read, and nothing once it found the file sound.
    ``"on-read"`` checks each row on its first read in the process only (no thread). ``None``
    takes the ``PSTORE_SERVING_VERIFY`` environment setting (``background`` or ``on-read``),
    else ``"background"``. The background check runs if any opening of the directory in the
    process asked for it.
    """

    def __init__(
        self, path: PathLike, *, writable: bool = False, verify: str | None = None
    ) -> None:
        self.path = os.fspath(path)
        self._native: _native.Artifact | None = _native.Artifact(self.path, writable, verify)

    @property
    def _inner(self) -> _native.Artifact:
        if self._native is None:
            raise InvalidArgumentError(f"the ServingStore of {self.path} is closed")
        return self._native

    @property
    def writable(self) -> bool:
        """Whether snapshots can be applied through this object."""
        return self._inner.writable

    def info(self) -> dict[str, Any]:
        """The artifact's state: ``dtype``, ``tables`` (name, kind, dim, shape, rows, ...),
        ``snapshot`` (``id``, ``kind``, ``path``, ``created_at``), ``generation`` (snapshots
        applied), ``created_at`` (export) and ``applied_at`` (last snapshot applied)."""
        state: dict[str, Any] = json.loads(self._inner.state_json())
        return state

    @property
    def dtype(self) -> str:
        """How sparse rows are stored: float32, float16 or int8."""
        dtype: str = self.info()["dtype"]
        return dtype

    @property
    def generation(self) -> int:
        """Bumped by every snapshot applied."""
        generation: int = self.info()["generation"]
        return generation

    def tables(self) -> list[str]:
        """The tables' names."""
        return [t["name"] for t in self.info()["tables"]]

    def table_info(self, name: str) -> dict[str, Any]:
        """One table's entry of :meth:`info`."""
        tables: list[dict[str, Any]] = self.info()["tables"]
        for t in tables:
            if t["name"] == name:
                return t
        from pstore.exceptions import UnknownTableError

        raise UnknownTableError(f"unknown table {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self.tables()

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables())

    def lookup(
        self,
        table: str,
        ids: IdsLike,
        default: Default = "zeros",
        *,
        return_found: bool = False,
    ) -> Any:
        """The float32 rows of ``ids`` (``(len(ids), dim)``), all from one version.

        ``default`` is what ids the artifact lacks get: ``"zeros"``, ``"initial"`` (the row the
        training table would create for the id: its initializer at (seed, id)), or a row of
        the table's dim. With ``return_found=True`` returns ``(rows, found)``, ``found`` a bool
        mask of the ids the artifact has.
        """
        inner = self._native
        if inner is None:
            inner = self._inner  # raises: closed
        # The common case (a contiguous uint64 array) skips the conversions.
        if type(ids) is np.ndarray and ids.dtype == np.uint64 and ids.flags.c_contiguous:
            a = ids if ids.ndim == 1 else _as_ids(ids)
        else:
            a = _as_ids(ids)
        if isinstance(default, str):
            if default not in ("zeros", "initial"):
                raise InvalidArgumentError(
                    f"default must be 'zeros', 'initial' or a row, got {default!r}"
                )
            rows, found, _ = inner.lookup(table, a, default, None, return_found)
        else:
            row = _as_f32(default, "the default row")
            if row.ndim != 1:
                from pstore.exceptions import ShapeError

                raise ShapeError(f"the default row must be 1-D, got shape {row.shape}")
            rows, found, _ = inner.lookup(table, a, "row", row, return_found)
        return (rows, found) if return_found else rows

    def contains(self, table: str, ids: IdsLike) -> np.ndarray:
        """A bool mask: which ids the artifact has rows for."""
        return self._inner.contains(table, _as_ids(ids))

    def verified(self, table: str) -> dict[str, Any]:
        """How far this process checked a sparse table's rows: ``"rows_verified"`` (rows whose
        checksum it verified, on a read or by the background check; later reads of a verified
        row skip the check), ``"rows"``, ``"bitmap_bytes"`` (the memory of the bitmaps that
        remember the rows and index slots verified) and ``"scan"``, where the background check
        of the whole row file stands: ``"off"`` (``verify="on-read"``), ``"running"``,
        ``"verified"`` (every row and slot sound: lookups check nothing more), ``"damaged"``
        (damage found: those rows are refused on every read, the others served) or
        ``"stopped"``. Rows a snapshot applied rewrote are in a new row file, checked again. An
        artifact of format version 1 (rows in LMDB) reports ``rows_verified`` 0 and scan
        ``"off"``."""
        r = self._inner.verified(table)
        if r is None:
            return {"rows_verified": 0, "rows": 0, "bitmap_bytes": 0, "scan": "off"}
        return {"rows_verified": r[0], "rows": r[1], "bitmap_bytes": r[2], "scan": r[3]}

    def dense(self, table: str) -> np.ndarray:
        """A dense table's value (float32, its shape)."""
        return self._inner.dense(table)

    def rows(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of a sparse table, dequantized: ``(ids, rows)``, ids (uint64) ascending,
        rows float32 ``(n, dim)``: exactly what :meth:`lookup` returns for them."""
        ids, stored = self.stored_rows(table)
        if stored.dtype == np.float32:
            return ids, stored
        if stored.dtype == np.float16:
            return ids, stored.astype(np.float32)
        return ids, stored["q"].astype(np.float32) * stored["scale"][:, None]

    def stored_rows(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of a sparse table as stored: ``(ids, rows)``, ids ascending; rows float32
        or float16 ``(n, dim)``, or for int8 a structured array with fields ``scale``
        (float32) and ``q`` (int8, ``(dim,)``); the value is ``q * scale``."""
        ids, raw, dim, dtype = self._inner.scan(table)
        n = len(ids)
        if dtype == "float32":
            return ids, raw.view("<f4").reshape(n, dim)
        if dtype == "float16":
            return ids, raw.view("<f2").reshape(n, dim)
        rec = np.dtype([("scale", "<f4"), ("q", "i1", (dim,))])
        return ids, raw.view(rec).reshape(n)

    def lag(self, snapshot_root: PathLike | None = None) -> dict[str, Any]:
        """How far behind training the artifact is.

        ``seconds``: since training took the snapshot the artifact is at; ``snapshot_id`` and
        ``generation``. With ``snapshot_root``: ``pending``, the snapshots there that
        :meth:`follow` would apply, and ``newest_seconds``, how much newer the newest is.
        """
        info = self.info()
        out: dict[str, Any] = {
            "seconds": max(0.0, time.time() - info["snapshot"]["created_at"]),
            "snapshot_id": info["snapshot"]["id"],
            "generation": info["generation"],
        }
        if snapshot_root is not None:
            pending = self._inner.pending(os.fspath(snapshot_root))
            out["pending"] = len(pending)
            newest = _native.newest_snapshot(os.fspath(snapshot_root))
            newest_at = info["snapshot"]["created_at"]
            if newest is not None and pending:
                with open(os.path.join(newest, "manifest.json"), "rb") as f:
                    newest_at = json.load(f)["created_at"]
            out["newest_seconds"] = max(0.0, newest_at - info["snapshot"]["created_at"])
        return out

    def apply(self, snapshot: PathLike) -> dict[str, Any] | None:
        """Apply one snapshot in one transaction: an increment of the snapshot the artifact is
        at (rows replaced, tombstones deleted), or a full snapshot (every table replaced).
        Returns what it did, or None if the artifact is at that snapshot already. Needs
        ``writable=True``."""
        r = self._inner.apply(os.fspath(snapshot))
        return None if r is None else json.loads(r)

    def follow(self, snapshot_root: PathLike) -> list[dict[str, Any]]:
        """Apply, in order, the snapshots under ``snapshot_root`` that lead to the newest one;
        returns what was applied. Needs ``writable=True``."""
        applied: list[dict[str, Any]] = json.loads(self._inner.follow(os.fspath(snapshot_root)))
        return applied

    def serve(self, **server_args: Any) -> ModelServer:
        """Serve the artifact read-only over gRPC (see :class:`ModelServer`)."""
        return ModelServer(self, **server_args)

    def close(self) -> None:
        """Let go of the artifact (it closes when no object of this process uses it)."""
        self._native = None

    def __enter__(self) -> ServingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ServingStore {self.path!r}>"


class ModelServer(Server):
    """A running model server: a serving artifact answered read-only on ``host:port``.

    Clients use :func:`pstore.connect` as for store servers: ``table.pull(ids)`` is a lookup
    (ids the artifact lacks get ``default``: ``"initial"``, ``"zeros"`` or a row), and
    ``contains``, dense ``pull``, ``status`` work; every write is refused. Tokens, TLS, metrics,
    connection limits and ``max_message`` are as for :class:`pstore.server.Server`; metrics add
    ``pstore_model_lag_seconds`` and ``pstore_model_generation``.

    ``rows_port`` (0: any free port) also serves pulls on a plain TCP port of ``host``
    (docs/PROTOCOL.md, "Rows port"): :func:`pstore.connect` learns it from the server's status
    and sends a pull that goes to this server alone there, answered without HTTP/2, and over
    gRPC if the port cannot be reached. Not with TLS (the port is not encrypted); tokens are
    checked as on the gRPC port.
    """

    def __init__(
        self,
        model: ServingStore,
        *,
        default: Default = "initial",
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        token: str | None = None,
        read_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        max_message: int | None = None,
        metrics_host: str | None = None,
        metrics_token: str | None = None,
        metrics_tls: bool = False,
        max_connections: int | None = None,
        handshake_timeout: float | None = None,
        rows_port: int | None = None,
    ) -> None:
        kind, row = (default, None) if isinstance(default, str) else ("row", default)
        if kind not in ("zeros", "initial", "row"):
            raise InvalidArgumentError(
                f"default must be 'zeros', 'initial' or a row, got {default!r}"
            )
        if token is None and read_token is not None:
            # Every write is refused anyway: a read-only token alone guards the reads.
            token, read_token = read_token, None
        self.model = model
        self.store = None
        fallback = None if row is None else _as_f32(row, "the default row")
        _check_port(rows_port, "rows_port")
        net = _net(
            metrics_host,
            metrics_token,
            metrics_tls,
            max_connections,
            handshake_timeout,
            rows_port=rows_port,
        )
        self._start(
            lambda cert, key: model._inner.serve(
                kind,
                fallback,
                host,
                port,
                metrics_port,
                token,
                read_token,
                cert,
                key,
                max_message,
                net,
            ),
            host,
            port,
            metrics_port,
            tls_cert,
            tls_key,
        )

    def __repr__(self) -> str:
        return f"<ModelServer {self.address} {self.model.path!r} running={self.running}>"


def follow(
    snapshot_root: PathLike,
    model_dir: PathLike,
    *,
    interval: float = 10.0,
    once: bool = False,
    stop: threading.Event | None = None,
    on_apply: Callable[[dict[str, Any]], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
) -> int:
    """Keep the artifact in ``model_dir`` at the newest snapshot under ``snapshot_root``.

    Every ``interval`` seconds it applies the snapshots that lead from the one the artifact is
    at to the newest (each in one transaction), calling ``on_apply`` with what each did. Runs
    until ``stop`` is set, or one round with ``once``. A round that fails (a damaged or
    half-copied snapshot) raises, unless ``on_error`` is given: it is called with the error and
    the next round tries again. Returns the snapshots applied.
    """
    if not interval > 0:
        raise InvalidArgumentError(f"interval must be > 0 seconds, got {interval}")
    model = ServingStore(model_dir, writable=True)
    applied = 0
    try:
        while True:
            try:
                for a in model.follow(snapshot_root):
                    applied += 1
                    if on_apply is not None:
                        on_apply(a)
            except Exception as e:
                if on_error is None or once:
                    raise
                on_error(e)
            if once or (stop is not None and stop.wait(interval)):
                return applied
            if stop is None:
                time.sleep(interval)
    finally:
        model.close()


def log_applied(a: dict[str, Any]) -> None:
    """Log what :meth:`ServingStore.apply` did (logfmt, stderr)."""
    log_event(
        "applied",
        snapshot=a["id"],
        path=a["path"],
        kind=a["kind"],
        rows=a["rows"],
        deleted=a["deleted"],
        generation=a["generation"],
    )


def log_follow_error(e: Exception) -> None:
    """Log a round of :func:`follow` that failed (the next round tries again)."""
    log_event("follow_failed", level="error", error=e)


def serve_model(
    model_dir: PathLike,
    *,
    follow_root: PathLike | None = None,
    interval: float = 10.0,
    log_interval: float = 60.0,
    grace: float = 30.0,
    ready: threading.Event | None = None,
    restore_signals: bool = True,
    **server_args: Any,
) -> int:
    """Serve an artifact until SIGTERM or SIGINT, logging in logfmt to stderr (what
    ``pstore serve-model`` runs); returns 0.

    With ``follow_root`` the artifact is opened writable and the snapshots that appear under
    ``follow_root`` are applied every ``interval`` seconds while it serves (as :func:`follow`).
    Every ``log_interval`` seconds it logs how far behind training the artifact is.
    """
    from pstore.server import run_until_signal

    model = ServingStore(model_dir, writable=follow_root is not None)
    stop = threading.Event()
    follower: threading.Thread | None = None

    def make() -> Server:
        nonlocal follower
        srv = ModelServer(model, **server_args)
        if follow_root is not None:
            # The same opening as `model` (one per process): its lookups see each snapshot
            # the follower applies.
            follower = threading.Thread(
                target=follow,
                args=(follow_root, model_dir),
                kwargs={
                    "interval": interval,
                    "stop": stop,
                    "on_apply": log_applied,
                    "on_error": log_follow_error,
                },
                name="pstore-follow",
                daemon=True,
            )
            follower.start()
        return srv

    def tick() -> None:
        lag = model.lag(follow_root)
        log_event(
            "model",
            generation=lag["generation"],
            snapshot=lag["snapshot_id"],
            lag_seconds=f"{lag['seconds']:.1f}",
            pending=lag.get("pending", ""),
        )

    def close() -> None:
        stop.set()
        if follower is not None:
            follower.join()
        model.close()

    info = model.info()
    return run_until_signal(
        make,
        lambda srv: {
            "model": model.path,
            "snapshot": info["snapshot"]["id"],
            "dtype": info["dtype"],
            "follow": "" if follow_root is None else os.fspath(follow_root),
            "rows_port": srv.rows_port or "",
        },
        tick=tick,
        close=close,
        auth=bool(server_args.get("token") or server_args.get("read_token")),
        tls=bool(server_args.get("tls_cert")),
        warnings=_warnings_of(server_args),
        log_interval=log_interval,
        grace=grace,
        ready=ready,
        restore_signals=restore_signals,
    )
