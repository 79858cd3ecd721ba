"""pstore on Ray (pstore.ray): the launcher, connect, a killed server, a killed controller,
snapshot and restore, the ``pstore ray`` commands, and DeepFM on Ray Train.

Everything runs on one local multi-node Ray cluster (``ray.cluster_utils.Cluster``, two nodes
on 127.0.0.1) shared by the module: Ray takes tens of seconds to start on a small machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray binds 127.0.0.1
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report to Ray's makers
ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import pstore  # noqa: E402
import pstore.ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def raycluster():
    """Two Ray nodes of 2 CPUs each, and this process connected to them."""
    c = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=pstore.ray.NAMESPACE, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _wait(cond, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _counter_table(store: pstore.RemoteStore) -> pstore.SparseTable:
    """Rows start at 0 and every push of gradient -1 adds 1: a row's value counts its pushes."""
    return store.create_sparse_table(
        "counts", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )


def test_replicas_and_bad_arguments_raise_before_anything_starts():
    with pytest.raises(pstore.InvalidArgumentError, match="replicas=2 needs a path"):
        pstore.ray.Cluster(2, replicas=2)
    with pytest.raises(pstore.InvalidArgumentError, match='needs durability "async" or "sync"'):
        pstore.ray.Cluster(2, replicas=2, path="x", durability="none")
    with pytest.raises(pstore.InvalidArgumentError, match="server_resources"):
        pstore.ray.Cluster(2, server_resources={"CPU": 1})
    with pytest.raises(pstore.InvalidArgumentError, match="num_servers"):
        pstore.ray.Cluster(0)
    with pytest.raises(pstore.InvalidArgumentError, match="needs a path"):
        pstore.ray.Cluster(2, durability="sync")
    with pytest.raises(pstore.InvalidArgumentError, match="durability"):
        pstore.ray.Cluster(2, path="x", durability="fast")  # type: ignore[arg-type]
    assert not ray.is_initialized(), "bad arguments must not even connect to Ray"


def test_start_connect_from_a_task_and_shutdown(raycluster, tmp_path):
    cluster = pstore.ray.Cluster(
        2, path=tmp_path / "s", durability="sync", name="basic", server_cpus=0.5
    )
    try:
        st = cluster.status()
        assert st["strategy"] == "STRICT_SPREAD", "2 nodes, 2 servers: one per node"
        assert len({s["node_id"] for s in st["servers"]}) == 2
        assert [s["health"] for s in st["servers"]] == ["SERVING", "SERVING"]
        assert st["generation"] == 0 and "token" not in st
        assert all(a.startswith("127.0.0.1:") for a in cluster.servers)
        with pytest.raises(pstore.ray.ClusterError, match="runs already"):
            pstore.ray.Cluster(2, name="basic")

        @ray.remote(num_cpus=0)
        def work(c: pstore.ray.Cluster) -> list[float]:
            store = pstore.ray.connect(c)
            t = _counter_table(store)
            ids = np.arange(100, dtype=np.int64)
            for _ in range(3):
                t.push(ids, -np.ones((100, 2), np.float32))
            return t.pull(ids)[:, 0].tolist()

        assert ray.get(work.remote(cluster)) == [3.0] * 100
        store = pstore.ray.connect("basic")
        assert store.servers == cluster.servers
        assert len(store.table("counts")) == 100
        # The token came from the controller: without it a server refuses.
        with pytest.raises(pstore.AuthenticationError):
            pstore.connect(cluster.servers, token="wrong", retries=0).tables()
        assert pstore.ray.list_clusters() == ["basic"]
    finally:
        cluster.shutdown()
    assert pstore.ray.list_clusters() == []
    with pytest.raises(pstore.ray.ClusterError, match="no pstore cluster named 'basic'"):
        pstore.ray.connect("basic")
    # Shut down with a flush: every server's store holds its rows on disk.
    rows = 0
    for i in range(2):
        with pstore.Store(tmp_path / "s" / f"server-{i}", durability="none") as s:
            rows += len(s.table("counts"))
    assert rows == 100


