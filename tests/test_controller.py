"""The controller of replica groups (pstore.controller, `pstore controller`): real `pstore serve`
processes on loopback, a primary killed with SIGKILL while a worker pushes with ack="all", the
controller promoting, restarted, replacing a member; servers restarted with their first
arguments, as a StatefulSet restarts a pod."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, free_port
from test_failover import DIM, _group, _group_with_a_joined_server, _sgd_table
from test_replication import _status, _wait_caught_up

import pstore
from pstore.controller import Controller, Engine


def _wait(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.1)


def _rep(address: str) -> dict[str, Any] | None:
    try:
        return _status(pstore.connect([address], timeout=2.0, retries=0))
    except pstore.ServerError:
        return None


class _Pusher:
    """A worker in a thread: push k writes ids 4k..4k+3 once with gradient 1 (SGD from zeros:
    each row ends at -1 per acknowledged push). Any error ends it and is kept."""

    def __init__(self, table: pstore.SparseTable) -> None:
        self.table = table
        self.n = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                ids = np.arange(4 * self.n, 4 * self.n + 4, dtype=np.int64)
                self.table.push(ids, np.ones((4, DIM), np.float32))
                self.n += 1
        except BaseException as e:
            self.error = e

    def wait_pushes(self, more: int) -> None:
        target = self.n + more
        _wait(f"{more} more pushes", lambda: self.n >= target or self.error is not None)
        assert self.error is None, self.error

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(120)
        assert self.error is None, self.error
        return self.n

    def check(self) -> None:
        n = self.n
        rows = self.table.pull(np.arange(4 * n + 8, dtype=np.int64)).reshape(-1, 4, DIM)
        for k in range(n):
            assert np.all(rows[k] == -1.0), f"push {k} of {n}: {rows[k]} (0: lost, -2: twice)"
        assert np.all(rows[n:] == 0.0)


def test_the_controller_refuses_bad_settings(tmp_path: Path) -> None:
    for kwargs, what in [
        ({"check_interval": 0}, "check_interval"),
        ({"dead_after": -1.0}, "dead_after"),
        ({"timeout": True}, "timeout"),
        ({"engine": object()}, "Engine"),
    ]:
        with pytest.raises(pstore.InvalidArgumentError, match=what):
            Controller([["127.0.0.1:1", "127.0.0.1:2"]], **kwargs)
    with pytest.raises(pstore.InvalidArgumentError, match="twice"):
        Controller([["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:2"])
    with pytest.raises(pstore.InvalidArgumentError, match="host:port"):
        Controller([["127.0.0.1"]])
    out = subprocess.run(
        [sys.executable, "-m", "pstore", "controller", "--cluster", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert out.returncode != 0 and "none.json" in out.stderr, out


class _Controller:
    """`pstore controller` as a process, with its status on an HTTP port."""

    def __init__(self, cluster: Path, publish: Path, log: Path) -> None:
        self.port = free_port()
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pstore",
                "controller",
                "--cluster",
                str(cluster),
                "--publish",
                str(publish),
                "--status-port",
                str(self.port),
                "--check-interval",
                "0.2",
                "--dead-after",
                "1.0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env=child_env(),
        )

    def status(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
                s: dict[str, Any] = json.load(r)
                return s
        except OSError:
            assert self.proc.poll() is None, "the controller exited"
            return None

    def wait(self, what: str, check: Any, timeout: float = 60.0) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            s = self.status()
            return s if s is not None and check(s) else None

        s: dict[str, Any] = _wait(what, ok, timeout)
        return s

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.log.close()


def _events(s: dict[str, Any], what: str) -> list[dict[str, Any]]:
    return [e for e in s["events"] if e["event"] == what]


def test_pstore_controller_fails_a_group_over_and_a_restarted_controller_changes_nothing(
    tmp_path: Path,
) -> None:
    a, b = _group(tmp_path, "g0")
    c, d = _group(tmp_path, "g1")
    procs = [a, b, c, d]
    ctl: _Controller | None = None
    pusher: _Pusher | None = None
    try:
        groups = [[a.address, b.address], [c.address, d.address]]
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps({"servers": groups}))
        published = tmp_path / "view.json"
        ctl = _Controller(cluster, published, tmp_path / "controller.log")
        s = ctl.wait("the first view", lambda s: all(g["state"] == "ok" for g in s["groups"]))
        assert [g["primary"] for g in s["groups"]] == [a.address, c.address]
        assert [g["epoch"] for g in s["groups"]] == [1, 1]

        store = pstore.connect(str(cluster), ack="all", timeout=10.0)
        t = _sgd_table(store)
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        pusher = _Pusher(t)
        pusher.wait_pushes(20)
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        s = ctl.wait("the promotion", lambda s: s["groups"][0]["primary"] == b.address)
        (promoted,) = _events(s, "promoted")
        assert promoted["server"] == b.address and promoted["old_primary"] == a.address
        assert promoted["group"] == 0 and promoted["epoch"] == 2
        assert s["groups"][1]["primary"] == c.address and s["groups"][1]["epoch"] == 1
        pusher.wait_pushes(20)
        assert json.loads(published.read_text())["servers"] == [[b.address, a.address], groups[1]]

        # The controller dies and comes back: it rebuilds the same view from the servers and
        # takes no decision; the worker goes on meanwhile.
        ctl.kill()
        pusher.wait_pushes(10)
        ctl = _Controller(cluster, published, tmp_path / "controller.log")
        s = ctl.wait("the rebuilt view", lambda s: s["rounds"] >= 3)
        assert [(g["primary"], g["epoch"]) for g in s["groups"]] == [
            (b.address, 2),
            (c.address, 1),
        ]
        assert s["groups"][0]["state"] == "degraded"
        assert not _events(s, "promoted") and not _events(s, "conflict")
        pusher.wait_pushes(10)

        # The old primary comes back on its disk with its first arguments (a supervisor's
        # restart): it rejoins as b's follower, and the controller sees the group whole.
        a2 = ServerProcess("--path", str(tmp_path / "g0-a"), "--durability", "sync", port=a.port)
        procs.append(a2)

        def a_follows(s: dict[str, Any]) -> bool:
            m = {x["address"]: x for x in s["groups"][0]["members"]}
            return s["groups"][0]["state"] == "ok" and m[a.address]["role"] == "follower"

        s = ctl.wait("a back as a follower", a_follows)
        m = {x["address"]: x for x in s["groups"][0]["members"]}
        assert m[a.address]["primary"] == b.address and s["groups"][0]["primary"] == b.address
        pusher.wait_pushes(10)
        n = pusher.stop()
        pusher.check()
        assert n > 50
        assert _status(pstore.connect([b.address]))["epoch"] == 2
    finally:
        if pusher is not None:
            pusher._stop.set()
            pusher._thread.join(120)
        if ctl is not None and ctl.proc.poll() is None:
            ctl.kill()
        for p in procs:
            p.stop()


class _SpawningEngine(Engine):
    """An engine that starts a replacement follower as a new `pstore serve` process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[ServerProcess] = []
        self.asked: list[tuple[int, str, str]] = []

    def replace(self, group: int, lost: str, primary: str) -> str | None:
        self.asked.append((group, lost, primary))
        p = ServerProcess(
            "--path",
            str(self.root / f"replacement-{len(self.started)}"),
            "--durability",
            "sync",
            "--follow",
            primary,
        )
        self.started.append(p)
        p.wait_ready()
        return p.address


