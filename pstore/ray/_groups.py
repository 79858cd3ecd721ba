"""Replica groups on Ray (``pstore.ray.Cluster(replicas=R)`` with R > 1): the controller actor
of such a cluster and the Ray :class:`~pstore.controller.Engine` it gives the shared
:class:`~pstore.controller.Controller`.

**Placement.** Group ``g`` has its own placement group ``pstore-servers:<name>:<g>``:
``STRICT_SPREAD`` over R bundles, so the members of one group never share a node. Member 0
starts as the primary, the others follow it (``pstore.server.Server(follow=...)``, the
arguments of ``pstore serve --follow``). A member's store is ``<path>/group-<g>/member-<k>``
(``k`` counts the members the group ever had), always a new directory.

**Failover.** The failover logic is :class:`pstore.controller.Controller`'s, run in this
actor. The engine tells it at once when a member's actor or node is dead (a ``watch`` call in
flight on every member fails when Ray loses the actor), so a lost primary's most caught-up
follower is promoted without waiting ``dead_after``. The engine replaces a lost member by a new
follower of the group's primary, started in the lost member's bundle: Ray places that bundle
again on a live node that holds no other member of the group (the strict spread), or, when the
member's process died on a live node, the bundle is still on that node. The follower is
started in the background; the controller lists it once it answers.

**Scaling.** :meth:`_GroupsController.scale` adds a group as a placement group of its own
(``STRICT_SPREAD`` over R bundles, named as the first groups'), its primary and followers, and,
once the primary lists every follower live, the data plane's ``add_server([primary, ...])``;
then the group is recorded and given to the Controller (``Controller.add_group``). A scale
down removes the last groups (``remove_server``, ``Controller.remove_group``), lets their
members answer "moved" for ``linger`` seconds, then stops them and removes their placement
group. One scale at a time (decision 0113).

**Membership.** The record in Ray's key-value store (``pstore-membership:<name>``) holds every
group with its members (address, node, store, actor name, bundle), its primary and epoch as the
servers last said, and a ``generation`` that grows with every change (a promotion, a
replacement). A restarted controller actor reads it, adopts the live member actors by name,
builds its view by asking the servers (the servers keep their roles and epochs) and changes
nothing that did not change.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Any

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
from pstore.controller import Controller, Engine
from pstore.exceptions import PstoreError
from pstore.ray import (
    NAMESPACE,
    ClusterError,
    _actor_info,
    _free_per_node,
    _kv_key,
    _pg_name,
    _server_list,
    _ServerActor,
    _stop_actors,
    _wait,
)

_WATCH_SECONDS = 30.0
# A primary that stops answering while Ray still sees its actor (hung, cut off) is failed over
# after this long; a dead actor or node is failed over at once.
_DEAD_AFTER = 3.0


def _group_pg_name(name: str, group: int) -> str:
    return f"{_pg_name(name)}:{group}"


def _member_actor(name: str, group: int, member: int) -> str:
    return f"pstore-server:{name}:{group}:{member}"


def bundle_of(spec: dict[str, Any]) -> dict[str, float]:
    """The resources of one server's bundle."""
    return {"CPU": float(spec["server_cpus"]), **dict(spec.get("server_resources") or {})}


def fitting_nodes(bundle: dict[str, float]) -> tuple[int, int]:
    """(live nodes, live nodes whose resources can hold ``bundle``)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    fit = [
        n for n in alive if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())
    ]
    return len(alive), len(fit)


def check_nodes(spec: dict[str, Any]) -> None:
    """Raises ClusterError when fewer live nodes can hold a server than a group has members."""
    r = spec["replicas"]
    bundle = bundle_of(spec)
    alive, fit = fitting_nodes(bundle)
    if fit < r:
        raise ClusterError(
            f"cluster {spec['name']!r}: replicas={r} puts the {r} members of each group on "
            f"{r} different Ray nodes, but only {fit} of the {alive} live nodes can hold a "
            f"server ({bundle}); add nodes or lower replicas"
        )


def groups_fit(bundle: dict[str, float], replicas: int, groups: int) -> tuple[bool, int, int]:
    """Whether ``groups`` new groups of ``replicas`` members (one ``bundle`` each, the members
    of a group on distinct nodes) fit the resources Ray has free now; how many live nodes have
    room for a member; how many members they have room for. Each group takes one bundle on
    each of ``replicas`` nodes, so they fit when at least ``replicas`` nodes have room and the
    nodes can give ``groups * replicas`` bundles with no node giving more than ``groups``."""
    room = [min(n, groups) for n in _free_per_node(bundle).values()]
    nodes = sum(1 for n in room if n > 0)
    return nodes >= replicas and sum(room) >= groups * replicas, nodes, sum(room)


class _RayEngine(Engine):
    """The Controller's engine on Ray (see the module)."""

    def __init__(self, owner: _GroupsController) -> None:
        self._owner = owner

    def is_down(self, address: str) -> bool:
        return self._owner.is_down(address)

    def replace(self, group: int, lost: str, primary: str) -> str | None:
        self._owner.start_replacement(group, lost, primary)
        return None


