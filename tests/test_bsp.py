"""BSP that is really synchronous, on real store-server processes over loopback.

* The servers aggregate a step's gradients of all workers per row and apply the optimizer once
  per row per step: the rows equal a numpy reference of "sum (or mean) the W gradients, one
  optimizer step", for Adagrad and Adam, sparse and dense tables, 2 to 4 workers, and every pull
  at step c+1 sees exactly steps <= c.
* Jobs scope the clocks: a new job's worker 0 does not pass a barrier alone.
* A worker killed with SIGKILL makes the others fail with WorkerLostError naming it, or, with
  on_worker_loss="continue", they go on and the restarted worker rejoins at the current step.
* A snapshot taken after step c holds every push of step <= c and none of step c+1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _netutil import child_env, run_threads, start_servers, stop_all

import pstore

IDS = np.arange(1, 41, dtype=np.int64)
DIM, SHAPE, STEPS = 4, (3, 4), 4
LR = {"adagrad": 0.1, "adam": 0.01}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[str]]:
    procs = start_servers(2)
    try:
        yield [p.address for p in procs]
    finally:
        stop_all(procs)


def _opt(name: str) -> pstore.optim.Optimizer:
    if name == "adagrad":
        return pstore.optim.Adagrad(lr=LR[name])
    return pstore.optim.Adam(lr=LR[name])


def _batch(w: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Worker w's batch of step c: ids (with repeats), their gradients, a dense gradient."""
    rng = np.random.default_rng(1000 * w + c)
    ids = rng.choice(IDS, size=24)
    return (
        ids,
        rng.standard_normal((24, DIM)).astype(np.float32),
        rng.standard_normal(SHAPE).astype(np.float32),
    )


class _Ref:
    """The optimizer of one table in numpy, as the kernel computes it (Adagrad in float32, Adam
    in float64 rounded once), applied to one coalesced gradient per row per step."""

    def __init__(self, opt: str, rows: np.ndarray) -> None:
        self.opt, self.w = opt, rows.astype(np.float32).copy()
        n = rows.shape[0]
        self.s = np.full(rows.shape, np.float32(0.1))
        self.m = np.zeros(rows.shape, np.float32)
        self.v = np.zeros(rows.shape, np.float32)
        self.t = np.zeros(n, np.int64)

    def step(self, rows: np.ndarray, g: np.ndarray) -> None:
        """One update of `rows` (indices) with the float32 gradient `g`."""
        if self.opt == "adagrad":
            lr, eps = np.float32(LR["adagrad"]), np.float32(1e-10)
            s = self.s[rows] + g * g
            self.s[rows] = s
            self.w[rows] = self.w[rows] - lr * (g / (np.sqrt(s) + eps))
            return
        b1, b2, eps, lr = 0.9, 0.999, 1e-8, LR["adam"]
        self.t[rows] += 1
        t = self.t[rows][:, None].astype(np.float64)
        step_size = lr / (1.0 - b1**t)
        bc2 = np.sqrt(1.0 - b2**t)
        g64 = g.astype(np.float64)
        mf = b1 * self.m[rows].astype(np.float64) + (1.0 - b1) * g64
        vf = b2 * self.v[rows].astype(np.float64) + (1.0 - b2) * g64 * g64
        self.m[rows] = mf.astype(np.float32)
        self.v[rows] = vf.astype(np.float32)
        wf = self.w[rows].astype(np.float64)
        self.w[rows] = (wf - step_size * mf / (np.sqrt(vf) / bc2 + eps)).astype(np.float32)


@pytest.fixture(scope="module")
def rows_servers() -> Iterator[list[str]]:
    """Two servers with rows ports: the workers' pulls and pushes go over them."""
    procs = start_servers(2, "--rows-port", "0")
    try:
        yield [p.address for p in procs]
    finally:
        stop_all(procs)