def test_a_replacement_follower_is_started_and_a_split_group_is_left_alone(
    tmp_path: Path,
) -> None:
    a, b = _group(tmp_path, "g0")
    # Two servers that both start as primaries of epoch 1: no epoch says which one holds the
    # writes, so the controller touches neither.
    x = ServerProcess("--path", str(tmp_path / "x"))
    y = ServerProcess("--path", str(tmp_path / "y"))
    engine = _SpawningEngine(tmp_path)
    views: list[dict[str, Any]] = []
    ctl = Controller(
        [[a.address, b.address], [x.address, y.address]],
        engine=engine,
        check_interval=0.2,
        dead_after=1.0,
        on_view=views.append,
    )
    try:
        x.wait_ready()
        y.wait_ready()
        t = _sgd_table(pstore.connect([[a.address, b.address]], ack="all"))  # type: ignore[list-item]
        ids = np.arange(64, dtype=np.int64)
        t.push(ids, np.ones((64, DIM), np.float32))
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        ctl.start()
        assert ctl.status()["groups"][1]["state"] == "conflict"
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        _wait("the replacement", lambda: any(e["event"] == "replaced" for e in ctl.events))
        assert engine.asked == [(0, a.address, b.address)]
        (new,) = engine.started
        _wait_caught_up(pstore.connect([b.address]), pstore.connect([new.address], retries=0))
        t.push(ids, np.ones((64, DIM), np.float32))
        s = _wait(
            "the group whole again",
            lambda: (s := ctl.status())["groups"][0]["state"] == "ok" and s,
        )
        g0 = s["groups"][0]
        assert g0["primary"] == b.address and g0["epoch"] == 2
        assert [m["address"] for m in g0["members"]] == [new.address, b.address]
        assert views[-1]["servers"][0] == [b.address, new.address]
        assert views[-1]["epochs"][0] == 2
        assert s["groups"][1]["state"] == "conflict"
        assert [e["group"] for e in ctl.events if e["event"] == "promoted"] == [0]
        for p in (x, y):
            assert _rep(p.address)["role"] == "primary"  # type: ignore[index]
        assert np.all(pstore.connect([new.address]).sparse_table("t").pull(ids) == -2.0)
    finally:
        ctl.stop()
        for p in (*engine.started, a, b, x, y):
            p.stop()


