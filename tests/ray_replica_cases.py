"""Replica groups on Ray (``pstore.ray.Cluster(replicas=2)``): a node holding a primary removed
while a worker pushes with ``ack="all"``, the follower promoted, a replacement follower started
on a live node, the controller actor killed; and too few nodes for the replicas.

The Ray cluster (``ray.cluster_utils.Cluster`` on 127.0.0.1) has a head node that holds no
server (this process is connected to it, so it cannot be removed) and two worker nodes with the
resource ``pstore_server`` that the servers ask for; the test adds a third before it removes
one, so that there is a live node for the replacement. Run by ``test_ray.py`` in a network
namespace with only loopback (see there).
"""

from __future__ import annotations

import os
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

pytestmark = pytest.mark.timeout(400)

SERVER = {"pstore_server": 1.0}
TOKEN = "replica-groups-on-ray"


@pytest.fixture(scope="module")
def raycluster():
    c = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    for _ in range(2):
        c.add_node(num_cpus=2, resources={"pstore_server": 4})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=pstore.ray.NAMESPACE, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _groups(n: int, tmp_path: Path, name: str, resources: dict[str, float]) -> Any:
    """A cluster of ``n`` durable (``sync``) groups of 2 under the test token, on the nodes
    that have ``resources``."""
    return pstore.ray.Cluster(
        n,
        replicas=2,
        path=tmp_path / "s",
        durability="sync",
        token=TOKEN,
        name=name,
        server_cpus=0.5,
        server_resources=resources,
        check_interval=0.5,
    )


def _wait(cond, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        last = got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} ({last!r})")


def test_replicas_need_a_path_and_a_node_for_every_member(raycluster, tmp_path):
    with pytest.raises(pstore.InvalidArgumentError, match="replicas=2 needs a path"):
        pstore.ray.Cluster(2, replicas=2)
    with pytest.raises(pstore.ray.ClusterError) as e:
        pstore.ray.Cluster(
            1,
            replicas=3,
            path=tmp_path / "s",
            name="few",
            server_cpus=0.5,
            server_resources=SERVER,
        )
    msg = str(e.value)
    assert "replicas=3" in msg and "only 2 of the 3 live nodes can hold a server" in msg, msg
    assert pstore.ray.list_clusters() == []


def _group_of_node(st: dict[str, Any], node_id: str) -> list[int]:
    return [
        g["index"]
        for g in st["groups"]
        if any(m["address"] == g["primary"] and m["node_id"] == node_id for m in g["members"])
    ]


def _whole(st: dict[str, Any]) -> bool:
    """Every group has its primary and a live follower caught up once."""
    return all(
        g["state"] == "ok"
        and not g["pending"]
        and len(g["members"]) == 2
        and g["live_followers"]
        and all(m["role"] in ("primary", "follower") for m in g["members"])
        and all(m.get("lag_seconds") is not None for m in g["members"] if m["role"] == "follower")
        for g in st["groups"]
    )


