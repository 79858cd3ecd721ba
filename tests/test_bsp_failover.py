"""A BSP job across a failover: a job on a replica group (and a second server) with ack="all"
survives a kill -9 of the group's primary in the middle of a step and the promotion of its
follower. The workers go on without restarting; every row equals the numpy reference of the
steps applied once each (docs/CLUSTER.md, "Jobs across a failover"). Real `pstore serve`
processes on loopback with --path and --durability sync."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from _bsp_failover_worker import DIM, IDS, batch
from _netutil import ServerProcess, child_env
from test_bsp import _Ref
from test_failover import _group
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


def _reference(first: np.ndarray, steps: int) -> np.ndarray:
    """Adagrad of the two workers' summed gradients, one update per row per step."""
    ref = _Ref("adagrad", first)
    pos = {int(x): i for i, x in enumerate(IDS)}
    for c in range(steps):
        sums: dict[int, np.ndarray] = {}
        for w in range(2):
            ids, g = batch(w, c)
            for i, row in zip(ids, g, strict=True):
                sums.setdefault(pos[int(i)], np.zeros(DIM, np.float64))
                sums[pos[int(i)]] += row
        rows = np.array(sorted(sums))
        ref.step(rows, np.stack([sums[r] for r in rows]).astype(np.float32))
    return ref.w


def test_a_bsp_job_goes_on_across_a_kill_9_of_its_primary_and_a_promotion(
    tmp_path: Path,
) -> None:
    a, b = _group(tmp_path)
    single = ServerProcess("--path", str(tmp_path / "single"), "--durability", "sync")
    single.wait_ready()
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
                "mode": "bsp",
            }
            workers.append(_spawn(args))
        first = np.array(_read(workers[0], "first"), np.float32)
        # Worker 0's tagged pushes of step HOLD are acknowledged (on b too: ack="all"); worker
        # 1 has not pushed: the step is pending, not applied.
        for p in workers:
            assert _read(p, "held") == HOLD
        a.send(signal.SIGKILL)  # this pid only
        a.proc.wait(30)
        pstore.promote(b.address)
        for p in workers:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        last = np.array(_read(workers[0], "last"), np.float32)
        assert np.array(_read(workers[1], "last"), np.float32).shape == last.shape
        np.testing.assert_allclose(last, _reference(first, STEPS), rtol=1e-6, atol=1e-7)
        rep = _status(pstore.connect([b.address]))
        assert rep["role"] == "primary" and rep["epoch"] == 2
    finally:
        for p in workers:
            p.kill()  # this pid only
            p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        single.stop()
        b.stop()
        a.stop()