@pytest.mark.parametrize(
    "workers,opt,aggregate,where",
    [
        (2, "adagrad", "sum", "servers"),
        (3, "adam", "sum", "servers"),
        (4, "adagrad", "mean", "servers"),
        (4, "adam", "mean", "servers"),
        (3, "adam", "sum", "rows_servers"),
    ],
)
def test_bsp_applies_one_aggregated_step_per_row(
    request: pytest.FixtureRequest, workers: int, opt: str, aggregate: str, where: str
) -> None:
    servers: list[str] = request.getfixturevalue(where)
    name, job = f"emb_{workers}_{opt}_{aggregate}", uuid.uuid4().hex

    def worker(w: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        store = pstore.connect(
            servers,
            mode="bsp",
            worker=w,
            num_workers=workers,
            job=job,
            aggregate=aggregate,  # type: ignore[arg-type]
            barrier_timeout=60.0,
        )
        emb = store.create_sparse_table(name, DIM, optimizer=_opt(opt), seed=3)
        dense = store.create_dense_table(name + "_d", SHAPE, optimizer=_opt(opt), seed=4)
        sparse_seen, dense_seen = [], []
        for c in range(STEPS):
            sparse_seen.append(emb.pull(IDS))
            dense_seen.append(dense.pull())
            ids, g, dg = _batch(w, c)
            emb.push(ids, g)
            dense.push(dg)
            assert store.end_step() == c + 1
        sparse_seen.append(emb.pull(IDS))
        dense_seen.append(dense.pull())
        return sparse_seen, dense_seen

    seen = run_threads(workers, worker)
    ref = _Ref(opt, seen[0][0][0])
    dref = _Ref(opt, seen[0][1][0].reshape(1, -1))
    pos = {int(x): i for i, x in enumerate(IDS)}
    div = float(workers) if aggregate == "mean" else 1.0
    for c in range(STEPS + 1):
        for w in range(workers):
            # A pull at step c sees exactly the steps before it, the same on every worker.
            np.testing.assert_allclose(seen[w][0][c], ref.w, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(seen[w][1][c].ravel(), dref.w[0], rtol=1e-6, atol=1e-7)
        if c == STEPS:
            break
        sums: dict[int, np.ndarray] = {}
        dsum = np.zeros(int(np.prod(SHAPE)), np.float64)
        for w in range(workers):
            ids, g, dg = _batch(w, c)
            for i, row in zip(ids, g, strict=True):
                sums.setdefault(pos[int(i)], np.zeros(DIM, np.float64))
                sums[pos[int(i)]] += row
            dsum += dg.ravel()
        rows = np.array(sorted(sums))
        ref.step(rows, (np.stack([sums[r] for r in rows]) / div).astype(np.float32))
        dref.step(np.array([0]), (dsum / div).astype(np.float32)[None, :])


def test_a_new_job_resets_the_clocks(servers: list[str]) -> None:
    name = "jobs_" + uuid.uuid4().hex[:8]

    def first_job(w: int) -> pstore.RemoteStore:
        s = pstore.connect(servers, mode="bsp", worker=w, num_workers=2, barrier_timeout=30.0)
        t = s.create_sparse_table(name, DIM)
        for _ in range(3):
            t.push(IDS[:4], np.ones((4, DIM), np.float32))
            s.end_step()
        return s

    old = run_threads(2, first_job)
    job = old[0].job
    assert job and old[1].job == job
    # The next job's worker 0 alone: its first barrier waits for worker 1 (it passed alone when
    # the clocks outlived the job).
    s0 = pstore.connect(servers, mode="bsp", worker=0, num_workers=2, barrier_timeout=1.0)
    assert s0.job != job and s0.clock == 0
    with pytest.raises(pstore.ServerTimeoutError, match="worker 0 of job"):
        s0.end_step()
    # Worker 1 finds the new job and the two go on together.
    s1 = pstore.connect(servers, mode="bsp", worker=1, num_workers=2, barrier_timeout=30.0)
    assert s1.job == s0.job and s1.clock == 0
    assert run_threads(2, lambda w: [s0, s1][w].end_step()) == [1, 1]
    assert all(st["clocks"] == [1, 1] for st in s1.status())
    # A late call of the ended job cannot take the servers back.
    with pytest.raises(pstore.InvalidArgumentError, match="not running on this server"):
        old[0].end_step()
    assert all(st["clocks"] == [1, 1] for st in s1.status())


def _spawn(args: dict[str, Any]) -> subprocess.Popen[str]:
    here = Path(__file__).resolve().parent
    return subprocess.Popen(
        [sys.executable, str(here / "_bsp_worker.py"), json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _read(p: subprocess.Popen[str], until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    assert p.stdout is not None
    for line in p.stdout:
        ev = json.loads(line)
        if until(ev):
            return ev
    raise AssertionError(f"worker exited ({p.wait()}) before the expected event")


def _args(servers: list[str], w: int, job: str, loss: str, **kw: Any) -> dict[str, Any]:
    return {
        "servers": servers,
        "worker": w,
        "num_workers": 2,
        "job": job,
        "steps": 6,
        "lease": 1.0,
        "on_worker_loss": loss,
        "table": "lease_" + job[:8],
        **kw,
    }


def test_a_killed_worker_fails_the_others_with_worker_lost(servers: list[str]) -> None:
    job = uuid.uuid4().hex
    w0 = _spawn(_args(servers, 0, job, "fail"))
    w1 = _spawn(_args(servers, 1, job, "fail", pause_at=2))
    try:
        _read(w1, lambda e: e.get("clock") == 2)
        w1.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        ev = _read(w0, lambda e: "error" in e)
        assert ev["error"] == "WorkerLostError"
        assert "worker 1 of job" in ev["message"] and job in ev["message"]
        assert time.monotonic() - t0 < 15
    finally:
        for p in (w0, w1):
            _stop(p)


def test_with_continue_the_others_go_on_and_a_restarted_worker_rejoins(
    servers: list[str],
) -> None:
    job = uuid.uuid4().hex
    w0 = _spawn(_args(servers, 0, job, "continue", steps=12, delay=0.3))
    w1 = _spawn(_args(servers, 1, job, "continue", steps=12, pause_at=2))
    w1b = None
    try:
        _read(w1, lambda e: e.get("clock") == 2)
        w1.send_signal(signal.SIGKILL)
        # Worker 0 goes on alone past the lost worker's clock.
        _read(w0, lambda e: e.get("clock", 0) >= 5)
        w1b = _spawn(_args(servers, 1, job, "continue", steps=12))
        joined = _read(w1b, lambda e: "joined" in e)["joined"]
        assert joined >= 5
        last0 = _read(w0, lambda e: e.get("clock") == 12 or "error" in e)
        last1 = _read(w1b, lambda e: e.get("clock") == 12 or "error" in e)
        assert last0 == {"clock": 12} and last1 == {"clock": 12}
    finally:
        for p in (w0, w1, w1b):
            if p is not None:
                _stop(p)


def test_a_snapshot_after_step_c_holds_exactly_the_steps_to_c(
    servers: list[str], tmp_path: Path
) -> None:
    name, job = "snap_" + uuid.uuid4().hex[:8], uuid.uuid4().hex
    ids = IDS[:8]
    sgd = pstore.optim.SGD(lr=1.0)
    pushed = [threading.Event() for _ in range(4)]

    def worker(w: int) -> list[Path]:
        s = pstore.connect(servers, mode="bsp", worker=w, num_workers=2, job=job)
        t = s.create_sparse_table(name, DIM, optimizer=sgd, initializer=pstore.init.Zeros())
        snaps = []
        for c in range(4):
            if w == 0 and c > 0:
                # Worker 1 pushed its part of step c+1 already: the snapshot must not hold it.
                assert pushed[c].wait(30)
                d = tmp_path / f"c{c}"
                d.mkdir()
                s.snapshot(str(d))
                snaps.append(d)
            t.push(ids, np.ones((8, DIM), np.float32))
            if w == 1:
                pushed[c].set()
            s.end_step()
        return snaps

    snaps = run_threads(2, worker)[0]
    for c, d in enumerate(snaps, start=1):
        rows = {}
        parts = sorted(d.glob("server-*"))
        assert len(parts) == 2 and (d / "cluster.json").is_file()
        for part in parts:
            t = pstore.Store.restore(part).table(name)
            have = t.contains(ids)
            for i, h in zip(ids, have, strict=True):
                if h:
                    rows[int(i)] = t.pull(np.array([i]))[0]
        assert sorted(rows) == [int(i) for i in ids]
        # Two workers' unit gradients per step, SGD lr 1: -2 per step, exactly c steps.
        for r in rows.values():
            np.testing.assert_array_equal(r, np.full(DIM, -2.0 * c, np.float32))


def test_a_durable_server_restarted_during_bsp_training_loses_no_step(tmp_path: Path) -> None:
    """SIGKILL + restart of the coordinator (the first address in sorted order), twice, each time
    after a worker's push of a step was acknowledged and before the step was applied, while two
    workers train 16 BSP steps: the final rows equal the reference of 16 aggregated steps."""
    from _netutil import ServerProcess

    args = ("--durability", "sync")
    procs = [ServerProcess("--path", str(tmp_path / f"s{i}"), *args) for i in range(2)]
    for p in procs:
        p.wait_ready()
    servers = [p.address for p in procs]
    coord = min(range(2), key=lambda i: servers[i])
    name, job, steps = "durable_emb", uuid.uuid4().hex, 16
    at_step = [threading.Event() for _ in range(steps + 1)]

    def worker(w: int) -> np.ndarray:
        s = pstore.connect(
            servers, mode="bsp", worker=w, num_workers=2, job=job, retries=12, timeout=10.0
        )
        emb = s.create_sparse_table(name, DIM, optimizer=_opt("adagrad"), seed=3)
        first = emb.pull(IDS)
        for c in range(steps):
            ids, g, _ = _batch(w, c)
            emb.push(ids, g)
            if w == 0:
                # Worker 0's push of this step is acknowledged and pending on the servers.
                at_step[c].set()
            assert s.end_step() == c + 1
        return first if w == 0 else emb.pull(IDS)

    def killer() -> None:
        for c in (5, 11):
            assert at_step[c].wait(120)
            procs[coord].proc.kill()  # SIGKILL, this pid only
            procs[coord].proc.wait()
            procs[coord] = ServerProcess(
                "--path", str(tmp_path / f"s{coord}"), *args, port=procs[coord].port
            )
            procs[coord].wait_ready()

    k = threading.Thread(target=killer)
    k.start()
    try:
        first, last = run_threads(2, worker)
        k.join(120)
        ref = _Ref("adagrad", first)
        pos = {int(x): i for i, x in enumerate(IDS)}
        for c in range(steps):
            sums: dict[int, np.ndarray] = {}
            for w in range(2):
                ids, g, _ = _batch(w, c)
                for i, row in zip(ids, g, strict=True):
                    sums.setdefault(pos[int(i)], np.zeros(DIM, np.float64))
                    sums[pos[int(i)]] += row
            rows = np.array(sorted(sums))
            ref.step(rows, np.stack([sums[r] for r in rows]).astype(np.float32))
        np.testing.assert_allclose(last, ref.w, rtol=1e-6, atol=1e-7)
    finally:
        k.join(120)
        stop_all(procs)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"aggregate": "max"}, "aggregate must be"),
        ({"on_worker_loss": "retry"}, "on_worker_loss must be"),
        ({"lease": 0.0}, "lease must be > 0"),
        ({"lease": float("nan")}, "lease must be > 0"),
        ({"job": ""}, "job must be a non-empty string"),
    ],
)
def test_bad_job_arguments_are_refused_before_anything_changes(
    servers: list[str], kw: dict[str, Any], match: str
) -> None:
    before = pstore.connect(servers).status()
    with pytest.raises(pstore.InvalidArgumentError, match=match):
        pstore.connect(servers, mode="bsp", worker=0, num_workers=2, **kw)
    assert [s["clocks"] for s in pstore.connect(servers).status()] == [s["clocks"] for s in before]


def test_a_worker_with_another_worker_count_is_refused(servers: list[str]) -> None:
    job = uuid.uuid4().hex
    pstore.connect(servers, mode="bsp", worker=0, num_workers=2, job=job)
    with pytest.raises(pstore.InvalidArgumentError, match="has 2 workers, worker 1 says 3"):
        pstore.connect(servers, mode="bsp", worker=1, num_workers=3, job=job)


def test_a_worker_computing_longer_than_its_lease_is_not_lost(servers: list[str]) -> None:
    job, name = uuid.uuid4().hex, "slow_" + uuid.uuid4().hex[:8]

    def worker(w: int) -> int:
        s = pstore.connect(
            servers, mode="bsp", worker=w, num_workers=2, job=job, lease=0.5, barrier_timeout=30.0
        )
        t = s.create_sparse_table(name, DIM)
        for _ in range(2):
            t.push(IDS[:4], np.ones((4, DIM), np.float32))
            if w == 1:
                time.sleep(2.0)  # no call of its own: the heartbeat keeps the lease
            s.end_step()
        return s.clock

    assert run_threads(2, worker) == [2, 2]