def _kill_servers_while_pushing(path: Path, name: str, kills: list[int]) -> None:
    """Push all along while SIGKILLing the servers ``kills`` names, one after the other; each
    comes back on its node and port, and with sync durability holds every acknowledged push."""
    cluster = pstore.ray.Cluster(
        2, path=path, durability="sync", name=name, server_cpus=0.5, check_interval=0.5
    )
    try:
        before = cluster.status()
        store = pstore.ray.connect(cluster, timeout=5.0)
        t = _counter_table(store)
        ids = np.arange(64, dtype=np.int64)
        acked = 0
        failed = 0
        stop = threading.Event()

        def pusher() -> None:
            nonlocal acked, failed
            while not stop.is_set():
                try:
                    t.push(ids, -np.ones((64, 2), np.float32))
                    acked += 1
                except pstore.PstoreError:
                    failed += 1

        th = threading.Thread(target=pusher)
        th.start()
        try:
            _wait(lambda: acked >= 20, 60, "pushes before the first kill")
            now = before
            for k, index in enumerate(kills, start=1):
                victim = now["servers"][index]
                os.kill(victim["pid"], signal.SIGKILL)
                now = _wait(
                    lambda k=k: (s := cluster.status())["generation"] == k and s, 90, "a restart"
                )
                at_restart = acked
                _wait(lambda a=at_restart: acked >= a + 20, 60, "pushes after the restart")
                back = now["servers"][index]
                assert back["address"] == victim["address"], "same port: ids keep their server"
                assert back["node_id"] == victim["node_id"], "same bundle, same node"
                assert back["pid"] != victim["pid"]
                assert back["incarnation"] == victim["incarnation"] + 1
                other = now["servers"][1 - index]
                assert other["incarnation"] == kills[:k].count(1 - index), "the other kept on"
        finally:
            stop.set()
            th.join()
        assert [e["event"] for e in now["events"]].count("server_restarted") == len(kills)
        assert cluster.servers == [s["address"] for s in before["servers"]]
        # sync durability: every acknowledged push is on disk; a push that raised may or may
        # not have been applied (the server may have died after applying it).
        got = t.pull(ids)[:, 0]
        assert (got >= acked).all() and (got <= acked + failed).all(), (acked, failed, got)
    finally:
        cluster.shutdown()


def test_killed_server_comes_back_on_its_port_with_every_acknowledged_push(raycluster, tmp_path):
    _kill_servers_while_pushing(tmp_path / "s", "kill", [0])


@pytest.mark.soak
def test_soak_servers_killed_again_and_again(raycluster, tmp_path):
    _kill_servers_while_pushing(tmp_path / "s", "soak", [0, 1, 0, 0, 1, 1, 0, 1])


@pytest.mark.soak
def test_soak_a_hung_server_fails_its_health_checks_and_is_replaced(raycluster, tmp_path):
    cluster = pstore.ray.Cluster(
        2, path=tmp_path / "s", durability="sync", name="hung", server_cpus=0.5
    )
    try:
        t = _counter_table(cluster.connect())
        ids = np.arange(64, dtype=np.int64)
        for _ in range(5):
            t.push(ids, -np.ones((64, 2), np.float32))
        before = cluster.status()
        os.kill(before["servers"][1]["pid"], signal.SIGSTOP)  # alive to Ray, silent on gRPC
        after = _wait(lambda: (s := cluster.status())["generation"] == 1 and s, 180, "a restart")
        down = [e for e in after["events"] if e["event"] == "server_down"]
        assert [(e["index"], e["reason"]) for e in down] == [
            (1, "the gRPC health service failed 3 checks in a row")
        ]
        assert after["servers"][1]["address"] == before["servers"][1]["address"]
        assert (t.pull(ids) == 5.0).all()
    finally:
        cluster.shutdown()


@ray.remote(num_cpus=0)
class _Worker:
    """Pushes in a loop until told to stop; counts what succeeded and what raised."""

    def __init__(self, name: str, rows: int = 32, retries: int = 0) -> None:
        self.store = pstore.ray.connect(name, retries=retries)
        self.t = _counter_table(self.store)
        self.rows = rows
        self.ok = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        ids = np.arange(self.rows, dtype=np.int64)
        while not self.stop.is_set():
            try:
                self.t.push(ids, -np.ones((self.rows, 2), np.float32))
                self.ok += 1
            except pstore.PstoreError as e:
                self.errors.append(str(e))
        self.stopped.set()

    def count(self) -> int:
        return self.ok

    def servers(self) -> list[str]:
        """The server list this worker's store uses now."""
        return list(self.store.servers)

    def values(self) -> list[float]:
        return self.t.pull(np.arange(self.rows, dtype=np.int64))[:, 0].tolist()

    def finish(self) -> tuple[int, list[str], float]:
        self.stop.set()
        self.stopped.wait()  # the push in flight counted before the rows are read
        return self.ok, self.errors, float(self.t.pull(np.zeros(1, np.int64))[0, 0])


