"""Cluster snapshots at a step boundary of an SSP job, on real `pstore serve` processes over
loopback: 2 servers, 3 or 4 workers of different speeds, SGD from zeros with gradients whose sums
are exact in float32 (so the content at step c does not depend on the order pushes arrive in).

* The snapshot, restored onto other servers, equals bit for bit on every row of a sparse and a
  dense table the reference "every push of steps <= c, none after", c being the boundary it
  reports, whether a monitor process asks for it, a worker that goes on training, or a worker's
  second thread with `snapshot()`; with staleness 0, 1, 2 and 3, and training goes on during
  and after it. (Without the servers' hold the fastest workers' pushes of later steps land in
  the parts, and these comparisons fail.)
* A BSP job's monitor gets the same boundary, an increment at a later boundary builds on the
  full one, and durable servers (`--path`) write their parts at the boundary too.
* A worker killed while the snapshot waits for it fails the snapshot with WorkerLostError
  naming it (on_worker_loss="fail"), or is left out ("continue").
* A step already passed is refused at once and holds nothing back; so is a snapshot where no
  job runs, and `snapshot()` on an SSP worker's training thread.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, run_threads, start_servers, stop_all
from _ssp_worker import DIM, IDS, SHAPE, batch, declare, train_step

import pstore

WAIT = 90.0


@pytest.fixture(scope="module")
def servers() -> Iterator[list[str]]:
    procs = start_servers(2)
    try:
        yield [p.address for p in procs]
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def restore_servers() -> Iterator[list[str]]:
    """Two more servers that the snapshots are restored onto."""
    procs = start_servers(2)
    try:
        yield [p.address for p in procs]
    finally:
        stop_all(procs)


def reference(table: str, pushes: Iterable[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of IDS and the dense value after SGD (lr 1, from zeros) applied the pushes of
    these (worker, step) pairs, in any order."""
    pos = {int(x): i for i, x in enumerate(IDS)}
    rows = np.zeros((len(IDS), DIM), np.float64)
    dense = np.zeros(SHAPE, np.float64)
    for w, s in pushes:
        ids, g, dg = batch(table, w, s)
        rows[[pos[int(i)] for i in ids]] -= g
        dense -= dg
    return rows.astype(np.float32), dense.astype(np.float32)


def upto(table: str, workers: Iterable[int], c: int) -> tuple[np.ndarray, np.ndarray]:
    return reference(table, [(w, s) for w in workers for s in range(1, c + 1)])


def restored(addrs: list[str], snap: Path, table: str) -> tuple[np.ndarray, np.ndarray]:
    """The rows of IDS and the dense value of `table` after restoring `snap` onto `addrs`."""
    rs = pstore.connect(addrs)
    for name in rs.tables():
        rs.drop_table(name)
    rs.restore_cluster(snap)
    emb, dense = rs.table(table), rs.table(table + "_d")
    assert isinstance(emb, pstore.SparseTable) and isinstance(dense, pstore.DenseTable)
    return emb.pull(IDS), dense.pull()


def assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_a_snapshot_at_a_step_boundary_holds_exactly_the_steps_up_to_it(
    servers: list[str], restore_servers: list[str], tmp_path: Path, staleness: int
) -> None:
    n, steps = 4, 10
    delays = [0.0, 0.01, 0.03, 0.06]
    table, job = f"ssp{staleness}_{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    worker1_at_3 = threading.Event()
    handles: dict[str, pstore.SnapshotHandle] = {}
    manifests: dict[str, dict[str, Any]] = {}

    def worker(w: int) -> int:
        store = pstore.connect(
            servers,
            mode="ssp",
            staleness=staleness,
            worker=w,
            num_workers=n,
            job=job,
            barrier_timeout=WAIT,
        )
        emb, dense = declare(store, table)
        side: threading.Thread | None = None
        while store.clock < steps:
            if w == 0 and store.clock == 2 and "worker" not in handles:
                # The fastest worker asks and goes on training to the boundary itself.
                handles["worker"] = store.snapshot_at_step(tmp_path / "by_worker")
            if w == 3 and store.clock == 2 and side is None:
                with pytest.raises(pstore.InvalidArgumentError, match="training thread"):
                    store.snapshot(tmp_path / "refused")

                def blocking() -> None:
                    manifests["blocking"] = store.snapshot(tmp_path / "blocking")

                side = threading.Thread(target=blocking)
                side.start()
            train_step(store, emb, dense, w)
            time.sleep(delays[w])
            store.end_step()
            if w == 1 and store.clock == 3:
                worker1_at_3.set()
        if side is not None:
            side.join(WAIT)
            assert not side.is_alive()
        return store.clock

    monitor = pstore.connect(servers)

    def ask() -> None:
        assert worker1_at_3.wait(WAIT)
        handles["monitor"] = monitor.snapshot_at_step(tmp_path / "by_monitor")

    asker = threading.Thread(target=ask)
    asker.start()
    assert run_threads(n, worker, WAIT) == [steps] * n
    asker.join(WAIT)
    for name, h in handles.items():
        assert h.job == job
        manifests[name] = h.result(WAIT)
        assert h.done() and manifests[name]["boundary"] == {"job": job, "step": h.step}
    assert sorted(manifests) == ["blocking", "monitor", "worker"]
    assert not (tmp_path / "refused").exists()
    for name, m in manifests.items():
        c = m["boundary"]["step"]
        assert 1 <= c <= steps, (name, c)
        snap = tmp_path / ("blocking" if name == "blocking" else f"by_{name}")
        assert json.loads((snap / "cluster.json").read_text())["id"] == m["id"]
        want = upto(table, range(n), c)
        assert not np.array_equal(want[0], upto(table, range(n), c + 1)[0])
        assert_same(restored(restore_servers, snap, table), want)
    # Training went on after the snapshots: the servers hold every step, once.
    emb, dense = monitor.table(table), monitor.table(table + "_d")
    assert isinstance(emb, pstore.SparseTable) and isinstance(dense, pstore.DenseTable)
    assert_same((emb.pull(IDS), dense.pull()), upto(table, range(n), steps))


