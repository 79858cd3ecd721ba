"""The distributed client: the tables of store servers, with the embedded store's API.

>>> store = pstore.connect(["10.0.0.1:7070", "10.0.0.2:7070"], token=...)  # doctest: +SKIP
>>> user = store.create_sparse_table("user", dim=32)  # doctest: +SKIP
>>> rows = user.pull(ids)  # the same calls as on pstore.Store  # doctest: +SKIP

Training code switches between the embedded store and servers by changing the line that makes
the store. The client is written in Rust: the requests of one call go to all servers at once,
with the GIL released. See docs/CLUSTER.md for running servers.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any, Literal

from pstore import _native
from pstore.exceptions import InvalidArgumentError, ServerError
from pstore.store import BaseStore, _check_int

__all__ = [
    "RemoteStore",
    "SnapshotHandle",
    "connect",
    "load_cluster",
    "promote",
    "restore_cluster",
]

Mode = Literal["async", "bsp", "ssp"]


def _pace(max_rows_per_second: float | None) -> float | None:
    """A move's pace as a float (None: unpaced); the core refuses one that is not positive."""
    if max_rows_per_second is None:
        return None
    if isinstance(max_rows_per_second, bool) or not isinstance(max_rows_per_second, (int, float)):
        raise TypeError(
            "max_rows_per_second must be a number of rows a second or None, got "
            f"{type(max_rows_per_second).__name__}"
        )
    return float(max_rows_per_second)


def _members_of(address: str | Sequence[str]) -> list[str]:
    """The members of a server or replica group given to :meth:`RemoteStore.add_server`: one
    address, a list or tuple of them, or one string of them joined with commas."""
    if isinstance(address, str):
        members = [m.strip() for m in address.split(",")]
    elif isinstance(address, (list, tuple)) and all(isinstance(m, str) for m in address):
        members = [m.strip() for m in address]
    else:
        raise TypeError(
            "address must be a str 'host:port' or a list of them (a replica group, its primary "
            f"first), got {type(address).__name__}"
        )
    if not members or any(not m for m in members):
        raise InvalidArgumentError(
            f"add_server needs 'host:port' addresses, got {address!r}; nothing was changed"
        )
    return members


def _read_secret(value: str | None, file: str | os.PathLike[str] | None, env: str) -> str | None:
    """A secret given directly, in a file (stripped of surrounding whitespace), or in ``env``."""
    if value is not None and file is not None:
        raise InvalidArgumentError("give a token or a token file, not both")
    if file is not None:
        with open(file, encoding="utf-8") as f:
            value = f.read().strip()
        if not value:
            raise InvalidArgumentError(f"token file {os.fspath(file)!r} is empty")
    if value is None:
        value = os.environ.get(env) or None
    return value


