"""The ``pstore`` command line. Each command calls the same public API users call.

Commands that are applications rather than library (``pstore demo``, from :mod:`pstore.apps`)
are not imported here by name: the command finds them through the ``pstore.commands``
entry-point group (see :data:`COMMANDS_GROUP`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

import numpy as np

import pstore
from pstore._progress import Progress, format_seconds
from pstore.inspection import inspect_store, snapshot_chain, verify_snapshot

COMMANDS_GROUP = "pstore.commands"
"""The entry-point group of the ``pstore`` commands that live outside the library, such as
``pstore demo``. Each entry, named like its command, is a function that takes the subparsers of
the ``pstore`` parser and adds its command's parser, with a ``func`` default: the function that
runs the command from the parsed arguments and returns the exit code."""


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"pstore {pstore.__version__} (numpy {np.__version__}, python {sys.version.split()[0]})")
    return 0


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _existing_store(path: str) -> str:
    if not os.path.isdir(path):
        raise pstore.InvalidArgumentError(f"{path}: no such directory")
    if not os.path.isfile(os.path.join(path, "data.mdb")):
        raise pstore.InvalidArgumentError(f"{path} is not a pstore store (it has no data.mdb)")
    return path


def _bar(total: int, desc: str, quiet: bool) -> Progress:
    return Progress(total=total, desc=desc, unit="row", disable=quiet)


def _advance(bar: Progress) -> Callable[[int], None]:
    def update(done: int) -> None:
        bar.update(done - bar.n)

    return update


def _rows(store: pstore.Store, *, dense: bool = True) -> int:
    """Rows of every table; a dense table counts as one, or not at all (progress counts the rows
    of sparse tables only)."""
    return sum(
        len(t) if isinstance(t, pstore.SparseTable) else int(dense)
        for t in map(store.table, store.tables())
    )


def _cmd_snapshot(args: argparse.Namespace) -> int:
    store_path = _existing_store(args.store)
    start = time.perf_counter()
    with pstore.Store(store_path, durability="none") as store:
        total = _rows(store, dense=False)
        with _bar(0 if args.incremental else total, "snapshot", args.quiet) as bar:
            m = store.snapshot(args.out, incremental=args.incremental, progress=_advance(bar))
    rows = sum(t["rows"] for t in m["tables"])
    print(
        f"{m['kind']} snapshot {m['id']} of {store_path} -> {args.out}: {len(m['tables'])} tables, "
        f"{rows} rows, {_bytes(m['bytes'])} in {format_seconds(time.perf_counter() - start)}"
    )
    return 0


def _cmd_restore(args: argparse.Namespace) -> int:
    chain = _chain(args.snapshot)
    total = sum(t["rows"] for _, m in chain for t in m["tables"] if t["record"]["kind"] == "sparse")
    if os.path.exists(os.path.join(args.out, "data.mdb")):
        raise pstore.InvalidArgumentError(
            f"{args.out} holds a store already; restore into a new directory"
        )
    start = time.perf_counter()
    with _bar(total, "restore", args.quiet) as bar:
        store = pstore.Store.restore(
            args.snapshot,
            args.out,
            num_shards=args.num_shards,
            environments=args.environments,
            progress=_advance(bar),
        )
    with store:
        rows = _rows(store)
        print(
            f"restored {len(chain)} snapshot(s) into {args.out}: {len(store.tables())} tables, "
            f"{rows} rows in {format_seconds(time.perf_counter() - start)}"
        )
    return 0


def _chain(path: str) -> list[tuple[str, dict[str, Any]]]:
    return snapshot_chain(path)


def _record(rec: dict[str, Any]) -> str:
    cfg = rec["config"]
    opt = cfg["optimizer"]["kind"]
    name = opt if isinstance(opt, str) else next(iter(opt))
    shape = f"dim {cfg['dim']}" if rec["kind"] == "sparse" else f"shape {tuple(cfg['shape'])}"
    return f"{rec['kind']:6} {shape}, {name} lr {rec['lr']:g}, seq {rec['seq']}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = args.path
    # An object-store URI (s3://) can only be a snapshot: its chain says if it is none.
    remote = "://" in path and not path.startswith("file://")
    if remote or os.path.isfile(os.path.join(path, "manifest.json")):
        chain = _chain(path)
        if args.verify:
            checked = verify_snapshot(path)
        if args.json:
            print(json.dumps({"kind": "snapshot", "chain": [m for _, m in chain]}, indent=2))
            return 0
        print(f"snapshot {path}: a chain of {len(chain)} (base first)")
        for p, m in chain:
            size = sum(
                f["bytes"]
                for t in m["tables"]
                for f in [*t["files"], *([t["tombstones"]] if t["tombstones"] else [])]
            )
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["created_at"]))
            print(f"  {m['kind']:11} {m['id']}  {when}  {_bytes(size):>10}  {p}")
        print("tables (the last snapshot):")
        for t in chain[-1][1]["tables"]:
            tomb = t["tombstones"]["rows"] if t["tombstones"] else 0
            print(
                f"  {t['name']:20} {_record(t['record'])}; {t['total_rows']} rows, "
                f"{t['rows']} in this snapshot, {tomb} tombstones"
            )
        if args.verify:
            print(f"verified: every file's size and checksum ({_bytes(checked)})")
        return 0
    if os.path.isfile(os.path.join(path, "data.mdb")):
        info = inspect_store(path)
        if args.json:
            print(json.dumps({"kind": "store", **info}, indent=2))
            return 0
        print(
            f"store {path}: format {info['format']} version {info['version']}, "
            f"{info['environments']} LMDB environment{'s' if info['environments'] > 1 else ''}, "
            f"{_bytes(info['file_bytes'])} on disk, flush cycle {info['cycle']}"
        )
        snap = info["snapshot"]
        print(f"  last snapshot: {snap['id'] + ' at ' + snap['path'] if snap else 'none'}")
        for t in info["tables"]:
            rec = t["record"]
            rows = t["rows"] if rec["kind"] == "sparse" else 1
            print(
                f"  {t['name']:20} {_record(rec)}; {rows} rows, "
                f"{t['changed_since_snapshot']} changed and {t['removed_since_snapshot']} "
                "removed since the last snapshot"
            )
        return 0
    if not os.path.exists(path):
        raise pstore.InvalidArgumentError(f"{path}: no such file or directory")
    raise pstore.InvalidArgumentError(
        f"{path} is neither a pstore store (no data.mdb) nor a snapshot (no manifest.json)"
    )


def _server_settings(args: argparse.Namespace, token_file: str | None) -> dict[str, Any]:
    """What the options of :func:`_server_options` give `serve` and `serve_model`."""
    from pstore.client import _read_secret

    return {
        "metrics_port": args.metrics_port,
        "token": _read_secret(None, token_file, "PSTORE_TOKEN"),
        "read_token": _read_secret(None, args.read_token_file, "PSTORE_READ_TOKEN"),
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "metrics_host": args.metrics_host,
        "metrics_token": _read_secret(None, args.metrics_token_file, "PSTORE_METRICS_TOKEN"),
        "metrics_tls": args.metrics_tls,
        "max_connections": args.max_connections,
        "handshake_timeout": args.handshake_timeout,
        "rows_port": args.rows_port,
        "max_message": args.max_message,
        "log_interval": args.log_interval,
        "grace": args.grace,
        "restore_signals": False,
    }


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _keep_freed_memory() -> None:
    """In a server process, glibc keeps up to 128 MiB of freed heap per arena instead of handing
    it back at once (decision 0118). A push's HTTP/2 frames are received into fresh buffers,
    freed once the push is applied: with glibc's defaults those pages went back to the kernel
    after every large push and were faulted in, zeroed, for the next one (a quarter of a store
    server's time at 65536 ids). Left alone when MALLOC_TRIM_THRESHOLD_ or
    MALLOC_MMAP_THRESHOLD_ is set, or off glibc."""
    if sys.platform != "linux":
        return
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Buffers up to 32 MiB come from the heap (the default moves between 128 KiB and that as
    # buffers are freed); the heap is trimmed only past 128 MiB free.
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 128 << 20)


def _cmd_serve(args: argparse.Namespace) -> int:
    _keep_freed_memory()
    from pstore.client import load_cluster
    from pstore.server import serve

    token_file = args.token_file
    follow, replica_name = args.follow, args.replica_name
    members = None
    if args.member is not None:
        follow, replica_name, members = _member_role(args)
        token_file = token_file or load_cluster(args.cluster).get("token_file")
    elif args.cluster is not None:
        cluster = load_cluster(args.cluster)
        if args.index is None or not 0 <= args.index < len(cluster["servers"]):
            raise pstore.InvalidArgumentError(
                f"--cluster needs --index in 0..{len(cluster['servers']) - 1}"
            )
        entry = cluster["servers"][args.index]
        # A replica group: its first member (its other members run with --port and --follow).
        host, _, port = (entry if isinstance(entry, str) else entry[0]).rpartition(":")
        args.port = int(port)
        if args.host is None:
            args.host = host.strip("[]")
        token_file = token_file or cluster.get("token_file")
    elif args.index is not None:
        raise pstore.InvalidArgumentError("--index needs --cluster")

    store = pstore.Store(
        path=args.path,
        durability=args.durability,
        flush_interval=args.flush_interval,
        num_shards=args.num_shards,
        threads=args.threads,
        environments=args.environments,
    )
    return serve(
        store,
        host=args.host or "127.0.0.1",
        port=args.port,
        follow=follow,
        replica_name=replica_name,
        replication_log_bytes=args.replication_log_bytes,
        replication_log_age=args.replication_log_age,
        ack_timeout=args.ack_timeout,
        members=members,
        **_server_settings(args, token_file),
    )


def _member_role(args: argparse.Namespace) -> tuple[str | None, str, list[str]]:
    """``pstore serve --cluster FILE --member NAME``: the first member of NAME's replica group
    starts as its primary, the others follow it; a restarted member keeps the role its store
    recorded (a promoted one stays primary until it learns a newer epoch). NAME is also the
    name a follower gives its primary (the controller matches it against the file). Returns
    the primary to follow, the name, and the group's other members (a member starting as
    primary asks them whether one was promoted meanwhile)."""
    from pstore.client import _groups, load_cluster

    if args.cluster is None:
        raise pstore.InvalidArgumentError("--member needs --cluster")
    if args.index is not None or args.follow is not None:
        raise pstore.InvalidArgumentError("--member takes the place of --index and --follow")
    if args.path is None:
        raise pstore.InvalidArgumentError("--member needs --path: a replica keeps its rows on disk")
    groups = _groups(load_cluster(args.cluster)["servers"], "the cluster file")
    mine = [g for g in groups if args.member in g]
    if not mine:
        raise pstore.InvalidArgumentError(
            f"--member {args.member} is no member of the cluster file {args.cluster!r} "
            f"(its servers: {groups})"
        )
    group = mine[0]
    follow = None if group[0] == args.member else group[0]
    return follow, args.replica_name or args.member, [m for m in group if m != args.member]


def _cmd_status(args: argparse.Namespace) -> int:
    if (args.cluster is None) == (not args.servers):
        raise pstore.InvalidArgumentError("give the servers (HOST:PORT ...) or --cluster FILE")
    # connect reads the token file, else the cluster file's, else $PSTORE_TOKEN.
    remote = pstore.connect(
        args.cluster or args.servers,
        token_file=args.token_file,
        timeout=args.timeout,
        retries=0,
        tls_ca=args.tls_ca,
    )
    health = remote.health()
    status = remote.status()
    if args.json:
        for s, h in zip(status, health, strict=True):
            s["health"] = h
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    for s, h in zip(status, health, strict=True):
        print(
            f"{s['server']}: {h}  pstore {s['version']} (protocol {s['protocol']})  "
            f"{s['durability']}{'  ' + s['path'] if s['path'] else ''}  "
            f"up {format_seconds(s['uptime_seconds'])}  "
            f"flush lag {s['flush_lag_seconds']:.2f} s"
        )
        if s["role"] == "model":
            m = s["model"]
            lag = max(0.0, time.time() - m["snapshot"]["created_at"])
            print(
                f"  model server: snapshot {m['snapshot']['id']} ({m['snapshot']['kind']}), "
                f"generation {m['generation']}, {m['dtype']}, {format_seconds(lag)} behind"
            )
            for t in s["tables"]:
                print(f"  {t['name']:<20} {t['kind']:<6} rows {t['rows']:>12,}")
            continue
        rep = s.get("replication")
        if rep and rep["role"] == "follower":
            lag = rep["lag_seconds"]
            print(
                f"  follower of {rep['primary']}: LSN {rep['lsn']} of {rep['primary_lsn']}, "
                f"{rep['lag_entries']} entries behind"
                + (f", caught up {lag:.2f} s ago" if lag is not None else ", never caught up")
                + ("" if rep["connected"] else f", not connected ({rep['last_error']})")
                + f", group epoch {rep.get('epoch', 1)}"
            )
        if rep and rep.get("dropped_commits") is not None:
            print(
                f"  rejoined as a follower: dropped {rep['dropped_commits']} commit(s) the new "
                "primary did not have"
            )
        if rep and rep["role"] == "primary":
            print(
                f"  primary of group epoch {rep.get('epoch', 1)}"
                + (
                    f" (promoted from {rep['promoted_from']['primary']} at its LSN "
                    f"{rep['promoted_from']['lsn']})"
                    if rep.get("promoted_from")
                    else ""
                )
            )
        if rep and rep["role"] == "primary" and rep["followers"]:
            for f in rep["followers"]:
                state = "live" if f["live"] else f"not live ({f['dropped'] or 'catching up'})"
                print(
                    f"  follower {f['name']}: acked LSN {f['acked_lsn']} of {rep['lsn']}, "
                    f"{state}{'' if f['connected'] else ', not connected'}"
                )
        if s["clocks"]:
            c = s["clocks"]
            print(f"  worker clocks: {c} (min {min(c)}, max {max(c)})")
        for t in s["tables"]:
            st = t["stats"]["staleness"]
            mean = st["total"] / st["pushes"] if st["pushes"] else 0.0
            shape = (
                f"dim {t['config']['dim']}"
                if t["kind"] == "sparse"
                else f"shape {tuple(t['config']['shape'])}"
            )
            print(
                f"  {t['name']:<20} {t['kind']:<6} {shape:<14} rows {t['rows']:>12,}  "
                f"seq {t['seq']:>10,}  lr {t['lr']:g}  stale {t['stale_policy']} "
                f"(mean {mean:.2f}, max {st['max']}, dropped {st['dropped']})"
            )
            hist = st.get("histogram")
            if st["pushes"] and hist:
                bounds = t["stats"].get("staleness_buckets", [])
                names = [str(b) for b in bounds] + [f">{bounds[-1]}" if bounds else "more"]
                shown = "  ".join(f"{b}: {n}" for b, n in zip(names, hist, strict=True) if n)
                print(f"  {'':<20} staleness histogram  {shown}")
    # Each push is counted once, by one server (however many servers its ids span).
    pushes: dict[str, int] = {}
    for s in status:
        for t in s.get("tables", []):
            if "pushes_counted" in t["stats"]:
                pushes[t["name"]] = pushes.get(t["name"], 0) + t["stats"]["pushes_counted"]
    if len(status) > 1 and pushes:
        print("cluster: " + ", ".join(f"{n} {c:,} pushes" for n, c in sorted(pushes.items())))
    return 0 if all(h == "SERVING" for h in health) else 1


def _cmd_reshard(args: argparse.Namespace) -> int:
    if (args.cluster is None) == (not args.servers):
        raise pstore.InvalidArgumentError("give the servers (HOST:PORT ...) or --cluster FILE")
    report = pstore.restore_cluster(
        args.snapshot,
        args.cluster or args.servers,
        token_file=args.token_file,
        timeout=args.timeout,
        tls_ca=args.tls_ca,
        via=args.via,
    )
    print(
        f"loaded {report['rows']:,} rows of {report['tables']} tables from "
        f"{report['parts']} part(s) of {args.snapshot}"
    )
    return 0


def _ray_address(args: argparse.Namespace, configured: str | None = None) -> str:
    """The Ray cluster of a `pstore ray` command: --address, the config's, $RAY_ADDRESS, else
    the running cluster of this node ("auto"): never a new local Ray that would end with the
    command."""
    return args.address or configured or os.environ.get("RAY_ADDRESS") or "auto"


def _cmd_ray_up(args: argparse.Namespace) -> int:
    import pstore.ray

    config = pstore.ray.load_config(args.config)
    config["address"] = _ray_address(args, config.get("address"))
    cluster = pstore.ray.Cluster(**config)
    groups = cluster.groups
    if all(len(g) == 1 for g in groups):
        print(f"cluster {cluster.name!r} is up: {len(groups)} servers")
        for i, g in enumerate(groups):
            print(f"  server {i}: {g[0]}")
    else:
        print(f"cluster {cluster.name!r} is up: {len(groups)} replica groups")
        for i, g in enumerate(groups):
            print(f"  group {i}: primary {g[0]}, followers {' '.join(g[1:])}")
    print(f"connect with pstore.ray.connect({cluster.name!r}); stop with `pstore ray down`")
    return 0


def _cmd_ray_status(args: argparse.Namespace) -> int:
    import pstore.ray

    st = pstore.ray.Cluster.attach(args.name, address=_ray_address(args)).status()
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    elif "groups" in st:
        print(
            f"cluster {st['name']!r}: {st['num_servers']} replica groups of {st['replicas']} "
            f"({st['strategy']}), generation {st['generation']}, {st['durability']}"
            f"{'  ' + st['path'] if st['path'] else ''}"
        )
        for g in st["groups"]:
            print(f"  group {g['index']}: {g['state']}  epoch {g['epoch']}  primary {g['primary']}")
            for m in g["members"]:
                lag = f"  lag {m['lag_entries']}" if m.get("lag_entries") is not None else ""
                node = f"  node {m['node_id'][:12]}" if m.get("node_id") else ""
                print(f"    {m['address']}  {m['role']}{lag}{node}  pid {m.get('pid')}")
            for a in g.get("pending", []):
                print(f"    (starting {a})")
    else:
        print(
            f"cluster {st['name']!r}: {st['num_servers']} servers ({st['strategy']}), "
            f"generation {st['generation']}, {st['durability']}"
            f"{'  ' + st['path'] if st['path'] else ''}"
        )
        for s in st["servers"]:
            print(
                f"  server {s['index']}: {s['address']}  {s['health']}  node {s['node_id'][:12]}  "
                f"pid {s['pid']}  restarts {s['incarnation']}"
                f"{'  LOST' if s.get('lost') else ''}"
            )
    if not args.json:
        for e in st["events"][-args.events :] if args.events else []:
            when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
            rest = "  ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event"))
            print(f"  {when} {e['event']}  {rest}")
    if "groups" in st:
        healthy = all(g["state"] == "ok" for g in st["groups"])
    else:
        healthy = all(s["health"] == "SERVING" for s in st["servers"])
    return 0 if healthy else 1


def _cmd_cluster_promote(args: argparse.Namespace) -> int:
    from pstore.client import promote

    r = promote(
        args.address,
        cluster=args.cluster,
        force=args.force,
        token_file=args.token_file,
        timeout=args.timeout,
    )
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
    else:
        print(
            f"{r['server']} is the primary of its group under epoch {r['epoch']} (it holds the "
            f"old primary's log up to LSN {r['from_lsn']}); it accepts writes in "
            f"{r['writes_in_seconds']:.2f} s"
        )
    return 0


def _connect_cluster(args: argparse.Namespace) -> pstore.RemoteStore:
    """The cluster of `--servers` or `--cluster` (a `--servers` entry with commas is a replica
    group, its primary first)."""
    if (args.cluster is None) == (not args.servers):
        raise pstore.InvalidArgumentError(
            "give the cluster's servers with --servers HOST:PORT ... or --cluster FILE"
        )
    servers = [s.split(",") if "," in s else s for s in args.servers or []]
    return pstore.connect(
        args.cluster or servers,
        token_file=args.token_file,
        timeout=args.timeout,
        tls_ca=args.tls_ca,
    )


def _cmd_cluster_members(args: argparse.Namespace) -> int:
    groups = [g.split(",") for g in args.groups]
    remote = _connect_cluster(args)
    try:
        epoch = remote.publish_members(groups)
    finally:
        remote.close()
    if args.json:
        print(json.dumps({"epoch": epoch, "groups": groups}, indent=2, sort_keys=True))
    elif epoch is None:
        print("nothing published: the servers hold no routing, or it names these members already")
    else:
        print(
            f"published routing epoch {epoch}: "
            + "; ".join(", ".join(g) for g in groups)
            + " (workers that cannot reach a group's members they know ask the other servers "
            "and follow)"
        )
    return 0


def _cmd_cluster_membership(args: argparse.Namespace) -> int:
    remote = _connect_cluster(args)
    try:
        pace = args.max_rows_per_second
        if args.cluster_command == "add-server":
            r = remote.add_server(args.address, max_rows_per_second=pace)
        else:
            r = remote.remove_server(args.address, max_rows_per_second=pace)
        listed = remote.servers
    finally:
        remote.close()
    if args.json:
        print(json.dumps({**r, "servers": listed}, indent=2, sort_keys=True))
    else:
        done = "joined" if args.cluster_command == "add-server" else "left"
        who = f"position {args.address}" if args.address.isdigit() else args.address
        print(
            f"{who} {done} the cluster: {r['slots']:,} slots and {r['rows']:,} rows "
            f"moved in {r['seconds']:.2f} s ({r['batches']} batches, the longest frozen "
            f"{r['max_frozen_seconds']:.3f} s); routing epoch {r['epoch']}, servers: "
            + ", ".join(listed)
        )
    return 0


def _cmd_ray_scale(args: argparse.Namespace) -> int:
    import pstore.ray

    cluster = pstore.ray.Cluster.attach(args.name, address=_ray_address(args))
    r = cluster.scale(args.num_servers, grace=args.grace, linger=args.linger)
    if not r["added"] and not r["removed"]:
        print(f"cluster {args.name!r} has {len(r['servers'])} servers already: nothing changed")
        return 0
    rows = sum(int(m.get("rows", 0)) for m in r["moves"])
    print(
        f"cluster {args.name!r} scaled from {len(r['before'])} to {len(r['servers'])} servers "
        f"in {r['seconds']:.1f} s ({rows} rows moved; generation {r['generation']})"
    )
    for a in r["added"]:
        print(f"  added {a}")
    for a in r["removed"]:
        print(f"  removed {a}")
    return 0


def _cmd_ray_down(args: argparse.Namespace) -> int:
    import pstore.ray

    pstore.ray.Cluster.attach(args.name, address=_ray_address(args)).shutdown(grace=args.grace)
    print(f"cluster {args.name!r} is down (its stores stay on the nodes' disks)")
    return 0


def _cmd_controller(args: argparse.Namespace) -> int:
    import http.server
    import threading

    from pstore.client import load_cluster
    from pstore.controller import Controller, write_cluster_file
    from pstore.server import log_event

    base = load_cluster(args.cluster)

    def on_event(e: dict[str, Any]) -> None:
        fields = {k: v for k, v in e.items() if k not in ("time", "event")}
        for k, v in fields.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool):
                fields[k] = json.dumps(v, sort_keys=True)
        level = "warning" if e["event"] in _CONTROLLER_WARNINGS else "info"
        log_event(e["event"], level=level, **fields)

    def on_view(view: dict[str, Any]) -> None:
        if args.publish is not None:
            write_cluster_file(args.publish, view, base)
            log_event("published", path=args.publish, generation=view["generation"])

    controller = Controller.from_cluster_file(
        args.cluster,
        **({"token_file": args.token_file} if args.token_file else {}),
        check_interval=args.check_interval,
        dead_after=args.dead_after,
        timeout=args.timeout,
        on_event=on_event,
        on_view=on_view,
    )
    got: list[int] = []
    stopped = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        stopped.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    httpd: http.server.ThreadingHTTPServer | None = None
    try:
        controller.start()
        if args.status_port is not None:

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self) -> None:
                    if self.path == "/status":
                        body = json.dumps(controller.status(), indent=2).encode()
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                    elif self.path == "/healthz":
                        body = b"ok\n"
                        self.send_response(200)
                        self.send_header("Content-Type", "text/plain")
                    else:
                        body = b"not found: GET /status or /healthz\n"
                        self.send_response(404)
                        self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, format: str, *a: Any) -> None:
                    pass

            httpd = http.server.ThreadingHTTPServer((args.status_host, args.status_port), Handler)
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            log_event(
                "status_served",
                address=f"{args.status_host}:{httpd.server_address[1]}",
                paths="/status,/healthz",
            )
        log_event("controlling", cluster=args.cluster, pid=os.getpid())
        stopped.wait()
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        controller.stop()
        for s, h in old.items():
            signal.signal(s, h)
    log_event("stopped", signal=signal.Signals(got[0]).name if got else "")
    return 0


_CONTROLLER_WARNINGS = ("conflict", "no_candidate", "promote_failed", "replace_failed")


def _cmd_export(args: argparse.Namespace) -> int:
    from pstore import serving

    tables = None if args.tables is None else [t for t in args.tables.split(",") if t]
    chain = _chain(args.snapshot)
    start = time.perf_counter()
    with Progress(total=len(chain), desc="export", unit="snapshot", disable=args.quiet) as bar:
        info = serving.export(
            args.snapshot, args.out, tables=tables, dtype=args.dtype, progress=_advance(bar)
        )
    rows = sum(t["rows"] for t in info["tables"] if t["kind"] == "sparse")
    print(
        f"exported {len(chain)} snapshot(s) of {args.snapshot} -> {args.out}: "
        f"{len(info['tables'])} tables, {rows} rows as {info['dtype']}, "
        f"{_bytes(info['file_bytes'])} ({info['bytes_per_row']:.1f} bytes/row) "
        f"in {format_seconds(time.perf_counter() - start)}"
    )
    for t in info["tables"]:
        shape = f"dim {t['dim']}" if t["kind"] == "sparse" else f"shape {tuple(t['shape'])}"
        print(f"  {t['name']:<20} {t['kind']:<6} {shape:<14} rows {t['rows']:>12,}")
    return 0


def _cmd_serving_follow(args: argparse.Namespace) -> int:
    import threading

    from pstore import serving
    from pstore.server import log_event

    stop = threading.Event()
    # A signal ends the wait between rounds; a snapshot being applied finishes first (each is
    # one transaction, so even a kill leaves the artifact at a whole version).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    log_event("following", root=args.root, model=args.model, interval=args.interval)

    n = serving.follow(
        args.root,
        args.model,
        interval=args.interval,
        once=args.once,
        stop=stop,
        on_apply=serving.log_applied,
        on_error=serving.log_follow_error,
    )
    log_event("stopped", applied=n)
    return 0


def _cmd_serve_model(args: argparse.Namespace) -> int:
    _keep_freed_memory()
    from pstore.serving import serve_model

    return serve_model(
        args.model,
        follow_root=args.follow,
        interval=args.interval,
        default=args.default,
        host=args.host,
        port=args.port,
        **_server_settings(args, args.token_file),
    )


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from pstore.serving.onnx import export_onnx

    tables = None if args.tables is None else [t for t in args.tables.split(",") if t]
    start = time.perf_counter()
    info = export_onnx(args.source, args.out, tables=tables, default=args.default)
    print(
        f"wrote {info['path']}: {len(info['tables'])} table(s), {_bytes(info['bytes'])}"
        f"{' (external data)' if info['external_data'] else ''} "
        f"in {format_seconds(time.perf_counter() - start)}"
    )
    return 0


def _server_options(p: argparse.ArgumentParser, *, token: str, logs: str) -> None:
    """The options `pstore serve` and `pstore serve-model` share: metrics, tokens, TLS, message
    size, the rows port, logs and the stop's grace period."""
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    p.add_argument(
        "--rows-port",
        type=int,
        default=None,
        help="also answer pulls (a store server: and pushes) on this plain TCP port of --host (0: "
        "any; not with TLS; pstore.connect clients find and use it, docs/PROTOCOL.md 'Rows port')",
    )
    p.add_argument(
        "--metrics-host", default=None, help="bind address of the metrics port (default: --host)"
    )
    p.add_argument(
        "--metrics-token-file",
        default=None,
        help="file holding a token every scrape must carry ($PSTORE_METRICS_TOKEN)",
    )
    p.add_argument(
        "--metrics-tls",
        action="store_true",
        help="serve the metrics over HTTPS with --tls-cert and --tls-key",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections open at once per port; more are closed as they come (default: the "
        "open-file limit less 64, at most 4096)",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=None,
        help="seconds a connection may stay open before its first request (default 10)",
    )
    p.add_argument("--token-file", default=None, help=f"file holding {token}")
    p.add_argument("--read-token-file", default=None, help="file holding a read-only token")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--max-message", type=int, default=None, help="largest message in bytes (default 64 MiB)"
    )
    p.add_argument("--log-interval", type=float, default=60.0, help=f"seconds between {logs} logs")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to finish calls on stop")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pstore`` command."""
    parser = argparse.ArgumentParser(
        prog="pstore", description="pstore: an embedding-table parameter store."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "snapshot",
        help="write a snapshot of a durable store (not open in another process)",
        description="Write a full (or, with --incremental, an incremental) snapshot of the "
        "durable store STORE into the new directory OUT, or into the object-store prefix OUT "
        "(s3://BUCKET/PREFIX, credentials and endpoint from the AWS_* environment).",
    )
    p.add_argument("store", metavar="STORE", help="a durable store directory")
    p.add_argument(
        "out", metavar="OUT", help="the snapshot directory (or s3://BUCKET/PREFIX) to create"
    )
    p.add_argument(
        "--incremental",
        action="store_true",
        help="only rows changed since the store's previous snapshot, plus tombstones",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_snapshot)

    p = sub.add_parser(
        "restore",
        help="rebuild a durable store from a snapshot and its increments",
        description="Rebuild the durable store OUT (a new directory) from SNAPSHOT, following "
        "an increment's parents back to its full snapshot.",
    )
    p.add_argument(
        "snapshot", metavar="SNAPSHOT", help="a snapshot directory or s3://BUCKET/PREFIX"
    )
    p.add_argument("out", metavar="OUT", help="the store directory to create")
    p.add_argument("--num-shards", type=int, default=None, help="shards per table (default 64)")
    p.add_argument(
        "--environments",
        type=int,
        default=None,
        help="LMDB environments of the new store, a writer thread each (default 1)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_restore)

    p = sub.add_parser(
        "reshard",
        help="load a cluster snapshot onto any list of store servers",
        description="Load the cluster snapshot SNAPSHOT (written by store.snapshot(DIR) on a "
        "connected store) onto the servers of --cluster FILE or HOST:PORT ..., routing every "
        "row by the new list: the same call as pstore.restore_cluster.",
    )
    p.add_argument(
        "snapshot", metavar="SNAPSHOT", help="a cluster snapshot directory or s3://BUCKET/PREFIX"
    )
    p.add_argument("servers", nargs="*", metavar="HOST:PORT")
    p.add_argument("--cluster", default=None, help="a cluster file of the new servers")
    p.add_argument("--token-file", default=None, help="file holding a token ($PSTORE_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM) of the servers")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each call, s")
    p.add_argument(
        "--via",
        choices=("servers", "client"),
        default="servers",
        help="servers: each server reads the snapshot's directory itself (default); client: "
        "this command reads it and sends the rows (for servers that do not reach it)",
    )
    p.set_defaults(func=_cmd_reshard)

    p = sub.add_parser(
        "inspect",
        help="show a store or a snapshot: tables, rows, bytes, versions, chain of increments",
    )
    p.add_argument(
        "path", metavar="PATH", help="a store directory, a snapshot directory or s3://BUCKET/PREFIX"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--verify", action="store_true", help="check every snapshot file's size and checksum"
    )
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "serve",
        help="run a store server (gRPC) until SIGTERM or SIGINT",
        description="Serve a store over gRPC (proto/pstore/v1/pstore.proto). Durable with "
        "--path, in memory without. Tokens come from --token-file or $PSTORE_TOKEN (read-only: "
        "--read-token-file or $PSTORE_READ_TOKEN); without one the server is open. On SIGTERM "
        "or SIGINT it finishes the calls in flight, flushes and exits 0.",
    )
    p.add_argument("--port", type=int, default=7070, help="gRPC port (default 7070; 0: any)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--cluster", default=None, help="a cluster file (docs/CLUSTER.md)")
    p.add_argument("--index", type=int, default=None, help="this server's index in --cluster")
    p.add_argument(
        "--member",
        default=None,
        metavar="HOST:PORT",
        help="this server's name in a replica group of --cluster: the group's first member "
        "starts as its primary, the others follow it (a restart keeps the role the store "
        "recorded); --host and --port still say where it listens",
    )
    p.add_argument("--path", default=None, help="durable store directory (default: in memory)")
    p.add_argument(
        "--durability",
        choices=["sync", "async", "none"],
        default="async",
        help="when pushes reach disk (with --path; default async)",
    )
    p.add_argument("--flush-interval", type=float, default=1.0, help="async flush period, s")
    p.add_argument("--num-shards", type=int, default=None, help="shards per table")
    p.add_argument("--threads", type=int, default=None, help="threads of the store's pool")
    p.add_argument(
        "--environments",
        type=int,
        default=None,
        help="LMDB environments of a new --path store, a writer thread each (default 1)",
    )
    p.add_argument(
        "--follow",
        default=None,
        metavar="HOST:PORT",
        help="be a follower of the primary at HOST:PORT: apply its commit log to --path, "
        "refuse writes (docs/CLUSTER.md, Replication)",
    )
    p.add_argument(
        "--replica-name",
        default=None,
        help="with --follow: the name this follower gives its primary (default: its address)",
    )
    p.add_argument(
        "--replication-log-bytes",
        type=int,
        default=None,
        help="a primary's commit log kept for followers, in bytes (default 256 MiB)",
    )
    p.add_argument(
        "--replication-log-age",
        type=float,
        default=None,
        help="seconds a primary keeps a commit log entry for followers (default 600)",
    )
    p.add_argument(
        "--ack-timeout",
        type=float,
        default=None,
        help='seconds a push with ack="all" waits for a follower before it leaves the live '
        "set (default 5)",
    )
    _server_options(p, token="the read-write token", logs="stats")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "status",
        help="show store servers: health, tables, rows, clocks, staleness",
    )
    p.add_argument("servers", nargs="*", metavar="HOST:PORT")
    p.add_argument("--cluster", default=None, help="a cluster file instead of the addresses")
    p.add_argument("--token-file", default=None, help="file holding a token ($PSTORE_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="PEM of the CA of the servers' certificates")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "export",
        help="build a read-only serving artifact from a snapshot and its increments",
        description="Build the serving artifact MODEL_DIR (a new directory) from SNAPSHOT and "
        "its chain of increments: weights only, optionally quantized (docs/FORMAT.md).",
    )
    p.add_argument("snapshot", metavar="SNAPSHOT", help="a snapshot directory")
    p.add_argument("--out", required=True, metavar="MODEL_DIR", help="the artifact to create")
    p.add_argument("--tables", default=None, help="comma-separated tables (default: all)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "int8"],
        default="float32",
        help="how rows are stored (int8: per-row scale; default float32)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serving", help="keep serving artifacts up to date")
    serving_sub = p.add_subparsers(dest="serving_command", metavar="COMMAND", required=True)
    f = serving_sub.add_parser(
        "follow",
        help="apply the snapshots training writes under a directory to an artifact",
        description="Keep MODEL_DIR at the newest snapshot under SNAPSHOT_ROOT: every "
        "--interval seconds, apply the increments after the one it is at (a newer full "
        "snapshot replaces it), each atomically. Runs until SIGINT/SIGTERM, or once.",
    )
    f.add_argument("root", metavar="SNAPSHOT_ROOT", help="the directory snapshots go into")
    f.add_argument("--model", required=True, metavar="MODEL_DIR", help="the artifact")
    f.add_argument("--interval", type=float, default=10.0, help="seconds between checks")
    f.add_argument("--once", action="store_true", help="apply what is there, then exit")
    f.set_defaults(func=_cmd_serving_follow)

    p = sub.add_parser(
        "serve-model",
        help="serve an artifact read-only over gRPC until SIGTERM or SIGINT",
        description="Answer lookups from the serving artifact MODEL_DIR over gRPC (the "
        "pstore.v1.PStore service, read-only: Pull is a lookup, writes are refused). Tokens "
        "as for `pstore serve`.",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a serving artifact")
    p.add_argument("--port", type=int, default=7071, help="gRPC port (default 7071; 0: any)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--default",
        choices=["initial", "zeros"],
        default="initial",
        help="the row of an id the artifact lacks (default: the table's initial value)",
    )
    p.add_argument("--follow", default=None, metavar="SNAPSHOT_ROOT", help="apply new snapshots")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between --follow checks")
    _server_options(p, token="a token ($PSTORE_TOKEN)", logs="lag")
    p.set_defaults(func=_cmd_serve_model)

    p = sub.add_parser(
        "export-onnx",
        help="write an ONNX model mapping int64 ids to rows, per table (needs pstore[onnx])",
    )
    p.add_argument("source", metavar="SNAPSHOT_OR_ARTIFACT", help="a snapshot or an artifact")
    p.add_argument("--out", required=True, help="the .onnx file to write")
    p.add_argument("--tables", default=None, help="comma-separated tables (default: all)")
    p.add_argument("--default", choices=["zeros"], default="zeros", help="the row of unknown ids")
    p.set_defaults(func=_cmd_export_onnx)

    p = sub.add_parser(
        "ray",
        help="run a cluster of store servers on Ray (needs pstore[ray])",
        description="Start, inspect and stop a pstore cluster on the Ray cluster of "
        "--address (default: $RAY_ADDRESS, else the one this node belongs to): docs/RAY.md.",
    )
    ray_sub = p.add_subparsers(dest="ray_command", metavar="COMMAND", required=True)
    r = ray_sub.add_parser(
        "up",
        help="start the servers and the controller of a config file",
        description="Start the cluster CONFIG describes: a JSON object of the arguments of "
        "pstore.ray.Cluster (num_servers, path, durability, name, server_cpus, ...; "
        "token_file instead of token; paths relative to the file).",
    )
    r.add_argument("config", metavar="CONFIG", help="a JSON config file")
    r.set_defaults(func=_cmd_ray_up)
    r = ray_sub.add_parser("status", help="the controller's view of a cluster")
    r.add_argument("--json", action="store_true", help="print the status as JSON")
    r.add_argument("--events", type=int, default=10, help="recent events shown (default 10)")
    r.set_defaults(func=_cmd_ray_status)
    r = ray_sub.add_parser(
        "scale",
        help="grow or shrink a running cluster to N servers, moving rows online",
        description="Add servers (their share of the rows moves to them) or remove the last "
        "ones (their rows move to the others) while workers train: pstore.ray.Cluster.scale.",
    )
    r.add_argument("num_servers", metavar="N", type=int, help="the number of servers wanted")
    r.add_argument("--grace", type=float, default=10.0, help="seconds to finish calls on stop")
    r.add_argument(
        "--linger",
        type=float,
        default=30.0,
        help="seconds a removed server answers 'moved' before it stops (default 30)",
    )
    r.set_defaults(func=_cmd_ray_scale)
    r = ray_sub.add_parser("down", help="stop a cluster's servers and controller")
    r.add_argument("--grace", type=float, default=10.0, help="seconds to finish calls on stop")
    r.set_defaults(func=_cmd_ray_down)
    for r in ray_sub.choices.values():
        r.add_argument("--address", default=None, help="the Ray cluster (ray.init's address)")
        if r.get_default("func") is not _cmd_ray_up:
            r.add_argument("--name", default="default", help="the cluster's name")

    p = sub.add_parser("cluster", help="replica groups: promote a follower; add and remove servers")
    cluster_sub = p.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    c = cluster_sub.add_parser(
        "promote",
        help="make a follower the primary of its replica group",
        description="Make the follower at HOST:PORT the primary of its replica group under the "
        "next group epoch (docs/CLUSTER.md, Failover). The old primary, if it comes back, "
        "refuses writes and rejoins as a follower; clients find the new primary themselves.",
    )
    c.add_argument("address", metavar="HOST:PORT", help="the follower to promote")
    c.add_argument(
        "--cluster",
        default=None,
        metavar="FILE",
        help="check that HOST:PORT is a member of a replica group of this cluster file and "
        "follows that group's primary (and take its token file)",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="promote a follower that was never caught up (it lacks what it had not received)",
    )
    c.add_argument("--token-file", default=None, help="file holding the token")
    c.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    c.add_argument("--json", action="store_true", help="print the answer as JSON")
    c.set_defaults(func=_cmd_cluster_promote)
    for name, what in (
        ("add-server", "add a store server to the list while workers train"),
        ("remove-server", "remove a store server from the list while workers train"),
        ("members", "publish the members of replica groups after a replacement by hand"),
    ):
        c = cluster_sub.add_parser(
            name,
            help=what,
            description=what[0].upper()
            + what[1:]
            + ": the call RemoteStore."
            + name.replace("-", "_")
            + ' makes (docs/CLUSTER.md, "When the list changes"). Running workers follow '
            "the new list without restarting. A replica group is its members joined with "
            "commas, its primary first.",
        )
        if name == "members":
            c.description = (
                "Publish replica groups' current members in the routing the servers hold (the "
                'call RemoteStore.publish_members makes; docs/CLUSTER.md, "Replacing a '
                'machine"): each position whose group shares a member with a GROUP gets that '
                "GROUP's members, under the next routing epoch, the same slots (no row moves). "
                "Workers that cannot reach the members they know ask the other servers and "
                "follow. The servers must hold a routing (a list changed once, or on Ray)."
            )
            c.add_argument(
                "groups",
                nargs="+",
                metavar="HOST:PORT,HOST:PORT[,...]",
                help="a group's members now, joined with commas (any order)",
            )
        else:
            c.add_argument(
                "address",
                metavar="HOST:PORT[,HOST:PORT...]"
                if name == "add-server"
                else "HOST:PORT|POSITION",
                help="the server or replica group (PRIMARY,FOLLOWER...) that joins"
                if name == "add-server"
                else "the server that leaves: any member's address of its group, or its position",
            )
            c.add_argument(
                "--max-rows-per-second",
                type=float,
                default=None,
                metavar="ROWS",
                help="pace the move: wait between batches so that rows move at most this fast "
                "on average (default: batches back to back)",
            )
        c.add_argument(
            "--servers",
            nargs="+",
            default=None,
            metavar="HOST:PORT[,HOST:PORT...]",
            help="the cluster's servers (a replica group: its members joined with commas)",
        )
        c.add_argument("--cluster", default=None, metavar="FILE", help="a cluster file instead")
        c.add_argument("--token-file", default=None, help="file holding the token")
        c.add_argument("--tls-ca", default=None, help="CA certificate (PEM) of the servers")
        c.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default 30)")
        c.add_argument("--json", action="store_true", help="print the report as JSON")
        c.set_defaults(func=_cmd_cluster_members if name == "members" else _cmd_cluster_membership)

    p = sub.add_parser(
        "controller",
        help="watch replica groups and promote a follower when a primary dies",
        description="Watch every server of the cluster file's replica groups (their Status: "
        "role, group epoch, lag) and, when a group has had no live primary for --dead-after "
        "seconds, promote its most caught-up live follower; log each decision (logfmt on "
        "stderr), serve the view on --status-port, and write it to --publish. The servers keep "
        "their roles: a restarted controller rebuilds its view from them (docs/CLUSTER.md, "
        '"The controller").',
    )
    p.add_argument("--cluster", required=True, metavar="FILE", help="the cluster file")
    p.add_argument("--token-file", default=None, help="file holding the token")
    p.add_argument(
        "--check-interval", type=float, default=0.5, help="seconds between checks (default 0.5)"
    )
    p.add_argument(
        "--dead-after",
        type=float,
        default=3.0,
        help="seconds a group may be without a live primary before a follower is promoted "
        "(default 3)",
    )
    p.add_argument(
        "--timeout", type=float, default=1.0, help="seconds a server has to answer (default 1)"
    )
    p.add_argument(
        "--publish",
        default=None,
        metavar="FILE",
        help="write the view as a cluster file (each group's primary first) on every change",
    )
    p.add_argument(
        "--status-port",
        type=int,
        default=None,
        help="serve GET /status (JSON) and /healthz over HTTP on this port (0: a free one)",
    )
    p.add_argument(
        "--status-host", default="127.0.0.1", help="the address of --status-port (127.0.0.1)"
    )
    p.set_defaults(func=_cmd_controller)

    p = sub.add_parser("version", help="print the versions of pstore and numpy")
    p.set_defaults(func=_cmd_version)

    _add_entry_point_commands(sub)
    return parser


def _add_entry_point_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the commands of the :data:`COMMANDS_GROUP` entry points, in name order. A name the
    command has already is skipped; a command that fails to load is reported on stderr, and the
    others still run."""
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        if ep.name in sub.choices:
            continue
        try:
            add: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None] = ep.load()
        except Exception as e:  # a broken plugin must not take the library's commands down
            print(
                f"pstore: warning: command {ep.name!r} ({ep.value}) failed to load: {e}",
                file=sys.stderr,
            )
            continue
        add(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pstore`` command with ``argv`` (default: ``sys.argv[1:]``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except pstore.PstoreError as e:
        print(f"pstore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `pstore demo | head`: the reader left, nothing to report
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