def test_a_lost_primary_node_fails_over_gets_a_replacement_and_the_controller_restarts(
    raycluster, tmp_path
):
    cluster = _groups(2, tmp_path, "rep", SERVER)
    spare = None
    pusher: threading.Thread | None = None
    stop = threading.Event()
    try:
        st = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 60, "the groups whole")
        assert st["replicas"] == 2 and st["strategy"] == "STRICT_SPREAD"
        for g in st["groups"]:
            assert len({m["node_id"] for m in g["members"]}) == 2, "a group shares no node"
            assert g["epoch"] >= 1
        assert cluster.groups == [
            [g["primary"]] + [m["address"] for m in g["members"] if m["address"] != g["primary"]]
            for g in st["groups"]
        ]
        spare = raycluster.add_node(num_cpus=2, resources={"pstore_server": 4})
        raycluster.wait_for_nodes()

        store = pstore.ray.connect(cluster, ack="all", timeout=10.0)
        t = store.create_sparse_table(
            "counts", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        ids = np.arange(64, dtype=np.int64)
        acked = 0
        failed = 0
        first_after: list[float] = []

        def push() -> None:
            nonlocal acked, failed
            while not stop.is_set():
                try:
                    began = time.monotonic()
                    t.push(ids, np.ones((64, 2), np.float32))  # SGD, lr 1: each row -1 a push
                    acked += 1
                    if removed_at and began > removed_at[0] and not first_after:
                        first_after.append(time.monotonic())
                except pstore.PstoreError:
                    failed += 1

        removed_at: list[float] = []
        pusher = threading.Thread(target=push)
        pusher.start()
        _wait(lambda: acked >= 20, 60, "pushes before the node is removed")

        head = raycluster.head_node.node_id
        victim = next(
            m
            for m in st["groups"][0]["members"]
            if m["address"] == st["groups"][0]["primary"] and m["node_id"] != head
        )
        lost_groups = _group_of_node(st, victim["node_id"])  # their primary was there
        touched = [  # any member was there: each gets a replacement
            g["index"]
            for g in st["groups"]
            if any(m["node_id"] == victim["node_id"] for m in g["members"])
        ]
        node = next(n for n in raycluster.worker_nodes if n.node_id == victim["node_id"])
        at_removal = acked
        raycluster.remove_node(node)  # returns once the node's processes are gone
        removed_at.append(time.monotonic())

        def failed_over() -> dict[str, Any] | None:
            s = cluster.status()
            ok = all(
                s["groups"][i]["primary"] != st["groups"][i]["primary"]
                and s["groups"][i]["epoch"] > st["groups"][i]["epoch"]
                for i in lost_groups
            )
            return s if ok else None

        after = _wait(failed_over, 60, "the promotions")
        _wait(lambda: acked >= at_removal + 20, 60, "pushes after the failover")
        assert first_after, "a push was accepted after the removal"
        print(f"remove_node -> first accepted push: {first_after[0] - removed_at[0]:.2f} s")
        promoted = [e for e in after["events"] if e["event"] == "promoted"]
        assert sorted(e["group"] for e in promoted) == sorted(lost_groups)

        # Ray reports the lost member's actor dead (the controller need not wait for it: a
        # primary that does not answer for dead_after is failed over too).
        def told() -> bool:
            evs = cluster.status()["events"]
            return victim["address"] in {
                e.get("address") for e in evs if e["event"] == "member_down"
            }

        try:
            _wait(told, 60, "Ray's word that the member is dead")
        except AssertionError:
            raise AssertionError(f"no member_down event: {cluster.status()['events']}") from None

        # Every group that lost a member gets a new follower on a live node that holds no
        # other member of the group, and it catches up.
        whole = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 120, "replacements")
        live_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for i in touched:
            g = whole["groups"][i]
            nodes = [m["node_id"] for m in g["members"]]
            assert victim["node_id"] not in nodes and len(set(nodes)) == 2
            assert set(nodes) <= live_nodes
            new = next(m for m in g["members"] if m["address"] != after["groups"][i]["primary"])
            assert new["role"] == "follower" and new["node_id"] == spare.node_id
            assert new["address"] in g["live_followers"]
        events = [e["event"] for e in whole["events"]]
        assert events.count("replaced") == len(touched)
        assert events.count("member_started") == len(touched)
        # One more for the promotions seen in a round, one for each replacement.
        assert whole["generation"] >= st["generation"] + 1 + len(touched)
        assert cluster.groups == [
            [g["primary"]] + [m["address"] for m in g["members"] if m["address"] != g["primary"]]
            for g in whole["groups"]
        ]

        # The controller actor dies and comes back: the same view, nothing restarted, and the
        # worker goes on without noticing.
        ctl = ray.get_actor("pstore-cluster:rep", namespace=pstore.ray.NAMESPACE)
        errors_before = failed
        ray.kill(ctl, no_restart=False)
        back = _wait(
            lambda: (
                (s := cluster.status())["controller_pid"] != whole["controller_pid"]
                and s["rounds"] >= 3
                and s
            ),
            90,
            "the controller's restart",
        )
        n = acked
        _wait(lambda: acked >= n + 20, 60, "pushes after the controller's restart")
        assert failed == errors_before, "the worker noticed the controller's death"
        assert back["generation"] == whole["generation"]
        for b, a in zip(whole["groups"], back["groups"], strict=True):
            assert (a["primary"], a["epoch"]) == (b["primary"], b["epoch"])
            assert [(m["address"], m["pid"]) for m in a["members"]] == [
                (m["address"], m["pid"]) for m in b["members"]
            ]
        assert back["events"][0]["event"] == "adopted"
        text = subprocess.run(
            [sys.executable, "-P", "-m", "pstore", "ray", "status", "--name", "rep"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, RAY_ADDRESS=raycluster.address),
        )
        assert text.returncode == 0, text.stderr
        assert "2 replica groups of 2" in text.stdout, text.stdout
        for g in back["groups"]:
            assert f"primary {g['primary']}" in text.stdout
        assert not [e for e in back["events"] if e["event"] in ("promoted", "replaced")]

        stop.set()
        pusher.join(120)
        # ack="all" and sync durability: every acknowledged push is in the rows; a push that
        # raised may or may not have applied.
        got = -t.pull(ids)[:, 0]
        assert (got >= acked).all() and (got <= acked + failed).all(), (acked, failed, got)
        assert acked > at_removal + 40
        # The replacements hold the rows of their group (absent ids read as 0 there).
        for i in touched:
            g = back["groups"][i]
            new = next(m["address"] for m in g["members"] if m["address"] != g["primary"])
            follower = pstore.connect([new], token=TOKEN, retries=0)

            def caught_up(follower=follower) -> bool:
                rows = -follower.sparse_table("counts").pull(ids)[:, 0]
                mine = rows != 0
                return bool(mine.any()) and bool((rows[mine] == got[mine]).all())

            _wait(caught_up, 30, f"group {i}'s replacement holding its rows")

        # A cluster snapshot is written by each group's primary; restored onto one group of 2.
        manifest = cluster.snapshot(tmp_path / "snap")
        assert len(manifest["parts"]) == 2
    finally:
        stop.set()
        if pusher is not None:
            pusher.join(120)
        cluster.shutdown()
    restored = pstore.ray.Cluster.restore(
        tmp_path / "snap",
        num_servers=1,
        replicas=2,
        path=tmp_path / "r",
        durability="sync",
        name="rep-restored",
        server_cpus=0.5,
        server_resources=SERVER,
    )
    try:
        assert (-restored.connect().table("counts").pull(ids)[:, 0] == got).all()
    finally:
        restored.shutdown()
        if spare is not None and spare in raycluster.worker_nodes:
            raycluster.remove_node(spare)