class SnapshotHandle:
    """A cluster snapshot at a step boundary being taken, returned by
    :meth:`RemoteStore.snapshot_at_step`.

    ``step`` is the boundary: the snapshot holds every push of the job's steps ``<= step`` and
    none of a later step. It is written once every live worker has ended that step.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: _native.StepSnapshot) -> None:
        self._inner = inner

    @property
    def job(self) -> str:
        """The id of the job the boundary belongs to."""
        return self._inner.job

    @property
    def step(self) -> int:
        """The boundary: the last step whose pushes the snapshot holds."""
        return self._inner.step

    def done(self) -> bool:
        """True once the snapshot is written (or has failed)."""
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the snapshot is written.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most; ``None`` waits as long as it takes (the snapshot itself
            gives up after the ``timeout`` it was started with).

        Raises
        ------
        TimeoutError
            If the snapshot is still being taken after ``timeout`` seconds.
        WorkerLostError
            A worker was lost before it ended the step, in a job started with
            ``on_worker_loss="fail"``.
        ServerTimeoutError
            The slowest worker did not end the step within the snapshot's own timeout.
        PstoreError
            Any other error of the snapshot (no cluster snapshot is left in its directory then).
        """
        if not self._inner.wait(timeout):
            raise TimeoutError(f"snapshot at step {self.step} still being taken after {timeout} s")

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the snapshot (as :meth:`wait`) and return its cluster manifest, as
        :meth:`RemoteStore.snapshot` returns it."""
        self.wait(timeout)
        manifest: dict[str, Any] = json.loads(self._inner.result())
        return manifest

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SnapshotHandle job={self.job!r} step={self.step} {state}>"


class RemoteStore(BaseStore):
    """Tables on store servers, with the API of :class:`pstore.Store`.

    Made by :func:`connect`. The table methods (``create_sparse_table``, ``table``, ``flush``,
    ...) are those of every store (:class:`pstore.store.BaseStore`); sparse rows are spread over
    the servers by id, a dense table lives on one server. Besides, a cluster has status, health,
    per-server snapshots and training clocks (:meth:`end_step`, for the BSP and SSP modes).
    """

    _inner: _native.Client

    def __init__(
        self,
        inner: _native.Client,
        mode: Mode,
        staleness: int,
        worker: int | None,
        num_workers: int | None,
        barrier_timeout: float,
    ) -> None:
        self._inner = inner
        self._mode = mode
        self._staleness = staleness
        self._worker = worker
        self._num_workers = num_workers
        self._barrier_timeout = barrier_timeout
        self._clock = 0
        self._job: str | None = None
        # The thread that trains: the one that joined the job or last called end_step.
        self._loop_thread: int | None = None

    def _join(self, job: str | None, lease: float, on_worker_loss: str, aggregate: str) -> None:
        """Joins the job on every server (BSP and SSP modes)."""
        assert self._worker is not None and self._num_workers is not None
        self._job, self._clock = self._inner.join_job(
            job,
            self._worker,
            self._num_workers,
            self._mode == "bsp",
            lease,
            on_worker_loss == "continue",
            aggregate == "mean",
            self._barrier_timeout,
        )
        self._loop_thread = threading.get_ident()

    @property
    def job(self) -> str | None:
        """The id of the synchronous job this worker takes part in (BSP and SSP modes)."""
        return self._job

    @property
    def worker(self) -> int | None:
        """This worker's rank (given to :func:`connect` or taken from the environment)."""
        return self._worker

    @property
    def num_workers(self) -> int | None:
        """The number of workers (given to :func:`connect` or taken from the environment)."""
        return self._num_workers

    @property
    def servers(self) -> list[str]:
        """The server addresses."""
        return self._inner.servers

    @property
    def slots(self) -> dict[str, Any]:
        """The slot table ids are routed by: ``{"epoch", "servers", "ranges"}``, each range
        ``[start, end, owner]`` giving hash slots ``start`` to ``end - 1`` (of 16,384) to the
        server at position ``owner`` of :attr:`servers`."""
        table: dict[str, Any] = json.loads(self._inner.slots)
        return table

    def publish_members(self, groups: Sequence[Sequence[str]]) -> int | None:
        """Publish replica groups' current members (each group's addresses, in any order) in
        the routing the servers hold: every position whose group shares a member with one of
        ``groups`` and names other members gets that group's members, under the next routing
        epoch with the same slot table (no row moves). Clients that cannot reach a group's
        members they know ask the other servers and follow (docs/CLUSTER.md, "How clients
        follow"). Returns the epoch published, or None when nothing changed or the servers hold
        no routing yet (a first routing is published by ``add_server`` or
        :meth:`publish_routing`). :class:`pstore.controller.Controller` calls it when it
        replaces a member.
        """
        if isinstance(groups, (str, bytes)) or not all(
            not isinstance(g, (str, bytes)) and all(isinstance(a, str) for a in g) for g in groups
        ):
            raise TypeError("groups must be a list of lists of 'host:port'")
        epoch: int | None = self._inner.publish_members([list(g) for g in groups])
        return epoch

    def publish_routing(self, slots: dict[str, Any]) -> None:
        """Publish ``slots`` (the form of :attr:`slots`) as the cluster's routing on every server.

        Its ``epoch`` must be above the current one (publishing the same table again is
        accepted). From then on each server answers a call for rows it does not own with
        "moved", and every client of this version fetches the new table and sends the call
        there: workers follow without restarting. No rows move: publish a table that changes
        owners only once the rows are on their new owners (docs/CLUSTER.md, "Routing epochs").
        """
        if not isinstance(slots, dict):
            kind = type(slots).__name__
            raise TypeError(f"slots must be a dict like RemoteStore.slots, got {kind}")
        self._inner.publish_routing(json.dumps(slots))

    def move_slots(
        self, slots: dict[str, Any], *, max_rows_per_second: float | None = None
    ) -> dict[str, Any]:
        """Move every hash slot whose owner differs in ``slots`` (the form of :attr:`slots`,
        over the same servers; its ``epoch`` is not used) to its new owner while workers train.

        A batch of slots at a time: its rows (every table's, with optimizer state and
        metadata) and a dense table whose home moves are copied to the new owner while writes
        go on; then its writes wait on the old owner (workers retry, briefly) while the rows
        written meanwhile (``delta_rows``), the seqs and the request ids of recent pushes are
        copied, the routing that gives it to the new owner is published under the next epoch,
        and the old owner drops its copy. Workers follow without restarting; nothing is lost or
        applied twice. Give a server no slot to empty it before it leaves, or its share when it
        joins (docs/CLUSTER.md, "Moving slots"). Returns ``{"slots", "rows", "batches",
        "epoch", "seconds", "max_frozen_seconds", "delta_rows"}``.

        ``max_rows_per_second`` paces the move: after each batch it waits, with nothing
        frozen, until the rows copied so far average at most that rate, leaving the cores and
        the network to training (a longer move, a smaller slowdown). None (the default) runs
        the batches back to back.
        """
        if not isinstance(slots, dict):
            kind = type(slots).__name__
            raise TypeError(f"slots must be a dict like RemoteStore.slots, got {kind}")
        rate = _pace(max_rows_per_second)
        report: dict[str, Any] = self._inner.move_slots(json.dumps(slots), rate)
        return report

    def add_server(
        self, address: str | Sequence[str], *, max_rows_per_second: float | None = None
    ) -> dict[str, Any]:
        """Add a store server, or a replica group, to the cluster while workers train.

        ``address`` is the server's "host:port", or a replica group: a list or tuple of its
        members' addresses (or one string of them joined with commas), its primary first, then
        its followers (each started with ``pstore serve --follow PRIMARY``). The new server or
        group gets every table's definition, joins the end of the server list (which the
        servers hold, with each position's group and the slot table, under the next routing
        epoch), then about 1/N of the hash slots move to it from every other position as
        :meth:`move_slots` moves them. Running workers follow the new list without restarting,
        also when they were connected with replica groups; nothing is lost or applied twice;
        durable servers keep the list across restarts. A running BSP or SSP job goes on: the
        new server is given the job as the others hold it, and every worker reports its steps
        to it from the list change on. Refused, with nothing changed, for an
        address already in the list (of any group), a member that does not answer, a first
        member that is not a primary or a follower that does not follow it, and a server that
        holds rows or another cluster's routing (docs/CLUSTER.md, "When the list changes").
        Returns the report of the move (as :meth:`move_slots`, which ``max_rows_per_second``
        paces).
        """
        members = _members_of(address)
        rate = _pace(max_rows_per_second)
        report: dict[str, Any] = self._inner.add_server(members, rate)
        return report

    def remove_server(
        self, address: str | int, *, max_rows_per_second: float | None = None
    ) -> dict[str, Any]:
        """Remove a store server, or a whole replica group, from the cluster while workers train.

        ``address`` is the address of the server or of any member of its group, or the
        position's number in :attr:`servers`. Every hash slot it owns moves to the other
        positions (spread evenly) with its rows, then the list without it is published under
        the next routing epoch: it holds no rows afterwards and can be stopped (all members of
        a group); a job's workers report their steps to the new list from then on. Refused,
        with nothing changed, for an address not in the list, a position past its end and the
        last server. A move that fails part way (a server died) leaves the slots
        moved so far where they are; run it again once the servers answer. Returns the report
        of the move (as :meth:`move_slots`, which ``max_rows_per_second`` paces).
        """
        if isinstance(address, bool) or not isinstance(address, (str, int)):
            raise TypeError(
                "address must be a str 'host:port' or a position (int), got "
                f"{type(address).__name__}"
            )
        if isinstance(address, int) and address < 0:
            raise InvalidArgumentError(
                f"position {address} is not in the list (positions count from 0); nothing was "
                "changed"
            )
        rate = _pace(max_rows_per_second)
        report: dict[str, Any] = self._inner.remove_server(str(address).strip(), rate)
        return report

    @property
    def mode(self) -> Mode:
        """The training mode: ``"async"``, ``"bsp"`` or ``"ssp"``."""
        return self._mode

    @property
    def clock(self) -> int:
        """Steps this worker has finished (calls of :meth:`end_step`)."""
        return self._clock

    @property
    def wire_dtype(self) -> str:
        """Element type of rows and gradients on the wire."""
        return self._inner.wire_dtype

    def snapshot(
        self, dest: str | os.PathLike[str], *, incremental: bool = False
    ) -> dict[str, Any]:
        """Write one snapshot of the whole cluster into ``dest``; return its cluster manifest.

        A worker of an ``"ssp"`` job takes it at a step boundary (:meth:`snapshot_at_step`) and
        waits for it (at most ``barrier_timeout`` seconds), which only a thread other than the
        training thread may do: the boundary is a step every worker, this one too, has yet to
        end. On the training thread it raises :class:`~pstore.InvalidArgumentError`; call
        :meth:`snapshot_at_step` there and go on training. In a ``"bsp"`` job, a worker's
        snapshot between two ``end_step`` calls holds exactly the steps ended so far.

        ``dest`` is a directory (or ``file://DIR``) that the client and every server reach (on one
        machine, or a shared file system), created with its parents, or an object-store prefix
        ``s3://BUCKET/PREFIX`` that every server writes to itself (each server and the client need
        the ``AWS_*`` environment, docs/CLUSTER.md). Each server writes its part,
        ``dest/server-<i>`` (an ordinary snapshot, per-row consistent while training goes on), so no
        row passes through the client, then the client writes ``dest/cluster.json``: the layout
        (server list, routing), the tables' configs and every part's manifest id and checksum
        (docs/FORMAT.md). With ``incremental``, each part holds the rows changed since the previous
        cluster snapshot plus tombstones, and the manifest names it as parent.
        :func:`restore_cluster` loads it onto any server list.
        """
        if self._mode == "ssp" and self._job is not None:
            if threading.get_ident() == self._loop_thread:
                raise InvalidArgumentError(
                    "snapshot() on the training thread of an SSP worker would wait for a step "
                    "boundary this worker has to reach itself: call snapshot_at_step(dest) and "
                    "go on training (the handle's result() gives the manifest), or call "
                    "snapshot() from another thread"
                )
            return self.snapshot_at_step(dest, incremental=incremental).result()
        out = self._inner.cluster_snapshot(os.fspath(dest), incremental)
        manifest: dict[str, Any] = json.loads(out)
        return manifest

    def snapshot_at_step(
        self,
        dest: str | os.PathLike[str],
        step: int | None = None,
        *,
        incremental: bool = False,
        timeout: float | None = None,
    ) -> SnapshotHandle:
        """Start one snapshot of the whole cluster at a step boundary of the running job;
        return a :class:`SnapshotHandle` at once.

        The snapshot holds every push of the job's steps ``<= step`` and none of a later step,
        on every server, for sparse and dense tables, in BSP and SSP jobs. Any process may ask
        for it: a worker of the job (which goes on training), or a monitor connected in
        ``"async"`` mode (the servers' current job). ``dest`` and ``incremental`` are those of
        :meth:`snapshot`.

        Parameters
        ----------
        step : int, optional
            The boundary. ``None``: the earliest step no worker has gone past (at most the
            fastest worker's clock + 1). A step a worker has gone on from already raises
            :class:`~pstore.InvalidArgumentError` at once.
        timeout : float, optional
            Seconds the snapshot waits for the slowest live worker to end the step (default:
            ``barrier_timeout``); after that it fails with :class:`~pstore.ServerTimeoutError`.

        Until every live worker has ended ``step``, each server answers no worker's
        ``end_step`` for that step or a later one: the fastest workers wait at most as long as
        the slowest takes to reach the step, plus the time to write the parts. Workers behind
        the step go on as SSP allows. A worker lost meanwhile fails the snapshot with
        :class:`~pstore.WorkerLostError` (``on_worker_loss="fail"``) or is left out
        (``"continue"``). See docs/CLUSTER.md, "Snapshots at a step boundary".
        """
        if step is not None:
            step = _check_int(step, "step")
        wait = self._barrier_timeout if timeout is None else timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0:
            raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
        inner = self._inner.snapshot_at_step(os.fspath(dest), step, incremental, float(wait))
        return SnapshotHandle(inner)

    def restore_cluster(
        self, snapshot: str | os.PathLike[str], via: Literal["servers", "client"] = "servers"
    ) -> dict[str, int]:
        """Load a cluster snapshot into these servers, routing every row by this store's list.

        See :func:`restore_cluster`. Returns ``{"rows", "tables", "parts"}``.
        """
        rows, tables, parts = self._inner.restore_cluster(os.fspath(snapshot), via)
        return {"rows": rows, "tables": tables, "parts": parts}

    def status(self) -> list[dict[str, Any]]:
        """Each server's status: version, durability, tables with rows and seq, clocks, and
        ``role``: ``"store"``, or ``"model"`` for a model server (``pstore serve-model``),
        whose ``model`` is its artifact's state (snapshot, generation, dtype)."""
        out = self._inner.status()
        for s in out:
            raw = s.pop("model_json", None)
            s["model"] = None if raw is None else json.loads(raw)
            rep = s.pop("replication_json", None)
            s["replication"] = json.loads(rep) if rep else None
        return out

    def health(self) -> list[str]:
        """Each server's gRPC health status (``"SERVING"`` when up)."""
        return self._inner.health()

    def replica_groups(self) -> list[dict[str, Any]]:
        """Each position's replica group, as its members answer now (this refreshes the
        routing): ``primary`` (where writes go), ``epoch``, ``reads_from`` (where pulls go:
        a follower with ``read_from="follower"``), and ``members``, each with ``name``,
        ``role``, ``epoch`` and a follower's ``lag_entries`` and ``lag_seconds`` (or ``error``
        for one that did not answer)."""
        groups: list[dict[str, Any]] = json.loads(self._inner.groups())
        return groups

    def end_step(self) -> int:
        """Mark the end of this worker's training step; returns the new clock.

        Queued pushes are sent first. In ``"bsp"`` mode it then waits until every live worker
        has ended this step and every server applied the step's aggregate (one optimizer step
        per row), so the next pull sees exactly the steps so far; in ``"ssp"`` mode it
        waits until the slowest worker is at most ``staleness`` steps behind. In ``"async"``
        mode with a worker index it only reports the clock (for ``pstore status``). When it
        raises (a timeout, :class:`~pstore.WorkerLostError`), the clock stays: calling it again
        waits for the same step.
        """
        if self._job is not None:
            self._loop_thread = threading.get_ident()
            self._clock = self._inner.end_job_step(self._staleness, self._barrier_timeout)
            return self._clock
        self._clock += 1
        if self._worker is None or self._num_workers is None:
            self._inner.drain()
            return self._clock
        wait = {"async": None, "bsp": 0, "ssp": self._staleness}[self._mode]
        self._inner.clock(self._worker, self._num_workers, self._clock, wait, self._barrier_timeout)
        return self._clock

    def __repr__(self) -> str:
        return f"<RemoteStore servers={self.servers} mode={self._mode}>"