def test_killed_controller_comes_back_with_the_same_membership(raycluster):
    cluster = pstore.ray.Cluster(2, name="ctl", server_cpus=0.5)
    try:
        before = cluster.status()
        w = _Worker.options(max_concurrency=3).remote("ctl")
        w.run.remote()
        _wait(lambda: ray.get(w.count.remote()) >= 10, 60, "the worker's first pushes")
        ctl = ray.get_actor("pstore-cluster:ctl", namespace=pstore.ray.NAMESPACE)
        ray.kill(ctl, no_restart=False)
        after = _wait(
            lambda: (s := cluster.status())["controller_pid"] != before["controller_pid"] and s,
            90,
            "the controller's restart",
        )
        n = ray.get(w.count.remote())
        _wait(lambda: ray.get(w.count.remote()) >= n + 10, 60, "pushes after the restart")
        ok, errors, value = ray.get(w.finish.remote())
        assert errors == [], "the worker noticed the controller's death"
        assert value == ok
        for key in ("generation", "strategy"):
            assert after[key] == before[key]
        for b, a in zip(before["servers"], after["servers"], strict=True):
            assert (a["address"], a["pid"], a["incarnation"]) == (
                b["address"],
                b["pid"],
                b["incarnation"],
            ), "no server was restarted"
        assert after["events"][0]["event"] == "adopted"
        assert pstore.ray.connect("ctl").servers == cluster.servers
    finally:
        cluster.shutdown()


def _rows_per_server(store: pstore.RemoteStore, table: str) -> dict[str, int]:
    return {
        s["server"]: next((x["rows"] for x in s["tables"] if x["name"] == table), 0)
        for s in store.status()
    }


def test_scale_up_and_down_while_a_worker_pushes(raycluster):
    cluster = pstore.ray.Cluster(2, name="scale", server_cpus=0.5, check_interval=0.5)
    try:
        before = cluster.servers
        with pytest.raises(pstore.InvalidArgumentError, match="num_servers must be an int >= 1"):
            cluster.scale(0)
        same = cluster.scale(2)
        assert (same["added"], same["removed"], same["generation"]) == ([], [], 0)
        with pytest.raises(pstore.ray.ClusterError, match=r"Ray has only .* free"):
            cluster.scale(40)  # 38 servers of 0.5 CPU on a Ray cluster of 4 CPUs
        assert cluster.servers == before and cluster.generation == 0, "nothing changed"

        w = _Worker.options(max_concurrency=4).remote("scale", 2000, 10)
        w.run.remote()
        _wait(lambda: ray.get(w.count.remote()) >= 10, 60, "the worker's first pushes")
        ctl = ray.get_actor("pstore-cluster:scale", namespace=pstore.ray.NAMESPACE)
        running = ctl.scale.remote(3, 10.0, 30.0)
        _wait(lambda: cluster.status()["scaling"], 30, "the scale to start")
        with pytest.raises(pstore.ray.ClusterError, match="a scale is running already"):
            cluster.scale(2)  # one at a time: refused, not queued
        up = ray.get(running)
        assert not cluster.status()["scaling"]
        assert up["before"] == before and up["servers"][:2] == before
        assert len(up["added"]) == 1 and up["generation"] == 1
        new = up["added"][0]
        assert up["moves"][0]["rows"] > 0, up
        n = ray.get(w.count.remote())
        _wait(lambda: ray.get(w.count.remote()) >= n + 10, 60, "pushes after the scale up")
        assert ray.get(w.servers.remote()) == up["servers"], "the worker follows the new list"
        store = pstore.ray.connect(cluster)
        assert store.servers == up["servers"]
        assert _rows_per_server(store, "counts")[new] > 0, "the new server holds rows"
        st = cluster.status()
        assert [s["address"] for s in st["servers"]] == up["servers"]
        assert st["servers"][2]["health"] == "SERVING"
        assert [e["event"] for e in st["events"]].count("server_added") == 1
        # A controller restarted after the scale adopts the added server and its placement group.
        ray.kill(ctl, no_restart=False)
        _wait(
            lambda: cluster.status()["controller_pid"] != st["controller_pid"],
            90,
            "the controller's restart",
        )
        assert cluster.servers == up["servers"] and cluster.generation == 1

        down = cluster.scale(2, linger=3.0)
        assert down["removed"] == [new] and down["servers"] == before
        assert down["generation"] == 2
        n = ray.get(w.count.remote())
        _wait(lambda: ray.get(w.count.remote()) >= n + 10, 60, "pushes after the scale down")
        # A worker that never met "moved" from the leaving server may list it still; it owns
        # no slot, so no call on rows goes there.
        assert ray.get(w.servers.remote())[:2] == before
        ok, errors, _ = ray.get(w.finish.remote())
        assert errors == [], "the worker noticed the scale"
        values = ray.get(w.values.remote())
        assert values == [float(ok)] * 2000, "every acknowledged push, each once"
        st = cluster.status()
        assert new not in [s["address"] for s in st["servers"]]
        assert [s["health"] for s in st["servers"]] == ["SERVING", "SERVING"]
        store = pstore.ray.connect("scale")
        assert store.servers == before
        assert sum(_rows_per_server(store, "counts").values()) == 2000
        _wait(
            lambda: "server_stopped" in [e["event"] for e in cluster.status()["events"]],
            30,
            "the removed server's stop after its linger",
        )
        with pytest.raises(ValueError):
            ray.get_actor("pstore-server:scale:2", namespace=pstore.ray.NAMESPACE)
    finally:
        cluster.shutdown()


