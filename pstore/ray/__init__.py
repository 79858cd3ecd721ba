"""pstore on Ray: store servers as Ray actors, a controller that keeps them running, and a
``connect`` for tasks, actors and Ray Train workers.

>>> import pstore.ray  # doctest: +SKIP
>>> cluster = pstore.ray.Cluster(2, path="pstore-data", durability="sync")  # doctest: +SKIP
>>> store = pstore.ray.connect(cluster)  # in any task or actor: a RemoteStore  # doctest: +SKIP

**Servers.** Each server is a detached Ray actor (``pstore-server:<name>:<i>``, namespace
``pstore``) that runs a :class:`pstore.server.Server` over a :class:`pstore.Store` in its own
process, so the actor's death is the server's death and Ray reports it; there is no child
process to leak or to supervise. The store of server ``i`` is ``<path>/server-<i>`` on the node
that runs it. The servers sit in one placement group, one bundle each: ``STRICT_SPREAD`` (one
server per node) when the cluster has at least as many nodes as servers, else ``SPREAD`` (as
spread as the nodes allow).

**Controller.** One detached, named actor (``pstore-cluster:<name>``) that Ray restarts when it
dies. It holds the membership (the server list in its order, the token, the placement group)
and watches the servers: Ray reports a dead actor; the gRPC health service reports a server
whose transport stopped. A dead server is started again in its bundle (its node), with the
same store directory and the **same port**: every server pins the hash of the list of
addresses its tables were made under, so a new port would be refused. Each restart adds one to
the membership's ``generation``. The membership is kept in Ray's key-value store (the GCS), so
a restarted controller takes it up again and adopts the live server actors by name: nothing is
lost and no server is restarted.

**Replica groups.** With ``replicas=R > 1`` each position is a replica group of R servers on R
nodes (one ``STRICT_SPREAD`` placement group per group), and the controller actor runs the
shared :class:`pstore.controller.Controller` with a Ray engine: a primary whose actor or node
Ray loses is failed over at once, and a new follower starts in the lost member's bundle
(:mod:`pstore.ray._groups`; docs/RAY.md, "Replica groups on Ray").

Data never passes through Ray's object store: workers talk gRPC to the servers. Importing
:mod:`pstore` does not import this module or Ray.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

import ray
from ray.experimental import internal_kv
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import pstore
from pstore.client import RemoteStore
from pstore.exceptions import InvalidArgumentError, PstoreError

__all__ = ["NAMESPACE", "Cluster", "ClusterError", "connect", "list_clusters"]

NAMESPACE = "pstore"
"""The Ray namespace of every actor, placement group and key this module makes."""

_KV_PREFIX = "pstore-membership:"
_DURABILITIES = ("none", "async", "sync")


class ClusterError(PstoreError, RuntimeError):
    """A pstore cluster on Ray could not be started, found or kept running."""


def _controller_name(name: str) -> str:
    return f"pstore-cluster:{name}"


def _server_name(name: str, index: int) -> str:
    return f"pstore-server:{name}:{index}"


def _pg_name(name: str) -> str:
    return f"pstore-servers:{name}"


def _position_pg_name(name: str, index: int) -> str:
    return f"{_pg_name(name)}:server-{index}"


def _kv_key(name: str) -> str:
    return _KV_PREFIX + name


def _ensure_ray(address: str | None = None, *, start: bool = False) -> None:
    """Connect this process to Ray if it is not: to ``address``, else ``RAY_ADDRESS``, else the
    cluster running on this node, else (with ``start``) a new local one."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or (None if start else "auto")
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise ClusterError(
                f"no Ray cluster to join at {address!r} ({e}); start one (`ray start --head`) "
                "or give its address (address=, --address or RAY_ADDRESS)"
            ) from None


# --------------------------------------------------------------------------------------------
# The server actor