def test_groups_added_and_removed_are_watched_and_failed_over(tmp_path: Path) -> None:
    """The list of groups grows and shrinks (a scale): an added group is failed over like the
    first ones; a removed one is no longer watched; bad changes are refused and change
    nothing."""
    a, b = _group(tmp_path, "g0")
    c, d = _group(tmp_path, "g1")
    ctl = Controller([[a.address, b.address]], check_interval=0.2, dead_after=1.0)
    try:
        t = _sgd_table(pstore.connect([[c.address, d.address]], ack="all"))  # type: ignore[list-item]
        ids = np.arange(16, dtype=np.int64)
        t.push(ids, np.ones((16, DIM), np.float32))
        _wait_caught_up(pstore.connect([c.address]), pstore.connect([d.address], retries=0))
        ctl.start()
        with pytest.raises(pstore.InvalidArgumentError, match="member of a group already"):
            ctl.add_group([c.address, b.address])
        with pytest.raises(pstore.InvalidArgumentError, match="last group"):
            ctl.remove_group(0)
        assert ctl.add_group([c.address, d.address]) == 1
        with pytest.raises(pstore.InvalidArgumentError, match="no group 2"):
            ctl.remove_group(2)
        _wait("group 1 seen", lambda: ctl.status()["groups"][1]["primary"] == c.address)
        c.send(signal.SIGKILL)
        c.proc.wait(30)
        s = _wait(
            "group 1 failed over",
            lambda: (s := ctl.status())["groups"][1]["primary"] == d.address and s,
        )
        assert s["groups"][1]["epoch"] == 2
        assert [e["group"] for e in ctl.events if e["event"] == "promoted"] == [1]
        assert ctl.remove_group(0) == [a.address, b.address]
        g = ctl.status()["groups"]
        assert [x["index"] for x in g] == [0] and g[0]["primary"] == d.address
        # Group 0 is no longer watched: its primary's death promotes nothing.
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        rounds = ctl.status()["rounds"]
        _wait("more rounds", lambda: ctl.status()["rounds"] >= rounds + 10)
        assert [e["group"] for e in ctl.events if e["event"] == "promoted"] == [1]
        assert np.all(t.pull(ids) == -1.0)
    finally:
        ctl.stop()
        for p in (a, b, c, d):
            p.stop()


def _member(cluster: Path, name: str, port: int) -> ServerProcess:
    """`pstore serve --cluster FILE --member NAME`, its store beside the cluster file: one
    command line for every member, as a StatefulSet's pods have."""
    return ServerProcess(
        "--cluster",
        str(cluster),
        "--member",
        name,
        "--path",
        str(cluster.parent / name.replace(":", "_")),
        "--durability",
        "sync",
        port=port,
        log=cluster.parent / f"{name.replace(':', '_')}.log",
    )


