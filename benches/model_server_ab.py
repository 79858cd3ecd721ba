"""Model servers of different builds side by side against the in-process lookup (W7's case c).

    python benches/model_server_ab.py base=PYTHON_A new=PYTHON_B
    python benches/model_server_ab.py new=.venv/bin/python "split=.venv/bin/python;VAR=1"
    python benches/model_server_ab.py grpc=PY "rows=PY;--rows-port=0"

Each NAME=PYTHON[;VAR=VALUE...][;--flag=value...] starts `PYTHON -m pstore serve-model` (with
those environment variables and flags) on a free 127.0.0.1 port, serving one float32 artifact
(rows x 64, every row the initializer's, exported once into --dir and reused). The client and
the in-process reference (`ServingStore.lookup`) are the pstore of the interpreter running this
script. Per batch size, each repetition times the same Zipf batches through every contender in
turn (the order rotated each repetition), so the ratios are of one run. It reports the median
rate, the ratio to the in-process median, p50/p99 latency, and the CPU time per call of this
process (client) and of the server process (from /proc), which on a loaded machine tells more
than the rates.

With ``--floor``, a bare loopback transfer of each answer's bytes (``tcp_floor.py``: an 8-byte
request, no lookup, no framing) runs beside them, and each batch also reports the bound it sets:
a server that looks the rows up and then sends them reaches at most in-process p50 /
(in-process p50 + floor p50) of the in-process rate on one client thread.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from idle_flood import cpu_seconds
from net import ServerProcess, free_port, start_tcp_floor
from tcp_floor import TcpFloor

import pstore
from pstore import serving

DIM = 64
TABLE = "emb"
BATCHES = {1: 2000, 256: 400, 4096: 100}  # batch size: calls per repetition


def build(art: Path, rows: int) -> None:
    """A float32 artifact of `rows` ids, unless `art` holds one already."""
    if (art / "data.mdb").exists():
        return
    with tempfile.TemporaryDirectory(dir=art.parent) as tmp:
        store = pstore.Store()
        t = store.create_sparse_table(TABLE, DIM, optimizer=pstore.optim.SGD(lr=0.1), seed=7)
        for s in range(0, rows, 65536):
            t.pull(np.arange(s, min(s + 65536, rows), dtype=np.uint64))
        store.snapshot(Path(tmp) / "snap")
        store.close()
        serving.export(Path(tmp) / "snap", art)


def start(spec: str, art: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`serve-model` of `art` by the interpreter of `spec`, once it accepts connections."""
    py, *rest = spec.split(";")
    envs = [e for e in rest if not e.startswith("--")]
    flags = [e for e in rest if e.startswith("--")]
    env = dict(os.environ, **dict(e.split("=", 1) for e in envs))
    port = free_port()
    argv = [py, "-m", "pstore", "serve-model", str(art), "--port", str(port), *flags]
    # Not from the repo root, whose pstore/ would shadow the interpreter's installed one.
    proc = subprocess.Popen(argv, cwd=art.parent, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec}: the model server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"{spec}: the model server did not listen within 60 s")


FLOOR = "TCP floor"


def server_cpu(pid: int | None) -> float:
    """CPU seconds of the server process `pid`; 0 for the in-process reference."""
    return 0.0 if pid is None else cpu_seconds(pid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("servers", nargs="+", help="NAME=PYTHON[;VAR=VALUE...]")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--batches", default="1,256,4096")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "pstore-model-ab")
    p.add_argument("--floor", action="store_true", help="also time the bare loopback transfer")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    art = args.dir / f"artifact-{args.rows}"
    build(art, args.rows)
    model = serving.ServingStore(art)
    readers: dict[str, Callable[[np.ndarray], Any]] = {
        "in process": lambda ids: model.lookup(TABLE, ids)
    }
    pids: dict[str, int] = {}
    procs = []
    floor_server: ServerProcess | None = None
    try:
        for arg in args.servers:
            name, spec = arg.split("=", 1)
            proc, addr = start(spec, art)
            procs.append(proc)
            pids[name] = proc.pid
            readers[name] = pstore.connect([addr], timeout=60.0).table(TABLE).pull
        floor = None
        if args.floor:
            floor_server = start_tcp_floor(args.dir)
            floor = TcpFloor(floor_server.address)
        rng = np.random.default_rng(71)
        check = (rng.zipf(1.05, 4096) % args.rows).astype(np.uint64)
        want = model.lookup(TABLE, check)
        if floor is not None:
            # The answer's bytes (float32 rows) and nothing else; added after the row checks.
            readers[FLOOR] = lambda ids: floor.pull(len(ids) * DIM * 4)
        for name, f in readers.items():
            if name == FLOOR:
                continue
            if not np.array_equal(f(check), want):
                raise AssertionError(f"{name}: rows differ from the in-process lookup's")
        # Every row read once by every reader: no first touches of pages in the timings.
        for s in range(0, args.rows, 65536):
            for f in readers.values():
                f(np.arange(s, min(s + 65536, args.rows), dtype=np.uint64))
        print(f"load at start {os.getloadavg()}")
        for batch in (int(b) for b in args.batches.split(",")):
            calls = BATCHES.get(batch, max(10, 400_000 // batch))
            batches = [(rng.zipf(1.05, batch) % args.rows).astype(np.uint64) for _ in range(calls)]
            lat: dict[str, list[float]] = {k: [] for k in readers}
            rate: dict[str, list[float]] = {k: [] for k in readers}
            cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in readers}
            for r in range(args.reps):
                order = list(readers)
                order = order[r % len(order) :] + order[: r % len(order)]
                for k in order:
                    f = readers[k]
                    pid = pids.get(k)
                    c0, s0, t0 = time.process_time(), server_cpu(pid), time.perf_counter()
                    for b in batches:
                        t = time.perf_counter()
                        f(b)
                        lat[k].append(time.perf_counter() - t)
                    rate[k].append(batch * calls / (time.perf_counter() - t0))
                    cpu[k].append((time.process_time() - c0, server_cpu(pid) - s0))
            ref = statistics.median(rate["in process"])
            for k in readers:
                m = statistics.median(rate[k])
                ms = np.percentile(np.array(lat[k]) * 1e3, [50, 99])
                client = statistics.median(c for c, _ in cpu[k]) / calls * 1e6
                server = statistics.median(s for _, s in cpu[k]) / calls * 1e6
                per_rep = [
                    round(x / y, 2) for x, y in zip(rate[k], rate["in process"], strict=True)
                ]
                print(
                    f"batch {batch:5d}  {k:12s} {m / 1e6:7.3f} M ids/s  ratio {m / ref:5.2f}  "
                    f"p50 {ms[0]:7.3f} ms  p99 {ms[1]:7.3f} ms  CPU/call client {client:7.1f} "
                    f"µs server {server:7.1f} µs  per repetition {per_rep}"
                )
            if FLOOR in readers:
                p50 = {k: statistics.median(lat[k]) for k in ("in process", FLOOR)}
                print(
                    f"batch {batch:5d}  bound of a lookup then a send: in-process p50 / "
                    f"(in-process p50 + floor p50) = {p50['in process'] / sum(p50.values()):.2f}"
                )
        print(f"load at end {os.getloadavg()}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        if floor_server is not None:
            floor_server.stop()
        model.close()


if __name__ == "__main__":
    main()