class _ServerActor:
    """One store server in this actor's process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from pstore.server import Server

        host = spec.get("host") or ray.util.get_node_ip_address()
        path = spec["path"]
        if path is not None and spec.get("fresh") and os.path.exists(path):
            # A new member starts from an empty store: never adopt a directory some earlier
            # cluster left on this node.
            path = f"{path}-{time.time_ns()}"
        durable = {} if path is None else {"path": path, "durability": spec["durability"]}
        self._store = pstore.Store(
            num_shards=spec.get("num_shards"), threads=spec.get("threads"), **durable
        )
        try:
            self._server = Server(
                self._store,
                host=host,
                port=spec["port"],
                token=spec["token"],
                follow=spec.get("follow"),
            )
        except BaseException:
            self._store.close()
            raise
        self._stopped = threading.Event()
        self._info = {
            "index": spec["index"],
            "address": self._server.address,
            "host": host,
            "port": self._server.port,
            "path": path,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "incarnation": spec["incarnation"],
            "started_at": time.time(),
        }
        for k in ("member", "bundle", "actor", "follow"):
            if k in spec:
                self._info[k] = spec[k]

    def info(self) -> dict[str, Any]:
        return dict(self._info, running=self._server.running)

    def watch(self, timeout: float) -> bool:
        """Returns when the server stops (True) or after ``timeout`` seconds (False): a call in
        flight fails at once when the actor dies, which is how the controller hears of it."""
        return self._stopped.wait(timeout)

    def stop(self, grace: float) -> None:
        try:
            self._server.stop(grace)
        finally:
            self._stopped.set()
            self._store.close()


# --------------------------------------------------------------------------------------------
# The controller actor


class _Controller:
    """Holds the membership of one cluster and keeps its servers running (see the module)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._spec = spec
        self._name: str = spec["name"]
        self._lock = threading.RLock()
        self._events: deque[dict[str, Any]] = deque(maxlen=200)
        self._stopping = threading.Event()
        self._health_failures: dict[int, int] = {}
        self._probes: dict[str, RemoteStore] = {}  # by address
        self._membership: dict[str, Any] = {}
        self._handles: list[Any] = []
        self._pg: PlacementGroup | None = None
        self._own_pgs: dict[int, PlacementGroup] = {}  # positions added by scale()
        self._scaling = threading.Lock()
        # position -> (actor, its own placement group, address) of a server a scale down
        # removed, until it stops
        self._retiring: dict[int, tuple[Any, PlacementGroup | None, str]] = {}
        raw = internal_kv._internal_kv_get(_kv_key(self._name), namespace=NAMESPACE)
        if raw is None:
            self._start()
        else:
            self._membership = json.loads(raw)
            self._adopt()
        self._watcher = threading.Thread(target=self._watch, name="pstore-watch", daemon=True)
        self._watcher.start()

    # -- starting and adopting

    def _start(self) -> None:
        """A new cluster: the placement group, every server, the membership record."""
        n = self._spec["num_servers"]
        nodes = sum(1 for x in ray.nodes() if x.get("Alive"))
        strategy = "STRICT_SPREAD" if nodes >= n else "SPREAD"
        bundles = [
            {"CPU": float(self._spec["server_cpus"]), **dict(self._spec["server_resources"] or {})}
            for _ in range(n)
        ]
        pg = placement_group(
            bundles, strategy=strategy, name=_pg_name(self._name), lifetime="detached"
        )
        if not _wait(pg.ready(), self._spec["start_timeout"]):
            remove_placement_group(pg)
            raise ClusterError(
                f"cluster {self._name!r}: Ray could not place {n} servers of "
                f"{self._spec['server_cpus']} CPU each ({strategy} over {nodes} live nodes) "
                f"within {self._spec['start_timeout']} s; add nodes or CPUs, or lower "
                "server_cpus"
            )
        membership: dict[str, Any] = {
            "name": self._name,
            "generation": 0,
            "token": self._spec["token"],
            "strategy": strategy,
            "bundles": n,
            "servers": [],
        }
        handles = [self._make_server(pg, i, 0, 0) for i in range(n)]
        try:
            infos = [self._server_info(h, i) for i, h in enumerate(handles)]
        except BaseException:
            for h in handles:
                ray.kill(h, no_restart=True)
            remove_placement_group(pg)
            raise
        membership["servers"] = infos
        self._handles = handles
        self._pg = pg
        self._membership = membership
        self._save()
        self._event("started", servers=[s["address"] for s in infos], strategy=strategy)

    def _adopt(self) -> None:
        """A restarted controller: find the placement group and the live servers by name;
        start the ones that died meanwhile."""
        self._pg = get_placement_group(_pg_name(self._name))
        for i, s in enumerate(self._membership["servers"]):
            if s.get("own_pg"):
                self._own_pgs[i] = get_placement_group(_position_pg_name(self._name, i))
        for r in self._membership.pop("retiring", []):
            # Removed by a scale down of the controller that died, and lingering: stop it now.
            try:
                old = ray.get_actor(_server_name(self._name, r["index"]), namespace=NAMESPACE)
                ray.kill(old, no_restart=True)
            except ValueError:
                pass
            if r.get("own_pg"):
                try:
                    remove_placement_group(
                        get_placement_group(_position_pg_name(self._name, r["index"]))
                    )
                except ValueError:
                    pass
            self._event("server_stopped", index=r["index"], address=r["address"])
        self._save()
        self._handles = []
        for i in range(len(self._membership["servers"])):
            try:
                h = ray.get_actor(_server_name(self._name, i), namespace=NAMESPACE)
                self._server_info(h, i)
            except (ValueError, ClusterError):
                h = None
            self._handles.append(h)
        self._event("adopted", live=sum(h is not None for h in self._handles))
        for i, h in enumerate(self._handles):
            if h is None:
                self._restart(i, "found dead when the controller started")

    def _make_server(
        self,
        pg: PlacementGroup,
        index: int,
        port: int,
        incarnation: int,
        *,
        bundle: int | None = None,
        path: str | None = None,
        fresh: bool = False,
    ) -> Any:
        if path is None and self._spec["path"] is not None:
            path = os.path.join(self._spec["path"], f"server-{index}")
        spec = {
            "index": index,
            "path": path,
            "fresh": fresh,
            "durability": self._spec["durability"],
            "token": self._spec["token"],
            "port": port,
            "host": self._spec.get("host"),
            "num_shards": self._spec.get("num_shards"),
            "threads": self._spec.get("threads"),
            "incarnation": incarnation,
        }
        actor = ray.remote(_ServerActor).options(
            name=_server_name(self._name, index),
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=0,
            max_concurrency=4,
            num_cpus=float(self._spec["server_cpus"]),
            resources=dict(self._spec["server_resources"] or {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=index if bundle is None else bundle,
            ),
        )
        return actor.remote(spec)

    def _bundle_of(self, i: int) -> tuple[PlacementGroup, int]:
        """The placement group and bundle of position ``i``: the cluster's own placement group
        for the first ``bundles`` positions, a placement group of its own for one added past
        them by :meth:`scale`."""
        if i in self._own_pgs:
            return self._own_pgs[i], 0
        assert self._pg is not None, "set when the controller started"
        return self._pg, i

    def _server_info(self, handle: Any, index: int) -> dict[str, Any]:
        return _actor_info(handle, self._spec, f"server {index}")

    def _save(self) -> None:
        internal_kv._internal_kv_put(
            _kv_key(self._name), json.dumps(self._membership), overwrite=True, namespace=NAMESPACE
        )

    def _event(self, what: str, **fields: Any) -> None:
        self._events.append({"time": time.time(), "event": what, **fields})

    # -- watching

    def _watch(self) -> None:
        interval = float(self._spec["check_interval"])
        while not self._stopping.wait(interval):
            for i in range(len(self._membership["servers"])):
                if self._stopping.is_set():
                    return
                try:
                    self._check(i)
                except Exception as e:  # keep watching the others
                    self._event("check_failed", index=i, error=f"{type(e).__name__}: {e}")

    def _check(self, i: int) -> None:
        with self._lock:
            if self._stopping.is_set() or i >= len(self._handles):
                return  # stopping, or the position left in a scale down
            h = self._handles[i]
            if self._membership["servers"][i].get("lost"):
                return
            if h is None:
                self._restart(i, "not running")
                return
            try:
                ray.get(h.info.remote(), timeout=10.0)
            except ray.exceptions.RayActorError:
                self._restart(i, "the actor died")
                return
            except ray.exceptions.GetTimeoutError:
                pass  # a busy actor, or a hung one: the health check below decides
        if self._healthy(i):
            self._health_failures[i] = 0
            return
        n = self._health_failures.get(i, 0) + 1
        self._health_failures[i] = n
        if n >= 3:
            with self._lock:
                if i >= len(self._handles) or self._handles[i] is None:
                    return
                ray.kill(self._handles[i], no_restart=True)
                self._restart(i, "the gRPC health service failed 3 checks in a row")

    def _healthy(self, i: int) -> bool:
        with self._lock:
            if i >= len(self._membership["servers"]):
                return False
            addr = self._membership["servers"][i]["address"]
        try:
            probe = self._probes.get(addr)
            if probe is None:
                probe = pstore.connect(
                    [addr], token=self._membership["token"], timeout=5, retries=0
                )
                self._probes[addr] = probe
            return probe.health() == ["SERVING"]
        except PstoreError:
            return False

    def _restart(self, i: int, reason: str) -> None:
        """Start server ``i`` again in its bundle, on its port, with its store."""
        old = self._membership["servers"][i]
        self._event("server_down", index=i, address=old["address"], reason=reason)
        incarnation = old["incarnation"] + 1
        pg, bundle = self._bundle_of(i)
        last: Exception | None = None
        for _ in range(20):
            try:
                h = self._make_server(
                    pg, i, old["port"], incarnation, bundle=bundle, path=old["path"]
                )
                info = self._server_info(h, i)
                break
            except (ValueError, ClusterError) as e:  # the dead actor's name not yet released
                last = e
                self._handles[i] = None
                time.sleep(0.5)
        else:
            self._event("restart_failed", index=i, error=str(last))
            return
        moved = info["node_id"] != old["node_id"] and old["path"] is not None
        if moved or info["address"] != old["address"]:
            # The bundle moved to another node (its node is gone): the store directory is not
            # there, and a new address would route ids elsewhere. Without replicas there is
            # nothing to promote: mark the position lost rather than serve an empty store.
            try:
                ray.get(h.stop.remote(1.0), timeout=30)
            finally:
                ray.kill(h, no_restart=True)
            self._handles[i] = None
            self._membership["servers"][i] = dict(old, lost=True)
            self._membership["generation"] += 1
            self._save()
            self._event(
                "server_lost",
                index=i,
                address=old["address"],
                node_id=old["node_id"],
                moved_to=info["node_id"],
            )
            return
        self._handles[i] = h
        self._membership["servers"][i] = dict(info, own_pg=old.get("own_pg", False))
        self._membership["generation"] += 1
        self._save()
        self._event(
            "server_restarted",
            index=i,
            address=info["address"],
            incarnation=incarnation,
            generation=self._membership["generation"],
        )

    # -- what clients and Cluster call

    def membership(self) -> dict[str, Any]:
        with self._lock:
            m: dict[str, Any] = json.loads(json.dumps(self._membership))
        return m

    def status(self) -> dict[str, Any]:
        with self._lock:
            m: dict[str, Any] = json.loads(json.dumps(self._membership))
            handles = list(self._handles)
        for i, s in enumerate(m["servers"]):
            s["alive"] = handles[i] is not None and not s.get("lost", False)
            s["health"] = "SERVING" if s["alive"] and self._healthy(i) else "NOT_SERVING"
        m.pop("token")
        m["num_servers"] = len(m["servers"])
        m["path"] = self._spec["path"]
        m["durability"] = self._spec["durability"]
        m["controller_pid"] = os.getpid()
        m["scaling"] = self._scaling.locked()
        m.pop("retiring", None)
        m["events"] = list(self._events)
        return m

    def scale(self, num_servers: int, grace: float, linger: float) -> dict[str, Any]:
        """Grow or shrink the cluster to ``num_servers`` positions while workers train (see
        :meth:`Cluster.scale`). One scale at a time: another one is refused."""
        if not self._scaling.acquire(blocking=False):
            raise ClusterError(
                f"cluster {self._name!r}: a scale is running already; wait for it to return, "
                "then call scale again (nothing was changed)"
            )
        try:
            t0 = time.monotonic()
            with self._lock:
                before = [s["address"] for s in self._membership["servers"]]
                lost = [s["index"] for s in self._membership["servers"] if s.get("lost")]
                dead = [i for i, h in enumerate(self._handles) if h is None]
            if lost or dead:
                raise ClusterError(
                    f"cluster {self._name!r}: server(s) {lost or dead} "
                    f"{'are lost' if lost else 'are not running'}; a scale moves rows from and "
                    "to every server, so it needs them all (nothing was changed)"
                )
            if num_servers == len(before):
                moves: list[dict[str, Any]] = []
            elif num_servers > len(before):
                moves = self._scale_up(len(before), num_servers)
            else:
                moves = self._scale_down(len(before), num_servers, grace, linger)
            with self._lock:
                after = [s["address"] for s in self._membership["servers"]]
                generation = self._membership["generation"]
            return {
                "before": before,
                "servers": after,
                "added": [a for a in after if a not in before],
                "removed": [a for a in before if a not in after],
                "generation": generation,
                "moves": moves,
                "seconds": time.monotonic() - t0,
            }
        finally:
            self._scaling.release()

    def _data_plane(self) -> RemoteStore:
        with self._lock:
            servers = [s["address"] for s in self._membership["servers"]]
        return pstore.connect(servers, token=self._membership["token"], retries=10)

    def _scale_up(self, n: int, target: int) -> list[dict[str, Any]]:
        """Start positions ``n`` .. ``target - 1``, then add them one at a time."""
        cpus = float(self._spec["server_cpus"])
        bundle = {"CPU": cpus, **dict(self._spec["server_resources"] or {})}
        for i in range(n, target):
            entry = self._retiring.get(i)
            if entry is not None:  # removed moments ago, still answering "moved": stop it now
                self._retire(i, entry[0], 1.0)
        reuse = list(range(n, min(target, int(self._membership.get("bundles", n)))))
        fresh = [i for i in range(n, target) if i not in reuse]
        # Ask Ray first: a placement group that cannot be placed would only time out.
        free = ray.available_resources()
        short = {
            k: free.get(k, 0.0) for k, v in bundle.items() if free.get(k, 0.0) < v * len(fresh)
        }
        if short:
            raise ClusterError(
                f"cluster {self._name!r}: {target - n} new server(s) need {len(fresh)} new "
                f"bundle(s) of {bundle}, but Ray has only {short} free; add nodes or CPUs, or "
                "lower num_servers (nothing was changed)"
            )
        pgs: dict[int, PlacementGroup] = {}
        handles: dict[int, Any] = {}
        infos: dict[int, dict[str, Any]] = {}
        placed: dict[str, int] = {}  # node -> servers this scale put there
        try:
            for i in fresh:
                name = _position_pg_name(self._name, i)
                try:  # a placement group a scale cut short left behind
                    remove_placement_group(get_placement_group(name))
                except ValueError:
                    pass
                target_node = self._emptiest_node(bundle, placed)
                if target_node is not None:
                    placed[target_node] = placed.get(target_node, 0) + 1
                # STRICT_PACK because Ray honours a target node only for it (one bundle: the
                # strategy places nothing else); a soft target, so a node that filled up
                # meanwhile or died only sends the bundle elsewhere.
                pgs[i] = placement_group(
                    [dict(bundle)],
                    strategy="STRICT_PACK",
                    name=name,
                    lifetime="detached",
                    _soft_target_node_id=target_node,
                )
            for i, pg in pgs.items():
                if not _wait(pg.ready(), self._spec["start_timeout"]):
                    raise ClusterError(
                        f"cluster {self._name!r}: Ray could not place server {i} ({bundle}) "
                        f"within {self._spec['start_timeout']} s; add nodes or CPUs, or lower "
                        "num_servers (nothing was changed)"
                    )
            for i in range(n, target):
                try:  # a server actor a scale cut short left behind
                    ray.kill(ray.get_actor(_server_name(self._name, i), namespace=NAMESPACE))
                except ValueError:
                    pass
                pg, b = (pgs[i], 0) if i in pgs else self._bundle_of(i)
                handles[i] = self._make_server(pg, i, 0, 0, bundle=b, fresh=True)
            for i, h in handles.items():
                infos[i] = self._server_info(h, i)
        except BaseException:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            for pg in pgs.values():
                remove_placement_group(pg)
            raise
        moves = []
        for k, i in enumerate(range(n, target)):
            info = infos[i]
            try:
                report = self._data_plane().add_server(info["address"])
            except BaseException as e:
                for j in range(i, target):
                    ray.kill(handles[j], no_restart=True)
                    if j in pgs:
                        remove_placement_group(pgs[j])
                raise ClusterError(
                    f"cluster {self._name!r}: adding server {i} ({info['address']}) failed: "
                    f"{e}; the cluster has {n + k} servers (the ones added before stay)"
                ) from None
            with self._lock:
                if i in pgs:
                    self._own_pgs[i] = pgs[i]
                self._handles.append(handles[i])
                self._membership["servers"].append(dict(info, own_pg=i in pgs))
                self._membership["generation"] += 1
                self._save()
                generation = self._membership["generation"]
            moves.append(report)
            self._event(
                "server_added",
                index=i,
                address=info["address"],
                node_id=info["node_id"],
                rows=report.get("rows"),
                seconds=report.get("seconds"),
                generation=generation,
            )
        return moves

    def _emptiest_node(self, bundle: dict[str, float], placed: dict[str, int]) -> str | None:
        """The live node with room for ``bundle`` that runs the fewest servers of this cluster
        (counting ``placed``, the ones this scale placed already; ties: the most free room), or
        None when no node has room (Ray then waits for one)."""
        with self._lock:
            count: dict[str, int] = dict(placed)
            for s in self._membership["servers"]:
                count[s["node_id"]] = count.get(s["node_id"], 0) + 1
        room = _free_per_node(bundle)
        for node, k in placed.items():
            room[node] = room.get(node, 0) - k
        fits = [node for node, k in room.items() if k > 0]
        if not fits:
            return None
        return min(fits, key=lambda node: (count.get(node, 0), -room[node], node))

    def _scale_down(self, n: int, target: int, grace: float, linger: float) -> list[dict[str, Any]]:
        """Remove positions ``n - 1`` down to ``target``: their rows move to the others, then
        their servers stop (after ``linger`` seconds)."""
        moves = []
        for i in range(n - 1, target - 1, -1):
            with self._lock:
                address = self._membership["servers"][i]["address"]
            report = self._data_plane().remove_server(i)
            with self._lock:
                h = self._handles.pop()
                gone = self._membership["servers"].pop()
                self._health_failures.pop(i, None)
                self._membership["generation"] += 1
                # Recorded, so that a controller restarted during the linger stops it.
                self._membership.setdefault("retiring", []).append(
                    {"index": i, "address": address, "own_pg": bool(gone.get("own_pg"))}
                )
                self._save()
                generation = self._membership["generation"]
                pg = self._own_pgs.pop(i, None)
                # It keeps answering "moved" for `linger` seconds, so that a worker whose call
                # was between two tries when the list changed meets "moved" (and follows)
                # rather than a closed port (which names no new list to follow).
                self._retiring[i] = (h, pg, address)
            self._probes.pop(address, None)
            threading.Thread(
                target=self._retire_later,
                args=(i, h, grace, linger),
                name=f"pstore-retire-{i}",
                daemon=True,
            ).start()
            moves.append(report)
            self._event(
                "server_removed",
                index=i,
                address=address,
                rows=report.get("rows"),
                seconds=report.get("seconds"),
                generation=generation,
            )
        return moves

    def _retire_later(self, i: int, h: Any, grace: float, linger: float) -> None:
        if self._stopping.wait(linger):
            return  # shutdown stops it
        self._retire(i, h, grace)

    def _retire(self, i: int, h: Any, grace: float) -> None:
        """Stop the server a scale down removed from position ``i`` (unless done already)."""
        with self._lock:
            entry = self._retiring.get(i)
            if entry is None or entry[0] is not h:
                return
            del self._retiring[i]
            self._membership["retiring"] = [
                r for r in self._membership.get("retiring", []) if r["index"] != i
            ]
            self._save()
        _, pg, address = entry
        _stop_actors([h], grace)
        if pg is not None:
            remove_placement_group(pg)
        self._event("server_stopped", index=i, address=address)

    def shutdown(self, grace: float) -> None:
        """Stop every server (flushing its store), remove the placement group and the record."""
        self._stopping.set()
        with self._lock:
            retiring = list(self._retiring.items())
        for i, (h, _, _) in retiring:
            self._retire(i, h, grace)
        with self._lock:
            _stop_actors([h for h in self._handles if h is not None], grace)
            self._handles = [None] * len(self._handles)
            if self._pg is not None:
                remove_placement_group(self._pg)
            for pg in self._own_pgs.values():
                remove_placement_group(pg)
            internal_kv._internal_kv_del(_kv_key(self._name), namespace=NAMESPACE)


def _stop_actors(handles: list[Any], grace: float) -> None:
    """Ask every server actor of ``handles`` to stop at once (each flushes its store within
    ``grace`` seconds), then end them; an actor already gone is skipped."""
    waits = [(h, h.stop.remote(grace)) for h in handles]
    for h, ref in waits:
        try:
            ray.get(ref, timeout=grace + 30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        ray.kill(h, no_restart=True)


def _actor_info(handle: Any, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """A server actor's ``info()``, within the cluster's ``start_timeout``; a server that does
    not answer or died is a ClusterError naming ``what``."""
    try:
        info: dict[str, Any] = ray.get(handle.info.remote(), timeout=spec["start_timeout"])
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(
            f"cluster {spec['name']!r}: {what} did not answer within {spec['start_timeout']} s"
        ) from None
    except ray.exceptions.RayActorError as e:
        raise ClusterError(f"cluster {spec['name']!r}: {what} failed to start: {e}") from None
    return info


def _free_per_node(bundle: Mapping[str, float]) -> dict[str, int]:
    """How many more ``bundle``s each live node has room for now (Ray's free resources per
    node, a DeveloperAPI of Ray's state; stale by the time a placement group asks)."""
    from ray._private.state import available_resources_per_node

    out: dict[str, int] = {}
    for node, free in available_resources_per_node().items():
        out[node] = min(int(free.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0)
    return out


def _wait(ref: Any, timeout: float) -> bool:
    try:
        ray.get(ref, timeout=timeout)
        return True
    except ray.exceptions.GetTimeoutError:
        return False


# --------------------------------------------------------------------------------------------
# The public API


class Cluster:
    """A pstore cluster on Ray: ``num_servers`` store servers and their controller.

    Parameters
    ----------
    num_servers : int
        Store servers, one per bundle of a placement group (see the module).
    path : str, optional
        Base directory of the servers' stores on their nodes: server ``i`` keeps
        ``<path>/server-<i>``. Without it the servers keep their rows in memory and a restarted
        server comes back empty.
    durability : "none", "async" or "sync"
        Of each server's store (see :class:`pstore.Store`); ``"sync"`` acknowledges a push only
        once it is on disk, so a restarted server has every acknowledged push.
    token : str, optional
        The servers' token. Default: a new random one, which :func:`connect` takes from the
        controller.
    replicas : int
        Copies of each server's rows. With R > 1 each of the ``num_servers`` positions is a
        replica group of R servers on R different Ray nodes: a primary and R - 1 followers,
        failed over by the controller when the primary's actor or node dies and refilled with a
        new follower on a live node (docs/RAY.md, "Replica groups on Ray"). Needs ``path``.
    name : str
        The cluster's name in Ray (``"default"``); one name, one cluster.
    server_cpus : float
        CPUs each server's bundle reserves.
    server_resources : dict, optional
        Other Ray resources each server's bundle reserves (``{"pstore": 1}`` keeps the
        servers on the nodes that declare a ``pstore`` resource).
    num_shards, threads : int, optional
        Of each server's store.
    check_interval : float
        Seconds between the controller's checks of the servers.
    start_timeout : float
        Seconds to wait for the placement group and each server to start.
    address : str, optional
        The Ray cluster to join when this process is not connected to Ray yet (``ray.init``'s
        address; default ``RAY_ADDRESS``, else a new local Ray cluster, which ends with this
        process). :meth:`attach` and :func:`connect` never start one: they join
        ``RAY_ADDRESS`` or the cluster running on this node.
    """

    def __init__(
        self,
        num_servers: int = 2,
        *,
        path: str | os.PathLike[str] | None = None,
        durability: Literal["none", "async", "sync"] = "async",
        token: str | None = None,
        replicas: int = 1,
        name: str = "default",
        server_cpus: float = 1.0,
        server_resources: Mapping[str, float] | None = None,
        num_shards: int | None = None,
        threads: int | None = None,
        check_interval: float = 1.0,
        start_timeout: float = 120.0,
        address: str | None = None,
    ) -> None:
        spec = _spec(
            num_servers=num_servers,
            path=path,
            durability=durability,
            token=token,
            replicas=replicas,
            name=name,
            server_cpus=server_cpus,
            server_resources=server_resources,
            num_shards=num_shards,
            threads=threads,
            check_interval=check_interval,
            start_timeout=start_timeout,
        )
        _ensure_ray(address, start=True)
        try:
            ray.get_actor(_controller_name(name), namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ClusterError(
                f"a pstore cluster named {name!r} runs already: connect to it "
                f"(pstore.ray.Cluster.attach({name!r})) or shut it down first"
            )
        if spec["replicas"] > 1:
            from pstore.ray._groups import _GroupsController, check_nodes

            check_nodes(spec)  # here too, so that the error is raised without an actor's trace
            actor_class: Any = _GroupsController
        else:
            actor_class = _Controller
        controller: Any = (
            ray.remote(actor_class)
            .options(
                name=_controller_name(name),
                namespace=NAMESPACE,
                lifetime="detached",
                max_restarts=-1,
                max_task_retries=-1,
                max_concurrency=8,
                num_cpus=0,
            )
            .remote(spec)
        )
        self.name = name
        try:
            ray.get(controller.membership.remote())
        except ray.exceptions.RayActorError as e:
            ray.kill(controller, no_restart=True)
            cause = getattr(e, "cause", None)
            raise ClusterError(f"cluster {name!r} failed to start: {cause or e}") from None

    @classmethod
    def attach(cls, name: str = "default", *, address: str | None = None) -> Cluster:
        """The running cluster ``name`` (from another driver, or ``pstore ray up``)."""
        _ensure_ray(address)
        _controller(name)
        c = cls.__new__(cls)
        c.name = name
        return c

    @classmethod
    def restore(
        cls,
        snapshot: str | os.PathLike[str],
        num_servers: int = 2,
        **cluster_args: Any,
    ) -> Cluster:
        """A new cluster of ``num_servers`` servers holding the rows of the cluster snapshot
        ``snapshot`` (:meth:`snapshot`, or :meth:`pstore.RemoteStore.snapshot`), of any number
        of servers. Every server reads the parts it needs itself, so ``snapshot`` must be a path
        every node reaches (a shared file system) or an ``s3://`` prefix. ``cluster_args`` are
        those of :class:`Cluster`. If the restore fails, the new cluster is shut down again.
        """
        cluster = cls(num_servers, **cluster_args)
        try:
            connect(cluster).restore_cluster(snapshot)
        except BaseException:
            cluster.shutdown()
            raise
        return cluster

    @property
    def servers(self) -> list[str]:
        """The server addresses, in their order (with replica groups: each group's primary)."""
        return [g[0] for g in _server_list(self._membership())]

    @property
    def groups(self) -> list[list[str]]:
        """Each position's members, its primary first (one member each with ``replicas=1``)."""
        return _server_list(self._membership())

    @property
    def generation(self) -> int:
        """The membership's version: it grows with every restart, promotion and replacement."""
        return int(self._membership()["generation"])

    def _membership(self) -> dict[str, Any]:
        m: dict[str, Any] = ray.get(_controller(self.name).membership.remote())
        return m

    def connect(self, **connect_args: Any) -> RemoteStore:
        """:func:`connect` to this cluster."""
        return connect(self, **connect_args)

    def status(self) -> dict[str, Any]:
        """The controller's view: ``name``, ``generation``, ``strategy``, ``path``,
        ``durability``, ``servers`` (each with ``index``, ``address``, ``node_id``, ``pid``,
        ``incarnation``, ``alive``, ``health``), ``scaling`` (a :meth:`scale` runs) and the
        recent ``events`` (starts, deaths, restarts, ``server_added``, ``server_removed``,
        ``server_stopped``). With replica groups, ``groups`` instead of ``servers``: each
        with ``index``, ``primary``, ``epoch``, ``state`` (``ok``, ``degraded``,
        ``primary_unreachable``, ..., as :meth:`pstore.controller.Controller.status`),
        ``live_followers``, ``pending`` (replacements being started) and ``members``
        (``address``, ``role``, ``epoch``, ``lsn``, a follower's lag, ``node_id``, ``pid``,
        ``path``, ``alive``); ``replicas``;
        ``events`` include ``member_down``, ``promoted``, ``replacement_awaited``,
        ``member_started`` and ``replaced``."""
        s: dict[str, Any] = ray.get(_controller(self.name).status.remote())
        return s

    def scale(
        self, num_servers: int, *, grace: float = 10.0, linger: float = 30.0
    ) -> dict[str, Any]:
        """Grow or shrink the cluster to ``num_servers`` servers while workers train.

        Up: the controller starts the new servers (empty; each in a placement group of its own,
        or in a bundle of the cluster's placement group that a scale down freed) and adds them
        one at a time with :meth:`pstore.RemoteStore.add_server`: about 1/N of the hash slots
        move to each, with their rows. An added server goes, when Ray honours the hint, to a
        live node with room that runs the fewest servers of this cluster (a soft preference).
        With replica groups (``replicas=R > 1``) each added position is a group of R new
        servers in a ``STRICT_SPREAD`` placement group of its own (its members never share a
        node: a hard rule), its followers following its primary before the group is added,
        and the controller watches and fails over the new group as the first ones; a group
        removed by a scale down leaves the controller's watch and its members stop after
        ``linger``. Down: the last positions leave one at a time with
        :meth:`pstore.RemoteStore.remove_server` (their rows move to the others); each removed
        server keeps answering "moved" for ``linger`` seconds, so that a worker that calls it
        then follows the new list, then stops (calls in flight get ``grace`` seconds) and its
        placement group goes. A worker that still routes to a removed server after that (it
        made no call on rows meanwhile) finds it unreachable, asks the other servers of its
        list for their routing and follows it as well.
        Each added or removed server adds one to :attr:`generation` and is recorded in the
        GCS, so :func:`connect` gives the new list; workers connected before follow it by
        themselves (a call that meets "moved" fetches the servers' routing) and lose nothing.

        Returns ``{"before", "servers", "added", "removed", "generation", "moves",
        "seconds"}`` (``moves``: the report of each server's move, as
        :meth:`pstore.RemoteStore.move_slots`). ``num_servers`` equal to the current count
        changes nothing. With groups the report also has ``groups_before`` and ``groups``
        (each position's members, its primary first). Raises
        :class:`pstore.InvalidArgumentError` for ``num_servers < 1``; :class:`ClusterError`,
        with nothing changed, when a scale runs already (one at a time: the second is
        refused), when a server is down or lost (a group without a live primary), when Ray
        lacks the free resources for the new servers (for groups: fewer nodes with room than
        a group has members).
        """
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise InvalidArgumentError(
                f"num_servers must be an int >= 1, got {num_servers!r}; nothing was changed"
            )
        for k, v in (("grace", grace), ("linger", linger)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise InvalidArgumentError(f"{k} must be a number >= 0, got {v!r}")
        ctl = _controller(self.name)
        try:
            report: dict[str, Any] = ray.get(
                ctl.scale.remote(num_servers, float(grace), float(linger))
            )
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, PstoreError):  # the controller's error, without Ray's trace
                raise cause from None
            raise
        return report

    def snapshot(
        self, dest: str | os.PathLike[str], *, incremental: bool = False
    ) -> dict[str, Any]:
        """Write a cluster snapshot into ``dest`` (see :meth:`pstore.RemoteStore.snapshot`): every
        server writes its own part, so ``dest`` must be a path every node reaches or an
        ``s3://`` prefix. Returns the cluster manifest."""
        return connect(self).snapshot(dest, incremental=incremental)

    def shutdown(self, grace: float = 10.0) -> None:
        """Stop every server (calls in flight get ``grace`` seconds, then each store is flushed
        and closed), the controller, and remove the placement group. The stores stay on disk."""
        shutdown(self.name, grace=grace)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Cluster.attach, (self.name,))

    def __repr__(self) -> str:
        return f"<pstore.ray.Cluster {self.name!r}>"


def _spec(**a: Any) -> dict[str, Any]:
    """The controller's settings, checked."""
    n = a["num_servers"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"num_servers must be an int >= 1, got {n!r}")
    r = a["replicas"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidArgumentError(f"replicas must be an int >= 1, got {r!r}")
    if r > 1 and a["path"] is None:
        raise InvalidArgumentError(
            f"replicas={r} needs a path: a follower keeps its copy of the rows on disk"
        )
    res = a.get("server_resources")
    if res is not None and (
        not isinstance(res, Mapping)
        or not all(
            isinstance(k, str)
            and k not in ("CPU", "GPU")
            and not isinstance(v, bool)
            and isinstance(v, (int, float))
            and v > 0
            for k, v in res.items()
        )
    ):
        raise InvalidArgumentError(
            "server_resources must map Ray resource names (not CPU or GPU) to numbers > 0, "
            f"got {res!r}"
        )
    a["server_resources"] = None if res is None else {k: float(v) for k, v in res.items()}
    if a["durability"] not in _DURABILITIES:
        raise InvalidArgumentError(
            f'durability must be "none", "async" or "sync", got {a["durability"]!r}'
        )
    if a["path"] is None and a["durability"] != "none":
        if a["durability"] == "sync":
            raise InvalidArgumentError('durability="sync" needs a path for the servers\' stores')
        a["durability"] = "none"
    if r > 1 and a["durability"] == "none":
        raise InvalidArgumentError(
            f'replicas={r} needs durability "async" or "sync": followers are fed by the '
            "primary's flush cycles"
        )
    if a["path"] is not None:
        a["path"] = os.path.abspath(os.fspath(a["path"]))
    name = a["name"]
    if not isinstance(name, str) or not name or any(c in name for c in ":/ \n"):
        raise InvalidArgumentError(
            f"name must be a non-empty string without ':', '/' or spaces, got {name!r}"
        )
    for k in ("server_cpus", "check_interval", "start_timeout"):
        v = a[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise InvalidArgumentError(f"{k} must be a number > 0, got {v!r}")
    if a["token"] is None:
        a["token"] = secrets.token_urlsafe(24)
    elif not isinstance(a["token"], str) or not a["token"]:
        raise InvalidArgumentError("token must be a non-empty string")
    return a


def _controller(name: str) -> Any:
    try:
        return ray.get_actor(_controller_name(name), namespace=NAMESPACE)
    except ValueError:
        raise ClusterError(
            f"no pstore cluster named {name!r} runs in this Ray cluster "
            f"(namespace {NAMESPACE!r}); start one with pstore.ray.Cluster or `pstore ray up`"
        ) from None


def connect(cluster: Cluster | str = "default", **connect_args: Any) -> RemoteStore:
    """The :class:`pstore.RemoteStore` of the cluster ``cluster`` (a :class:`Cluster` or its
    name), from any process of the Ray cluster: a driver, a task, an actor, a Ray Train worker.

    The server list and the token come from the controller; ``connect_args`` are those of
    :func:`pstore.connect` (``mode``, ``worker``, ``num_workers``, ``job``, ...). Calls go
    straight to the servers over gRPC. ``retries`` defaults to 10 (about 11 s of backoff), so a
    call rides over a server's restart, which keeps its address.
    """
    name = cluster.name if isinstance(cluster, Cluster) else cluster
    if not isinstance(name, str):
        raise InvalidArgumentError(f"cluster must be a pstore.ray.Cluster or a name, got {name!r}")
    _ensure_ray()
    m: dict[str, Any] = ray.get(_controller(name).membership.remote())
    lost = [s["index"] for s in m.get("servers", []) if s.get("lost")]
    if lost:
        raise ClusterError(f"cluster {name!r} lost server(s) {lost} with their nodes")
    args: dict[str, Any] = {"retries": 10, **connect_args}
    if "token" not in args and "token_file" not in args:
        args["token"] = m["token"]
    groups = _server_list(m)
    if "groups" not in m:
        return pstore.connect([g[0] for g in groups], **args)
    return pstore.connect(groups, **args)  # type: ignore[arg-type]


def _server_list(m: dict[str, Any]) -> list[list[str]]:
    """The server list of a membership record: each position's members, primary first."""
    if "groups" not in m:
        return [[s["address"]] for s in m["servers"]]
    out = []
    for g in m["groups"]:
        members = [x["address"] for x in g["members"]]
        p = g.get("primary")
        out.append(([p] if p in members else []) + [a for a in members if a != p])
    return out


def shutdown(name: str = "default", *, grace: float = 10.0) -> None:
    """Stop the cluster ``name`` (see :meth:`Cluster.shutdown`)."""
    _ensure_ray()
    c = _controller(name)
    ray.get(c.shutdown.remote(float(grace)))
    ray.kill(c, no_restart=True)


def list_clusters() -> list[str]:
    """The names of the pstore clusters running in this Ray cluster."""
    _ensure_ray()
    keys = internal_kv._internal_kv_list(_KV_PREFIX, namespace=NAMESPACE)
    return sorted(k.decode()[len(_KV_PREFIX) :] for k in keys)


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The arguments of :class:`Cluster` in a JSON file (``pstore ray up CONFIG``): an object
    whose keys are :class:`Cluster`'s parameters (``num_servers``, ``path``, ...), plus
    ``token_file`` (relative to the file) instead of ``token``."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            c = json.load(f)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"config {p!r}: {e}") from None
    if not isinstance(c, Mapping):
        raise InvalidArgumentError(f"config {p!r} must be a JSON object")
    allowed = {
        "num_servers",
        "path",
        "durability",
        "token_file",
        "replicas",
        "name",
        "server_cpus",
        "server_resources",
        "num_shards",
        "threads",
        "check_interval",
        "start_timeout",
        "address",
    }
    unknown = set(c) - allowed
    if unknown:
        raise InvalidArgumentError(f"config {p!r}: unknown keys {sorted(unknown)}")
    out = dict(c)
    base = os.path.dirname(os.path.abspath(p))
    if "token_file" in out:
        tf = os.path.join(base, out.pop("token_file"))
        with open(tf, encoding="utf-8") as f:
            out["token"] = f.read().strip()
        if not out["token"]:
            raise InvalidArgumentError(f"token file {tf!r} is empty")
    if "path" in out and out["path"] is not None:
        out["path"] = os.path.join(base, out["path"])
    return out