def test_a_promoted_member_restarted_with_its_first_arguments_stays_primary(
    tmp_path: Path,
) -> None:
    """A StatefulSet restarts a pod with the arguments it first had: the follower b, promoted
    after a died, restarts with `--member b` (which follows a). It must stay the primary of its
    epoch (a follows it), not follow a: two followers and no primary would stop the group."""
    pa, pb = free_port(), free_port()
    A, B = f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"servers": [[A, B]]}))

    def member(name: str, port: int) -> ServerProcess:
        return _member(cluster, name, port)

    procs = [member(A, pa)]
    try:
        procs[0].wait_ready()
        procs.append(member(B, pb))
        procs[1].wait_ready()
        t = _sgd_table(pstore.connect(str(cluster), ack="all"))
        ids = np.arange(32, dtype=np.int64)
        t.push(ids, np.ones((32, DIM), np.float32))
        _wait_caught_up(pstore.connect([A]), pstore.connect([B], retries=0))
        assert _rep(B)["primary"] == A  # type: ignore[index]
        procs[0].send(signal.SIGKILL)
        procs[0].proc.wait(30)
        pstore.promote(B)
        t.push(ids, np.ones((32, DIM), np.float32))
        procs.append(member(A, pa))  # a comes back and follows b (it asks the member it had)
        _wait("a following b", lambda: (r := _rep(A)) and r["role"] == "follower" and r)
        _wait_caught_up(pstore.connect([B]), pstore.connect([A], retries=0))
        procs[1].send(signal.SIGKILL)
        procs[1].proc.wait(30)
        procs.append(member(B, pb))  # b comes back with `--member B`: it would follow a
        procs[-1].wait_ready()
        rb = _wait("b's role", lambda: (r := _rep(B)) and r.get("role") and r)
        assert rb["role"] == "primary" and rb["epoch"] == 2, rb
        t.push(ids, np.ones((32, DIM), np.float32))
        assert np.all(t.pull(ids) == -3.0)
        ra = _rep(A)
        assert ra is not None and ra["role"] == "follower" and ra["primary"] == B
    finally:
        for p in procs:
            p.stop()


def _forget_members(path: Path) -> None:
    """Rewrites the group record of the store at ``path`` as a primary killed before it
    recorded any follower leaves it (its group thread records them every 50 ms)."""
    import lmdb

    env = lmdb.open(str(path), max_dbs=64)
    try:
        with env.begin(write=True) as tx:
            meta = env.open_db(b"meta", txn=tx, create=False)
            record = json.loads(tx.get(b"replication/group", db=meta))
            assert record["role"] == "primary", record
            record["members"] = []
            tx.put(b"replication/group", json.dumps(record).encode(), db=meta)
    finally:
        env.close()


def test_a_primary_killed_before_it_recorded_its_follower_follows_the_promoted_one(
    tmp_path: Path,
) -> None:
    """The first member of a group, killed before its store recorded the follower, then
    restarted with `--member` after that follower was promoted: the cluster file names the
    group's other members, so it asks them, finds the newer epoch and follows (else two
    primaries, of epochs 1 and 2)."""
    pa, pb = free_port(), free_port()
    A, B = f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"servers": [[A, B]]}))
    procs = [_member(cluster, A, pa)]
    try:
        procs[0].wait_ready()
        procs.append(_member(cluster, B, pb))
        procs[1].wait_ready()
        t = _sgd_table(pstore.connect(str(cluster), ack="all"))
        ids = np.arange(16, dtype=np.int64)
        t.push(ids, np.ones((16, DIM), np.float32))
        _wait_caught_up(pstore.connect([A]), pstore.connect([B], retries=0))
        procs[0].send(signal.SIGKILL)
        procs[0].proc.wait(30)
        _forget_members(tmp_path / A.replace(":", "_"))
        pstore.promote(B)
        t.push(ids, np.ones((16, DIM), np.float32))
        procs.append(_member(cluster, A, pa))
        ra = _wait("a following b", lambda: (r := _rep(A)) and r["role"] == "follower" and r)
        assert ra["primary"] == B and ra["epoch"] == 2, ra
        _wait_caught_up(pstore.connect([B]), pstore.connect([A], retries=0))
        assert np.all(t.pull(ids) == -2.0)
    finally:
        for p in procs:
            p.stop()


def test_serve_member_checks_its_arguments(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"servers": [["127.0.0.1:1", "127.0.0.1:2"]]}))
    for args, what in [
        (["--member", "127.0.0.1:2", "--path", "p"], "--member needs --cluster"),
        (["--cluster", str(cluster), "--member", "127.0.0.1:3", "--path", "p"], "no member"),
        (["--cluster", str(cluster), "--member", "127.0.0.1:2"], "needs --path"),
        (
            ["--cluster", str(cluster), "--member", "127.0.0.1:2", "--path", "p", "--index", "0"],
            "takes the place",
        ),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "pstore", "serve", *args],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=tmp_path,
            timeout=60,
        )
        assert out.returncode != 0 and what in out.stderr, (args, out.stderr)
        assert not (tmp_path / "p").exists()


