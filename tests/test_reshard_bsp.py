"""Slot moves while a BSP job trains (decision 0123): `move_slots` gives every slot to the other
server while 4 BSP workers push and end steps. A batch whose slots hold a pending step's
aggregate is frozen at the next step boundary (the old owner holds the workers' clock answers
there for the freeze call) instead of being refused, so the move completes during the job.
Every row holds each step's pushes once, and every pull at step c saw exactly the steps before
it. Then the same while a third server joins (`add_server`) and one of the first two leaves
(`remove_server`), the joining server given the job's state by the join (decision 0125); and a
freeze that meets no step boundary within its bound (`PSTORE_FREEZE_WAIT_SECONDS`) is refused,
thawed, and the job goes on. Real `pstore serve` processes on loopback."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, run_threads, start_servers, stop_all

import pstore

SLOTS, WORKERS, DIM, N = 16384, 4, 4, 6000


def _ids(w: int, c: int) -> np.ndarray:
    """Worker w's ids at step c: a different third of 0..N each time, overlapping the others'."""
    return np.flatnonzero((np.arange(N) * 7 + w * 3 + c) % 3 == 0).astype(np.int64)


def _counts(steps: int) -> np.ndarray:
    """Per id, the pushes of gradient 1 the steps before `steps` sent for it."""
    n = np.zeros(N, np.int64)
    for c in range(steps):
        for w in range(WORKERS):
            n[_ids(w, c)] += 1
    return n


def test_a_move_completes_while_four_bsp_workers_train() -> None:
    procs = start_servers(2)
    try:
        servers = [p.address for p in procs]
        admin = pstore.connect(servers)
        admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, SLOTS, 0]]})
        total, seen, report = _train(
            servers,
            lambda a: [a.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]})],
            admin,
        )
        assert len(report) == 2 and "error" not in report[-1], report
        r = report[0]
        assert r["slots"] == SLOTS and r["batches"] == SLOTS // 512
        # The job went on during the move.
        assert report[1]["steps_at_end"] > 2
        # Each step's pushes once, on whichever server owned the rows then; a pull at step c
        # saw exactly the steps before it, on every worker.
        _check(total, seen, admin)
        # The old owner holds nothing.
        rows = [
            sum(int(x["rows"]) for x in s["tables"] if x["name"] == "m") for s in admin.status()
        ]
        assert rows == [0, N]
    finally:
        stop_all(procs)


def _train(
    servers: list[str],
    change: Callable[[pstore.RemoteStore], list[dict]],
    admin: pstore.RemoteStore,
) -> tuple[int, list[list[np.ndarray]], list[dict]]:
    """4 BSP workers connected to `servers` train until 3 steps after `change(admin)` returned
    (started once every worker finished 2 steps); answers the steps run, every worker's pulls
    and what `change` answered (or its error)."""
    job = uuid.uuid4().hex
    final: list[int] = []
    steps = [0] * WORKERS
    seen: list[list[np.ndarray]] = [[] for _ in range(WORKERS)]
    ids = np.arange(N, dtype=np.int64)

    def worker(w: int) -> None:
        s = pstore.connect(
            servers, mode="bsp", worker=w, num_workers=WORKERS, job=job, barrier_timeout=60.0
        )
        t = s.create_sparse_table(
            "m", DIM, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        c = 0
        while not (final and c >= final[0]):
            seen[w].append(t.pull(ids))
            mine = _ids(w, c)
            t.push(mine, np.ones((mine.size, DIM), np.float32))
            assert s.end_step() == c + 1
            c += 1
            steps[w] = c

    report: list[dict] = []

    def mover() -> None:
        try:
            deadline = time.monotonic() + 60
            while min(steps) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            report.extend(change(admin))
            report.append({"steps_at_end": max(steps)})
        except BaseException as e:  # reported below
            report.append({"error": repr(e)})
        finally:
            final.append(max(steps) + 3)

    m = threading.Thread(target=mover)
    m.start()
    run_threads(WORKERS, worker, wait=300.0)
    m.join(60)
    assert not m.is_alive() and final, report
    return final[0], seen, report


def _check(total: int, seen: list[list[np.ndarray]], admin: pstore.RemoteStore) -> None:
    """Each step's pushes once in every row; every pull at step c saw exactly the steps before."""
    ids = np.arange(N, dtype=np.int64)
    want = -_counts(total).astype(np.float32)
    np.testing.assert_array_equal(
        admin.sparse_table("m").pull(ids), np.repeat(want[:, None], DIM, axis=1)
    )
    for w in range(WORKERS):
        assert len(seen[w]) == total
        for c in range(total):
            np.testing.assert_array_equal(
                seen[w][c], np.repeat(-_counts(c).astype(np.float32)[:, None], DIM, axis=1)
            )


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "durable"])
def test_a_server_joins_and_another_leaves_while_four_bsp_workers_train(
    durable: bool, tmp_path: Path
) -> None:
    """add_server gives the joining server the job (its workers, clocks, lost workers, applied
    steps and options) before and again after the list that names it is published, and every
    server refuses a job's clock call routed by an older list ("moved"), so every worker reports
    each later step to the new server and waits for it there; a worker's clock call waiting on a
    server whose list changed is answered "moved" too, so none waits for a server that left.
    Durable servers keep the carried job in their job files (`bsp/job.json`)."""
    if durable:
        procs = [ServerProcess("--path", str(tmp_path / f"s{i}")) for i in range(3)]
        for p in procs:
            p.wait_ready()
    else:
        procs = start_servers(3)
    try:
        addrs = [p.address for p in procs]
        admin = pstore.connect(addrs[:2])
        admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, SLOTS, 0]]})

        def change(a: pstore.RemoteStore) -> list[dict]:
            join = a.add_server(addrs[2])
            return [join, a.remove_server(addrs[0])]

        total, seen, report = _train(addrs[:2], change, admin)
        assert len(report) == 3 and "error" not in report[-1], report
        join, leave, end = report
        assert join["slots"] == SLOTS // 3 and leave["slots"] > 0, report
        # The job went on during both changes.
        assert end["steps_at_end"] > 2
        assert admin.servers == [addrs[1], addrs[2]]
        _check(total, seen, admin)
        # The server that left holds nothing and its clocks stopped where the list left it.
        one = pstore.connect([addrs[0]])
        assert sum(int(x["rows"]) for x in one.status()[0]["tables"] if x["name"] == "m") == 0
        one.close()
        # The joined server ran the job's later steps: its clocks are the job's last.
        clocks = [s["clocks"] for s in admin.status()]
        assert clocks == [[total] * WORKERS] * 2, clocks
        if durable:
            kept = json.loads((tmp_path / "s2" / "bsp" / "job.json").read_text())
            assert kept["clocks"] == [total] * WORKERS and kept["applied"] == total, kept
    finally:
        stop_all(procs)