@pytest.mark.soak
def test_soak_primaries_nodes_removed_round_after_round(raycluster, tmp_path):
    """Four rounds: a spare node added, the node of group 0's primary removed while a worker
    pushes with ack="all", the group failed over and refilled. The worker connects again after
    each replacement (a client keeps the member list it connected with: docs/RAY.md)."""
    cluster = _groups(2, tmp_path, "soak", SERVER)
    stop = threading.Event()
    counts = {"acked": 0, "failed": 0}
    table: list[pstore.SparseTable] = []
    ids = np.arange(64, dtype=np.int64)

    def push() -> None:
        while not stop.is_set():
            try:
                table[-1].push(ids, np.ones((64, 2), np.float32))
                counts["acked"] += 1
            except pstore.PstoreError:
                counts["failed"] += 1

    pusher = threading.Thread(target=push)
    try:
        st = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 60, "the groups whole")
        store = pstore.ray.connect(cluster, ack="all", timeout=10.0)
        table.append(
            store.create_sparse_table(
                "counts", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
            )
        )
        pusher.start()
        for k in range(4):
            raycluster.add_node(num_cpus=2, resources={"pstore_server": 4})
            raycluster.wait_for_nodes()
            n = counts["acked"]
            _wait(lambda n=n: counts["acked"] >= n + 10, 60, f"round {k}: pushes")
            g0 = st["groups"][0]
            victim = next(m for m in g0["members"] if m["address"] == g0["primary"])
            node = next(x for x in raycluster.worker_nodes if x.node_id == victim["node_id"])
            raycluster.remove_node(node)
            st = _wait(
                lambda g0=g0: (
                    (s := cluster.status())
                    and s["groups"][0]["epoch"] > g0["epoch"]
                    and _whole(s)
                    and s
                ),
                120,
                f"round {k}: the failover and the replacement",
            )
            table.append(pstore.ray.connect(cluster, ack="all", timeout=10.0).table("counts"))
            n = counts["acked"]
            _wait(lambda n=n: counts["acked"] >= n + 10, 60, f"round {k}: pushes after")
        stop.set()
        pusher.join(120)
        got = -table[-1].pull(ids)[:, 0]
        acked, failed = counts["acked"], counts["failed"]
        assert (got >= acked).all() and (got <= acked + failed).all(), (acked, failed, got)
        promoted = [e for e in st["events"] if e["event"] == "promoted"]
        assert len(promoted) >= 4
    finally:
        stop.set()
        if pusher.is_alive():
            pusher.join(120)
        cluster.shutdown()


