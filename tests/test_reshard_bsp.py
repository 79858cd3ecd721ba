"""Slot moves while a BSP job trains (decision 0123): `move_slots` gives every slot to the other
server while 4 BSP workers push and end steps. A batch whose slots hold a pending step's
aggregate is frozen at the next step boundary (the old owner holds the workers' clock answers
there for the freeze call) instead of being refused, so the move completes during the job.
Every row holds each step's pushes once, and every pull at step c saw exactly the steps before
it. Real `pstore serve` processes on loopback."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
from _netutil import run_threads, start_servers, stop_all

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
        job = uuid.uuid4().hex
        final: list[int] = []  # the step count, fixed once the move is done
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

        done = threading.Event()
        report: list[dict] = []

        def mover() -> None:
            try:
                deadline = time.monotonic() + 60
                while min(steps) < 2:  # the job is under way
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                report.append(
                    admin.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]})
                )
                report.append({"steps_at_end": max(steps)})
            except BaseException as e:  # reported below
                report.append({"error": repr(e)})
            finally:
                final.append(max(steps) + 3)
                done.set()

        m = threading.Thread(target=mover)
        m.start()
        run_threads(WORKERS, worker, wait=300.0)
        m.join(60)
        assert done.is_set() and len(report) == 2, report
        r = report[0]
        assert r["slots"] == SLOTS and r["batches"] == SLOTS // 512
        # The job went on during the move.
        assert report[1]["steps_at_end"] > 2
        total = final[0]
        # Each step's pushes once, on whichever server owned the rows then.
        want = -_counts(total).astype(np.float32)
        got = admin.sparse_table("m").pull(ids)
        np.testing.assert_array_equal(got, np.repeat(want[:, None], DIM, axis=1))
        # A pull at step c saw exactly the steps before it, on every worker.
        for w in range(WORKERS):
            assert len(seen[w]) == total
            for c in range(total):
                np.testing.assert_array_equal(
                    seen[w][c], np.repeat(-_counts(c).astype(np.float32)[:, None], DIM, axis=1)
                )
        # The old owner holds nothing.
        rows = [
            sum(int(x["rows"]) for x in s["tables"] if x["name"] == "m") for s in admin.status()
        ]
        assert rows == [0, N]
    finally:
        stop_all(procs)
