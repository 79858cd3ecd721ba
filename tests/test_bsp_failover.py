"""Jobs across a failover: a BSP (and an SSP) job on a replica group and a second server with
ack="all" survives a kill -9 of the group's primary in the middle of a step and the promotion
of its follower. The workers go on without restarting; every row equals the numpy reference of
each step applied once (docs/CLUSTER.md, "Jobs across a failover"). The old primary, restarted
on its disk, rejoins as a follower and holds the new primary's job state. Real `pstore serve`
processes on loopback with --path and --durability sync."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _bsp_failover_worker import DIM, IDS, batch
from _netutil import ServerProcess, child_env, run_threads, start_servers, stop_all
from test_bsp import _Ref
from test_failover import _group, _wait_role
from test_replication import _status

import pstore

STEPS, HOLD = 6, 3


def _spawn(args: dict[str, Any]) -> subprocess.Popen[str]:
    here = Path(__file__).resolve().parent
    return subprocess.Popen(
        [sys.executable, str(here / "_bsp_failover_worker.py"), json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _read(p: subprocess.Popen[str], key: str) -> Any:
    assert p.stdout is not None
    for line in p.stdout:
        ev = json.loads(line)
        assert "error" not in ev, ev
        if key in ev:
            return ev[key]
    raise AssertionError(f"worker exited ({p.wait()}) before {key!r}")


def _tell(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


def _sums(c: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows (positions in IDS) step c touches and the float64 sum of both workers' grads."""
    pos = {int(x): i for i, x in enumerate(IDS)}
    sums: dict[int, np.ndarray] = {}
    for w in range(2):
        ids, g = batch(w, c)
        for i, row in zip(ids, g, strict=True):
            sums.setdefault(pos[int(i)], np.zeros(DIM, np.float64))
            sums[pos[int(i)]] += row
    rows = np.array(sorted(sums))
    return rows, np.stack([sums[r] for r in rows])


def _reference(mode: str, first: np.ndarray) -> np.ndarray:
    """BSP: Adagrad of the two workers' summed gradients, one update per row per step. SSP
    (SGD, pushes applied on arrival): the rows minus lr times every gradient, once each."""
    if mode == "bsp":
        ref = _Ref("adagrad", first)
        for c in range(STEPS):
            rows, g = _sums(c)
            ref.step(rows, g.astype(np.float32))
        return ref.w
    w = first.astype(np.float64)
    for c in range(STEPS):
        rows, g = _sums(c)
        w[rows] -= 0.1 * g
    return w


def _job_file(path: Path) -> dict[str, Any] | None:
    """The job header a durable server keeps (None: none, or being replaced just now)."""
    try:
        return json.loads((path / "bsp" / "job.json").read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("mode", ["bsp", "ssp"])
def test_a_job_goes_on_across_a_kill_9_of_its_primary_and_a_promotion(
    tmp_path: Path, mode: str
) -> None:
    a, b = _group(tmp_path)
    single = ServerProcess("--path", str(tmp_path / "single"), "--durability", "sync")
    single.wait_ready()
    old: ServerProcess | None = None
    workers: list[subprocess.Popen[str]] = []
    try:
        servers = [[a.address, b.address], single.address]
        job = uuid.uuid4().hex
        for w in range(2):
            args = {
                "servers": servers,
                "worker": w,
                "num_workers": 2,
                "job": job,
                "steps": STEPS,
                "hold": HOLD,
                "mode": mode,
                "opt": "adagrad" if mode == "bsp" else "sgd",
            }
            workers.append(_spawn(args))
        first = np.array(_read(workers[0], "first"), np.float32)
        _tell(workers[1])
        # Worker 0's pushes of step HOLD are acknowledged (on b too: ack="all"); worker 1 has
        # not pushed: the step is pending (BSP: aggregated, not applied).
        for p in workers:
            assert _read(p, "held") == HOLD
        a.send(signal.SIGKILL)  # this pid only
        a.proc.wait(30)
        pstore.promote(b.address)
        for p in workers:
            _tell(p)
        for p in workers:
            assert _read(p, "done") == STEPS
        c = pstore.connect(servers, timeout=10.0)  # type: ignore[arg-type]
        last = c.sparse_table("emb").pull(IDS)
        np.testing.assert_allclose(last, _reference(mode, first), rtol=1e-5, atol=1e-6)
        rep = _status(pstore.connect([b.address]))
        assert rep["role"] == "primary" and rep["epoch"] == 2
        held = _job_file(tmp_path / "g-b")
        assert held is not None and held["id"] == job and held["clocks"] == [STEPS, STEPS]
        # The old primary comes back on its disk: a follower of b, whose job it holds now.
        old = ServerProcess("--path", str(tmp_path / "g-a"), "--durability", "sync", port=a.port)
        _wait_role(old.wait_ready(), "follower")
        deadline = time.monotonic() + 30
        while _job_file(tmp_path / "g-a") != _job_file(tmp_path / "g-b"):
            assert time.monotonic() < deadline, _job_file(tmp_path / "g-a")
            time.sleep(0.05)
        assert not list((tmp_path / "g-a" / "bsp").glob("step-*.log"))
    finally:
        for p in workers:
            p.kill()  # this pid only
            p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        if old is not None:
            old.stop()
        single.stop()
        b.stop()
        a.stop()


def test_a_move_waits_for_the_step_boundary_of_a_pending_aggregate_in_its_slots() -> None:
    """Decision 0123: a step's aggregate is not moved with its slots, so a batch of slots holding
    one is frozen at the job's next step boundary: the move started while step 1 holds worker
    0's pushes waits (it cannot end before both workers end the step); then the step is applied
    on the old owner, the batch frozen and moved. The step is applied once, and reaches the new
    owner: its rows, pending when their batch was marked and written by no push after the mark,
    are copied again with the delta (without that the new owner's rows lose the step)."""
    procs = start_servers(2)
    try:
        servers = [p.address for p in procs]
        job = uuid.uuid4().hex
        w = [
            pstore.connect(servers, mode="bsp", worker=k, num_workers=2, job=job) for k in range(2)
        ]
        sgd = pstore.optim.SGD(lr=1.0)
        t = [
            c.create_sparse_table("moving", DIM, optimizer=sgd, initializer=pstore.init.Zeros())
            for c in w
        ]
        ids = IDS
        t[0].push(ids, np.ones((ids.size, DIM), np.float32))
        admin = pstore.connect(servers)
        before = admin.slots
        out: list[Any] = []

        def move() -> None:
            try:
                out.append(admin.move_slots(dict(before, ranges=[[0, 16384, 1]])))
            except BaseException as e:  # checked below
                out.append(e)

        mover = threading.Thread(target=move)
        mover.start()
        time.sleep(1.0)
        assert mover.is_alive() and not out  # waiting for the step's boundary
        # Worker 1 pushes nothing this step: the rows hold worker 0's pushes alone, admitted
        # before the move marked their slots and applied after their pre-copy.
        assert run_threads(2, lambda k: w[k].end_step()) == [1, 1]
        mover.join(60)
        assert len(out) == 1 and isinstance(out[0], dict), out
        assert out[0]["slots"] == sum(e - a for a, e, o in before["ranges"] if o == 0) > 0
        # The step applied once, on its rows' owner then, and moved with it.
        np.testing.assert_array_equal(t[0].pull(ids), np.full((ids.size, DIM), -1.0, np.float32))
        old_owner = admin.status()[0]
        assert sum(x["rows"] for x in old_owner["tables"]) == 0
    finally:
        stop_all(procs)
