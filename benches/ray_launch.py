"""pstore on Ray (docs/RAY.md): the time from ``pstore.ray.Cluster(...)`` to the first pull, and
DeepFM samples/s on Ray Train against the same training loop and servers as plain processes
(issue 34's goal: Ray >= 0.9x plain, since Ray adds nothing to the data path).

    unshare --net sh -c 'ip link set lo up && python benches/ray_launch.py [--repeats 3] ...'

It runs only in a network namespace that has nothing but loopback (as above, as root): Ray's
dashboard asks cloud metadata addresses and reports usage whatever its settings, and this
benchmark's traffic stays on the machine (it refuses to start otherwise).

Ray runs as a local two-node cluster (``ray.cluster_utils.Cluster``, 2 CPUs each, on
127.0.0.1), started once and not timed. *Launch*: ``Cluster(num_servers, server_cpus=0.5)``,
``connect``, create a table, pull 1000 ids; timed from the call to the pull's return, then the
cluster is shut down (untimed). *Training*: the loop of examples/ray_train_deepfm.py (DeepFM,
BSP through pstore, DDP over the dense layers, 2 workers) run (a) by Ray Train's TorchTrainer
against a ``pstore.ray.Cluster`` and (b) by two plain worker processes (torch.distributed gloo
on loopback + DDP) against ``pstore serve`` processes, alternately, ``repeats`` times each;
samples/s is rank 0's count over every worker's samples per second of training (data set made,
model built and the first step's join excluded). Prints one JSON line.

``--failover N`` measures instead replica groups on Ray (``Cluster(2, replicas=2,
durability="sync")``, defaults otherwise): a head node holding no server and two worker nodes
(2 CPUs each, a ``pstore_server`` resource the servers ask for), a third added as the spare;
a thread pushes (``ack="all"``, 1024 ids x dim 16) in a loop; ``remove_node`` of the node of
group 0's primary; timed from ``remove_node``'s return (the node's processes are gone) to the
return of the first push sent after it, and to the replacement follower listed by the
controller. N trials, each on a new pstore cluster; the removed node is added back between
trials.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "ray_train_deepfm", ROOT / "examples" / "ray_train_deepfm.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plain_worker(a: dict[str, Any]) -> None:
    """One worker process of the plain run."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import pstore

    ex = _example()
    rank, world = a["rank"], a["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{a['port']}", rank=rank, world_size=world
    )
    store = pstore.connect(
        a["servers"], token=a["token"], mode="bsp", worker=rank, num_workers=world, job=a["job"]
    )

    def report(m: dict[str, Any]) -> None:
        if rank == 0 and "samples_per_s" in m:
            print(json.dumps(m), flush=True)

    ex.fit(store, rank, world, a["config"], DistributedDataParallel, report)
    dist.destroy_process_group()


