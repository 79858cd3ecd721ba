"""Cluster snapshot, restore and reshard rates against the embedded store's (issue 31).

    python benches/cluster_snapshot.py            # quick: 1M x 64 rows
    python benches/cluster_snapshot.py --full     # the issue's 10M x 64 rows

One sparse table of dim 64 with Adagrad (64 floats of state per row). The embedded store
(threads=2) snapshots and restores it in process; the same rows on 2 in-memory store servers on
127.0.0.1 are snapshotted with ``store.snapshot(dir)`` (each server writes its part) and restored
onto 2 fresh servers with ``pstore.restore_cluster``, once ``via="servers"`` (each server reads
the parts) and once ``via="client"`` (rows sent with BulkLoad). Then the rows on 4 servers are
resharded onto 8, both ways. Rates are rows per second of wall time; the goal is cluster >= 0.7x
embedded. ``--only servers`` skips the client-path runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
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


def embedded_snapshot(dest: Path, rows: int, threads: int) -> float:
    """Seconds of a snapshot of `rows` rows of an embedded store into `dest`."""
    local = pstore.Store(threads=threads)
    fill(local, rows)
    seconds = timed(lambda: local.snapshot(dest))
    local.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="10M rows (default 1M)")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="threads of each store")
    ap.add_argument(
        "--only", choices=("servers", "client"), default=None, help="one restore path only"
    )
    args = ap.parse_args()
    vias = [v for v in ("servers", "client") if args.only in (None, v)]
    rows = args.rows or (10_000_000 if args.full else 1_000_000)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        # In a function: its store is freed before the servers start.
        out["embedded snapshot"] = rows / embedded_snapshot(root / "emb", rows, args.threads)
        out["embedded restore"] = rows / timed(
            lambda: pstore.Store.restore(root / "emb", threads=args.threads)
        )

        src = Servers(2, args.threads)
        try:
            remote = pstore.connect(src.addresses)
            fill(remote, rows)
            out["cluster snapshot (2 servers)"] = rows / timed(
                lambda: remote.snapshot(root / "cluster")
            )
        finally:
            src.stop()
        for via in vias:
            # One set of servers at a time: the machine holds one copy of the rows at once.
            dst = Servers(2, args.threads)
            try:
                out[f"cluster restore (2 -> 2) via {via}"] = rows / timed(
                    partial(pstore.restore_cluster, root / "cluster", dst.addresses, via=via)
                )
                assert len(pstore.connect(dst.addresses).table("emb")) == rows
            finally:
                dst.stop()

        four = Servers(4, 1)
        try:
            remote = pstore.connect(four.addresses)
            fill(remote, rows)
            remote.snapshot(root / "four")
        finally:
            four.stop()
        for via in vias:
            eight = Servers(8, 1)
            try:
                out[f"reshard 4 -> 8 via {via}"] = rows / timed(
                    partial(pstore.restore_cluster, root / "four", eight.addresses, via=via)
                )
                assert len(pstore.connect(eight.addresses).table("emb")) == rows
            finally:
                eight.stop()

    print(f"{rows:,} rows x {DIM}, Adagrad, threads={args.threads}")
    for k, v in out.items():
        print(f"{k:<32} {v / 1e6:8.2f} M rows/s")
    snap = out["cluster snapshot (2 servers)"] / out["embedded snapshot"]
    print(f"cluster/embedded snapshot               {snap:.2f}x")
    for via in vias:
        rest = out[f"cluster restore (2 -> 2) via {via}"] / out["embedded restore"]
        print(f"cluster/embedded restore via {via:<8}   {rest:.2f}x")


if __name__ == "__main__":
    main()
