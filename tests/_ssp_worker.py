"""An SSP worker for tests/test_ssp_snapshot.py: trains with known gradients and reports clocks.

Run as a process: argument JSON of {servers, worker, num_workers, job, steps, staleness, lease,
on_worker_loss, table, pause_at, delay}. Prints one JSON line per event to stdout:
{"joined": clock} once connected, {"clock": c} after each step, {"paused": c} when it stops
after step ``pause_at`` (to be killed), {"error": class, "message": ...} when a step fails,
{"done": c} at the end. The tests import :func:`batch` and :func:`train_step` from here.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import numpy as np

import pstore

#: The ids a worker's batches are drawn from (spread over the servers by routing).
IDS = np.arange(1, 241, dtype=np.int64) * 7919
DIM = 4
SHAPE = (2, 3)


def batch(table: str, w: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Worker w's batch of step ``step`` (1-based): distinct ids, their gradients and a dense
    gradient. Every value is a multiple of 1/8 of at most 1 in size, so SGD with lr 1 from
    zeros keeps every sum exact in float32, whatever the order the pushes arrive in."""
    rng = np.random.default_rng([zlib.crc32(table.encode()), w, step])
    ids = rng.choice(IDS, size=24, replace=False)
    g = (rng.integers(-8, 9, size=(24, DIM)) / 8).astype(np.float32)
    dg = (rng.integers(-8, 9, size=SHAPE) / 8).astype(np.float32)
    return ids, g, dg


def declare(store: pstore.RemoteStore, table: str) -> tuple[pstore.SparseTable, pstore.DenseTable]:
    sgd = pstore.optim.SGD(lr=1.0)
    emb = store.create_sparse_table(table, DIM, optimizer=sgd, initializer=pstore.init.Zeros())
    dense = store.create_dense_table(
        table + "_d", SHAPE, optimizer=sgd, initializer=pstore.init.Zeros()
    )
    return emb, dense


def train_step(
    store: pstore.RemoteStore, emb: pstore.SparseTable, dense: pstore.DenseTable, w: int
) -> None:
    """Pulls and pushes this worker's batch of its next step (not ending the step)."""
    ids, g, dg = batch(emb.name, w, store.clock + 1)
    emb.pull(ids)
    emb.push(ids, g)
    dense.push(dg)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    a = json.loads(sys.argv[1])
    store = pstore.connect(
        a["servers"],
        mode="ssp",
        staleness=a["staleness"],
        worker=a["worker"],
        num_workers=a["num_workers"],
        job=a["job"],
        lease=a["lease"],
        on_worker_loss=a["on_worker_loss"],
        barrier_timeout=60.0,
    )
    emb, dense = declare(store, a["table"])
    say(joined=store.clock)
    while store.clock < a["steps"]:
        if a.get("pause_at") is not None and store.clock >= a["pause_at"]:
            say(paused=store.clock)
            time.sleep(3600)
        train_step(store, emb, dense, a["worker"])
        time.sleep(a.get("delay", 0.0))
        try:
            c = store.end_step()
        except pstore.PstoreError as e:
            say(error=type(e).__name__, message=str(e))
            return
        say(clock=c)
    say(done=store.clock)


if __name__ == "__main__":
    main()