# --------------------------------------------------------------------------------------------
# Scaling replica groups, and two failovers in a row (decision 0113)

TWO = {"pstore_server": 2.0}  # two servers per worker node (each node declares 4)


@ray.remote(num_cpus=0)
class _Pusher:
    """A worker on the head node (never removed): connects once, then pushes ids 0..63 with
    gradient 1 (SGD from zeros, lr 1: each row -1 per push) with ack="all" until stopped;
    counts what was acknowledged and what raised."""

    def __init__(self, name: str, table: str) -> None:
        self.store = pstore.ray.connect(name, ack="all", timeout=10.0, failover_timeout=15.0)
        self.t = self.store.create_sparse_table(
            table, 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        self.acked = 0
        self.errors: list[str] = []
        self.stop_ = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ids = np.arange(64, dtype=np.int64)
        while not self.stop_.is_set():
            with self.lock:
                try:
                    self.t.push(ids, np.ones((64, 2), np.float32))
                    self.acked += 1
                except pstore.PstoreError as e:
                    self.errors.append(str(e).splitlines()[0])
            time.sleep(0.001)  # lets exact() take the lock

    def exact(self) -> tuple[int, list[float]]:
        """Between two pushes: the pushes acknowledged and each row's count."""
        with self.lock:
            rows = -self.t.pull(np.arange(64, dtype=np.int64))[:, 0]
            return self.acked, rows.tolist()

    def counts(self) -> tuple[int, list[str]]:
        return self.acked, list(self.errors)

    def stop(self) -> tuple[int, list[str], list[float]]:
        self.stop_.set()
        self.thread.join(120)
        rows = -self.t.pull(np.arange(64, dtype=np.int64))[:, 0]
        return self.acked, list(self.errors), rows.tolist()


def _pusher(name: str, table: str = "counts") -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = ray.get_runtime_context().get_node_id()  # the driver's node: the head
    return _Pusher.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)
    ).remote(name, table)


def _more_pushes(p: Any, more: int, timeout: float, what: str) -> int:
    n = ray.get(p.counts.remote())[0]
    _wait(lambda: ray.get(p.counts.remote())[0] >= n + more, timeout, what)
    acked, errors = ray.get(p.counts.remote())
    assert not errors, errors
    return int(acked)


def _server_nodes(raycluster: Any, k: int) -> None:
    """Add worker nodes until ``k`` live ones declare pstore_server."""
    live = [
        n for n in ray.nodes() if n["Alive"] and n.get("Resources", {}).get("pstore_server", 0) > 0
    ]
    for _ in range(k - len(live)):
        raycluster.add_node(num_cpus=2, resources={"pstore_server": 4})
    raycluster.wait_for_nodes()


def _node_of(raycluster: Any, node_id: str) -> Any:
    return next(n for n in raycluster.worker_nodes if n.node_id == node_id)


def _primary_member(g: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in g["members"] if m["address"] == g["primary"])


def _holds_its_rows(follower: str, rows: np.ndarray) -> bool:
    """The follower's rows (absent ids read as 0) equal ``rows`` where it holds any."""
    try:
        t = pstore.connect([follower], token=TOKEN, retries=0).sparse_table("counts")
        mine = -t.pull(np.arange(64, dtype=np.int64))[:, 0]
    except pstore.PstoreError:
        return False
    held = mine != 0
    return bool(held.any()) and bool((mine[held] == rows[held]).all())


