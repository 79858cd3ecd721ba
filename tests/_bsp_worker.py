"""A BSP worker process for tests/test_bsp.py: trains a few steps and reports each clock.

Arguments: JSON of {servers, worker, num_workers, job, steps, lease, on_worker_loss, table,
pause_at}. Prints one JSON line per event to stdout: {"joined": clock} once connected,
{"clock": c} after each step, {"error": class, "message": ...} when a step fails. With
``pause_at`` = k it stops after step k and sleeps (to be killed).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import pstore


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    a = json.loads(sys.argv[1])
    store = pstore.connect(
        a["servers"],
        mode="bsp",
        worker=a["worker"],
        num_workers=a["num_workers"],
        job=a["job"],
        lease=a["lease"],
        on_worker_loss=a["on_worker_loss"],
        barrier_timeout=60.0,
    )
    t = store.create_sparse_table(a["table"], dim=4, optimizer=pstore.optim.SGD(lr=0.1))
    say(joined=store.clock)
    ids = np.arange(16, dtype=np.int64)
    while store.clock < a["steps"]:
        if a.get("pause_at") is not None and store.clock >= a["pause_at"]:
            time.sleep(3600)
        t.pull(ids)
        t.push(ids, np.ones((16, 4), np.float32))
        try:
            c = store.end_step()
        except pstore.PstoreError as e:
            say(error=type(e).__name__, message=str(e))
            return
        say(clock=c)
        time.sleep(a.get("delay", 0.0))


if __name__ == "__main__":
    main()