def _plain(config: dict[str, Any], servers: int, workers: int) -> float:
    """Samples/s of the loop with `pstore serve` servers and plain worker processes."""
    token = uuid.uuid4().hex
    env = dict(os.environ, PSTORE_TOKEN=token)
    ports = [_free_port() for _ in range(servers)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pstore", "serve", "--port", str(p), "--log-interval", "0"],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        addrs = [f"127.0.0.1:{p}" for p in ports]
        import pstore

        deadline = time.monotonic() + 60
        while True:
            try:
                if pstore.connect(addrs, token=token, retries=0).health() == ["SERVING"] * servers:
                    break
            except pstore.PstoreError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("pstore serve did not start")
            time.sleep(0.2)
        common = {
            "servers": addrs,
            "token": token,
            "world": workers,
            "port": _free_port(),
            "job": uuid.uuid4().hex,
            "config": config,
        }
        ws = [
            subprocess.Popen(
                [sys.executable, __file__, "--plain-worker", json.dumps({**common, "rank": r})],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(workers)
        ]
        outs = [w.communicate(timeout=1800)[0] for w in ws]
        if any(w.returncode for w in ws):
            raise RuntimeError(f"a plain worker failed: {[w.returncode for w in ws]}")
        return float(json.loads(outs[0].strip().splitlines()[-1])["samples_per_s"])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)


def _push_loop(
    t: Any, ids: Any, grads: Any, stop: Any, gone: list[float], done: list[float]
) -> None:
    """Push until ``stop``; the first push sent after ``gone`` was set notes its return."""
    import pstore

    while not stop.is_set():
        began = time.monotonic()
        try:
            t.push(ids, grads)
        except pstore.PstoreError:
            continue
        if gone and began > gone[0] and not done:
            done.append(time.monotonic())


def _failover(trials: int) -> dict[str, Any]:
    """remove_node of a primary's node -> first accepted push, on Ray (see the module)."""
    import threading

    import numpy as np
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    import pstore
    import pstore.ray

    server = {"pstore_server": 4}
    rc = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        rc.add_node(num_cpus=2, resources=server)
    rc.wait_for_nodes()
    ray.init(address=rc.address, namespace=pstore.ray.NAMESPACE, log_to_driver=False)
    to_push, to_listed, promoted_after = [], [], []
    removal_s: list[float] = []
    timelines: list[list[Any]] = []
    root = tempfile.mkdtemp(prefix="pstore-ray-failover-")
    try:
        for i in range(trials):
            c = pstore.ray.Cluster(
                2,
                replicas=2,
                path=os.path.join(root, f"t{i}"),
                durability="sync",
                name=f"failover{i}",
                server_cpus=0.5,
                server_resources={"pstore_server": 1},
            )
            try:
                deadline = time.monotonic() + 60
                while not all(g["live_followers"] for g in c.status()["groups"]):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"followers not live: {c.status()}")
                    time.sleep(0.2)
                st = c.status()
                spare = rc.add_node(num_cpus=2, resources=server)
                rc.wait_for_nodes()
                t = c.connect(ack="all").create_sparse_table("t", 16)
                ids = np.arange(1024, dtype=np.int64)
                g = np.ones((1024, 16), np.float32)
                done: list[float] = []
                gone: list[float] = []
                stop = threading.Event()

                th = threading.Thread(target=_push_loop, args=(t, ids, g, stop, gone, done))
                th.start()
                time.sleep(2.0)
                g0 = st["groups"][0]
                victim = next(m for m in g0["members"] if m["address"] == g0["primary"])
                node = next(n for n in rc.worker_nodes if n.node_id == victim["node_id"])
                began_wall = time.time()
                rc.remove_node(node)
                gone.append(time.monotonic())
                removal_s.append(time.time() - began_wall)
                while not done and time.monotonic() < gone[0] + 120:
                    time.sleep(0.01)
                to_push.append(done[0] - gone[0] if done else float("nan"))
                while time.monotonic() < gone[0] + 120:
                    s = c.status()
                    if all(
                        len(x["members"]) == 2 and x["live_followers"] and not x["pending"]
                        for x in s["groups"]
                    ):
                        to_listed.append(time.monotonic() - gone[0])
                        break
                    time.sleep(0.1)
                evs = c.status()["events"]
                ev = [e for e in evs if e["event"] == "promoted"]
                promoted_after += [float(e["after_seconds"]) for e in ev]
                timelines.append(
                    [
                        (e["event"], e.get("group"), round(e["time"] - began_wall, 2))
                        for e in evs
                        if e["time"] >= began_wall
                    ]
                )
                stop.set()
                th.join(60)
            finally:
                c.shutdown()
            if spare not in rc.worker_nodes:
                raise RuntimeError("the spare node was removed")
            rc.add_node(num_cpus=2, resources=server)  # in place of the removed one
            rc.wait_for_nodes()
    finally:
        ray.shutdown()
        rc.shutdown()
    return {
        "remove_node_to_first_push_s": to_push,
        "median_s": statistics.median(to_push),
        "remove_node_to_replacement_listed_s": to_listed,
        "promoted_after_s": promoted_after,
        "remove_node_call_s": removal_s,
        "events_since_remove_node_call_s": timelines,
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=24_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument(
        "--failover",
        type=int,
        default=0,
        metavar="N",
        help="measure N trials of a primary's node removed from replica groups on Ray instead",
    )
    p.add_argument("--plain-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.plain_worker is not None:
        _plain_worker(json.loads(a.plain_worker))
        return

    others = sorted({name for _, name in socket.if_nameindex()} - {"lo"})
    if others:
        sys.exit(
            f"ray_launch.py: network interfaces {others} are up; run it in a namespace with only "
            "loopback: unshare --net sh -c 'ip link set lo up && python benches/ray_launch.py'"
        )
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import numpy as np
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    import pstore.ray

    if a.failover:
        print(json.dumps(_failover(a.failover)))
        return
    rc = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    rc.add_node(num_cpus=2)
    rc.wait_for_nodes()
    ray.init(address=rc.address, namespace=pstore.ray.NAMESPACE, log_to_driver=False)
    ex = _example()
    ray.cloudpickle.register_pickle_by_value(ex)
    try:
        launch = []
        for i in range(a.repeats):
            t0 = time.perf_counter()
            c = pstore.ray.Cluster(a.servers, name=f"launch{i}", server_cpus=0.5)
            t = c.connect().create_sparse_table("t", 16)
            t.pull(np.arange(1000, dtype=np.int64))
            launch.append(time.perf_counter() - t0)
            c.shutdown()
        config = {"samples": a.samples, "epochs": a.epochs}
        on_ray, plain = [], []
        storage = tempfile.mkdtemp(prefix="pstore-ray-bench-")
        for i in range(a.repeats):
            c = pstore.ray.Cluster(a.servers, name=f"train{i}", server_cpus=0.25)
            try:
                m = ex.train(c, num_workers=2, cpus_per_worker=0.5, storage=storage, **config)
            finally:
                c.shutdown()
            on_ray.append(float(m["samples_per_s"]))
            plain.append(_plain(config, a.servers, 2))
    finally:
        ray.shutdown()
        rc.shutdown()
    out = {
        "launch_to_first_pull_s": launch,
        "launch_median_s": statistics.median(launch),
        "ray_train_samples_per_s": on_ray,
        "plain_samples_per_s": plain,
        "ratio_ray_over_plain": statistics.median(on_ray) / statistics.median(plain),
        "config": {**config, "servers": a.servers, "workers": 2},
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