class _GroupsController:
    """The controller actor of a cluster of replica groups (see the module)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._spec = spec
        self._name: str = spec["name"]
        self._lock = threading.RLock()
        self._events: deque[dict[str, Any]] = deque(maxlen=200)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._membership: dict[str, Any] = {}
        self._handles: dict[str, Any] = {}  # address -> actor handle of a live member
        self._watches: dict[Any, str] = {}  # watch call in flight -> address
        self._dead: set[str] = set()
        self._replacing: set[str] = set()  # lost addresses being replaced
        self._pgs: list[PlacementGroup] = []
        self._scaling = threading.Lock()
        # group index -> (its members' actor handles, its placement group, its addresses) of a
        # group a scale down removed, until its members stop
        self._retiring: dict[int, tuple[list[Any], PlacementGroup, list[str]]] = {}
        raw = internal_kv._internal_kv_get(_kv_key(self._name), namespace=NAMESPACE)
        if raw is None:
            self._start()
        else:
            self._membership = json.loads(raw)
            self._adopt()
        self._ctl = Controller(
            [[m["address"] for m in g["members"]] for g in self._membership["groups"]],
            token=self._spec["token"],
            engine=_RayEngine(self),
            check_interval=float(self._spec["check_interval"]),
            dead_after=_DEAD_AFTER,
            timeout=1.0,
            on_event=self._controller_event,
            on_view=self._on_view,
        )
        self._ctl.check()
        self._loop = threading.Thread(target=self._run, name="pstore-groups", daemon=True)
        self._loop.start()
        self._watcher = threading.Thread(target=self._watch, name="pstore-watch", daemon=True)
        self._watcher.start()

    # -- starting and adopting

    def _start(self) -> None:
        n, r = self._spec["num_servers"], self._spec["replicas"]
        bundle = bundle_of(self._spec)
        check_nodes(self._spec)
        fit = fitting_nodes(bundle)[1]
        pgs = [
            placement_group(
                [dict(bundle) for _ in range(r)],
                strategy="STRICT_SPREAD",
                name=_group_pg_name(self._name, g),
                lifetime="detached",
            )
            for g in range(n)
        ]
        started: list[Any] = []
        tracked: list[tuple[str, Any]] = []
        try:
            for pg in pgs:
                if not _wait(pg.ready(), self._spec["start_timeout"]):
                    raise ClusterError(
                        f"cluster {self._name!r}: Ray could not place {n} groups of {r} "
                        f"servers ({bundle} each, STRICT_SPREAD over {fit} nodes that fit) "
                        f"within {self._spec['start_timeout']} s; add nodes or CPUs, or lower "
                        "server_cpus"
                    )
            groups: list[dict[str, Any]] = []
            for g in range(n):
                started.append(self._make_member(pgs[g], g, 0, 0, None))
            for g, h in enumerate(started):
                info = self._info(h, g)
                tracked.append((info["address"], h))
                groups.append({"index": g, "members": [info], "next": r, "pending": []})
            followers = []
            for g in range(n):
                primary = groups[g]["members"][0]["address"]
                groups[g]["primary"] = primary
                groups[g]["epoch"] = None
                for k in range(1, r):
                    h = self._make_member(pgs[g], g, k, k, primary)
                    started.append(h)
                    followers.append((g, h))
            for g, h in followers:  # started all at once, then waited for
                info = self._info(h, g)
                tracked.append((info["address"], h))
                groups[g]["members"].append(info)
        except BaseException:
            for h in started:
                ray.kill(h, no_restart=True)
            for pg in pgs:
                remove_placement_group(pg)
            raise
        self._pgs = pgs
        self._membership = {
            "name": self._name,
            "generation": 0,
            "token": self._spec["token"],
            "strategy": "STRICT_SPREAD",
            "replicas": r,
            "groups": groups,
        }
        for address, h in tracked:
            self._track(address, h)
        self._save()
        self._event(
            "started",
            groups=[[m["address"] for m in g["members"]] for g in groups],
            strategy="STRICT_SPREAD",
        )
        self._publish_first_routing()

    def _publish_first_routing(self) -> None:
        """Give the new servers the cluster's routing (the default slot table, with each
        position's members), so that the controller can publish replaced members in it and a
        worker whose group failed over twice, to a member it never knew, learns the member from
        the other groups (decision 0112; a cluster without a routing publishes none). Every
        client of this cluster gets its list from the controller, so no client of another list
        meets it. A failure is an event, not a failed start: the cluster serves as before."""
        try:
            store = self._data_plane()
            try:
                slots = store.slots
                slots["epoch"] = int(slots["epoch"]) + 1
                store.publish_routing(slots)
            finally:
                store.close()
        except PstoreError as e:
            self._event("routing_failed", error=str(e).splitlines()[0][:300])

    def _adopt(self) -> None:
        """A restarted controller: the placement groups and the live members by name; pending
        replacements of the controller that died are stopped (the new one asks again)."""
        groups = self._membership["groups"]
        self._pgs = [get_placement_group(_group_pg_name(self._name, g["index"])) for g in groups]
        for r in self._membership.pop("retiring", []):
            # Removed by a scale down of the controller that died, and lingering: stop it now.
            for actor in r["actors"]:
                try:
                    ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=True)
                except ValueError:
                    pass
            try:
                remove_placement_group(get_placement_group(_group_pg_name(self._name, r["index"])))
            except ValueError:
                pass
            self._event("group_stopped", group=r["index"], members=r["members"])
        for g in groups:
            for m in g["members"]:
                try:
                    h = ray.get_actor(m["actor"], namespace=NAMESPACE)
                    ray.get(h.info.remote(), timeout=10.0)
                except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    self._dead.add(m["address"])
                    self._event(
                        "member_down",
                        address=m["address"],
                        reason="found dead when the controller started",
                    )
                    continue
                self._track(m["address"], h)
            for actor in g.get("pending", []):
                try:
                    ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=True)
                except ValueError:
                    pass
            g["pending"] = []
        self._save()
        self._event("adopted", live=len(self._handles), dead=sorted(self._dead))

    def _make_member(
        self, pg: PlacementGroup, group: int, member: int, bundle: int, follow: str | None
    ) -> Any:
        base = self._spec["path"]
        spec = {
            "index": group,
            "member": member,
            "bundle": bundle,
            "actor": _member_actor(self._name, group, member),
            "follow": follow,
            "fresh": True,
            "path": os.path.join(base, f"group-{group}", f"member-{member}"),
            "durability": self._spec["durability"],
            "token": self._spec["token"],
            "port": 0,
            "host": self._spec.get("host"),
            "num_shards": self._spec.get("num_shards"),
            "threads": self._spec.get("threads"),
            "incarnation": 0,
        }
        actor = ray.remote(_ServerActor).options(
            name=spec["actor"],
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=0,
            max_concurrency=8,
            num_cpus=float(self._spec["server_cpus"]),
            resources=dict(self._spec.get("server_resources") or {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle
            ),
        )
        return actor.remote(spec)

    def _info(self, handle: Any, group: int) -> dict[str, Any]:
        info = _actor_info(handle, self._spec, f"a server of group {group}")
        info.pop("running", None)
        return info

    def _track(self, address: str, handle: Any) -> None:
        with self._lock:
            self._handles[address] = handle
            self._watches[handle.watch.remote(_WATCH_SECONDS)] = address

    def _save(self) -> None:
        internal_kv._internal_kv_put(
            _kv_key(self._name), json.dumps(self._membership), overwrite=True, namespace=NAMESPACE
        )

    def _event(self, what: str, **fields: Any) -> None:
        self._events.append({"time": time.time(), "event": what, **fields})

    def _controller_event(self, e: dict[str, Any]) -> None:
        self._events.append(dict(e))

    # -- the engine's side

    def is_down(self, address: str) -> bool:
        with self._lock:
            return address in self._dead or address not in self._handles

    def _find(self, group: int, address: str) -> dict[str, Any] | None:
        """The member ``address`` of group ``group``; None when either left (a scale down)."""
        if group >= len(self._membership["groups"]):
            return None
        g = self._membership["groups"][group]
        return next((m for m in g["members"] if m["address"] == address), None)

    def start_replacement(self, group: int, lost: str, primary: str) -> None:
        """Start, in the background, a follower of ``primary`` in the bundle of the member
        ``lost`` of ``group``; the controller lists it once it answers."""
        with self._lock:
            old = self._find(group, lost)
            if old is None or lost in self._replacing or self._stopping.is_set():
                return
            self._replacing.add(lost)
            h = self._handles.pop(lost, None)
            self._dead.add(lost)
        if h is not None:  # a member that stopped answering but whose actor lives: end it
            ray.kill(h, no_restart=True)
        threading.Thread(
            target=self._replace,
            args=(group, old, primary),
            name=f"pstore-replace-{group}",
            daemon=True,
        ).start()

    def _replace(self, group: int, old: dict[str, Any], primary: str) -> None:
        lost = old["address"]
        try:
            delay = 1.0
            while not self._stopping.is_set():
                with self._lock:
                    if self._find(group, lost) is None:
                        return
                    g = self._membership["groups"][group]
                    member = int(g["next"])
                    g["next"] = member + 1
                    actor = _member_actor(self._name, group, member)
                    g["pending"].append(actor)
                    self._save()
                h = self._make_member(self._pgs[group], group, member, old["bundle"], primary)
                info = self._await_member(h, group, lost, actor)
                if info is not None:
                    self._admit(group, old, info, h, actor, primary)
                    return
                with self._lock:
                    if actor in g["pending"]:
                        g["pending"].remove(actor)
                        self._save()
                ray.kill(h, no_restart=True)
                if self._stopping.wait(delay):
                    return
                delay = min(delay * 2, 30.0)
        except Exception as e:  # the controller asks again when the member is still listed
            self._event("replace_failed", group=group, lost=lost, error=f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._replacing.discard(lost)

    def _await_member(self, h: Any, group: int, lost: str, actor: str) -> dict[str, Any] | None:
        ref = h.info.remote()
        waited = 0.0
        told = False
        while not self._stopping.is_set():
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                try:
                    info: dict[str, Any] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._event("replacement_failed", group=group, lost=lost, error=str(e)[:300])
                    return None
                info.pop("running", None)
                return info
            waited += 1.0
            if waited >= 15.0 and not told:
                told = True
                alive, fit = fitting_nodes(bundle_of(self._spec))
                self._event(
                    "replacement_pending",
                    group=group,
                    lost=lost,
                    actor=actor,
                    reason=(
                        f"Ray has not placed its bundle for {int(waited)} s: it needs a live "
                        f"node that holds no other member of group {group} ({fit} of the "
                        f"{alive} live nodes can hold a server)"
                    ),
                )
        return None

    def _admit(
        self,
        group: int,
        old: dict[str, Any],
        info: dict[str, Any],
        h: Any,
        actor: str,
        primary: str,
    ) -> None:
        with self._lock:
            if self._stopping.is_set() or self._find(group, old["address"]) is None:
                ray.kill(h, no_restart=True)
                return
            g = self._membership["groups"][group]
            g["members"][g["members"].index(old)] = info
            g["pending"].remove(actor)
            self._membership["generation"] += 1
            self._save()
            self._track(info["address"], h)
        # Outside this actor's lock: the controller calls the engine (is_down, replace) under
        # its own lock, which replace_member takes.
        self._ctl.replace_member(group, old["address"], info["address"], primary=primary)
        self._event(
            "member_started",
            group=group,
            address=info["address"],
            node_id=info["node_id"],
            follows=primary,
            replaces=old["address"],
            generation=self._membership["generation"],
        )
        self._wake.set()

    def _on_view(self, view: dict[str, Any]) -> None:
        with self._lock:
            changed = False
            # A scale adds and removes groups at the end, the record and the controller's list
            # one after the other: the groups both hold are the first ones, in the same order.
            for g, members, epoch in zip(
                self._membership["groups"], view["servers"], view["epochs"], strict=False
            ):
                primary = members[0] if members else None
                if (g.get("primary"), g.get("epoch")) == (primary, epoch):
                    continue
                if g.get("epoch") is not None:
                    changed = True
                g["primary"], g["epoch"] = primary, epoch
            if changed:
                self._membership["generation"] += 1
            self._save()

    # -- watching

    def _run(self) -> None:
        interval = float(self._spec["check_interval"])
        while not self._stopping.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self._ctl.check()
            except Exception as e:  # keep watching: one bad round must not end the controller
                self._event("check_failed", error=f"{type(e).__name__}: {e}")

    def _watch(self) -> None:
        """Hears of dead members at once: each member has a ``watch`` call in flight, which
        fails when Ray loses the actor (its process, or its node)."""
        while not self._stopping.is_set():
            with self._lock:
                refs = list(self._watches)
            if not refs:
                self._stopping.wait(0.5)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            for ref in ready:
                with self._lock:
                    address = self._watches.pop(ref, None)
                    h = self._handles.get(address) if address is not None else None
                if address is None:
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    with self._lock:
                        self._dead.add(address)
                        self._handles.pop(address, None)
                    self._event(
                        "member_down",
                        address=address,
                        reason=str(e).strip().splitlines()[0][:300],
                    )
                    self._wake.set()
                    continue
                if h is not None and not self._stopping.is_set():
                    with self._lock:
                        self._watches[h.watch.remote(_WATCH_SECONDS)] = address

    # -- scaling

    def scale(self, num_servers: int, grace: float, linger: float) -> dict[str, Any]:
        """Grow or shrink the cluster to ``num_servers`` groups while workers train (see
        :meth:`pstore.ray.Cluster.scale`). One scale at a time: another one is refused."""
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise ClusterError(
                f"num_servers must be an int >= 1, got {num_servers!r} (nothing was changed)"
            )
        if not self._scaling.acquire(blocking=False):
            raise ClusterError(
                f"cluster {self._name!r}: a scale is running already; wait for it to return, "
                "then call scale again (nothing was changed)"
            )
        try:
            t0 = time.monotonic()
            with self._lock:
                before = _server_list(self._membership)
            headless = [
                g["index"]
                for g in self._ctl.status()["groups"]
                if g["state"] not in ("ok", "degraded")
            ]
            if headless:
                raise ClusterError(
                    f"cluster {self._name!r}: group(s) {headless} have no live primary now; a "
                    "scale moves rows from and to every group, so it needs them all (nothing "
                    "was changed; try again once they failed over)"
                )
            n = len(before)
            if num_servers > n:
                moves = self._scale_up(n, num_servers)
            elif num_servers < n:
                moves = self._scale_down(n, num_servers, grace, linger)
            else:
                moves = []
            with self._lock:
                after = _server_list(self._membership)
                generation = self._membership["generation"]
            return {
                "before": [g[0] for g in before],
                "servers": [g[0] for g in after],
                "groups_before": before,
                "groups": after,
                "added": [g[0] for g in after[n:]],
                "removed": [g[0] for g in before[len(after) :]],
                "generation": generation,
                "moves": moves,
                "seconds": time.monotonic() - t0,
            }
        finally:
            self._scaling.release()

    def _data_plane(self) -> RemoteStore:
        with self._lock:
            groups = _server_list(self._membership)
        return pstore.connect(
            groups,  # type: ignore[arg-type]
            token=self._membership["token"],
            retries=10,
        )

    def _scale_up(self, n: int, target: int) -> list[dict[str, Any]]:
        """Start groups ``n`` .. ``target - 1`` and add them one at a time."""
        r = int(self._membership["replicas"])
        bundle = bundle_of(self._spec)
        for g in range(n, target):
            if g in self._retiring:  # removed moments ago, still answering "moved"
                self._retire(g, 1.0)
        ok, nodes, room = groups_fit(bundle, r, target - n)
        if not ok:
            raise ClusterError(
                f"cluster {self._name!r}: {target - n} new group(s) of {r} servers ({bundle} "
                f"each) need {r} different nodes per group, but the live nodes have room now "
                f"for {room} of the {(target - n) * r} servers, on {nodes} node(s); add nodes "
                "or resources, or lower num_servers (nothing was changed)"
            )
        moves = []
        for k, g in enumerate(range(n, target)):
            members, handles, pg = self._start_group(g, r, bundle)
            addresses = [m["address"] for m in members]
            try:
                report = self._data_plane().add_server(addresses)
            except BaseException as e:
                for h in handles:
                    ray.kill(h, no_restart=True)
                remove_placement_group(pg)
                raise ClusterError(
                    f"cluster {self._name!r}: adding group {g} ({addresses}) failed: {e}; the "
                    f"cluster has {n + k} groups (the ones added before stay)"
                ) from None
            with self._lock:
                self._pgs.append(pg)
                self._membership["groups"].append(
                    {
                        "index": g,
                        "members": members,
                        "next": r,
                        "pending": [],
                        "primary": addresses[0],
                        "epoch": None,
                    }
                )
                self._membership["generation"] += 1
                self._save()
                generation = self._membership["generation"]
                for m, h in zip(members, handles, strict=True):
                    self._track(m["address"], h)
            self._ctl.add_group(addresses)
            moves.append(report)
            self._event(
                "group_added",
                group=g,
                members=addresses,
                nodes=[m["node_id"] for m in members],
                rows=report.get("rows"),
                seconds=report.get("seconds"),
                generation=generation,
            )
            self._wake.set()
        return moves

    def _start_group(
        self, g: int, r: int, bundle: dict[str, float]
    ) -> tuple[list[dict[str, Any]], list[Any], PlacementGroup]:
        """Group ``g``'s placement group (STRICT_SPREAD, ``r`` bundles) and members, the
        followers following the primary; nothing is left behind when it fails."""
        name = _group_pg_name(self._name, g)
        try:  # a placement group a scale cut short left behind
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass
        for k in range(r):  # actors a scale cut short left behind
            try:
                ray.kill(ray.get_actor(_member_actor(self._name, g, k), namespace=NAMESPACE))
            except ValueError:
                pass
        pg = placement_group(
            [dict(bundle) for _ in range(r)],
            strategy="STRICT_SPREAD",
            name=name,
            lifetime="detached",
        )
        handles: list[Any] = []
        try:
            if not _wait(pg.ready(), self._spec["start_timeout"]):
                raise ClusterError(
                    f"cluster {self._name!r}: Ray could not place group {g} ({r} servers of "
                    f"{bundle}, STRICT_SPREAD) within {self._spec['start_timeout']} s; add nodes "
                    "or CPUs, or lower num_servers (nothing was changed)"
                )
            handles.append(self._make_member(pg, g, 0, 0, None))
            primary = self._info(handles[0], g)
            for k in range(1, r):
                handles.append(self._make_member(pg, g, k, k, primary["address"]))
            members = [primary] + [self._info(h, g) for h in handles[1:]]
            self._await_followers(g, primary["address"], [m["address"] for m in members[1:]])
        except BaseException:
            for h in handles:
                ray.kill(h, no_restart=True)
            remove_placement_group(pg)
            raise
        return members, handles, pg

    def _await_followers(self, g: int, primary: str, followers: list[str]) -> None:
        """Until the primary lists every follower live (the data plane's add_server checks
        that they follow it)."""
        deadline = time.monotonic() + float(self._spec["start_timeout"])
        c = pstore.connect([primary], token=self._membership["token"], timeout=5.0, retries=2)
        try:
            while True:
                try:
                    rep = c.status()[0].get("replication") or {}
                    live = {f["name"] for f in rep.get("followers", []) if f.get("live")}
                except PstoreError:
                    live = set()
                if set(followers) <= live:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"cluster {self._name!r}: the followers {sorted(set(followers) - live)} "
                        f"of group {g} did not follow {primary} within "
                        f"{self._spec['start_timeout']} s (nothing was changed)"
                    )
                time.sleep(0.2)
        finally:
            c.close()

    def _scale_down(self, n: int, target: int, grace: float, linger: float) -> list[dict[str, Any]]:
        """Remove groups ``n - 1`` down to ``target``: their rows move to the others, then their
        members stop (after ``linger`` seconds) and their placement groups go."""
        moves = []
        for g in range(n - 1, target - 1, -1):
            report = self._data_plane().remove_server(g)
            self._ctl.remove_group(g)
            with self._lock:
                gone = self._membership["groups"].pop()
                pg = self._pgs.pop()
                addresses = [m["address"] for m in gone["members"]]
                handles = [h for a in addresses if (h := self._handles.pop(a, None)) is not None]
                for actor in gone.get("pending", []):
                    try:
                        handles.append(ray.get_actor(actor, namespace=NAMESPACE))
                    except ValueError:
                        pass
                self._membership["generation"] += 1
                # Recorded, so that a controller restarted during the linger stops it.
                self._membership.setdefault("retiring", []).append(
                    {
                        "index": g,
                        "members": addresses,
                        "actors": [m["actor"] for m in gone["members"]] + gone.get("pending", []),
                    }
                )
                self._save()
                generation = self._membership["generation"]
                # Its members keep answering "moved" for `linger` seconds, so that a worker
                # that calls them then follows the new list at once (decision 0111).
                self._retiring[g] = (handles, pg, addresses)
            threading.Thread(
                target=self._retire_later,
                args=(g, handles, grace, linger),
                name=f"pstore-retire-{g}",
                daemon=True,
            ).start()
            moves.append(report)
            self._event(
                "group_removed",
                group=g,
                members=addresses,
                rows=report.get("rows"),
                seconds=report.get("seconds"),
                generation=generation,
            )
        return moves

    def _retire_later(self, g: int, handles: list[Any], grace: float, linger: float) -> None:
        if self._stopping.wait(linger):
            return  # shutdown stops them
        with self._lock:
            entry = self._retiring.get(g)
            if entry is None or entry[0] is not handles:
                return
        self._retire(g, grace)

    def _retire(self, g: int, grace: float) -> None:
        """Stop the members of group ``g`` that a scale down removed, remove its placement
        group and its record."""
        with self._lock:
            entry = self._retiring.pop(g, None)
            if entry is None:
                return
            self._membership["retiring"] = [
                x for x in self._membership.get("retiring", []) if x["index"] != g
            ]
            self._save()
        handles, pg, addresses = entry
        _stop_actors(handles, grace)
        remove_placement_group(pg)
        self._event("group_stopped", group=g, members=addresses)

    # -- what clients and Cluster call

    def membership(self) -> dict[str, Any]:
        with self._lock:
            m: dict[str, Any] = json.loads(json.dumps(self._membership))
        return m

    def status(self) -> dict[str, Any]:
        view = self._ctl.status()
        with self._lock:
            m: dict[str, Any] = json.loads(json.dumps(self._membership))
            live = set(self._handles) - self._dead
        n = min(len(view["groups"]), len(m["groups"]))  # differ only while a scale runs
        view["groups"] = view["groups"][:n]
        for cg, g in zip(view["groups"], m["groups"][:n], strict=True):
            infos = {x["address"]: x for x in g["members"]}
            for x in cg["members"]:
                ray_info = infos.get(x["address"], {})
                for k in ("node_id", "pid", "path", "member", "actor", "started_at"):
                    if k in ray_info:
                        x[k] = ray_info[k]
                x["alive"] = x["address"] in live
            cg["pending"] = g.get("pending", [])
        return {
            "name": m["name"],
            "generation": m["generation"],
            "strategy": m["strategy"],
            "replicas": m["replicas"],
            "num_servers": len(m["groups"]),
            "scaling": self._scaling.locked(),
            "path": self._spec["path"],
            "durability": self._spec["durability"],
            "controller_pid": os.getpid(),
            "groups": view["groups"],
            "rounds": view["rounds"],
            "events": list(self._events),
        }

    def shutdown(self, grace: float) -> None:
        """Stop every member (flushing its store), remove the placement groups and the record."""
        self._stopping.set()
        self._wake.set()
        self._loop.join(30)
        self._ctl.stop()
        with self._lock:
            handles = list(self._handles.values())
            pending = [a for g in self._membership["groups"] for a in g.get("pending", [])]
            self._handles = {}
            retiring = list(self._retiring.values())
            self._retiring = {}
        for members, pg, _ in retiring:
            handles.extend(members)
            self._pgs.append(pg)
        for a in pending:
            try:
                handles.append(ray.get_actor(a, namespace=NAMESPACE))
            except ValueError:
                pass
        _stop_actors(handles, grace)
        for pg in self._pgs:
            remove_placement_group(pg)
        internal_kv._internal_kv_del(_kv_key(self._name), namespace=NAMESPACE)
