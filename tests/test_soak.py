"""Long soaks of the durability promises, behind the ``soak`` marker (not run by ``make test``).

    cd tests && python -m pytest -m soak test_soak.py          # PSTORE_SOAK_SECONDS, default 1800

* ``test_soak_server_kills``: a `pstore serve --durability sync` process is killed with SIGKILL
  every few seconds and restarted on the same port while four client threads push SGD gradients
  of ones to random ids, retrying through each restart with the same request ids. At the end
  every row must equal minus the number of acknowledged pushes that hit it: nothing lost,
  nothing applied twice, over hundreds of kills.
* ``test_soak_power_cuts``: the power-cut trials of tests/test_power_loss.py (a file system that
  drops unsynced writes) in a loop, sync and async mode in turn.

The bounded forms of both run in every ``make test`` (tests/test_restart_semantics.py,
tests/test_crash.py, tests/test_power_loss.py).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
from _netutil import ServerProcess

import pstore
from pstore import init, optim

pytestmark = [pytest.mark.soak, pytest.mark.timeout(0)]

SECONDS = float(os.environ.get("PSTORE_SOAK_SECONDS", "1800"))
N_IDS = 5000
BATCH = 64
WORKERS = 4


def test_soak_server_kills(tmp_path):
    path = tmp_path / "store"
    srv = ServerProcess("--path", str(path), "--durability", "sync", log=tmp_path / "server.log")
    port = srv.port
    admin = srv.wait_ready()
    admin.create_sparse_table(
        "emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(0.0), seed=0
    )
    admin.close()
    stop = threading.Event()
    acked: list[Counter[int]] = [Counter() for _ in range(WORKERS)]
    doubtful: set[int] = set()  # ids of pushes whose outcome is unknown (retries exhausted)
    errors: list[BaseException] = []

    def work(w: int) -> None:
        rng = np.random.default_rng(w)
        store = pstore.connect([f"127.0.0.1:{port}"], timeout=5.0, retries=40)
        table = store.sparse_table("emb")
        try:
            while not stop.is_set():
                ids = np.unique(rng.integers(0, N_IDS, BATCH, dtype=np.uint64))
                try:
                    table.push(ids, np.ones((ids.size, 4), np.float32))
                except pstore.ServerError:
                    doubtful.update(int(i) for i in ids)
                    continue
                acked[w].update(int(i) for i in ids)
        except BaseException as e:
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    kills = 0
    rng = random.Random(20261203)
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline and not errors:
            time.sleep(rng.uniform(0.5, 4.0))
            srv.stop(signal.SIGKILL)
            kills += 1
            srv = ServerProcess(
                "--path", str(path), "--durability", "sync", port=port, log=tmp_path / "server.log"
            )
            srv.wait_ready().close()
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    try:
        assert not errors, errors
        total: Counter[int] = Counter()
        for c in acked:
            total.update(c)
        store = pstore.connect([srv.address], timeout=30.0)
        ids = np.arange(N_IDS, dtype=np.uint64)
        got = store.sparse_table("emb").pull(ids)[:, 0]
        store.close()
        want = -np.array([total[i] for i in range(N_IDS)], dtype=np.float32)
        sure = np.array([i not in doubtful for i in range(N_IDS)])
        print(f"\n{kills} kills, {sum(total.values())} acknowledged row updates")
        assert (got[sure] == want[sure]).all(), "a row lost or doubled an acknowledged push"
        # A push whose retries ran out applied once or not at all, never twice.
        assert (got[~sure] <= want[~sure]).all()
        assert kills > 0
    finally:
        srv.stop()


def test_soak_power_cuts(tmp_path):
    from test_power_loss import _missing, run_power_cuts

    if _missing() is not None:
        pytest.skip(str(_missing()))
    deadline = time.monotonic() + SECONDS
    rounds = 0
    while time.monotonic() < deadline:
        for mode in ("sync", "async"):
            run = tmp_path / f"{mode}-{rounds}"
            run.mkdir()
            for acked, lo, hi in run_power_cuts(run, mode, trials=5, seed=rounds):
                assert lo == hi, f"round {rounds}: a push is split"
                assert hi <= acked + 1
                if mode == "sync":
                    assert acked <= lo, f"round {rounds}: an acknowledged push is lost"
        rounds += 1
    assert rounds > 0
