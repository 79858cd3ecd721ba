"""BSP with aggregation against async: step time of 4 worker processes x 2 store servers on
loopback, batch 4096, dim 64 (issue 31's goal: BSP <= 1.5x async per step).

    python benches/cluster.py [--workers 4] [--servers 2] [--steps 30] [--batch 4096] [--dim 64]

Each worker process runs pull(ids) -> push(ids, grads) -> end_step() per step on its own batch
(ids drawn from a Zipf-like distribution over 1M ids, so workers share hot rows); the first 5
steps are warm-up. Reported: the median over workers of each worker's mean step time, per mode,
and the ratio BSP / async. Servers are in-memory `pstore serve` processes started on free ports
and stopped by their pids.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np

WARMUP = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(a: dict[str, Any]) -> None:
    import pstore

    mode = a["mode"]
    store = pstore.connect(
        a["servers"],
        mode=mode,
        worker=a["worker"],
        num_workers=a["workers"],
        job=a["job"] if mode == "bsp" else None,
        barrier_timeout=120.0,
    )
    dim, batch = a["dim"], a["batch"]
    t = store.create_sparse_table(a["table"], dim, optimizer=pstore.optim.Adagrad(lr=0.05))
    rng = np.random.default_rng(a["worker"])
    batches = [(rng.zipf(1.2, batch) % 1_000_000).astype(np.int64) for _ in range(a["steps"])]
    grads = rng.standard_normal((batch, dim)).astype(np.float32) * 0.01
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        t.pull(ids)
        t.push(ids, grads)
        store.end_step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": float(np.mean(times[WARMUP:]))}), flush=True)


def _run(mode: str, servers: list[str], args: argparse.Namespace) -> float:
    base: dict[str, Any] = {
        "mode": mode,
        "servers": servers,
        "workers": args.workers,
        "dim": args.dim,
        "batch": args.batch,
        "steps": args.steps + WARMUP,
        "job": uuid.uuid4().hex,
        "table": f"emb_{mode}",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker-json", json.dumps({**base, "worker": w})],
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in range(args.workers)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"a {mode} worker exited with {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1])["step_s"])
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_json:
        _worker(json.loads(args.worker_json))
        return
    ports = [_free_port() for _ in range(args.servers)]
    servers = [f"127.0.0.1:{p}" for p in ports]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pstore", "serve", "--host", "127.0.0.1", "--port", str(p)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        import pstore

        deadline = time.monotonic() + 60
        while True:
            try:
                pstore.connect(servers, timeout=2.0, retries=0)
                break
            except pstore.ServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        res: dict[str, list[float]] = {}
        # Twice each, alternating, to see the noise of a shared machine.
        for mode in ("async", "bsp", "async", "bsp"):
            res.setdefault(mode, []).append(_run(mode, servers, args))
        a, b = min(res["async"]), min(res["bsp"])
        print(
            json.dumps(
                {
                    "workers": args.workers,
                    "servers": args.servers,
                    "batch": args.batch,
                    "dim": args.dim,
                    "async_step_ms": [round(x * 1e3, 1) for x in res["async"]],
                    "bsp_step_ms": [round(x * 1e3, 1) for x in res["bsp"]],
                    "bsp_over_async": round(b / a, 2),
                }
            )
        )
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(60)


if __name__ == "__main__":
    main()
