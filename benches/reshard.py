"""Online resharding: how fast slots move while 4 workers train, and how much training slows
during the move (issue 33's goal: training keeps >= 0.5x of its speed).

    python benches/reshard.py [--rows 200000] [--workers 4] [--batch 4096] [--dim 64]
                              [--warmup 5] [--after 3] [--membership]
                              [--max-rows-per-second R]

Three in-memory `pstore serve` processes on loopback; the routing gives server 2 no slot.
`--rows` rows of a dim-`dim` Adagrad table are written first; then each worker process runs
pull(ids) -> push(ids, grads) on its own batches (ids drawn from a Zipf-like distribution over
the rows) until told to stop. After `--warmup` seconds, `move_slots` gives server 2 its third of
the slots ("join"); after `--after` more seconds, a second `move_slots` takes every slot from
server 0 ("leave"). Reported per move: slots and rows moved, seconds, rows/s, the longest time
one batch was frozen, the rows copied again under the freeze (`delta_rows`, decision 0114), the
whole call's seconds (with `--membership` also the table definitions
and the list's own publishes), and the workers' steps/s during the call over their steps/s in
the `--warmup` seconds before it (all workers' steps, counted by their end times). With
`--membership` the list itself changes: the workers and the table start on servers 0 and 1
only, "join" is `add_server(server 2)` and "leave" is `remove_server(server 0)` (the workers
follow the new lists). `--max-rows-per-second` paces every move (`max_rows_per_second`:
it waits between batches so that rows move at most that fast on average). Servers are stopped
by their pids.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

SLOTS = 16384


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _table(positions: list[int], servers: int) -> dict[str, Any]:
    ranges = [[s, s + 64, positions[(s // 64) % len(positions)]] for s in range(0, SLOTS, 64)]
    return {"epoch": 0, "servers": servers, "ranges": ranges}


def _worker(a: dict[str, Any]) -> None:
    import pstore

    store = pstore.connect(a["servers"])
    t = store.table("emb")
    rng = np.random.default_rng(a["worker"])
    grads = rng.standard_normal((a["batch"], a["dim"])).astype(np.float32) * 0.01
    ends = []
    stop = a["stop_file"]
    while not os.path.exists(stop):
        ids = (rng.zipf(1.2, a["batch"]) % a["rows"]).astype(np.int64)
        t.pull(ids)
        t.push(ids, grads)
        ends.append(time.time())
    print(json.dumps({"ends": ends}), flush=True)


def _rate(ends: list[float], t0: float, t1: float) -> float:
    return sum(t0 <= e < t1 for e in ends) / max(t1 - t0, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--membership", action="store_true", help="add_server / remove_server")
    ap.add_argument("--max-rows-per-second", type=float, default=None, help="pace the moves")
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_json:
        _worker(json.loads(args.worker_json))
        return
    ports = [_free_port() for _ in range(3)]
    servers = [f"127.0.0.1:{p}" for p in ports]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pstore", "serve", "--host", "127.0.0.1", "--port", str(p)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    stop_file = os.path.join(tempfile.gettempdir(), f"pstore-reshard-bench-{os.getpid()}.stop")
    workers: list[subprocess.Popen[str]] = []
    try:
        import pstore

        deadline = time.monotonic() + 60
        while True:
            try:
                admin = pstore.connect(servers, timeout=2.0, retries=0)
                break
            except pstore.ServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        first = servers[:2] if args.membership else servers
        admin = pstore.connect(first)
        if not args.membership:
            admin.publish_routing({**_table([0, 1], 3), "epoch": 1})
        t = admin.create_sparse_table("emb", args.dim, optimizer=pstore.optim.Adagrad(lr=0.05))
        ids = np.arange(args.rows, dtype=np.int64)
        for k in range(0, args.rows, 50_000):
            part = ids[k : k + 50_000]
            t.push(part, np.full((len(part), args.dim), 0.01, np.float32))
        base = {
            "servers": first,
            "rows": args.rows,
            "batch": args.batch,
            "dim": args.dim,
            "stop_file": stop_file,
        }
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker-json", json.dumps({**base, "worker": w})],
                stdout=subprocess.PIPE,
                text=True,
            )
            for w in range(args.workers)
        ]
        moves = []
        time.sleep(args.warmup)
        for name, positions in (("join", [0, 1, 2]), ("leave", [1, 2])):
            t0 = time.time()
            pace = args.max_rows_per_second
            if not args.membership:
                r = admin.move_slots(_table(positions, 3), max_rows_per_second=pace)
            elif name == "join":
                r = admin.add_server(servers[2], max_rows_per_second=pace)
            else:
                r = admin.remove_server(servers[0], max_rows_per_second=pace)
            t1 = time.time()
            moves.append((name, t0, t1, r))
            time.sleep(args.after)
        with open(stop_file, "w"):
            pass
        ends: list[float] = []
        for p in workers:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"a worker exited with {p.returncode}")
            ends += json.loads(out.strip().splitlines()[-1])["ends"]
        rows_after = [
            sum(int(x["rows"]) for x in s["tables"] if x["name"] == "emb") for s in admin.status()
        ]
        load = os.getloadavg()
        for name, t0, t1, r in moves:
            before = _rate(ends, t0 - args.warmup, t0)
            during = _rate(ends, t0, t1)
            print(
                json.dumps(
                    {
                        "move": name,
                        "membership": args.membership,
                        "workers": args.workers,
                        "batch": args.batch,
                        "dim": args.dim,
                        "table_rows": args.rows,
                        "max_rows_per_second": args.max_rows_per_second,
                        "slots": r["slots"],
                        "rows_moved": r["rows"],
                        "batches": r["batches"],
                        "seconds": round(r["seconds"], 3),
                        "call_seconds": round(t1 - t0, 3),
                        "rows_per_s": round(r["rows"] / max(r["seconds"], 1e-9)),
                        "max_frozen_ms": round(r["max_frozen_seconds"] * 1e3, 1),
                        # Rows copied again under the freeze (a build with pre-copy moves).
                        "delta_rows": r.get("delta_rows"),
                        "steps_per_s_before": round(before, 1),
                        "steps_per_s_during": round(during, 1),
                        "during_over_before": round(during / max(before, 1e-9), 2),
                        "rows_per_server_after": rows_after,
                        "loadavg": [round(x, 2) for x in load],
                    }
                )
            )
    finally:
        with open(stop_file, "w"):
            pass
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if os.path.exists(stop_file):
            os.remove(stop_file)


if __name__ == "__main__":
    main()