class _KnowingEngine(Engine):
    """An engine that knows which servers died (as Ray knows a dead actor)."""

    def __init__(self) -> None:
        self.dead: set[str] = set()

    def is_down(self, address: str) -> bool:
        return address in self.dead


def test_a_paused_primary_is_failed_over_after_dead_after_or_at_once_on_the_engines_word(
    tmp_path: Path,
) -> None:
    """A stopped process keeps its port and answers nothing: the controller waits dead_after
    before it promotes (no Status answer in that time); the engine's word skips the wait."""
    a, b = _group(tmp_path, "g0")
    engine = _KnowingEngine()
    ctl = Controller([[a.address, b.address]], engine=engine, check_interval=0.2, dead_after=30.0)
    try:
        group = [[a.address, b.address]]
        t = _sgd_table(pstore.connect(group, ack="all", timeout=3.0))  # type: ignore[arg-type]
        ids = np.arange(16, dtype=np.int64)
        t.push(ids, np.ones((16, DIM), np.float32))
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        ctl.start()
        a.send(signal.SIGSTOP)
        _wait("the pause seen", lambda: ctl.status()["groups"][0]["state"] == "primary_unreachable")
        time.sleep(2.0)
        assert not [e for e in ctl.events if e["event"] == "promoted"]  # dead_after is 30 s
        engine.dead.add(a.address)
        _wait("the promotion", lambda: ctl.status()["groups"][0]["primary"] == b.address)
        t.push(ids, np.ones((16, DIM), np.float32))
        a.send(signal.SIGCONT)
        # Resumed, the old primary learns the newer epoch and follows b; nothing is lost.
        _wait("a following b", lambda: (r := _rep(a.address)) and r["role"] == "follower")
        assert np.all(t.pull(ids) == -2.0)
        assert [e["group"] for e in ctl.events if e["event"] == "promoted"] == [0]
    finally:
        a.send(signal.SIGCONT)
        ctl.stop()
        b.stop()
        a.stop()


def test_a_controller_started_after_the_primary_died_fails_over_on_the_engines_word(
    tmp_path: Path,
) -> None:
    """A controller that never saw the primary (it started after the primary died, as a
    restarted Ray controller actor may) takes the primary the followers follow; the engine's
    word that it is down promotes at once, not after dead_after."""
    a, b = _group(tmp_path, "g0")
    engine = _KnowingEngine()
    views: list[dict[str, Any]] = []
    ctl = Controller(
        [[a.address, b.address]],
        engine=engine,
        check_interval=0.2,
        dead_after=30.0,
        on_view=views.append,
    )
    try:
        t = _sgd_table(pstore.connect([[a.address, b.address]], ack="all", timeout=3.0))  # type: ignore[list-item]
        ids = np.arange(16, dtype=np.int64)
        t.push(ids, np.ones((16, DIM), np.float32))
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        engine.dead.add(a.address)
        started = time.monotonic()
        ctl.start()
        _wait("the promotion", lambda: ctl.status()["groups"][0]["primary"] == b.address)
        assert time.monotonic() - started < 10.0, "promoted on the engine's word"
        (promoted,) = [e for e in ctl.events if e["event"] == "promoted"]
        assert promoted["old_primary"] == a.address and promoted["epoch"] == 2
        assert views[-1]["servers"][0][0] == b.address and views[-1]["epochs"] == [2]
        t.push(ids, np.ones((16, DIM), np.float32))
        assert np.all(t.pull(ids) == -2.0)
    finally:
        ctl.stop()
        b.stop()
        a.stop()


