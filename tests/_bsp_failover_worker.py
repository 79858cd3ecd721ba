"""A BSP (or SSP) worker process for tests/test_bsp_failover.py: trains a few steps on a
cluster of replica groups with ack="all" and stops at one step until told to go on.

Argument: JSON of {servers, worker, num_workers, job, steps, hold, mode, opt}. At step
``hold`` worker 0 pushes, says {"held": step} and waits for a line on stdin before it ends the
step; the other workers start once told (a line on stdin), then say {"held": step} and wait
before they push. Prints {"first": rows}
(the rows before training, worker 0), {"clock": c} after each step, {"done": c} at the end, and
{"error": class, "message": ...} when a call fails.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import pstore

IDS = np.arange(1, 41, dtype=np.int64)
DIM = 4


def batch(w: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Worker w's batch of step c: ids (with repeats) and their gradients."""
    rng = np.random.default_rng(1000 * w + c)
    return rng.choice(IDS, size=24), rng.standard_normal((24, DIM)).astype(np.float32)


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    a = json.loads(sys.argv[1])
    w = a["worker"]
    store = pstore.connect(
        a["servers"],
        mode=a["mode"],
        staleness=1 if a["mode"] == "ssp" else 0,
        worker=w,
        num_workers=a["num_workers"],
        job=a["job"],
        ack="all",
        retries=12,
        timeout=10.0,
        barrier_timeout=60.0,
    )
    opt = pstore.optim.Adagrad(lr=0.1) if a["opt"] == "adagrad" else pstore.optim.SGD(lr=0.1)
    t = store.create_sparse_table("emb", DIM, optimizer=opt, seed=3)
    if w == 0:
        say(first=t.pull(IDS).tolist())
    else:
        # Not before worker 0 read the rows (an SSP worker may run ahead of it).
        sys.stdin.readline()
    try:
        for c in range(a["steps"]):
            ids, g = batch(w, c)
            held = c == a["hold"]
            if held and w != 0:
                say(held=c)
                sys.stdin.readline()
            t.push(ids, g)
            if held and w == 0:
                say(held=c)
                sys.stdin.readline()
            say(clock=store.end_step())
        say(done=store.clock)
    except pstore.PstoreError as e:
        say(error=type(e).__name__, message=str(e))


if __name__ == "__main__":
    main()