def test_an_incremental_snapshot_at_a_step_boundary_and_one_of_a_bsp_job(
    servers: list[str], restore_servers: list[str], tmp_path: Path
) -> None:
    """A BSP job's monitor gets the same boundary (the servers apply the step's sum once, which
    SGD with exact sums makes the same rows), and a worker's increment builds on its full one."""
    n, steps = 3, 8
    table, job = "bsp_" + uuid.uuid4().hex[:6], uuid.uuid4().hex
    at_2, asked = threading.Event(), threading.Event()
    handles: dict[str, pstore.SnapshotHandle] = {}

    def worker(w: int) -> int:
        store = pstore.connect(
            servers, mode="bsp", worker=w, num_workers=n, job=job, barrier_timeout=WAIT
        )
        emb, dense = declare(store, table)
        while store.clock < steps:
            if w == 0 and store.clock == 2:
                at_2.set()
                assert asked.wait(WAIT)
            if w == 1 and store.clock == 5:
                # After the monitor's full snapshot (its boundary is at most 3: no worker ended
                # step 3 before it was asked for), every server's previous snapshot is its part.
                handles["full"].wait(WAIT)
                handles["inc"] = store.snapshot_at_step(tmp_path / "inc", incremental=True)
            train_step(store, emb, dense, w)
            time.sleep(0.02 * w)
            store.end_step()
        return store.clock

    def ask() -> None:
        try:
            assert at_2.wait(WAIT)
            handles["full"] = pstore.connect(servers).snapshot_at_step(tmp_path / "full")
        finally:
            asked.set()

    asker = threading.Thread(target=ask)
    asker.start()
    assert run_threads(n, worker, WAIT) == [steps] * n
    asker.join(WAIT)
    full, inc = handles["full"].result(WAIT), handles["inc"].result(WAIT)
    assert handles["full"].step <= 3 < handles["inc"].step
    assert inc["kind"] == "incremental" and inc["parent"]["id"] == full["id"]
    for h, snap in ((handles["full"], "full"), (handles["inc"], "inc")):
        got = restored(restore_servers, tmp_path / snap, table)
        assert_same(got, upto(table, range(n), h.step))


