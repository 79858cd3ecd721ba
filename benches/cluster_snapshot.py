"""Cluster snapshot, restore and reshard rates against the embedded store's (issue 31).

    python benches/cluster_snapshot.py            # quick: 1M x 64 rows
    python benches/cluster_snapshot.py --full     # the issue's 10M x 64 rows

One sparse table of dim 64 with Adagrad (64 floats of state per row). The embedded store
(threads=2) snapshots and restores it in process; the same rows on 2 in-memory store servers on
127.0.0.1 are snapshotted with ``store.snapshot(dir)`` (each server writes its part) and restored
onto 2 fresh servers with ``pstore.restore_cluster``. Then the rows on 4 servers are resharded
onto 8. Rates are rows per second of wall time; the goal is cluster >= 0.7x embedded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import pstore
from pstore.client import RemoteStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from net import free_port

DIM = 64
CHUNK = 1 << 16


class Servers:
    """`n` in-memory `pstore serve` processes on 127.0.0.1, stopped by their pids."""

    def __init__(self, n: int, threads: int) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "pstore", "serve", "--host", "127.0.0.1", "--port",
                 str(p), "--threads", str(threads), "--log-interval", "0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for p in self.ports
        ]  # fmt: skip
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        deadline = time.monotonic() + 60
        while True:
            try:
                pstore.connect(self.addresses, timeout=2.0, retries=0).status()
                return
            except pstore.PstoreError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=60)


def fill(store: pstore.Store | RemoteStore, rows: int) -> None:
    t = store.create_sparse_table("emb", DIM, optimizer=pstore.optim.Adagrad(lr=0.05))
    rng = np.random.default_rng(0)
    for lo in range(0, rows, CHUNK):
        ids = np.arange(lo, min(rows, lo + CHUNK), dtype=np.uint64)
        t.push(ids, rng.standard_normal((len(ids), DIM), dtype=np.float32))


def timed(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="10M rows (default 1M)")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="threads of each store")
    args = ap.parse_args()
    rows = args.rows or (10_000_000 if args.full else 1_000_000)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        local = pstore.Store(threads=args.threads)
        fill(local, rows)
        out["embedded snapshot"] = rows / timed(lambda: local.snapshot(root / "emb"))
        local.close()
        out["embedded restore"] = rows / timed(
            lambda: pstore.Store.restore(root / "emb", threads=args.threads)
        )

        src = Servers(2, args.threads)
        dst = Servers(2, args.threads)
        try:
            remote = pstore.connect(src.addresses)
            fill(remote, rows)
            out["cluster snapshot (2 servers)"] = rows / timed(
                lambda: remote.snapshot(root / "cluster")
            )
            src.stop()
            out["cluster restore (2 -> 2)"] = rows / timed(
                lambda: pstore.restore_cluster(root / "cluster", dst.addresses)
            )
        finally:
            src.stop() if src.procs[0].poll() is None else None
            dst.stop()

        four = Servers(4, 1)
        try:
            remote = pstore.connect(four.addresses)
            fill(remote, rows)
            remote.snapshot(root / "four")
        finally:
            four.stop()
        eight = Servers(8, 1)
        try:
            out["reshard 4 -> 8"] = rows / timed(
                lambda: pstore.restore_cluster(root / "four", eight.addresses)
            )
            assert len(pstore.connect(eight.addresses).table("emb")) == rows
        finally:
            eight.stop()

    print(f"{rows:,} rows x {DIM}, Adagrad, threads={args.threads}")
    for k, v in out.items():
        print(f"{k:<32} {v / 1e6:8.2f} M rows/s")
    snap = out["cluster snapshot (2 servers)"] / out["embedded snapshot"]
    rest = out["cluster restore (2 -> 2)"] / out["embedded restore"]
    print(f"cluster/embedded snapshot {snap:.2f}x")
    print(f"cluster/embedded restore  {rest:.2f}x")


if __name__ == "__main__":
    main()