def test_a_freeze_without_a_step_boundary_is_refused_after_its_bound_and_training_goes_on() -> None:
    """Decision 0123's refusal path: one of 4 BSP workers stops in the middle of a step (after
    its push, before its end_step), so no step boundary comes; the move's first batch, whose
    slots hold the step's aggregate, is refused after the bound the servers were started with
    (PSTORE_FREEZE_WAIT_SECONDS=2), with the clear error; nothing of it moved (the routing is
    the same, the old owner owns and serves every row), its slots are thawed (a plain push to
    them is applied at once), and once the worker resumes the job goes on, every row right."""
    env = {"PSTORE_FREEZE_WAIT_SECONDS": "2"}
    procs = [ServerProcess(env=env) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    try:
        servers = [p.address for p in procs]
        admin = pstore.connect(servers)
        admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, SLOTS, 0]]})
        job = uuid.uuid4().hex
        pause, resumed, stopped = threading.Event(), threading.Event(), threading.Event()
        total = 6
        ids = np.arange(N, dtype=np.int64)
        seen: list[list[np.ndarray]] = [[] for _ in range(WORKERS)]

        def worker(w: int) -> None:
            s = pstore.connect(
                servers, mode="bsp", worker=w, num_workers=WORKERS, job=job, barrier_timeout=90.0
            )
            t = s.create_sparse_table(
                "m", DIM, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
            )
            for c in range(total):
                seen[w].append(t.pull(ids))
                mine = _ids(w, c)
                t.push(mine, np.ones((mine.size, DIM), np.float32))
                if w == 0 and c == 2:
                    stopped.set()
                    assert resumed.wait(60)
                assert s.end_step() == c + 1

        before = admin.slots
        out: list[object] = []

        def mover() -> None:
            assert stopped.wait(60)
            t0 = time.monotonic()
            try:
                out.append(admin.move_slots(dict(before, ranges=[[0, SLOTS, 1]])))
            except pstore.PstoreError as e:
                out.append(e)
            out.append(time.monotonic() - t0)
            # Thawed: a push to those slots, outside the job, is applied at once.
            plain = pstore.connect(servers, timeout=5.0, retries=0)
            other = plain.create_sparse_table(
                "plain", DIM, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
            )
            other.push(ids[:64], np.ones((64, DIM), np.float32))
            out.append(other.pull(ids[:64]))
            pause.set()
            resumed.set()

        m = threading.Thread(target=mover)
        m.start()
        run_threads(WORKERS, worker, wait=240.0)
        m.join(60)
        assert len(out) == 3, out
        err, took, plain_rows = out
        assert isinstance(err, pstore.PstoreError), err
        msg = str(err)
        assert "no step boundary came within 2s" in msg and "nothing was frozen" in msg, msg
        assert 2.0 <= took < 20.0, took
        np.testing.assert_array_equal(plain_rows, np.full((64, DIM), -1.0, np.float32))
        # Nothing of the batch moved: the routing is the one before, the old owner serves all.
        assert admin.slots == before
        rows = [
            sum(int(x["rows"]) for x in s["tables"] if x["name"] == "m") for s in admin.status()
        ]
        assert rows[0] == N, rows
        _check(total, seen, admin)
    finally:
        stop_all(procs)
