"""Snapshot and restore of an embedded store into a local directory and into S3 (issue 31).

    python benches/object_store_snapshot.py             # 200k x 64 rows
    python benches/object_store_snapshot.py --rows 1000000

One sparse table of dim 64 with Adagrad (64 floats of state per row, ~0.5 KiB a row). The S3
side is moto's server mode on 127.0.0.1 (started here), which keeps objects in its own memory:
its rates say what staging plus the transfer cost on this machine, not what a real S3 gives.
Rates are rows per second of wall time, best of `--repeat`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import numpy as np

import pstore

DIM = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    port = free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        os.environ.update(
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ALLOW_HTTP="true",
        )
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client(
            "s3",
            endpoint_url=os.environ["AWS_ENDPOINT_URL"],
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)

        store = pstore.Store(threads=2)
        t = store.create_sparse_table("t", DIM, optimizer=pstore.optim.Adagrad(lr=0.1))
        ids = np.arange(args.rows, dtype=np.uint64)
        rng = np.random.default_rng(0)
        for lo in range(0, args.rows, 1 << 16):
            chunk = ids[lo : lo + (1 << 16)]
            t.push(chunk, rng.standard_normal((len(chunk), DIM)).astype(np.float32))
        n = args.rows
        best: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.repeat):
                for name, dest in (
                    ("local", str(Path(tmp) / f"s{k}")),
                    ("s3", f"s3://{bucket}/s{k}"),
                ):
                    t0 = time.perf_counter()
                    m = store.snapshot(dest)
                    dt = time.perf_counter() - t0
                    best[f"snapshot {name}"] = min(best.get(f"snapshot {name}", dt), dt)
                    size = m["bytes"]
                    t0 = time.perf_counter()
                    r = pstore.Store.restore(dest, threads=2)
                    dt = time.perf_counter() - t0
                    assert len(r.table("t")) == n
                    best[f"restore {name}"] = min(best.get(f"restore {name}", dt), dt)
                    del r
        print(f"{n} rows x dim {DIM} (Adagrad), {size / 2**20:.0f} MiB a snapshot")
        for k, dt in best.items():
            rate = f"{n / dt / 1e6:6.2f} M rows/s  {size / dt / 2**20:7.0f} MiB/s"
            print(f"  {k:18} {dt:7.2f} s  {rate}")
    finally:
        moto.terminate()
        moto.wait(timeout=30)


if __name__ == "__main__":
    main()