def _groups(servers: Sequence[str | Sequence[str]], where: str) -> list[list[str]]:
    """The replica groups of a server list whose entries are "host:port" or lists of them."""
    groups: list[list[str]] = []
    for x in servers:
        g = [x] if isinstance(x, str) else list(x) if isinstance(x, (list, tuple)) else None
        if not g or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in g):
            raise InvalidArgumentError(
                f'{where} needs "servers": a list whose entries are "host:port" strings or '
                f"non-empty lists of them (a replica group, primary first), got {x!r}"
            )
        groups.append(g)
    flat = [a for g in groups for a in g]
    if len(set(flat)) != len(flat):
        raise InvalidArgumentError(f"{where} lists a server twice")
    return groups


def load_cluster(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a cluster file: JSON with ``servers`` (a list whose entries are "host:port", or a
    list of them: a replica group, the first its initial primary and the others its followers,
    docs/CLUSTER.md "Failover"), optionally
    ``token_file`` (relative to the file), ``tls_ca``, ``tls_domain`` and ``slots``, the slot
    table (``{"epoch": E, "servers": N, "ranges": [[START, END, OWNER], ...]}``; without it, the
    16,384 hash slots are split into equal contiguous ranges over the servers in order).

    One file describes the cluster for every machine: ``pstore serve --cluster FILE --index I``
    runs server I, and ``pstore.connect(FILE)`` or ``pstore status --cluster FILE`` reach them
    all (docs/CLUSTER.md).
    """
    with open(path, encoding="utf-8") as f:
        try:
            c = json.load(f)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"cluster file {os.fspath(path)!r}: {e}") from None
    servers = c.get("servers") if isinstance(c, dict) else None
    if not isinstance(servers, list) or not servers:
        raise InvalidArgumentError(
            f'cluster file {os.fspath(path)!r} needs "servers": a list of "host:port" strings '
            "(or lists of them: replica groups)"
        )
    _groups(servers, f"cluster file {os.fspath(path)!r}")
    unknown = set(c) - {"servers", "token_file", "tls_ca", "tls_domain", "slots"}
    if unknown:
        raise InvalidArgumentError(
            f"cluster file {os.fspath(path)!r}: unknown keys {sorted(unknown)}"
        )
    if "slots" in c and not isinstance(c["slots"], dict):
        raise InvalidArgumentError(
            f'cluster file {os.fspath(path)!r}: "slots" must be an object '
            '{"epoch": E, "servers": N, "ranges": [[START, END, OWNER], ...]}'
        )
    base = os.path.dirname(os.path.abspath(path))
    for k in ("token_file", "tls_ca"):
        if k in c:
            c[k] = os.path.join(base, c[k])
    return dict(c)


def _env_int(name: str) -> int | None:
    """The environment variable ``name`` as a non-negative integer; None when it is not set."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    s = raw.strip()
    if not s.isascii() or not s.isdigit() or int(s) >= 2**32:
        raise InvalidArgumentError(
            f"{name}={raw!r} in the environment is not an integer in 0..2**32 (a worker's rank "
            "or count, as torchrun or a Kubernetes indexed Job sets it)"
        )
    return int(s)


def _launcher_env(
    worker: int | None, num_workers: int | None, job: str | None
) -> tuple[int | None, int | None, str | None]:
    """The rank, worker count and job id a launcher gives a BSP/SSP worker in its environment,
    for those not given as arguments: RANK (torchrun) or JOB_COMPLETION_INDEX (a Kubernetes
    indexed Job), WORLD_SIZE, and PSTORE_JOB (docs/API_SPEC.md)."""
    rank_var = "RANK" if "RANK" in os.environ else "JOB_COMPLETION_INDEX"
    w_from = n_from = ""
    if worker is None:
        worker = _env_int(rank_var)
        w_from = "" if worker is None else f"{rank_var}={worker} in the environment"
    if num_workers is None:
        num_workers = _env_int("WORLD_SIZE")
        n_from = "" if num_workers is None else f"WORLD_SIZE={num_workers} in the environment"
    if w_from and num_workers is None:
        raise InvalidArgumentError(
            f"{rank_var} is set in the environment but WORLD_SIZE is not: give num_workers, "
            "or set WORLD_SIZE to the number of workers"
        )
    if n_from and num_workers == 0:
        raise InvalidArgumentError(f"{n_from}: a job needs at least one worker")
    if (w_from or n_from) and isinstance(worker, int) and isinstance(num_workers, int):
        if worker >= num_workers:
            raise InvalidArgumentError(
                f"{w_from or f'worker={worker}'} is not below "
                f"{n_from or f'num_workers={num_workers}'}"
            )
    if job is None:
        # Not torchrun's TORCHELASTIC_RUN_ID: its restarts keep it, and a restarted group that
        # rejoins its job finds the others' leases expired (docs/decisions/0097).
        job = os.environ.get("PSTORE_JOB") or None
    return worker, num_workers, job


def connect(
    servers: str | os.PathLike[str] | Sequence[str],
    token: str | None = None,
    *,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    retries: int = 3,
    wire_dtype: Literal["float32", "float16", "bfloat16"] = "float32",
    mode: Mode = "async",
    staleness: int = 0,
    worker: int | None = None,
    num_workers: int | None = None,
    barrier_timeout: float = 300.0,
    job: str | None = None,
    aggregate: Literal["sum", "mean"] = "sum",
    lease: float = 10.0,
    on_worker_loss: Literal["fail", "continue"] = "fail",
    tls_ca: str | os.PathLike[str] | None = None,
    tls_domain: str | None = None,
    max_message: int | None = None,
    max_inflight_bytes: int | None = None,
    ack: Literal["primary", "all"] = "primary",
    read_from: Literal["primary", "follower"] = "primary",
    failover_timeout: float = 30.0,
) -> RemoteStore:
    """Connect to store servers; returns a store with the API of :class:`pstore.Store`.

    Parameters
    ----------
    servers : list of "host:port", or the path of a cluster file
        Every server of the cluster. An entry may be a list of "host:port": a replica group
        (its first member the initial primary, the others followers); calls go to the
        group's primary, found again after a promotion (docs/CLUSTER.md, Failover). Every
        worker must give the same addresses in the same order: ids are routed through 16,384
        hash slots, each owned by a position in this list (the uniform table: equal contiguous
        ranges). A cluster file (:func:`load_cluster`)
        also gives the token file, the TLS settings and the slot table.
    token, token_file :
        The token (or a file holding it); default: the ``PSTORE_TOKEN`` environment variable.
    timeout : float
        Deadline of each request in seconds. Calls that fail as UNAVAILABLE or
        DEADLINE_EXCEEDED are retried ``retries`` times with exponential backoff; a retried
        push carries the same request id, and the server applies it once.
    wire_dtype : "float32", "float16" or "bfloat16"
        Element type of rows and gradients on the wire: 16-bit types halve the bytes at a
        relative rounding error of at most 2**-11 (float16, whose largest value is 65504) or
        2**-8 (bfloat16). The servers keep and update float32 rows.
    mode : "async", "bsp" or "ssp"
        Training mode across workers, enforced at :meth:`RemoteStore.end_step`; "bsp" and "ssp"
        need ``worker`` (0..num_workers-1) and ``num_workers``; "ssp" takes ``staleness``.
    worker, num_workers : int, optional
        "bsp" and "ssp": this worker's rank and the number of workers. Default: from the
        environment a launcher sets: ``RANK`` (torchrun) or else ``JOB_COMPLETION_INDEX`` (a
        Kubernetes indexed Job), and ``WORLD_SIZE``; a value there that is not an integer, or a
        rank not below the count, raises InvalidArgumentError naming the variable.
    barrier_timeout : float
        Seconds ``end_step`` waits for slow workers before raising ServerTimeoutError.
    job : str, optional
        "bsp" and "ssp": the job's id, the same on every worker. Clocks, leases and pending
        steps belong to a job, and a new job resets them on every server. Default: the
        ``PSTORE_JOB`` environment variable, else worker 0 makes a new id when it connects and
        the other workers take it from the coordinator (the first server in sorted order), so
        every launch (and every torchrun restart of the group) is a new job. A restarted worker
        rejoins a running job only with its id (``store.job``), at the step the job is at.
    aggregate : "sum" or "mean"
        "bsp": the servers apply, once per row and step, the sum of the step's gradients of all
        workers, or their mean (the sum divided by the number of live workers).
    lease : float
        "bsp" and "ssp": seconds without a call from a worker (the client sends a heartbeat
        every lease/4 seconds while it computes) after which the worker is lost.
    on_worker_loss : "fail" or "continue"
        What the other workers' ``end_step`` does when a worker is lost: raise
        :class:`~pstore.WorkerLostError` naming it, or go on without it (its clock no longer
        counts; when it comes back with the same rank and job it rejoins at the current step).
    tls_ca : path, optional
        PEM file of the CA that signed the servers' certificates: connect over TLS.
    ack : "primary" or "all"
        When a push returns: "primary" once each server has it under its durability mode;
        "all" once each server has committed it and every live follower of that server
        (``pstore serve --follow``) holds it durably too (docs/CLUSTER.md, Replication).
    read_from : "primary" or "follower"
        Where pulls go in a replica group: the primary, or the follower of least lag (falling
        back to the primary when it does not answer): for evaluation and serving, which may
        read rows a little behind the primary (the lag is in :meth:`RemoteStore.replica_groups`;
        a follower reads absent ids as their initial value without creating them).
    failover_timeout : float
        Seconds a call of a replica group looks for the group's primary (after a failure that
        says "not the primary", or no answer) before it fails; the same request is sent again
        to the primary found, and applies once.
    """
    if ack not in ("primary", "all"):
        raise InvalidArgumentError(f'ack must be "primary" or "all", got {ack!r}')
    addrs: list[str]
    slots: str | None = None
    if isinstance(servers, os.PathLike) or (
        isinstance(servers, str) and servers.endswith(".json") and os.path.isfile(servers)
    ):
        cluster = load_cluster(servers)
        groups = _groups(cluster["servers"], "the cluster file")
        if token is None and token_file is None:
            token_file = cluster.get("token_file")
        tls_ca = tls_ca if tls_ca is not None else cluster.get("tls_ca")
        tls_domain = tls_domain if tls_domain is not None else cluster.get("tls_domain")
        if "slots" in cluster:
            slots = json.dumps(cluster["slots"])
    elif isinstance(servers, str):
        groups = [[servers]]
    else:
        groups = _groups(list(servers), "connect")
    addrs = [g[0] for g in groups]
    replicas = [g[1:] for g in groups]
    if read_from not in ("primary", "follower"):
        raise InvalidArgumentError(f'read_from must be "primary" or "follower", got {read_from!r}')
    if mode not in ("async", "bsp", "ssp"):
        raise InvalidArgumentError(f'mode must be "async", "bsp" or "ssp", got {mode!r}')
    if mode != "async":
        worker, num_workers, job = _launcher_env(worker, num_workers, job)
    if mode != "async" and (worker is None or num_workers is None):
        raise InvalidArgumentError(
            f"mode {mode!r} needs worker and num_workers (or RANK, or JOB_COMPLETION_INDEX, "
            "and WORLD_SIZE in the environment)"
        )
    if num_workers is not None:
        num_workers = _check_int(num_workers, "num_workers", 2**32)
        if num_workers < 1:
            raise InvalidArgumentError("num_workers must be >= 1")
    if worker is not None:
        worker = _check_int(worker, "worker", 2**32)
        if num_workers is None or worker >= num_workers:
            raise InvalidArgumentError(f"worker must be in 0..num_workers, got {worker}")
    stale = _check_int(staleness, "staleness")
    if aggregate not in ("sum", "mean"):
        raise InvalidArgumentError(f'aggregate must be "sum" or "mean", got {aggregate!r}')
    if on_worker_loss not in ("fail", "continue"):
        raise InvalidArgumentError(
            f'on_worker_loss must be "fail" or "continue", got {on_worker_loss!r}'
        )
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0:
        raise InvalidArgumentError(f"lease must be > 0 seconds, got {lease!r}")
    if job is not None and (not isinstance(job, str) or not job):
        raise InvalidArgumentError(f"job must be a non-empty string, got {job!r}")
    secret = _read_secret(token, token_file, "PSTORE_TOKEN")
    ca = None
    if tls_ca is not None:
        with open(tls_ca, "rb") as f:
            ca = f.read()
    inner = _native.Client(
        addrs,
        secret,
        float(timeout),
        _check_int(retries, "retries", 2**32),
        wire_dtype,
        ca,
        tls_domain,
        max_message,
        max_inflight_bytes,
        slots,
        ack,
        replicas,
        read_from,
        _check_seconds(failover_timeout, "failover_timeout"),
    )
    store = RemoteStore(inner, mode, stale, worker, num_workers, float(barrier_timeout))
    if mode != "async":
        store._join(job, float(lease), on_worker_loss, aggregate)
    return store


def _check_seconds(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise InvalidArgumentError(f"{name} must be > 0 seconds, got {v!r}")
    return float(v)


def promote(
    address: str,
    *,
    cluster: str | os.PathLike[str] | None = None,
    force: bool = False,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Make the follower at ``address`` the primary of its replica group, under the next group
    epoch (docs/CLUSTER.md, Failover). The old primary, if it comes back, refuses writes and
    rejoins as a follower. The new primary accepts its first write once the old primary's write
    lease has run out (``writes_in_seconds``, at most about 2 s); clients find it by themselves.

    With ``cluster`` (a cluster file), ``address`` must be a member of one of its replica
    groups and follow that group's primary; the token comes from the file too. ``force``
    promotes a follower that was never caught up (it lacks what it had not received).
    Returns ``{"server", "epoch", "from_replication_id", "from_lsn", "writes_in_seconds"}``.
    Raises InvalidArgumentError for an address that is no member of the cluster's groups, and
    ServerError when the server refuses (it is a primary, it follows another group's primary,
    it holds no whole copy yet) or cannot be reached.
    """
    if not isinstance(force, bool):
        raise InvalidArgumentError(f"force must be a bool, got {force!r}")
    wait = _check_seconds(timeout, "timeout")
    expected: str | None = None
    if cluster is not None:
        c = load_cluster(cluster)
        if token is None and token_file is None:
            token_file = c.get("token_file")
        mine = [g for g in _groups(c["servers"], "the cluster file") if address in g]
        if not mine:
            raise InvalidArgumentError(
                f"{address} is no member of a replica group of the cluster file "
                f"{os.fspath(cluster)!r}"
            )
        if len(mine[0]) < 2:
            raise InvalidArgumentError(
                f"{address} is a group of one in the cluster file {os.fspath(cluster)!r}: "
                "there is no primary to take over from"
            )
        secret = _read_secret(token, token_file, "PSTORE_TOKEN")
        expected = _group_primary([a for a in mine[0] if a != address], secret, wait)
    else:
        secret = _read_secret(token, token_file, "PSTORE_TOKEN")
    return _native.promote(address, secret, expected, force, wait)


def _group_primary(members: list[str], token: str | None, timeout: float) -> str | None:
    """The member that answers as primary of the highest epoch (None when none answers)."""
    best: tuple[int, str] | None = None
    for a in members:
        try:
            status = _native.Client([a], token, min(timeout, 2.0), 0).status()[0]
        except ServerError:
            continue
        raw = status.get("replication_json")
        r = json.loads(raw) if raw else {}
        if r.get("role") == "primary" and (best is None or int(r.get("epoch", 0)) > best[0]):
            best = (int(r.get("epoch", 0)), a)
    return None if best is None else best[1]


def restore_cluster(
    snapshot: str | os.PathLike[str],
    servers: Sequence[str] | str | os.PathLike[str],
    *,
    via: Literal["servers", "client"] = "servers",
    **connect_args: Any,
) -> dict[str, int]:
    """Load a cluster snapshot (:meth:`RemoteStore.snapshot`) onto ``servers``, any number of them.

    Every row (weights, optimizer state, step, version, frequency) goes to the server the new
    list routes it to, so a snapshot of 4 servers restores onto 8 or onto 2. ``snapshot`` is a
    directory or an ``s3://BUCKET/PREFIX`` URI. Everything is checked before anything is
    written: every part present with its manifest's checksum, every file of every part's chain
    (a remote snapshot is downloaded into a staging directory for this), and every table that
    exists already on the new servers having the snapshot's dim (shape) and optimizer. With
    ``via="servers"`` (the default) every server reads the parts itself, from the object store
    or from the snapshot's directory at the absolute path the client sees, and keeps its rows; a
    server that cannot read it fails the restore naming itself and the location.
    ``via="client"`` is the fallback for servers that do not reach it: the client reads the
    parts and sends every row with the ``BulkLoad`` call (several times slower). If a write
    fails later, the tables the restore created are dropped again and the error says so.
    ``servers`` and ``connect_args`` are those of :func:`connect`. Returns ``{"rows", "tables",
    "parts"}``.
    """
    store = connect(servers, **connect_args)
    return store.restore_cluster(snapshot, via)
