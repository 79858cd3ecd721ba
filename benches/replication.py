"""Replication cost: push throughput of 4 worker processes x 2 durable store servers on loopback,
batch 4096, dim 64, with one follower per server and `ack="all"` (R=2) against no followers
(R=1, `ack="primary"`); and the followers' lag while they train (issue 33's goal: R=2 keeps
>= 0.6x of R=1's push ids/s).

    python benches/replication.py [--workers 4] [--servers 2] [--seconds 20] [--batch 4096]
                                  [--dim 64] [--durability sync]

Each worker process pushes gradients of its own batches (ids drawn from a Zipf-like
distribution over 1M ids, so workers share hot rows) for `--seconds` after 3 warm-up pushes;
reported: ids pushed per second over all workers, per setup, and the ratio. While R=2 runs, the
script reads every follower's status each 50 ms: the p50/p99/max of its `lag_entries` (log
entries it has not applied yet) and of `lag_seconds` (seconds since it last held everything);
and it runs R=2 with `ack="primary"` too, where followers may lag. Servers are `pstore serve`
processes (primaries with `--path`, followers with `--follow`) on free ports, stopped by their
pids; stores go in a temporary directory.

    python benches/replication.py --failover 7 [--batch 4096] [--dim 64]

measures failover instead (issue 33's goal: under 5 s from kill -9 to the first accepted write,
default settings): a replica group [primary, follower], one client pushing batches with
`ack="all"` through the group; the primary is killed with SIGKILL 0.5-1.5 s in; the script plays
the control plane: it polls the primary's Status every 100 ms (0.5 s deadline) and on the first
failure calls `pstore.promote(follower)`. Reported per trial and as medians: detection (kill to
the failed poll), promotion (the Promote call), and kill to the first push acknowledged after
the kill (the client fails over by itself and resends its request).

    python benches/replication.py --controller-failover 7 [--batch 4096] [--dim 64]

the same trials with `pstore controller` on its defaults (checks every 0.5 s, a group without
a primary for 3 s gets its follower promoted) as the control plane (issue 34's goal: under
10 s from kill -9 to the first accepted push). Reported: kill to the promotion (the controller's
`event=promoted` time) and kill to the first push acknowledged after the kill.
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
import threading
import time
from typing import Any

import numpy as np

WARMUP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(a: dict[str, Any]) -> None:
    import pstore

    store = pstore.connect(a["servers"], ack=a["ack"], timeout=120.0)
    dim, batch = a["dim"], a["batch"]
    t = store.create_sparse_table("emb", dim, optimizer=pstore.optim.Adagrad(lr=0.05))
    rng = np.random.default_rng(a["worker"])
    batches = [(rng.zipf(1.2, batch) % 1_000_000).astype(np.int64) for _ in range(16)]
    grads = rng.standard_normal((batch, dim)).astype(np.float32) * 0.01
    for i in range(WARMUP):
        t.push(batches[i], grads)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < a["seconds"]:
        t.push(batches[n % len(batches)], grads)
        n += 1
    took = time.perf_counter() - t0
    print(json.dumps({"ids_per_s": n * batch / took}), flush=True)


class _Server:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-P", "-m", "pstore", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--log-interval", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready(self) -> None:
        import pstore

        deadline = time.monotonic() + 60
        while True:
            try:
                pstore.connect([self.address], timeout=2.0, retries=0).status()
                return
            except pstore.PstoreError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _run(replicas: int, ack: str, args: argparse.Namespace) -> dict[str, Any]:
    import pstore

    with tempfile.TemporaryDirectory() as tmp:
        primaries = [
            _Server("--path", os.path.join(tmp, f"p{i}"), "--durability", args.durability)
            for i in range(args.servers)
        ]
        for s in primaries:
            s.ready()
        followers = [
            _Server(
                "--path",
                os.path.join(tmp, f"f{i}-{k}"),
                "--durability",
                args.durability,
                "--follow",
                p.address,
            )
            for i, p in enumerate(primaries)
            for k in range(replicas - 1)
        ]
        for s in followers:
            s.ready()
        lags: list[tuple[int, float]] = []
        done = threading.Event()

        def sample() -> None:
            clients = [pstore.connect([f.address], timeout=5.0, retries=0) for f in followers]
            while not done.is_set():
                for c in clients:
                    r = c.status()[0]["replication"]
                    lags.append((r["lag_entries"], r["lag_seconds"] or 0.0))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        base = {
            "servers": [p.address for p in primaries],
            "ack": ack,
            "dim": args.dim,
            "batch": args.batch,
            "seconds": args.seconds,
        }
        try:
            pstore.connect(base["servers"]).create_sparse_table(
                "emb", args.dim, optimizer=pstore.optim.Adagrad(lr=0.05)
            )
            if followers:
                sampler.start()
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker-json", json.dumps({**base, "worker": w})],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for w in range(args.workers)
            ]
            rates = []
            for p in procs:
                out, _ = p.communicate(timeout=args.seconds * 10 + 300)
                if p.returncode != 0:
                    raise RuntimeError(f"a worker failed ({p.returncode})")
                rates.append(json.loads(out.strip().splitlines()[-1])["ids_per_s"])
        finally:
            done.set()
            if sampler.is_alive():
                sampler.join()
            for s in followers + primaries:
                s.stop()
    out: dict[str, Any] = {"ids_per_s": float(sum(rates))}
    if lags:
        e = np.array([x[0] for x in lags], dtype=np.float64)
        sec = np.array([x[1] for x in lags], dtype=np.float64)
        out["lag_entries"] = [float(np.percentile(e, q)) for q in (50, 99)] + [float(e.max())]
        out["lag_seconds"] = [float(np.percentile(sec, q)) for q in (50, 99)] + [float(sec.max())]
    return out


def _pushing(
    t: Any, args: argparse.Namespace, rng: np.random.Generator, clock: Any
) -> tuple[threading.Event, list[float], threading.Thread]:
    """A thread pushing batches into ``t`` until the event is set; the ``clock`` time of each
    acknowledgement goes into the list."""
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    stop = threading.Event()
    acked: list[float] = []

    def push() -> None:
        while not stop.is_set():
            ids = rng.integers(0, 1 << 20, size=args.batch, dtype=np.int64)
            t.push(ids, grads)
            acked.append(clock())

    pusher = threading.Thread(target=push)
    pusher.start()
    return stop, acked, pusher


def _failover_trial(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    import pstore

    with tempfile.TemporaryDirectory() as tmp:
        p = _Server("--path", os.path.join(tmp, "a"), "--durability", args.durability)
        p.ready()
        f = _Server(
            "--path",
            os.path.join(tmp, "b"),
            "--durability",
            args.durability,
            "--follow",
            p.address,
        )
        f.ready()
        try:
            c = pstore.connect([[p.address, f.address]], ack="all")  # type: ignore[list-item]
            t = c.create_sparse_table("emb", args.dim, optimizer=pstore.optim.Adagrad(lr=0.05))
            stop, acked, pusher = _pushing(t, args, rng, time.monotonic)
            watch = pstore.connect([p.address], timeout=0.5, retries=0)
            time.sleep(float(rng.uniform(0.5, 1.5)))
            killed = time.monotonic()
            os.kill(p.proc.pid, signal.SIGKILL)
            while True:
                try:
                    watch.status()
                except pstore.PstoreError:
                    break
                time.sleep(0.1)
            detected = time.monotonic()
            pstore.promote(f.address)
            promoted = time.monotonic()
            while not any(a > killed for a in acked):
                time.sleep(0.005)
            first = min(a for a in acked if a > killed)
            stop.set()
            pusher.join()
        finally:
            for s in (f, p):
                s.stop()
    return {
        "detection_s": detected - killed,
        "promote_s": promoted - detected,
        "first_write_s": first - killed,
    }


def _controller_trial(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    import urllib.request

    import pstore

    with tempfile.TemporaryDirectory() as tmp:
        p = _Server("--path", os.path.join(tmp, "a"), "--durability", args.durability)
        p.ready()
        f = _Server(
            "--path", os.path.join(tmp, "b"), "--durability", args.durability, "--follow", p.address
        )
        f.ready()
        cluster = os.path.join(tmp, "cluster.json")
        with open(cluster, "w") as out:
            json.dump({"servers": [[p.address, f.address]]}, out)
        port = _free_port()
        cmd = [sys.executable, "-P", "-m", "pstore", "controller", "--cluster", cluster]
        ctl = subprocess.Popen(
            [*cmd, "--status-port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def status() -> dict[str, Any] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
                    s: dict[str, Any] = json.load(r)
                    return s
            except OSError:
                return None

        try:
            while (s := status()) is None or s["groups"][0]["state"] != "ok":
                time.sleep(0.1)
            c = pstore.connect(cluster, ack="all")
            t = c.create_sparse_table("emb", args.dim, optimizer=pstore.optim.Adagrad(lr=0.05))
            stop, acked, pusher = _pushing(t, args, rng, time.time)
            time.sleep(float(rng.uniform(0.5, 1.5)))
            killed = time.time()
            os.kill(p.proc.pid, signal.SIGKILL)
            while not any(a > killed for a in acked):
                time.sleep(0.005)
            first = min(a for a in acked if a > killed)
            stop.set()
            pusher.join()
            s = status()
            assert s is not None
            (promoted,) = [e for e in s["events"] if e["event"] == "promoted"]
        finally:
            ctl.terminate()
            ctl.wait(60)
            for x in (f, p):
                x.stop()
    return {"promoted_s": promoted["time"] - killed, "first_write_s": first - killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--durability", default="sync", choices=["sync", "async"])
    ap.add_argument("--failover", type=int, default=0, help="failover trials instead")
    ap.add_argument(
        "--controller-failover",
        type=int,
        default=0,
        help="failover trials with `pstore controller` as the control plane",
    )
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_json is not None:
        _worker(json.loads(args.worker_json))
        return
    if args.controller_failover:
        rng = np.random.default_rng(34)
        load = os.getloadavg()[0]
        ctrials = [_controller_trial(args, rng) for _ in range(args.controller_failover)]
        for k, r in enumerate(ctrials):
            print(
                f"trial {k}: kill to promotion {r['promoted_s']:.3f} s, kill to first accepted "
                f"write {r['first_write_s']:.3f} s"
            )
        med = {k: float(np.median([r[k] for r in ctrials])) for k in ctrials[0]}
        print(
            f"median of {len(ctrials)}: kill to promotion {med['promoted_s']:.3f} s, kill to "
            f"first accepted write {med['first_write_s']:.3f} s (batch {args.batch}, dim "
            f"{args.dim}, durability {args.durability}; load {load:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end)"
        )
        return
    if args.failover:
        rng = np.random.default_rng(33)
        trials = [_failover_trial(args, rng) for _ in range(args.failover)]
        for k, r in enumerate(trials):
            print(
                f"trial {k}: detection {r['detection_s']:.3f} s, promote {r['promote_s']:.3f} s, "
                f"kill to first accepted write {r['first_write_s']:.3f} s"
            )
        med = {k: float(np.median([r[k] for r in trials])) for k in trials[0]}
        print(
            f"median of {len(trials)}: detection {med['detection_s']:.3f} s, promote "
            f"{med['promote_s']:.3f} s, kill to first accepted write {med['first_write_s']:.3f} s "
            f"(batch {args.batch}, dim {args.dim}, durability {args.durability}; load "
            f"{os.getloadavg()[0]:.2f})"
        )
        return
    r1 = _run(1, "primary", args)
    r2 = _run(2, "all", args)
    r2p = _run(2, "primary", args)
    print(
        f"{args.workers} workers x {args.servers} servers, batch {args.batch}, dim {args.dim}, "
        f"durability {args.durability}, {args.seconds:g} s each"
    )
    print(f"R=1 ack=primary   {r1['ids_per_s']:12.0f} ids/s")
    for name, r in (("R=2 ack=all      ", r2), ("R=2 ack=primary  ", r2p)):
        e, s = r["lag_entries"], r["lag_seconds"]
        print(
            f"{name} {r['ids_per_s']:12.0f} ids/s ({r['ids_per_s'] / r1['ids_per_s']:.2f}x R=1); "
            f"follower lag entries p50/p99/max {e[0]:.0f}/{e[1]:.0f}/{e[2]:.0f}, "
            f"seconds p50/p99/max {s[0]:.3f}/{s[1]:.3f}/{s[2]:.3f}"
        )


if __name__ == "__main__":
    main()