def _statefulset_rounds(tmp_path: Path, rounds: int) -> None:
    """Both members started by `--member` from one cluster file, restarted with the same
    arguments after each SIGKILL (what a StatefulSet does), the controller failing the group
    over each time while a worker pushes with ack="all": every push applies exactly once."""
    ports = {f"127.0.0.1:{p}": p for p in (free_port(), free_port())}
    names = list(ports)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"servers": [names]}))

    def pod(name: str) -> ServerProcess:
        p = _member(cluster, name, ports[name])
        p.wait_ready()
        return p

    pods = {n: pod(n) for n in names}
    ctl = Controller.from_cluster_file(cluster, check_interval=0.2, dead_after=1.0)
    pusher: _Pusher | None = None
    try:
        t = _sgd_table(pstore.connect(str(cluster), ack="all", timeout=10.0))
        ctl.start()
        for k in range(rounds):

            def whole() -> str | None:
                # The group's primary, once the controller saw its follower live (it
                # acknowledges every push): a follower it did not see live is never promoted.
                g = ctl.status()["groups"][0]
                others = [m["address"] for m in g["members"] if m["address"] != g["primary"]]
                ok = g["state"] == "ok" and g["live_followers"] == others
                return g["primary"] if ok else None

            primary = _wait(f"round {k}: the group whole", whole)
            if pusher is None:
                pusher = _Pusher(t)
            pusher.wait_pushes(10)
            pods[primary].send(signal.SIGKILL)
            pods[primary].proc.wait(30)
            promoted = k + 1
            try:
                _wait(
                    f"round {k}: the promotion",
                    lambda n=promoted: sum(e["event"] == "promoted" for e in ctl.events) == n,
                )
            except AssertionError as e:
                raise AssertionError(f"{e}; the controller: {ctl.status()}") from None
            pusher.wait_pushes(10)
            pods[primary].stop()  # dead already: closes its log
            pods[primary] = pod(primary)  # the same arguments, the same disk
        _wait("the last pod rejoined", whole)
        assert pusher is not None
        pusher.wait_pushes(5)
        pusher.stop()
        pusher.check()
        epochs = [e["epoch"] for e in ctl.events if e["event"] == "promoted"]
        assert epochs == list(range(2, rounds + 2))
        assert not [e for e in ctl.events if e["event"] in ("conflict", "no_candidate")]
    finally:
        if pusher is not None:
            pusher._stop.set()
            pusher._thread.join(120)
        ctl.stop()
        for p in pods.values():
            p.stop()


def test_pods_restarted_with_their_arguments_rejoin_and_fail_over_again(tmp_path: Path) -> None:
    _statefulset_rounds(tmp_path, 2)


@pytest.mark.soak
def test_statefulset_failover_soak(tmp_path: Path) -> None:
    _statefulset_rounds(tmp_path, 12)


def test_a_client_follows_a_group_that_failed_over_twice_to_a_member_it_never_knew(
    tmp_path: Path,
) -> None:
    # A group [a, b] and a server d: the cluster holds a routing (d joined). A worker connects,
    # a dies, b is promoted, a replacement c joins as follower of b (the controller publishes
    # the group's new members), b dies, c is promoted: the worker, which knows only [a, b],
    # asks d for the routing and pushes on to c (decision 0112).
    a, b = _group(tmp_path, "g0")
    d = ServerProcess("--path", str(tmp_path / "d"), "--durability", "sync")
    engine = _SpawningEngine(tmp_path)
    ctl = Controller([[a.address, b.address]], engine=engine, check_interval=0.2, dead_after=1.0)
    try:
        # The default-sized failover timeout: the worker must not wait it out before it asks
        # d (it asks the others while it looks for the primary, decision 0112).
        t = _group_with_a_joined_server(a, b, d, failover_timeout=30.0)
        ids = np.arange(1000, dtype=np.int64)
        pushes = 0

        def push() -> None:
            nonlocal pushes
            t.push(ids, np.ones((len(ids), DIM), np.float32))
            pushes += 1

        push()
        ctl.start()
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        _wait("the replacement", lambda: any(e["event"] == "replaced" for e in ctl.events))
        (c,) = engine.started
        published = _wait(
            "the new members published",
            lambda: [e for e in ctl.events if e["event"] == "routing_published"],
        )
        assert published[0]["servers"][0] in ([b.address, c.address], [c.address, b.address])
        _wait_caught_up(pstore.connect([b.address]), pstore.connect([c.address], retries=0))
        b.send(signal.SIGKILL)
        b.proc.wait(30)
        started = time.monotonic()
        push()
        took = time.monotonic() - started
        assert took < 15.0, f"the push after the second failover took {took:.1f} s"
        assert _status(pstore.connect([c.address]))["role"] == "primary"
        push()
        rows = t.pull(ids)
        np.testing.assert_array_equal(rows, np.full((len(ids), DIM), -pushes, np.float32))
    finally:
        ctl.stop()
        for p in [a, b, d, *engine.started]:
            p.stop()