def test_durable_servers_write_their_parts_at_the_boundary(
    restore_servers: list[str], tmp_path: Path
) -> None:
    procs = [ServerProcess("--path", str(tmp_path / f"data{i}")) for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        servers = [p.address for p in procs]
        n, steps, table, job = 3, 6, "durable", uuid.uuid4().hex
        at_2 = threading.Event()

        def worker(w: int) -> int:
            store = pstore.connect(
                servers, mode="ssp", staleness=2, worker=w, num_workers=n, job=job
            )
            emb, dense = declare(store, table)
            while store.clock < steps:
                train_step(store, emb, dense, w)
                time.sleep(0.03 * w)
                store.end_step()
                if w == 0 and store.clock == 2:
                    at_2.set()
            return store.clock

        handles: list[pstore.SnapshotHandle] = []

        def ask() -> None:
            assert at_2.wait(WAIT)
            handles.append(pstore.connect(servers).snapshot_at_step(tmp_path / "snap"))

        asker = threading.Thread(target=ask)
        asker.start()
        assert run_threads(n, worker, WAIT) == [steps] * n
        asker.join(WAIT)
        h = handles[0]
        assert h.result(WAIT)["boundary"]["step"] == h.step
        assert_same(
            restored(restore_servers, tmp_path / "snap", table), upto(table, range(n), h.step)
        )
    finally:
        stop_all(procs)


class Worker:
    """A worker process (tests/_ssp_worker.py) and its events, read on a thread of their own."""

    def __init__(self, args: dict[str, Any]) -> None:
        here = Path(__file__).resolve().parent
        self.proc = subprocess.Popen(
            [sys.executable, str(here / "_ssp_worker.py"), json.dumps(args)],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def until(self, key: str, timeout: float = WAIT) -> dict[str, Any]:
        """The first event with `key` (or an error event); fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {key!r} event within {timeout} s"
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if key in ev or "error" in ev:
                return ev

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.mark.parametrize("loss", ["fail", "continue"])
def test_a_worker_lost_while_the_snapshot_waits_follows_the_jobs_policy(
    servers: list[str], restore_servers: list[str], tmp_path: Path, loss: str
) -> None:
    table, job, steps = f"lost_{loss}_{uuid.uuid4().hex[:6]}", uuid.uuid4().hex, 8
    base = {
        "servers": servers,
        "num_workers": 3,
        "job": job,
        "steps": steps,
        "staleness": 2,
        "lease": 1.0,
        "on_worker_loss": loss,
        "table": table,
        "delay": 0.02,
    }
    workers = [Worker({**base, "worker": w, "pause_at": 2 if w == 2 else None}) for w in range(3)]
    try:
        # Worker 2 ends step 2 and stops (its heartbeat goes on: it is slow, not lost).
        assert "paused" in workers[2].until("paused")
        monitor = pstore.connect(servers)
        h = monitor.snapshot_at_step(tmp_path / "snap")
        # Worker 2 went on from clock 2, so the boundary is a step it has yet to end.
        assert h.step >= 3 and not h.done()
        workers[2].stop()
        if loss == "fail":
            with pytest.raises(pstore.WorkerLostError, match="worker 2 of job"):
                h.wait(WAIT)
            assert not (tmp_path / "snap" / "cluster.json").exists()
            for w in (0, 1):
                assert workers[w].until("done")["error"] == "WorkerLostError"
            return
        m = h.result(WAIT)
        assert m["boundary"]["step"] == h.step
        for w in (0, 1):
            assert workers[w].until("done") == {"done": steps}
        pushes = [(w, s) for w in (0, 1) for s in range(1, h.step + 1)] + [(2, 1), (2, 2)]
        assert_same(restored(restore_servers, tmp_path / "snap", table), reference(table, pushes))
    finally:
        for wk in workers:
            wk.stop()


def test_a_step_already_passed_is_refused_and_holds_nothing_back(
    servers: list[str], tmp_path: Path
) -> None:
    table, job, steps = "passed_" + uuid.uuid4().hex[:6], uuid.uuid4().hex, 6
    at_3 = threading.Event()
    refused = threading.Event()

    def worker(w: int) -> int:
        store = pstore.connect(
            servers,
            mode="ssp",
            staleness=2,
            worker=w,
            num_workers=2,
            job=job,
            lease=1.0,
            barrier_timeout=WAIT,
        )
        emb, dense = declare(store, table)
        while store.clock < steps:
            train_step(store, emb, dense, w)
            store.end_step()
            if store.clock == 3:
                at_3.set()
                # Both go on only after the refusal: a hold it left would stop them.
                assert refused.wait(WAIT)
        return store.clock

    def ask() -> None:
        assert at_3.wait(WAIT)
        monitor = pstore.connect(servers)
        try:
            for step in (1, 3):
                with pytest.raises(pstore.InvalidArgumentError, match=f"step {step} of job"):
                    monitor.snapshot_at_step(tmp_path / f"s{step}", step)
                assert not (tmp_path / f"s{step}" / "cluster.json").exists()
        finally:
            refused.set()

    asker = threading.Thread(target=ask)
    asker.start()
    assert run_threads(2, worker) == [steps, steps]
    asker.join(WAIT)
    # The job's workers are gone: a boundary past their last step waits for them in vain,
    # and their leases ended, so the job's "fail" policy ends the snapshot.
    h = pstore.connect(servers).snapshot_at_step(tmp_path / "late", steps + 1)
    with pytest.raises(pstore.WorkerLostError, match=f"job {job!r}".replace("'", '"')):
        h.wait(WAIT)


def test_a_snapshot_at_a_step_needs_a_running_job(tmp_path: Path) -> None:
    procs = start_servers(1)
    try:
        store = pstore.connect([procs[0].address])
        with pytest.raises(pstore.InvalidArgumentError, match="no job is running"):
            store.snapshot_at_step(tmp_path / "snap")
        with pytest.raises(pstore.InvalidArgumentError, match="timeout must be > 0"):
            store.snapshot_at_step(tmp_path / "snap", timeout=0)
        assert not (tmp_path / "snap" / "cluster.json").exists()
    finally:
        stop_all(procs)
