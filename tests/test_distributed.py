"""Distributed training: store-server processes and four worker processes train the main job's
matrix-factorisation model in each training mode and reach the embedded store's test RMSE.

The stated tolerance: the final test RMSE is within 0.02 of the embedded store's, trained on the
same batches in one process (async and SSP apply gradients computed from slightly stale rows, so
the runs are not bit-identical; BSP differs by the order of updates within a step).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _mf_worker import batches, data, model
from _netutil import start_servers, start_workers, stop_all

import pstore
from pstore.apps import datasets

WORKERS, EPOCHS = 4, 5
TOLERANCE = 0.02


def _rmse(m, d: datasets.Ratings) -> float:
    return m.rmse(d, 1.0, 5.0)


@pytest.fixture(scope="module")
def embedded_rmse() -> float:
    train, test = data()
    store = pstore.Store()
    m = model(store, train)
    # Every worker's batches, step by step: batches(train, EPOCHS, 1, 0) holds fewer when the
    # batch count is not a multiple of WORKERS, so take each step's WORKERS batches explicitly.
    per_worker = [list(batches(train, EPOCHS, WORKERS, k)) for k in range(WORKERS)]
    for step in zip(*per_worker, strict=True):
        for idx in step:
            m.train_step(train.users[idx], train.items[idx], train.ratings[idx])
    return _rmse(m, test)


@pytest.mark.parametrize(
    ("mode", "staleness", "n_servers"),
    [("async", 0, 1), ("async", 0, 3), ("bsp", 0, 2), ("ssp", 2, 3)],
)
def test_workers_reach_the_embedded_rmse(mode, staleness, n_servers, embedded_rmse):
    servers = start_servers(n_servers)
    try:
        addrs = ",".join(s.address for s in servers)
        procs = start_workers(
            "_mf_worker.py", addrs, WORKERS, "--mode", mode, "--staleness", str(staleness),
            "--epochs", str(EPOCHS),
        )  # fmt: skip
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (_out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err
        steps = [json.loads(out)["steps"] for out, _ in outs]
        assert len(set(steps)) == 1 and steps[0] > 0
        remote = pstore.connect(addrs.split(","))
        train, test = data()
        rmse = _rmse(model(remote, train), test)
        baseline = float(np.sqrt(np.mean((test.ratings - np.mean(train.ratings)) ** 2)))
        assert rmse < baseline - 0.05, (rmse, baseline)
        assert abs(rmse - embedded_rmse) <= TOLERANCE, (mode, n_servers, rmse, embedded_rmse)
        clocks = remote.status()
        if mode != "async":
            coord = min(range(n_servers), key=lambda i: servers[i].address)
            assert clocks[coord]["clocks"] == [steps[0]] * WORKERS
        if n_servers > 1:
            rows = [s["rows"] for s in remote.table("user_emb").stats()["servers"]]
            assert all(r > 0 for r in rows)
    finally:
        assert stop_all(servers) == [0] * n_servers
