"""The control plane of replica groups: watch every server, promote a follower when a group's
primary is dead, publish the new view, ask the engine for a replacement follower.

>>> from pstore.controller import Controller  # doctest: +SKIP
>>> c = Controller.from_cluster_file("cluster.json")  # doctest: +SKIP
>>> c.start()  # a thread checks every server each check_interval  # doctest: +SKIP
>>> c.status()["groups"][0]["primary"]  # doctest: +SKIP

The logic is written once and runs wherever the servers run: ``pstore controller --cluster
FILE`` (plain processes, Kubernetes) and the Ray controller actor drive the same
:class:`Controller`; what differs is the :class:`Engine`, the one part that knows how servers
are started (docs/CLUSTER.md, "The controller"; why this shape: docs/decisions/0094).

**What it trusts.** The servers' own ``Status`` (role, group epoch, LSN, lag, the primary's live
followers) and the engine's word that a server is gone. The servers keep their role and epoch
in their stores, so the controller keeps no state of its own: a restarted controller asks every
member and has the same view (the primary of the highest epoch wins).

**When it acts.** A group whose members answer with no primary of the newest epoch for
``dead_after`` seconds (or whose primary the engine reports dead) gets its most caught-up live
follower promoted (``pstore.promote``, under the next epoch). It never promotes a follower that
the primary last reported outside its live set (with ``ack="all"`` it could lack acknowledged
pushes), never one that is resyncing or was never caught up, never in a group where two members
claim to be primary of the same epoch, and never twice for one loss: one promotion per group is
in flight, and a group with a live primary of the newest epoch is left alone. The data plane
fences any old primary (docs/decisions/0100), so a wrong guess about a death costs a failover,
not a write under two primaries.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pstore.client import RemoteStore, connect, load_cluster, promote
from pstore.exceptions import InvalidArgumentError, PstoreError

__all__ = ["Controller", "Engine", "write_cluster_file"]


class Engine:
    """What a :class:`Controller` asks of the system that runs the servers. The default engine
    is a supervisor's: something else (Kubernetes' StatefulSet, systemd) restarts a dead server
    with its disk, and the restarted server rejoins its group as a follower by itself."""

    def replace(self, group: int, lost: str, primary: str) -> str | None:
        """Start a follower of ``primary`` in place of the member ``lost`` of ``group`` (it
        catches up by the primary's resync). Returns the new member's address when it differs
        from ``lost``, else None: the supervisor restarts ``lost`` at its address, or the
        engine starts the follower in the background and calls
        :meth:`Controller.replace_member` once it answers. The default does nothing: the
        supervisor restarts ``lost``."""
        return None

    def is_down(self, address: str) -> bool:
        """True when the engine knows ``address`` is gone for good (its process or node died):
        the controller need not wait ``dead_after`` to act. The default knows nothing."""
        return False


class _Member:
    """What one member last answered."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.rep: dict[str, Any] | None = None  # its replication status, when it answered
        self.error: str | None = None
        self.seen: float | None = None  # monotonic time of its last answer
        self.failing_since: float | None = None
        self.replacement_asked = False

    def role(self) -> str:
        if self.rep is None or self.error is not None:
            return "down"
        return str(self.rep.get("role") or "none")

    def epoch(self) -> int:
        return int((self.rep or {}).get("epoch") or 0)

    def describe(self, now: float) -> dict[str, Any]:
        r = self.rep if self.error is None else None
        d: dict[str, Any] = {"address": self.address, "role": self.role()}
        if r is not None:
            d["epoch"] = self.epoch()
            d["lsn"] = r.get("lsn")
            if r.get("role") == "follower":
                for k in ("primary", "lag_entries", "lag_seconds", "resyncing", "connected"):
                    d[k] = r.get(k)
        else:
            d["error"] = self.error
            d["down_for"] = None if self.failing_since is None else now - self.failing_since
        return d


class _Group:
    def __init__(self, index: int, members: Sequence[str]) -> None:
        self.index = index
        self.members = [_Member(a) for a in members]
        self.primary: str | None = None  # the primary of the newest epoch, as last seen
        self.epoch = 0
        self.state = "unknown"
        self.headless_since: float | None = None  # no live primary since
        self.live: set[str] | None = None  # the primary's live followers, as last seen
        self.promoting = False

    def member(self, address: str) -> _Member | None:
        return next((m for m in self.members if m.address == address), None)


class Controller:
    """Watches the replica groups of one cluster and fails them over (see the module).

    Parameters
    ----------
    groups : list
        The cluster's server list: entries "host:port" or lists of them (a replica group, its
        first member the initial primary), as in a cluster file.
    token, token_file : optional
        The servers' token (default ``PSTORE_TOKEN``).
    engine : Engine, optional
        How servers are started (default: a supervisor restarts them, see :class:`Engine`).
    check_interval : float
        Seconds between two rounds of checks (each asks every member its ``Status``).
    dead_after : float
        Seconds a group must be without a live primary before a follower is promoted.
    timeout : float
        Seconds one member has to answer a check.
    on_event : callable, optional
        Called with each event (a dict: ``time``, ``event``, ``group`` and details) as it is
        taken; events are also kept in :meth:`status` (the last 200).
    on_view : callable, optional
        Called with :meth:`view` whenever it changes (a new primary, a replaced member): the
        place to publish it (``pstore controller --publish FILE`` writes a cluster file).
    """

    def __init__(
        self,
        groups: Sequence[str | Sequence[str]],
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        engine: Engine | None = None,
        check_interval: float = 0.5,
        dead_after: float = 3.0,
        timeout: float = 1.0,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        on_view: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        from pstore.client import _groups, _read_secret

        parsed = _groups(groups, "groups")
        seen: set[str] = set()
        for g in parsed:
            for a in g:
                if a in seen:
                    raise InvalidArgumentError(f"{a} is listed twice in the groups")
                seen.add(a)
        for name, v in (
            ("check_interval", check_interval),
            ("dead_after", dead_after),
            ("timeout", timeout),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidArgumentError(f"{name} must be a number > 0, got {v!r}")
        if engine is not None and not isinstance(engine, Engine):
            raise InvalidArgumentError(f"engine must be a pstore.controller.Engine, got {engine!r}")
        self._token = _read_secret(token, token_file, "PSTORE_TOKEN")
        self._engine = engine or Engine()
        self._interval = float(check_interval)
        self._dead_after = float(dead_after)
        self._timeout = float(timeout)
        self._on_event = on_event
        self._on_view = on_view
        self._groups = [_Group(i, g) for i, g in enumerate(parsed)]
        self._lock = threading.RLock()
        self._events: deque[dict[str, Any]] = deque(maxlen=200)
        self._clients: dict[str, RemoteStore] = {}
        self._generation = 0
        self._rounds = 0
        self._published: str | None = None
        # The generation of the members last put in the servers' routing (publish_members).
        self._routed = 0
        self._routing_failed = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(16, max(2, len(seen))))

    @classmethod
    def from_cluster_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> Controller:
        """A controller of the groups of the cluster file ``path`` (its ``token_file`` too,
        unless ``token`` or ``token_file`` is given)."""
        c = load_cluster(path)
        if "token" not in kwargs and "token_file" not in kwargs and c.get("token_file"):
            kwargs["token_file"] = c["token_file"]
        return cls(c["servers"], **kwargs)

    # -- running

    def start(self) -> None:
        """Build the view from the servers (one round of checks), then keep checking in a
        thread until :meth:`stop`."""
        if self._thread is not None:
            raise InvalidArgumentError("this controller runs already")
        self._event(None, "started", groups=[[m.address for m in g.members] for g in self._groups])
        self.check()
        self._thread = threading.Thread(target=self._run, name="pstore-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop checking (the servers go on as they are)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check()
            except Exception as e:  # keep watching: one bad round must not end the controller
                self._event(None, "check_failed", error=f"{type(e).__name__}: {e}")

    def check(self) -> None:
        """One round: ask every member, then act on each group (see the module)."""
        with self._lock:
            groups = list(self._groups)
        members = [m for g in groups for m in g.members]
        answers = list(self._pool.map(self._ask, [m.address for m in members]))
        now = time.monotonic()
        with self._lock:
            for m, (rep, err) in zip(members, answers, strict=True):
                if err is None:
                    m.rep, m.error, m.seen, m.failing_since = rep, None, now, None
                    m.replacement_asked = False
                else:
                    m.error = err
                    if m.failing_since is None:
                        m.failing_since = now
            self._rounds += 1
        for g in groups:
            with self._lock:
                if g not in self._groups:
                    continue  # removed meanwhile
            self._decide(g, now)
        self._publish()
        self._publish_members()

    def _ask(self, address: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            c = self._clients.get(address)
            if c is None:
                c = connect([address], self._token, timeout=self._timeout, retries=0)
                self._clients[address] = c
            rep = c.status()[0].get("replication")
            return (rep or {"role": "none"}), None
        except PstoreError as e:
            self._clients.pop(address, None)
            return None, str(e).splitlines()[0][:300]

    # -- deciding

    def _decide(self, g: _Group, now: float) -> None:
        with self._lock:
            primaries = [m for m in g.members if m.role() == "primary"]
            top = max((m.epoch() for m in primaries), default=0)
            newest = [m for m in primaries if m.epoch() == top]
            heard = max((m.epoch() for m in g.members if m.role() != "down"), default=0)
            if len(newest) > 1:
                # Two members claim the same epoch: no rule says which one holds the writes.
                self._set_state(g, "conflict", primaries=[m.address for m in newest], epoch=top)
                return
            if newest and top >= max(heard, g.epoch):
                p = newest[0]
                if g.primary != p.address or g.epoch != top:
                    if g.primary is not None:
                        self._event(g.index, "primary_seen", primary=p.address, epoch=top)
                    g.primary, g.epoch = p.address, top
                    self._generation += 1
                g.headless_since = None
                g.live = {f["name"] for f in (p.rep or {}).get("followers", []) if f.get("live")}
                down = [m for m in g.members if m.role() == "down"]
                self._set_state(g, "degraded" if down else "ok")
                for m in down:
                    self._maybe_replace(g, m, p.address, now)
                return
            # No live primary of the newest epoch.
            if g.headless_since is None:
                g.headless_since = now
            if g.primary is None:
                # Never seen (a controller started after the primary died): the member the
                # followers follow, when they agree on one.
                followed = {
                    str((m.rep or {}).get("primary"))
                    for m in g.members
                    if m.role() == "follower" and (m.rep or {}).get("primary")
                }
                if len(followed) == 1 and g.member(next(iter(followed))) is not None:
                    g.primary, g.epoch = next(iter(followed)), max(g.epoch, heard)
            gone = g.primary is not None and self._engine.is_down(g.primary)
            waited = now - g.headless_since
            if g.promoting or (waited < self._dead_after and not gone):
                self._set_state(g, "primary_unreachable", primary=g.primary)
                return
            cand = self._candidate(g, max(heard, g.epoch))
            if cand is None:
                self._set_state(
                    g,
                    "no_candidate",
                    primary=g.primary,
                    members={m.address: m.describe(now) for m in g.members},
                )
                return
            g.promoting = True
            old = g.primary
        self._promote(g, cand, old, waited)

    def _candidate(self, g: _Group, epoch: int) -> _Member | None:
        """The follower to promote: live, whole, caught up once, of the group's newest epoch,
        in the primary's live set when that was seen; the most caught-up (lowest lag)."""
        ok = []
        for m in g.members:
            r = m.rep
            if m.role() != "follower" or r is None or r.get("resyncing"):
                continue
            if r.get("lag_seconds") is None:
                continue  # never caught up with its primary
            if int(r.get("epoch") or 0) < epoch:
                continue  # it follows a primary of an older epoch
            if r.get("primary") not in {x.address for x in g.members}:
                continue  # it follows a server of another group
            if g.live is not None and m.address not in g.live:
                continue  # the primary acknowledged pushes without it
            ok.append(m)
        if not ok:
            return None
        return max(ok, key=lambda m: (int((m.rep or {}).get("lsn") or 0), -g.members.index(m)))

    def _promote(self, g: _Group, cand: _Member, old: str | None, waited: float) -> None:
        try:
            r = promote(cand.address, token=self._token, timeout=max(5.0, self._timeout))
        except PstoreError as e:
            with self._lock:
                g.promoting = False
            self._event(
                g.index, "promote_failed", server=cand.address, error=str(e).splitlines()[0]
            )
            return
        with self._lock:
            g.promoting = False
            g.primary, g.epoch = cand.address, int(r["epoch"])
            g.headless_since = None
            g.live = None
            self._generation += 1
            g.state = "ok"
        self._event(
            g.index,
            "promoted",
            server=cand.address,
            epoch=int(r["epoch"]),
            old_primary=old,
            after_seconds=round(waited, 3),
            from_lsn=r["from_lsn"],
            writes_in_seconds=round(float(r["writes_in_seconds"]), 3),
        )
        if old is not None:
            m = g.member(old)
            if m is not None:
                self._maybe_replace(g, m, cand.address, time.monotonic(), now_dead=True)

    def _maybe_replace(
        self, g: _Group, m: _Member, primary: str, now: float, *, now_dead: bool = False
    ) -> None:
        if m.replacement_asked:
            return
        if (
            not now_dead
            and (m.failing_since is None or now - m.failing_since < self._dead_after)
            and not self._engine.is_down(m.address)
        ):
            return
        m.replacement_asked = True
        try:
            new = self._engine.replace(g.index, m.address, primary)
        except Exception as e:
            self._event(g.index, "replace_failed", lost=m.address, error=f"{type(e).__name__}: {e}")
            m.replacement_asked = False
            return
        if new is None or new == m.address:
            self._event(g.index, "replacement_awaited", lost=m.address, primary=primary)
            return
        self.replace_member(g.index, m.address, new, primary=primary)

    def replace_member(
        self, group: int, lost: str, new: str, *, primary: str | None = None
    ) -> None:
        """Put the member ``new`` in the place of ``lost`` in group ``group`` (the view lists it
        from now on). :meth:`Engine.replace` returning an address does this; an engine that
        starts the follower in the background calls it itself once the follower answers.
        Raises InvalidArgumentError when ``lost`` is no member of the group or ``new`` is a
        member of a group already."""
        with self._lock:
            if not 0 <= group < len(self._groups):
                raise InvalidArgumentError(
                    f"no group {group} (the cluster has {len(self._groups)})"
                )
            g = self._groups[group]
            m = g.member(lost)
            if m is None:
                raise InvalidArgumentError(f"{lost} is no member of group {group}")
            if any(x.address == new for gg in self._groups for x in gg.members):
                raise InvalidArgumentError(f"{new} is a member of a group already")
            g.members[g.members.index(m)] = _Member(new)
            self._generation += 1
        self._event(group, "replaced", lost=lost, server=new, primary=primary)

    def add_group(self, members: Sequence[str]) -> int:
        """Watch one more group, ``members`` its addresses (the first believed primary), at the
        end of the list: call it once the group joined the data plane's list
        (:meth:`pstore.RemoteStore.add_server`). Returns its index. Raises InvalidArgumentError
        for no members, or a member listed in a group already."""
        from pstore.client import _groups

        parsed = _groups([list(members)], "members")[0]
        with self._lock:
            for a in parsed:
                if any(x.address == a for g in self._groups for x in g.members):
                    raise InvalidArgumentError(f"{a} is a member of a group already")
            index = len(self._groups)
            self._groups.append(_Group(index, parsed))
            self._list_changed()
        self._event(index, "group_added", members=parsed)
        return index

    def remove_group(self, group: int) -> list[str]:
        """Stop watching group ``group`` (the ones after it move down one place, as the data
        plane's positions do after :meth:`pstore.RemoteStore.remove_server`). Returns its
        members. Raises InvalidArgumentError for a group not in the list or the last one."""
        with self._lock:
            if isinstance(group, bool) or not isinstance(group, int):
                raise InvalidArgumentError(f"group must be an int, got {group!r}")
            if not 0 <= group < len(self._groups):
                raise InvalidArgumentError(
                    f"no group {group} (the cluster has {len(self._groups)})"
                )
            if len(self._groups) == 1:
                raise InvalidArgumentError("the last group cannot be removed")
            g = self._groups.pop(group)
            for i, other in enumerate(self._groups):
                other.index = i
            self._list_changed()
        members = [m.address for m in g.members]
        self._event(group, "group_removed", members=members)
        return members

    def _list_changed(self) -> None:
        """The list of groups changed (under the lock). The data plane's add_server or
        remove_server published the new list's members, so the routing names them already:
        nothing more to publish, unless a replacement was waiting for its publish."""
        up_to_date = self._routed == self._generation
        self._generation += 1
        if up_to_date:
            self._routed = self._generation

    def _set_state(self, g: _Group, state: str, **details: Any) -> None:
        if g.state != state:
            g.state = state
            self._event(g.index, state, **details)

    # -- what others read

    def _event(self, group: int | None, what: str, **fields: Any) -> None:
        e: dict[str, Any] = {"time": time.time(), "event": what}
        if group is not None:
            e["group"] = group
        e.update(fields)
        with self._lock:
            self._events.append(e)
        if self._on_event is not None:
            self._on_event(e)

    def view(self) -> dict[str, Any]:
        """The membership as the servers say it is: ``servers`` (each group, its primary
        first: a cluster file's list), ``epochs`` (each group's), ``generation`` (grows with
        every change)."""
        with self._lock:
            servers: list[list[str]] = []
            for g in self._groups:
                first = [g.primary] if g.primary else []
                servers.append(first + [m.address for m in g.members if m.address != g.primary])
            return {
                "servers": servers,
                "epochs": [g.epoch for g in self._groups],
                "generation": self._generation,
            }

    def _publish(self) -> None:
        if self._on_view is None:
            return
        v = self.view()
        key = json.dumps({k: v[k] for k in ("servers", "epochs")})
        if key != self._published:
            self._on_view(v)
            self._published = key

    def _publish_members(self) -> None:
        """Once a member was replaced, put the groups' members in the routing the servers hold
        (``RemoteStore.publish_members``: the next epoch, the same slots), so that a client that
        knows none of a group's live members learns them from the other servers (decision
        0112). Servers that hold no routing are left so (nothing is published); a publish that
        fails is tried again next round."""
        with self._lock:
            generation = self._generation
            groups = self.view()["servers"]
        if generation == self._routed:
            return
        try:
            store = connect(
                groups,
                self._token,
                timeout=self._timeout,
                retries=0,
                failover_timeout=self._timeout,
            )
            try:
                epoch = store.publish_members(groups)
            finally:
                store.close()
        except PstoreError as e:
            if self._routing_failed != generation:
                self._routing_failed = generation
                self._event(None, "routing_failed", error=str(e).splitlines()[0][:300])
            return
        self._routed = generation
        if epoch is not None:
            self._event(None, "routing_published", epoch=epoch, servers=groups)

    def status(self) -> dict[str, Any]:
        """``groups`` (each with ``index``, ``primary``, ``epoch``, ``state`` — ``ok``,
        ``degraded`` (a member down), ``primary_unreachable``, ``no_candidate``, ``conflict`` —
        ``live_followers`` (the primary's live set as last seen: the followers that may be
        promoted; None before the primary was seen) and ``members``, each with its ``role``,
        ``epoch``, ``lsn``, a follower's lag, or the ``error`` of a member that did not
        answer), ``generation``, ``rounds`` and the recent ``events``."""
        now = time.monotonic()
        with self._lock:
            return {
                "groups": [
                    {
                        "index": g.index,
                        "primary": g.primary,
                        "epoch": g.epoch,
                        "state": g.state,
                        "live_followers": None if g.live is None else sorted(g.live),
                        "members": [m.describe(now) for m in g.members],
                    }
                    for g in self._groups
                ],
                "generation": self._generation,
                "rounds": self._rounds,
                "events": list(self._events),
            }

    @property
    def events(self) -> list[dict[str, Any]]:
        """The recent events, oldest first."""
        with self._lock:
            return list(self._events)


def write_cluster_file(
    path: str | os.PathLike[str], view: Mapping[str, Any], base: Mapping[str, Any]
) -> None:
    """Write ``view``'s server list (each group's primary first) into the cluster file ``path``
    atomically, with the other keys of ``base`` (a cluster file's content: ``token_file``,
    ``slots``, ...)."""
    out = {k: v for k, v in base.items() if k != "servers"}
    out["servers"] = [g[0] if len(g) == 1 else list(g) for g in view["servers"]]
    p = os.fspath(path)
    tmp = f"{p}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