def test_snapshot_and_restore_onto_another_number_of_servers(raycluster, tmp_path):
    src = pstore.ray.Cluster(2, name="snap", server_cpus=0.5)
    try:
        t = _counter_table(src.connect())
        ids = np.arange(0, 5000, 7, dtype=np.int64)
        for k in range(1, 4):
            t.push(ids, -np.full((len(ids), 2), k, np.float32))
        m = src.snapshot(tmp_path / "snap")
        assert [p["dir"] for p in m["parts"]] == ["server-0", "server-1"]
    finally:
        src.shutdown()
    dst = pstore.ray.Cluster.restore(
        tmp_path / "snap", num_servers=3, name="snap3", server_cpus=0.5
    )
    try:
        st = dst.status()
        assert st["num_servers"] == 3 and st["strategy"] == "SPREAD", "3 servers on 2 nodes"
        store = dst.connect()
        t = store.table("counts")
        assert (t.pull(ids) == 6.0).all()
        per_server = [
            next(x["rows"] for x in s["tables"] if x["name"] == "counts") for s in store.status()
        ]
        assert sum(per_server) == len(ids) and all(n > 0 for n in per_server)
    finally:
        dst.shutdown()


def _pstore(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "pstore", "ray", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_up_status_down(raycluster, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    cfg = tmp_path / "cluster.json"
    cfg.write_text(
        json.dumps(
            {
                "name": "cli",
                "num_servers": 2,
                "path": "data",
                "durability": "sync",
                "token_file": "token",
                "server_cpus": 0.5,
            }
        )
    )
    env = dict(os.environ, RAY_ADDRESS=raycluster.address)
    up = _pstore("up", str(cfg), env=env)
    assert up.returncode == 0, up.stderr
    try:
        assert "cluster 'cli' is up: 2 servers" in up.stdout
        store = pstore.ray.connect("cli")
        assert store.servers == pstore.ray.Cluster.attach("cli").servers
        pstore.connect(store.servers, token="s3cret").create_sparse_table("x", 2)
        st = _pstore("status", "--name", "cli", "--json", env=env)
        assert st.returncode == 0, st.stderr
        got = json.loads(st.stdout)
        assert [s["health"] for s in got["servers"]] == ["SERVING", "SERVING"]
        assert got["path"] == str(tmp_path / "data")
        text = _pstore("status", "--name", "cli", env=env)
        assert text.returncode == 0 and "generation 0" in text.stdout
        sc = _pstore("scale", "--name", "cli", "3", env=env)
        assert sc.returncode == 0, sc.stderr
        assert "scaled from 2 to 3 servers" in sc.stdout and "generation 1" in sc.stdout
        again = _pstore("scale", "--name", "cli", "3", env=env)
        assert again.returncode == 0 and "has 3 servers already" in again.stdout
        bad = _pstore("scale", "--name", "cli", "0", env=env)
        assert bad.returncode == 2 and "num_servers must be an int >= 1" in bad.stderr
        assert len(pstore.ray.connect("cli").servers) == 3
    finally:
        down = _pstore("down", "--name", "cli", env=env)
    assert down.returncode == 0, down.stderr
    gone = _pstore("status", "--name", "cli", env=env)
    assert gone.returncode == 2 and "no pstore cluster named 'cli'" in gone.stderr
    assert (tmp_path / "data" / "server-1" / "data.mdb").exists()


def _example():
    spec = importlib.util.spec_from_file_location(
        "ray_train_deepfm", ROOT / "examples" / "ray_train_deepfm.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    # The module is not importable on Ray's workers: ship train_loop by value.
    ray.cloudpickle.register_pickle_by_value(mod)
    return mod


def _row_freqs(snap: Path, table: str) -> dict[int, int]:
    """id -> the row's push count, over every part of a cluster snapshot."""
    pa_ipc = pytest.importorskip("pyarrow.ipc")
    m = json.loads((snap / "cluster.json").read_text())
    out: dict[int, int] = {}
    for part in m["parts"]:
        pm = json.loads((snap / part["dir"] / "manifest.json").read_text())
        for e in pm["tables"]:
            if e["name"] != table:
                continue
            for f in e["files"]:
                tab = pa_ipc.open_file(str(snap / part["dir"] / f["name"])).read_all()
                out.update(
                    zip(tab.column("id").to_pylist(), tab.column("freq").to_pylist(), strict=True)
                )
    return out


# Ray Train copies Ray Data's context, whose setters warn about Ray's own deprecated fields.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_deepfm_on_ray_train_bsp(raycluster, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("ray.train.torch")
    ex = _example()
    cluster = pstore.ray.Cluster(2, name="train", server_cpus=0.25)
    try:
        config = {"samples": 6000, "epochs": 3, "batch_size": 500}
        m = ex.train(
            cluster, num_workers=2, cpus_per_worker=0.5, storage=str(tmp_path / "runs"), **config
        )
        losses = m["losses"]
        assert len(losses) == 3 and losses[-1] < losses[0] - 0.01, losses
        assert m["steps"] == 3 * 6000 // 2 // 500
        cluster.snapshot(tmp_path / "snap")
        want = ex.pushed_ids(config, world=2)
        for table in ("deepfm_first_order", "deepfm_embedding"):
            assert _row_freqs(tmp_path / "snap", table) == want, table
    finally:
        cluster.shutdown()


@pytest.mark.soak
def test_soak_a_lost_node_marks_its_durable_server_lost(raycluster, tmp_path):
    """Last in the file: it removes a node of the module's Ray cluster."""
    spare = raycluster.add_node(num_cpus=2)
    raycluster.wait_for_nodes()
    cluster = pstore.ray.Cluster(
        2, path=tmp_path / "s", durability="sync", name="nodeloss", server_cpus=0.5
    )
    try:
        st = cluster.status()
        head = raycluster.head_node.node_id
        index, victim = next((i, s) for i, s in enumerate(st["servers"]) if s["node_id"] != head)
        node = next(n for n in raycluster.worker_nodes if n.node_id == victim["node_id"])
        raycluster.remove_node(node)
        after = _wait(
            lambda: (s := cluster.status())["servers"][index].get("lost") and s, 240, "the loss"
        )
        assert after["generation"] == 1
        lost = [e for e in after["events"] if e["event"] == "server_lost"]
        assert [(e["index"], e["node_id"]) for e in lost] == [(index, victim["node_id"])]
        assert after["servers"][1 - index]["health"] == "SERVING"
        with pytest.raises(pstore.ray.ClusterError, match=rf"lost server\(s\) \[{index}\]"):
            pstore.ray.connect(cluster)
    finally:
        cluster.shutdown()
        if spare in raycluster.worker_nodes:
            raycluster.remove_node(spare)