def test_groups_scale_up_and_down_while_a_worker_pushes_and_an_added_group_fails_over(
    raycluster, tmp_path
):
    _server_nodes(raycluster, 2)
    cluster = _groups(1, tmp_path, "grow", TWO)
    pusher = None
    try:
        st = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 60, "the group whole")
        pusher = _pusher("grow")
        _more_pushes(pusher, 10, 60, "pushes")

        # Refusals change nothing: N < 1, and more groups than the free nodes hold (each of the
        # two nodes has room for one more server: one group of 2, not two).
        with pytest.raises(pstore.InvalidArgumentError, match="num_servers must be an int >= 1"):
            cluster.scale(0)
        with pytest.raises(pstore.ray.ClusterError, match="room now for 2 of the 4 servers"):
            cluster.scale(3)
        assert cluster.generation == st["generation"] and len(cluster.groups) == 1
        assert ray.util.placement_group_table()  # nothing left behind by the refusal:
        pgs = [
            p["name"]
            for p in ray.util.placement_group_table().values()
            if p["name"].startswith("pstore-servers:grow") and p["state"] != "REMOVED"
        ]
        assert pgs == ["pstore-servers:grow:0"], pgs

        # A node joins, then the cluster grows to two groups while the worker pushes; a
        # second scale meanwhile is refused.
        new_node = raycluster.add_node(num_cpus=2, resources={"pstore_server": 4})
        raycluster.wait_for_nodes()
        result: list[Any] = []
        scaler = threading.Thread(target=lambda: result.append(cluster.scale(2, linger=2.0)))
        scaler.start()
        _wait(lambda: cluster.status()["scaling"], 30, "the scale to start")
        with pytest.raises(pstore.ray.ClusterError, match="a scale is running already"):
            cluster.scale(3)
        scaler.join(120)
        (up,) = result
        assert len(up["groups"]) == 2 and up["groups"][0] == up["groups_before"][0]
        assert up["generation"] == st["generation"] + 1 and up["moves"][0]["rows"] > 0
        print(f"scale 1 -> 2 groups: {up['seconds']:.2f} s")
        _more_pushes(pusher, 20, 60, "pushes after the scale up")
        grown = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 60, "2 groups whole")
        g1 = grown["groups"][1]
        nodes1 = [m["node_id"] for m in g1["members"]]
        assert len(set(nodes1)) == 2, "the new group's members share no node"
        print(f"new group on the new node: {new_node.node_id in nodes1}")
        assert [e["event"] for e in grown["events"]].count("group_added") >= 1
        follower1 = next(m["address"] for m in g1["members"] if m["address"] != g1["primary"])

        # The controller actor restarts: it sees both groups, the same generation.
        ctl = ray.get_actor("pstore-cluster:grow", namespace=pstore.ray.NAMESPACE)
        ray.kill(ctl, no_restart=False)
        back = _wait(
            lambda: (
                (s := cluster.status())["controller_pid"] != grown["controller_pid"]
                and s["rounds"] >= 3
                and s
            ),
            90,
            "the controller's restart",
        )
        assert back["num_servers"] == 2 and back["generation"] == grown["generation"]
        assert [g["primary"] for g in back["groups"]] == [g["primary"] for g in grown["groups"]]

        # The added group's primary loses its node: the restarted controller fails it over and
        # refills it on a live node; the worker goes on.
        victim = _primary_member(back["groups"][1])
        touched = [
            g["index"]
            for g in back["groups"]
            if any(m["node_id"] == victim["node_id"] for m in g["members"])
        ]
        raycluster.remove_node(_node_of(raycluster, victim["node_id"]))
        _wait(
            lambda: cluster.status()["groups"][1]["primary"] == follower1,
            60,
            "the added group's failover",
        )
        _more_pushes(pusher, 20, 60, "pushes after the failover")
        refilled = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 120, "refilled")
        for i in touched:
            assert victim["node_id"] not in {m["node_id"] for m in refilled["groups"][i]["members"]}

        # Back to one group while the worker pushes: the removed group's members answer
        # "moved" for the linger, then stop; their placement group goes.
        down = cluster.scale(1, linger=2.0)
        assert len(down["groups"]) == 1 and down["removed"] == [refilled["groups"][1]["primary"]]
        _more_pushes(pusher, 20, 60, "pushes after the scale down")
        _wait(
            lambda: any(e["event"] == "group_stopped" for e in cluster.status()["events"]),
            60,
            "the removed group's members stopped",
        )
        live_pgs = [
            p["name"]
            for p in ray.util.placement_group_table().values()
            if p["name"].startswith("pstore-servers:grow") and p["state"] != "REMOVED"
        ]
        assert live_pgs == ["pstore-servers:grow:0"], live_pgs
        acked, errors, rows = ray.get(pusher.stop.remote())
        assert not errors, errors
        got = np.array(rows)
        assert (got == acked).all(), (acked, got)  # exact: nothing lost, nothing applied twice
        g0 = cluster.status()["groups"][0]
        f0 = next(m["address"] for m in g0["members"] if m["address"] != g0["primary"])
        _wait(lambda: _holds_its_rows(f0, got), 30, "the remaining group's follower's rows")
    finally:
        if pusher is not None:
            ray.kill(pusher)
        cluster.shutdown()


