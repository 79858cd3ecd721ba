"""W3 child: grow one table by `n` fresh ids in a fresh process and report speed and memory.

Usage (run by workloads.w3_growth): python benches/growth.py '{"impl": ..., "n": ..., ...}'
Prints one JSON line. RSS is read from /proc/self/statm right before the table is created and
right after the last insert, so the delta holds the table and nothing the benchmark set up.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import numpy as np
from harness import ids_of, import_pstore, rss_bytes
from peers import DictNumpyGrowth

# Positions far from the ranges W1-W4 use, so the ids are fresh in any table.
ID_OFFSET = 1 << 40


def main() -> None:
    args = json.loads(sys.argv[1])
    impl, n, dim, batch = args["impl"], args["n"], args["dim"], args["batch"]
    ids = ids_of(np.arange(ID_OFFSET, ID_OFFSET + n, dtype=np.int64))
    grads = np.random.default_rng(31).standard_normal((batch, dim), dtype=np.float32)
    out: dict[str, object] = {"impl": impl}
    if impl.startswith("pstore"):
        pstore = import_pstore(args["pstore_dir"])
    gc.collect()
    rss0 = rss_bytes()
    if impl.startswith("pstore"):
        store = pstore.Store()
        table = store.create_sparse_table(
            "w3", dim, optimizer=pstore.optim.Adagrad(lr=0.01, initial_accumulator_value=0.1)
        )
        op = table.pull if impl == "pstore_pull" else None
    elif impl == "dict_numpy":
        table = DictNumpyGrowth(dim, init_acc=0.1)
        op = table.pull
    else:
        raise ValueError(impl)
    times = []
    gc.disable()
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        chunk = ids[start : start + batch]
        b0 = time.perf_counter()
        if op is not None:
            op(chunk)
        else:
            table.push(chunk, grads[: len(chunk)])
        times.append(time.perf_counter() - b0)
    elapsed = time.perf_counter() - t0
    gc.enable()
    rss1 = rss_bytes()
    if impl.startswith("pstore"):
        stats = table.stats()
        out["rows"] = int(stats["rows"])
        out["bytes_used"] = int(stats["bytes_used"])
        out["pstore_threads"] = store.threads
    else:
        out["rows"] = table.rows
    out.update(
        inserts_per_s=n / elapsed,
        elapsed_s=elapsed,
        rss_before=rss0,
        rss_after=rss1,
        rss_delta=rss1 - rss0,
        batch_p50_ms=float(np.median(times)) * 1e3,
        batch_max_ms=max(times) * 1e3,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