def test_a_worker_rides_over_two_failovers_in_a_row(raycluster, tmp_path):
    """The node of group 0's primary goes, the follower is promoted and a replacement catches
    up on a spare node; then the promoted primary's node goes too: the replacement (which
    the worker never heard of when it connected) is promoted and the worker pushes on."""
    _server_nodes(raycluster, 4)
    cluster = _groups(2, tmp_path, "twice", TWO)
    pusher = None
    try:
        st = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 60, "the groups whole")
        pusher = _pusher("twice")
        _more_pushes(pusher, 10, 60, "pushes")
        g0 = st["groups"][0]
        first = _primary_member(g0)
        raycluster.remove_node(_node_of(raycluster, first["node_id"]))
        second = next(m for m in g0["members"] if m["address"] != first["address"])
        s1 = _wait(
            lambda: (s := cluster.status())["groups"][0]["primary"] == second["address"] and s,
            60,
            "the first failover",
        )
        _more_pushes(pusher, 10, 60, "pushes after the first failover")
        whole = _wait(lambda: (s := cluster.status()) and _whole(s) and s, 120, "the refill")
        new = next(m for m in whole["groups"][0]["members"] if m["address"] != second["address"])
        assert new["address"] not in [m["address"] for m in g0["members"]]
        assert s1["groups"][0]["epoch"] > g0["epoch"]
        # Caught up: pushes acknowledged with ack="all" went through it.
        _more_pushes(pusher, 10, 60, "pushes with the replacement live")
        acked, rows = ray.get(pusher.exact.remote())
        assert (np.array(rows) == acked).all(), ("after the first failover", acked, rows)
        raycluster.remove_node(_node_of(raycluster, second["node_id"]))
        _wait(
            lambda: cluster.status()["groups"][0]["primary"] == new["address"],
            60,
            "the second failover",
        )
        _more_pushes(pusher, 20, 90, "pushes after the second failover")
        acked, errors, rows = ray.get(pusher.stop.remote())
        assert not errors, errors
        assert (np.array(rows) == acked).all(), (acked, rows)
    finally:
        if pusher is not None:
            ray.kill(pusher)
        cluster.shutdown()


@ray.remote
class _Load:
    """Holds resources on a node (another user's work)."""

    def ready(self) -> bool:
        return True


def test_an_added_single_server_goes_to_a_node_without_one(raycluster, tmp_path):
    """replicas=1: an added server prefers the node with room that runs the fewest of the
    cluster's servers (a soft target), even when other work makes that node the busier one,
    where Ray's own choice for one bundle is the least used node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _server_nodes(raycluster, 2)
    cluster = pstore.ray.Cluster(
        1, name="spread", token=TOKEN, server_cpus=0.5, server_resources=TWO, check_interval=0.5
    )
    loads: list[Any] = []
    try:
        first = cluster.status()["servers"][0]["node_id"]
        others = [
            n["NodeID"]
            for n in ray.nodes()
            if n["Alive"]
            and n["NodeID"] != first
            and n.get("Resources", {}).get("pstore_server", 0) > 0
        ]
        # Other work fills most of every other node: room for one server is left on each.
        for node in others:
            assert pstore.ray._free_per_node({"CPU": 0.5, **TWO})[node] == 2
            loads.append(
                _Load.options(
                    num_cpus=1.5,
                    resources=TWO,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote()
            )
        ray.get([x.ready.remote() for x in loads])
        _wait(
            lambda: all(
                pstore.ray._free_per_node({"CPU": 0.5, **TWO})[node] == 1 for node in others
            ),
            30,
            "the load",
        )
        up = cluster.scale(2, linger=0.0)
        assert len(up["added"]) == 1
        nodes = [s["node_id"] for s in cluster.status()["servers"]]
        assert nodes[0] == first and nodes[1] in others, (nodes, first, others)
    finally:
        for x in loads:
            ray.kill(x)
        cluster.shutdown()
