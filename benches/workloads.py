"""The workloads W1-W6. Each returns a Section: its configuration and result rows."""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from harness import (
    DISTS,
    REPO_ROOT,
    PositionSampler,
    Row,
    ids_of,
    import_redis,
    log,
    measure_interleaved,
    measure_phases,
    mem_available_bytes,
    pstore_search_dir,
    reset_peak_rss,
    rows_from_rates,
    run_child,
    status_bytes,
)
from net import (
    ServerProcess,
    redis_server_path,
    start_pstore_server,
    start_redis,
    start_tcp_floor,
)
from peers import (
    ArrowIpcFile,
    DictTake,
    NumpyAddAt,
    NumpySave,
    NumpyTake,
    RedisRows,
    ReferenceAdagrad,
    ReferenceAdam,
    ReferenceGather,
    ReferenceLookup,
    TorchEmbeddingPull,
    TorchSparseStep,
)
from tcp_floor import TcpFloor

POPULATE_BATCH = 65536
RAW_W3_BYTES_PER_KEY = (16 + 16) * 4


@dataclass(frozen=True)
class Sizes:
    mode: str
    reps: int
    w1_rows: int
    w1_ids_per_rep: int
    w2_rows: int
    w2_ids_per_rep: int
    w3_inserts: int
    w3_reps: int
    w4_rows: int
    w4_ids_per_rep: int
    w5_rows: int
    w5_train_seconds: float
    w5_steady_seconds: float  # the loop of the async store (part c's target): cycles must run
    w5_train_reps: int
    w6_rows: int
    w6_calls: dict[int, int]  # batch size -> calls per repetition (all threads together)
    w6_cap_s: float  # a repetition's calls stop after this many seconds
    w6_reps: int


QUICK = Sizes(
    mode="quick",
    reps=5,
    w1_rows=1_000_000,
    w1_ids_per_rep=1 << 19,
    w2_rows=1_000_000,
    w2_ids_per_rep=1 << 18,
    w3_inserts=2_000_000,
    w3_reps=3,
    w4_rows=1_000_000,
    w4_ids_per_rep=1 << 19,
    w5_rows=1_000_000,
    w5_train_seconds=10.0,
    w5_steady_seconds=10.0,
    w5_train_reps=3,
    w6_rows=1_000_000,
    w6_calls={1: 2000, 256: 200, 4096: 40, 65536: 8},
    w6_cap_s=2.0,
    w6_reps=4,
)
FULL = Sizes(
    mode="full",
    reps=7,
    w1_rows=10_000_000,
    w1_ids_per_rep=1 << 21,
    w2_rows=4_000_000,
    w2_ids_per_rep=1 << 20,
    w3_inserts=20_000_000,
    w3_reps=3,
    w4_rows=4_000_000,
    w4_ids_per_rep=1 << 21,
    w5_rows=10_000_000,
    w5_train_seconds=20.0,
    w5_steady_seconds=60.0,
    w5_train_reps=3,
    w6_rows=10_000_000,
    w6_calls={1: 4000, 256: 400, 4096: 80, 65536: 16},
    w6_cap_s=5.0,
    w6_reps=7,
)


@dataclass
class Context:
    pstore: ModuleType
    torch: ModuleType | None
    sizes: Sizes
    reps: int
    pyarrow: ModuleType | None = None
    tmp_parent: Path | None = None


@dataclass
class Section:
    workload: str
    title: str
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _loop(fn: Callable[[np.ndarray], Any], batches: list[np.ndarray]) -> Callable[[], int]:
    total = sum(len(b) for b in batches)

    def run() -> int:
        for b in batches:
            fn(b)
        return total

    return run


def _push_loop(
    fn: Callable[[np.ndarray, np.ndarray], Any],
    batches: list[np.ndarray],
    grads: list[np.ndarray],
) -> Callable[[], int]:
    total = sum(len(b) for b in batches)

    def run() -> int:
        for i, b in enumerate(batches):
            fn(b, grads[i % len(grads)])
        return total

    return run


def _pull_push_loop(table: Any, batches: list[np.ndarray], grads: list[np.ndarray]):
    total = sum(len(b) for b in batches)

    def run() -> int:
        for i, b in enumerate(batches):
            table.pull(b)
            table.push(b, grads[i % len(grads)])
        return total

    return run


def _two_thread_loop(table: Any, batches: list[np.ndarray], grads: list[np.ndarray]):
    """The same work as _pull_push_loop, split over two Python threads (even/odd batches)."""
    total = sum(len(b) for b in batches)
    shares = [range(0, len(batches), 2), range(1, len(batches), 2)]

    def worker(share: range, errors: list[BaseException]) -> None:
        try:
            for i in share:
                table.pull(batches[i])
                table.push(batches[i], grads[i % len(grads)])
        except BaseException as exc:
            errors.append(exc)

    def run() -> int:
        errors: list[BaseException] = []
        threads = [threading.Thread(target=worker, args=(s, errors)) for s in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return total

    return run


def _populate(table: Any, n: int) -> float:
    """Create rows for positions 0..n-1 by pulling their ids once; returns ids/s."""
    t0 = time.perf_counter()
    for start in range(0, n, POPULATE_BATCH):
        table.pull(ids_of(np.arange(start, min(start + POPULATE_BATCH, n), dtype=np.int64)))
    rate = n / (time.perf_counter() - t0)
    if len(table) != n:
        log(f"WARNING: {table.name}: len(table) = {len(table)} after pulling {n} distinct ids")
    return rate


def _grads(batch: int, dim: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, dim), dtype=np.float32) for _ in range(count)]


def _unique_frac(batches: list[np.ndarray]) -> float:
    return float(np.mean([len(np.unique(b)) / len(b) for b in batches[:8]]))


def w1_pull(ctx: Context) -> Section:
    n, dim, batch_sizes = ctx.sizes.w1_rows, 64, (4096, 65536)
    torch = ctx.torch
    sec = Section(
        "W1",
        f"pull, {n:,} rows x {dim} float32, pstore default SGD table",
        {"rows": n, "dim": dim, "batches": batch_sizes, "ids_per_rep": ctx.sizes.w1_ids_per_rep},
    )
    log(f"W1: building the numpy table {n:,} x {dim}")
    table = np.random.default_rng(12).random((n, dim), dtype=np.float32)
    store = ctx.pstore.Store()
    pt = store.create_sparse_table("w1", dim)
    log(f"W1: populating pstore ({n:,} pulls of new ids)")
    sec.config["pstore_populate_ids_per_s"] = _populate(pt, n)
    sec.config["pstore_threads"] = store.threads
    stats = pt.stats()
    sec.config["pstore_bytes_used_per_row"] = stats["bytes_used"] / max(len(pt), 1)
    sec.config["pstore_huge_page_frac"] = stats["huge_page_bytes"] / max(stats["bytes_used"], 1)
    # The same table in a store of one thread, for the goal against the one-thread reference.
    store_1t = ctx.pstore.Store(threads=1)
    pt_1t = store_1t.create_sparse_table("w1", dim)
    log(f"W1: populating a one-thread store ({n:,} pulls of new ids)")
    _populate(pt_1t, n)
    log("W1: building the dict peer")
    t0 = time.perf_counter()
    dict_peer = DictTake(ids_of(np.arange(n, dtype=np.int64)), table)
    sec.config["dict_build_s"] = time.perf_counter() - t0
    np_peer = NumpyTake(table)
    log("W1: building the reference rows (dense gather, the memory limit)")
    ref_rows = ctx.pstore._native.ReferenceRows(table, dim, 0.0)
    sec.config["reference_huge_pages"] = ref_rows.huge_pages
    ref_peers = {
        f"ref_gather_{t}t{'' if pf else '_noprefetch'}": ReferenceGather(ref_rows, dim, t, pf)
        for t, pf in ((2, True), (2, False), (1, True), (1, False))
    }
    log("W1: indexing the reference rows by id (the hashed-lookup limit)")
    sec.config["reference_index_huge_pages"] = ref_rows.index(ids_of(np.arange(n, dtype=np.int64)))
    lookup_peers = {f"ref_hashed_{t}t": ReferenceLookup(ref_rows, dim, t) for t in (2, 1)}
    torch_peer = TorchEmbeddingPull(torch, table) if torch is not None else None
    skipped = {} if torch is not None else {"torch_embedding": "torch not installed"}
    targets = {"numpy_take": (">=1.0x", 1.0), "dict_take": (">=5x", 5.0)}
    sampler = PositionSampler(n, seed=11)
    ref_goal = {4096: (">=0.5x", 0.5), 65536: (">=0.6x", 0.6)}
    for dist in DISTS:
        for batch in batch_sizes:
            nb = max(1, ctx.sizes.w1_ids_per_rep // batch)
            pos = [sampler.sample(dist, batch) for _ in range(nb)]
            ids = [ids_of(p) for p in pos]
            sec.config[f"unique_frac_{dist}_{batch}"] = _unique_frac(pos)
            fns = {
                "pstore": _loop(pt.pull, ids),
                "pstore_1t": _loop(pt_1t.pull, ids),
                "numpy_take": _loop(np_peer.pull, pos),
                "dict_take": _loop(dict_peer.pull, ids),
            }
            for ref_name, ref_peer in ref_peers.items():
                fns[ref_name] = _loop(ref_peer.pull, pos)
            for ref_name, lookup_peer in lookup_peers.items():
                fns[ref_name] = _loop(lookup_peer.pull, ids)
            targets["ref_gather_2t"] = ref_goal[batch]
            if torch_peer is not None:
                fns["torch_embedding"] = _loop(torch_peer.pull, pos)
            log(f"W1: {dist} batch {batch}: {nb} batches x {ctx.reps} reps")
            rates = measure_interleaved(fns, ctx.reps)
            sec.rows += rows_from_rates(
                "W1", "pull", dist, batch, rates, "pstore", targets, skipped
            )
    if len(pt) != n:
        sec.notes.append(f"pstore len(table) changed during pulls of existing ids: {len(pt)}")
    store.drop_table("w1")
    store_1t.drop_table("w1")
    return sec


W2_OPTIMIZERS: dict[str, dict[str, float]] = {
    "SGD": {"lr": 0.01},
    "Adagrad": {"lr": 0.01, "init_acc": 0.1, "eps": 1e-10},
    "Adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "Ftrl": {"alpha": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0},
}


def _pstore_optimizer(optim: ModuleType, name: str, kw: dict[str, float]) -> Any:
    if name == "SGD":
        return optim.SGD(lr=kw["lr"])
    if name == "Adagrad":
        return optim.Adagrad(lr=kw["lr"], initial_accumulator_value=kw["init_acc"], eps=kw["eps"])
    if name == "Adam":
        return optim.Adam(lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"])
    if name == "Ftrl":
        return optim.Ftrl(alpha=kw["alpha"], beta=kw["beta"], l1=kw["l1"], l2=kw["l2"])
    raise ValueError(name)


def w2_push(ctx: Context) -> Section:
    n, dim, batch = ctx.sizes.w2_rows, 64, 65536
    torch = ctx.torch
    nb = max(1, ctx.sizes.w2_ids_per_rep // batch)
    sec = Section(
        "W2",
        f"push, {n:,} rows x {dim} float32, batch {batch} (Zipf batches hold duplicates)",
        {"rows": n, "dim": dim, "batch": batch, "ids_per_rep": nb * batch,
         "optimizers": W2_OPTIMIZERS},
    )  # fmt: skip
    sampler = PositionSampler(n, seed=21)
    pos = {d: [sampler.sample(d, batch) for _ in range(nb)] for d in DISTS}
    ids = {d: [ids_of(p) for p in pos[d]] for d in DISTS}
    for d in DISTS:
        sec.config[f"unique_frac_{d}"] = _unique_frac(pos[d])
    grads = _grads(batch, dim, 4, seed=22)
    rng = np.random.default_rng(23)
    for name, kw in W2_OPTIMIZERS.items():
        store = ctx.pstore.Store()
        pt = store.create_sparse_table(
            f"w2_{name}", dim, optimizer=_pstore_optimizer(ctx.pstore.optim, name, kw)
        )
        log(f"W2 {name}: populating pstore ({n:,} rows)")
        sec.config[f"pstore_populate_ids_per_s_{name}"] = _populate(pt, n)
        sec.config[f"pstore_bytes_used_per_row_{name}"] = pt.stats()["bytes_used"] / len(pt)
        peers: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        targets: dict[str, tuple[str, float]] = {}
        torch_name = {"SGD": "torch_SGD", "Adagrad": "torch_Adagrad", "Adam": "torch_SparseAdam"}
        if name in torch_name:
            if torch is None:
                skipped[torch_name[name]] = "torch not installed"
            else:
                log(f"W2 {name}: building the torch peer")
                peer = TorchSparseStep(torch, rng.random((n, dim), dtype=np.float32), name, **kw)
                peer.push(pos["uniform"][0], grads[0])
                peer.prefault_state()
                peers[torch_name[name]] = peer
        if name in ("Adagrad", "Adam"):
            targets[torch_name[name]] = (">=3x", 3.0)
        if name in ("Adagrad", "Adam"):
            log(f"W2 {name}: building the reference rows (dense read-modify-write)")
            # Weights, then the state: Adagrad's accumulators (starting at init_acc), or
            # Adam's first and second moments (starting at 0).
            state, fill = (1, kw["init_acc"]) if name == "Adagrad" else (2, 0.0)
            ref_rows = ctx.pstore._native.ReferenceRows(
                rng.random((n, dim), dtype=np.float32), (1 + state) * dim, fill
            )
            for t in (2, 1):
                peers[f"ref_rmw_{t}t"] = (
                    ReferenceAdagrad(ref_rows, kw["lr"], t)
                    if name == "Adagrad"
                    else ReferenceAdam(ref_rows, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], t)
                )
            targets["ref_rmw_2t"] = (">=0.5x", 0.5)
        if name == "SGD":
            peers["numpy_add_at"] = NumpyAddAt(rng.random((n, dim), dtype=np.float32), kw["lr"])
            targets["numpy_add_at"] = (">=5x", 5.0)
        for dist in DISTS:
            fns = {"pstore": _push_loop(pt.push, ids[dist], grads)}
            for peer_name, peer in peers.items():
                fns[peer_name] = _push_loop(peer.push, pos[dist], grads)
            log(f"W2 {name}: {dist}: {nb} batches x {ctx.reps} reps")
            rates = measure_interleaved(fns, ctx.reps)
            sec.rows += rows_from_rates(
                "W2", f"push {name}", dist, batch, rates, "pstore", targets, skipped
            )
        if len(pt) != n:
            sec.notes.append(f"{name}: pstore len(table) = {len(pt)} after pushes, expected {n}")
        stats = pt.stats()
        if stats.get("rows_updated", 0) <= 0:
            sec.notes.append(f"{name}: stats()['rows_updated'] = {stats.get('rows_updated')}")
        store.drop_table(f"w2_{name}")
        del pt, store, peers
        gc.collect()
    return sec


GROWTH_SCRIPT = Path(__file__).resolve().parent / "growth.py"


def w3_growth(ctx: Context) -> Section:
    n, dim, batch = ctx.sizes.w3_inserts, 16, 65536
    impls = ["pstore_pull", "pstore_push", "dict_numpy"]
    sec = Section(
        "W3",
        f"growth, {n:,} new ids at dim {dim} with Adagrad, batches of {batch} fresh ids, "
        f"each run in a fresh process",
        {"inserts": n, "dim": dim, "batch": batch, "reps": min(ctx.reps, ctx.sizes.w3_reps),
         "raw_bytes_per_key": RAW_W3_BYTES_PER_KEY},
    )  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    child_args = {"n": n, "dim": dim, "batch": batch, "pstore_dir": pstore_search_dir(ctx.pstore)}
    reps = min(ctx.reps, ctx.sizes.w3_reps)
    for r in range(reps):
        k = r % len(impls)
        for impl in impls[k:] + impls[:k]:
            log(f"W3: rep {r + 1}/{reps} {impl}")
            results[impl].append(run_child(GROWTH_SCRIPT, {**child_args, "impl": impl}))
    dict_median = statistics.median(x["inserts_per_s"] for x in results["dict_numpy"])
    for impl in impls:
        res = results[impl]
        rss_bpk = statistics.median(x["rss_delta"] / x["rows"] for x in res)
        extra: dict[str, Any] = {
            "runs": res,
            "rss_bytes_per_key": rss_bpk,
            "rss_over_raw": rss_bpk / RAW_W3_BYTES_PER_KEY,
            "batch_p50_ms": statistics.median(x["batch_p50_ms"] for x in res),
            "batch_max_ms": max(x["batch_max_ms"] for x in res),
        }
        if impl.startswith("pstore"):
            stats_bpk = statistics.median(x["bytes_used"] / x["rows"] for x in res)
            extra["stats_bytes_per_key"] = stats_bpk
            extra["stats_over_raw"] = stats_bpk / RAW_W3_BYTES_PER_KEY
            extra["bytes_target_met"] = extra["rss_over_raw"] <= 1.4
            if any(x["rows"] != n for x in res):
                sec.notes.append(f"{impl}: rows {[x['rows'] for x in res]} != {n}")
        samples = [x["inserts_per_s"] for x in res]
        row = Row("W3", "insert", "fresh", batch, impl, "inserts/s", samples, extra=extra)
        if impl != "dict_numpy":
            row.ratio = statistics.median(samples) / dict_median
            row.ratio_of = f"{impl}/dict_numpy"
            row.target = "bytes <=1.4x raw"
        sec.rows.append(row)
    return sec


def w4_concurrency(ctx: Context) -> Section:
    n, dim = ctx.sizes.w4_rows, 64
    sec = Section(
        "W4",
        f"concurrency, {n:,} rows x {dim}, SGD; one unit = one id pulled and pushed (a) or "
        f"pulled or pushed (b)",
        {"rows": n, "dim": dim, "ids_per_rep": ctx.sizes.w4_ids_per_rep},
    )
    store1 = ctx.pstore.Store(threads=1)
    store_d = ctx.pstore.Store()
    sec.config["default_threads"] = store_d.threads
    t1 = store1.create_sparse_table("w4", dim)
    td = store_d.create_sparse_table("w4", dim)
    log(f"W4: populating two pstore tables ({n:,} rows each)")
    _populate(t1, n)
    _populate(td, n)
    sampler = PositionSampler(n, seed=41)
    one, two = "1 py thread", "2 py threads"
    for dist in DISTS:
        batch = 4096
        nb = max(2, ctx.sizes.w4_ids_per_rep // batch) // 2 * 2
        ids = [ids_of(sampler.sample(dist, batch)) for _ in range(nb)]
        grads = _grads(batch, dim, 4, seed=42)
        log(f"W4a: {dist}: {nb} batches of {batch} x {ctx.reps} reps")
        rates = measure_interleaved(
            {one: _pull_push_loop(t1, ids, grads), two: _two_thread_loop(t1, ids, grads)},
            ctx.reps,
        )
        sec.rows += rows_from_rates(
            "W4", "a: threads=1 pull+push", dist, batch, rates, two, {one: (">=1.6x", 1.6)}
        )
    for dist in DISTS:
        batch = 65536
        nb = max(1, ctx.sizes.w4_ids_per_rep // batch)
        ids = [ids_of(sampler.sample(dist, batch)) for _ in range(nb)]
        grads = _grads(batch, dim, 2, seed=43)
        log(f"W4b: {dist}: {nb} batches of {batch} x {ctx.reps} reps")
        rates = measure_interleaved(
            {
                "pull default": _loop(td.pull, ids),
                "pull threads=1": _loop(t1.pull, ids),
                "push default": _push_loop(td.push, ids, grads),
                "push threads=1": _push_loop(t1.push, ids, grads),
            },
            ctx.reps,
        )
        for op in ("pull", "push"):
            sub = {
                f"default pool ({store_d.threads})": rates[f"{op} default"],
                "threads=1": rates[f"{op} threads=1"],
            }
            sec.rows += rows_from_rates(
                "W4",
                f"b: {op}",
                dist,
                batch,
                sub,
                f"default pool ({store_d.threads})",
                {"threads=1": (">=1.6x", 1.6)},
            )
    for t in (t1, td):
        if len(t) != n:
            sec.notes.append(f"len(table) = {len(t)} after W4, expected {n}")
    return sec


W5_DIM = 64
W5_BATCH = 65536
W5_TABLE = "w5"
W5_LR = 0.01
W5_INIT_ACC = 0.1
W5_FLUSH_INTERVAL = 1.0
W5_INCREMENT = 0.01
W5_PARTS = {
    "a": "full snapshot and restore against peers writing and reading the same arrays "
    "(every contender fsyncs its files, then reads them right back, usually from the page cache)",
    "b": f"incremental snapshot after pushing {W5_INCREMENT:.0%} of the rows (distinct ids), "
    "against the full snapshot taken just before it",
    "c": "training: pull+push of batches for a fixed time, then flush(); rates over the loop "
    "plus the final flush",
    "d": "reopening a durable store (rows load lazily) and pulling every row once, against the "
    "first write of the store",
}
# Peak memory and disk of W5 in units of the raw row bytes (rows x bytes of one snapshot row).
# Memory: the in-memory store (1.04 x the raw bytes), the peers' arrays (1.0) and one read-back
# copy (1.0 to 1.04) in part a, 3.1 in all; two populated stores (2.1) in part c, beside the
# page cache of the replica they write through (1.3x the raw bytes after the first write, more
# as rows keep changing; clean pages the kernel can drop, so a cache smaller than the file
# costs the durable store re-reads, which the bench measures and does not hide). 3.3 leaves
# 0.2 for the process and pstore's transient buffers. W5 reports the lowest MemAvailable it
# saw (mem_available_min_gib) and its peak RSS, which also counts the replica's file pages
# mapped by LMDB (page cache, not the process's own memory).
# Disk: an LMDB replica takes ~3x the raw bytes; part c holds one at a time, plus its growth.
W5_MEM_FACTOR = 3.3
W5_DISK_FACTOR = 8.0
W5_MIN_ROWS = 1 << 17
GIB = 1 << 30


def latency_extra(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Call counts and latency percentiles (ms) of timed repetitions (`_w6_run`'s results)."""
    lat_ms = np.array([x for r in reps for x in r["lat"]]) * 1e3
    p50, p90, p99 = np.percentile(lat_ms, [50, 90, 99])
    return {
        "calls": int(sum(r["calls"] for r in reps)),
        "calls_per_rep": [r["calls"] for r in reps],
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p99_ms": float(p99),
        "max_ms": float(lat_ms.max()),
        "mean_ms": float(lat_ms.mean()),
    }


def scaled_down(
    requested: int, n: int, batch: int, by_memory: bool, info: dict[str, Any]
) -> tuple[int, list[str]]:
    """`n` rounded down to whole batches, with a note when it is below `requested`."""
    if n >= requested:
        return n, []
    n = max(n // batch * batch, 0)
    why = "memory" if by_memory else "disk space"
    return n, [
        f"SCALED DOWN from {requested:,} to {n:,} rows: not enough {why} (needs about "
        f"{info['mem_needed_gib']} GiB memory with {info['mem_available_gib']} GiB "
        f"available, {info['disk_needed_gib']} GiB disk with {info['disk_free_gib']} GiB free)"
    ]


class _MemLowWater:
    """The lowest MemAvailable seen while it runs (a daemon thread reading /proc/meminfo every
    half second): how close W5 came to the machine's memory, page cache not counted as used."""

    def __init__(self) -> None:
        self.low = mem_available_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="w5-mem", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.low = min(self.low, mem_available_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return min(self.low, mem_available_bytes())


def _w5_fit(requested: int, row_bytes: int, parent: Path) -> tuple[int, dict[str, Any], list[str]]:
    """The row count that fits 80% of the available memory and 90% of the free disk."""
    mem = mem_available_bytes()
    disk = shutil.disk_usage(parent).free
    fit_mem = int((0.8 * mem - GIB) / (W5_MEM_FACTOR * row_bytes))
    fit_disk = int((0.9 * disk - GIB) / (W5_DISK_FACTOR * row_bytes))
    n = min(requested, fit_mem, fit_disk)
    info = {
        "mem_available_gib": round(mem / GIB, 1),
        "disk_free_gib": round(disk / GIB, 1),
        "mem_needed_gib": round((W5_MEM_FACTOR * requested * row_bytes + GIB) / GIB, 1),
        "disk_needed_gib": round((W5_DISK_FACTOR * requested * row_bytes + GIB) / GIB, 1),
    }
    n, notes = scaled_down(requested, n, W5_BATCH, fit_mem <= fit_disk, info)
    return n, info, notes


def _w5_table(pstore: ModuleType, store: Any) -> Any:
    opt = pstore.optim.Adagrad(lr=W5_LR, initial_accumulator_value=W5_INIT_ACC)
    return store.create_sparse_table(W5_TABLE, W5_DIM, optimizer=opt, seed=5)


def _w5_fill(store: Any, table: Any, n: int) -> float:
    """Create the rows of positions 0..n-1 by pushing each id once (so weights and state are
    updated values), then flush(); returns the seconds taken."""
    grads = np.random.default_rng(50).standard_normal((W5_BATCH, W5_DIM), dtype=np.float32)
    t0 = time.perf_counter()
    for start in range(0, n, W5_BATCH):
        ids = ids_of(np.arange(start, min(start + W5_BATCH, n), dtype=np.int64))
        table.push(ids, grads[: len(ids)])
    store.flush()
    return time.perf_counter() - t0


def _w5_all_ids(n: int) -> list[np.ndarray]:
    return [
        ids_of(np.arange(s, min(s + W5_BATCH, n), dtype=np.int64)) for s in range(0, n, W5_BATCH)
    ]


def _w5_read_snapshot(
    pa: ModuleType, d: Path, entry: dict[str, Any], n: int
) -> tuple[dict[str, np.ndarray], Any]:
    """Every column of a snapshot's table as numpy arrays, read part by part with pyarrow."""
    cols: dict[str, np.ndarray] = {}
    schema = None
    at = 0
    for fi in entry["files"]:
        with pa.OSFile(str(d / fi["name"])) as src:
            reader = pa.ipc.open_file(src)
            if schema is None:
                schema = reader.schema.remove_metadata()
                for f in schema:
                    if pa.types.is_fixed_size_list(f.type):
                        cols[f.name] = np.empty((n, f.type.list_size), np.float32)
                    else:
                        cols[f.name] = np.empty(n, f.type.to_pandas_dtype())
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                m = b.num_rows
                for name in schema.names:
                    col = b.column(name)
                    if pa.types.is_fixed_size_list(col.type):
                        cols[name][at : at + m] = col.flatten().to_numpy().reshape(m, -1)
                    else:
                        cols[name][at : at + m] = col.to_numpy()
                at += m
    if at != n:
        raise RuntimeError(f"the snapshot holds {at:,} rows, expected {n:,}")
    return cols, schema


def _w5_snapshot_restore(ctx: Context, sec: Section, tmp: Path, store: Any, table: Any, n: int):
    pstore, pa = ctx.pstore, ctx.pyarrow
    base = tmp / "a-source"
    entry = store.snapshot(base)["tables"][0]
    sec.config["state_len"] = entry["state_len"]
    arrays = schema = None
    if pa is not None:
        log("W5a: reading the peers' arrays from a snapshot")
        arrays, schema = _w5_read_snapshot(pa, base, entry, n)
    shutil.rmtree(base)
    if arrays is not None:
        probe = arrays["id"][:4096]
        if not np.array_equal(table.pull(probe), arrays["weights"][:4096]):
            sec.notes.append("a: the snapshot's weights differ from pull() of the same ids")
    seq = itertools.count()

    def run_pstore() -> dict[str, float]:
        d = tmp / f"a-pstore-{next(seq)}"
        t0 = time.perf_counter()
        manifest = store.snapshot(d)
        t1 = time.perf_counter()
        restored = pstore.Store.restore(d)
        t2 = time.perf_counter()
        rows = len(restored.sparse_table(W5_TABLE))
        restored.close()
        del restored
        shutil.rmtree(d)
        return {"write_s": t1 - t0, "read_s": t2 - t1, "bytes": manifest["bytes"], "rows": rows}

    def run_peer(peer: Any) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            d = tmp / f"a-peer-{next(seq)}"
            t0 = time.perf_counter()
            nbytes = peer.write(d)
            t1 = time.perf_counter()
            got = peer.read(d)
            t2 = time.perf_counter()
            rows = len(got["id"])
            del got
            if hasattr(peer, "release"):
                peer.release()
            shutil.rmtree(d)
            return {"write_s": t1 - t0, "read_s": t2 - t1, "bytes": nbytes, "rows": rows}

        return run

    fns: dict[str, Callable[[], dict[str, float]]] = {"pstore": run_pstore}
    skipped: dict[str, str] = {}
    if arrays is not None:
        fns["pyarrow_ipc"] = run_peer(ArrowIpcFile(pa, arrays, schema))
        fns["numpy_save"] = run_peer(NumpySave({k: arrays[k] for k in ("id", "weights", "state")}))
    else:
        skipped["pyarrow_ipc"] = "pyarrow not installed"
        skipped["numpy_save"] = "pyarrow not installed (it reads the peers' arrays)"
    log(f"W5a: snapshot+restore vs peers, {ctx.reps} reps")
    res = measure_phases(fns, ctx.reps)
    del arrays, fns
    targets = {"pyarrow_ipc": (">=0.7x", 0.7)}
    for phase, case in (("write_s", "snapshot (write)"), ("read_s", "restore (read)")):
        rates = {name: [n / r[phase] for r in reps] for name, reps in res.items()}
        rows = rows_from_rates("W5", case, "-", None, rates, "pstore", targets, skipped, "rows/s")
        for row in rows:
            row.extra = {"part": "a"}
            if row.status != "ok":
                continue
            reps = res[row.impl]
            nbytes = statistics.median(r["bytes"] for r in reps)
            gbps = statistics.median(r["bytes"] / r[phase] for r in reps) / 1e9
            assert row.median is not None
            row.extra.update(
                seconds=[r[phase] for r in reps],
                bytes=nbytes,
                gb_per_s=gbps,
                rate=f"{gbps:.2f} GB/s",
                detail=f"{nbytes / 1e6:,.0f} MB, {row.median / 1e6:.2f} M rows/s",
            )
        sec.rows += rows
    for name, reps in res.items():
        if any(r["rows"] != n for r in reps):
            sec.notes.append(f"a: {name} read back {[r['rows'] for r in reps]} rows, not {n:,}")


def _w5_incremental(ctx: Context, sec: Section, tmp: Path, stores: dict[str, Any], n: int):
    k = max(1, int(n * W5_INCREMENT))
    rng = np.random.default_rng(51)
    grads = rng.standard_normal((k, W5_DIM), dtype=np.float32)
    seq = itertools.count()

    def run_for(name: str, store: Any, table: Any) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            i = next(seq)
            full, inc = tmp / f"b-{i}-full", tmp / f"b-{i}-inc"
            ids = ids_of(rng.choice(n, size=k, replace=False))
            store.flush()
            t0 = time.perf_counter()
            m_full = store.snapshot(full)
            t1 = time.perf_counter()
            table.push(ids, grads)
            store.flush()
            t2 = time.perf_counter()
            m_inc = store.snapshot(inc, incremental=True)
            t3 = time.perf_counter()
            shutil.rmtree(inc)
            shutil.rmtree(full)
            return {
                "full_s": t1 - t0,
                "full_bytes": m_full["bytes"],
                "full_rows": m_full["tables"][0]["rows"],
                "inc_s": t3 - t2,
                "inc_bytes": m_inc["bytes"],
                "inc_rows": m_inc["tables"][0]["rows"],
            }

        return run

    fns = {name: run_for(name, s, t) for name, (s, t) in stores.items()}
    log(f"W5b: full then incremental snapshots, {ctx.reps} reps")
    res = measure_phases(fns, ctx.reps)
    sec.config["incremental_rows_pushed"] = k
    for name, reps in res.items():
        full_s = [r["full_s"] for r in reps]
        inc_s = [r["inc_s"] for r in reps]
        full_b = statistics.median(r["full_bytes"] for r in reps)
        inc_b = statistics.median(r["inc_bytes"] for r in reps)
        inc_rows = sorted({r["inc_rows"] for r in reps})
        full_gbps = statistics.median(r["full_bytes"] / r["full_s"] for r in reps) / 1e9
        fs, ins = statistics.median(full_s), statistics.median(inc_s)
        sec.rows += [
            Row("W5", "full snapshot", "-", None, name, "s", full_s,
                extra={"part": "b", "seconds": full_s, "bytes": full_b,
                       "rate": f"{full_gbps:.2f} GB/s",
                       "detail": f"{full_b / 1e6:,.1f} MB, {reps[0]['full_rows']:,} rows"}),
            Row("W5", "incremental: time", "-", None, name, "s", inc_s, ratio=ins / fs,
                ratio_of="incremental/full seconds", target="<=5%", target_max=0.05,
                extra={"part": "b", "seconds": inc_s, "ratio_fmt": "pct",
                       "detail": f"{k:,} ids pushed, rows written {inc_rows}"}),
            Row("W5", "incremental: bytes", "-", None, name, "bytes",
                [r["inc_bytes"] for r in reps], ratio=inc_b / full_b,
                ratio_of="incremental/full bytes", target="<=5%", target_max=0.05,
                extra={"part": "b", "bytes": inc_b, "ratio_fmt": "pct",
                       "detail": f"{inc_b / 1e6:,.2f} MB of {full_b / 1e6:,.1f} MB"}),
        ]  # fmt: skip
        if inc_rows != [k]:
            sec.notes.append(f"b: {name}: increments held {inc_rows} rows after pushing {k:,}")


def _w5_train_for(
    store: Any, table: Any, batches: list[np.ndarray], grads: list[np.ndarray], seconds: float
) -> Callable[[], dict[str, float]]:
    """Pull+push batches (cycling through them) until `seconds` have passed, then flush()."""

    durable = store.storage_info() is not None

    def cycle() -> int:
        info = store.storage_info()
        return 0 if info is None else int(info["cycle"])

    def run() -> dict[str, float]:
        c0 = cycle()
        k = 0
        lag = 0.0  # the largest flush lag seen: what a crash at that moment would have lost
        t0 = time.perf_counter()
        while True:
            b = batches[k % len(batches)]
            table.pull(b)
            table.push(b, grads[k % len(grads)])
            k += 1
            if durable and k % 4 == 0:
                lag = max(lag, store.storage_info()["flush_lag"])
            if time.perf_counter() - t0 >= seconds:
                break
        t1 = time.perf_counter()
        c1 = cycle()
        t2 = time.perf_counter()
        store.flush()
        t3 = time.perf_counter()
        return {
            "ids": k * len(batches[0]),
            "loop_s": t1 - t0,
            "flush_s": t3 - t2,
            "total_s": (t1 - t0) + (t3 - t2),
            "cycles_loop": c1 - c0,
            "cycles": cycle() - c0,
            "max_lag_s": lag,
        }

    return run


def _disk_fsync_rate(parent: Path, nbytes: int) -> float:
    """Bytes per second that one writer gets onto the disk under `parent`: `nbytes` of random
    bytes written in 16 MiB pieces, then fsync; the file is removed. The final flush of a
    table whose rows all changed cannot be faster than its bytes at this rate."""
    block = np.random.default_rng(55).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    pieces = max(1, nbytes // len(block))
    path = parent / "disk_rate.tmp"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(pieces):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    path.unlink()
    return pieces * len(block) / secs


def _w5_training(
    ctx: Context,
    sec: Section,
    mem: tuple[Any, Any],
    name: str,
    durable: tuple[Any, Any],
    n: int,
    disk_rate: float,
) -> None:
    """Training on the durable store `name` against the in-memory one, interleaved. Each durable
    store is measured in a phase of its own, with only the in-memory store beside it: a user
    trains one store at a time, and at the issue's size a third store and a second replica file
    would leave too little memory for the page cache the replica writes through.

    The target store (one environment, async) runs `w5_steady_seconds` per loop, long enough
    for background flush cycles to finish during the loop (at the full size a cycle rewrites
    most of a 5.4 GB table and the flusher stretches its interval to several seconds): its
    loop rate is the training rate with the replica kept up, and carries the target only if
    every run saw a cycle finish. The final flush is reported beside it, with the time the disk
    needs for the table's bytes."""
    steady = name == "durable async"
    seconds = ctx.sizes.w5_steady_seconds if steady else ctx.sizes.w5_train_seconds
    reps = min(ctx.reps, ctx.sizes.w5_train_reps)
    sec.config["train_seconds"] = ctx.sizes.w5_train_seconds
    sec.config["steady_seconds"] = ctx.sizes.w5_steady_seconds
    sec.config["train_reps"] = reps
    sampler = PositionSampler(n, seed=53)  # the same batches in every phase
    grads = _grads(W5_BATCH, W5_DIM, 4, seed=54)
    in_mem = "in-memory"
    stores = {in_mem: mem, name: durable}
    table_bytes = mem[1].stats()["bytes_used"]
    for dist in DISTS:
        pos = [sampler.sample(dist, W5_BATCH) for _ in range(16)]
        sec.config[f"unique_frac_{dist}"] = _unique_frac(pos)
        batches = [ids_of(p) for p in pos]
        log(f"W5c: {name}: {dist}: warm-up, 1 s each")
        for s, t in stores.values():
            _w5_train_for(s, t, batches, grads, 1.0)()
        fns = {k: _w5_train_for(*st, batches, grads, seconds) for k, st in stores.items()}
        log(f"W5c: {name}: {dist}: {seconds:g} s per run x {reps} reps")
        res = measure_phases(fns, reps, warmup=0)
        rs = res[name]
        flush_s = statistics.median(r["flush_s"] for r in rs)
        cycles = [r["cycles_loop"] for r in rs]
        max_lag = max(r["max_lag_s"] for r in rs)
        info = durable[0].storage_info()
        interval = info.get("current_flush_interval", info["flush_interval"])
        # The loop's rate: a training run's rate while the replica keeps up (the target row,
        # for the async store, when every run saw a background cycle finish).
        loop = {k: [r["ids"] / r["loop_s"] for r in res[k]] for k in stores}
        kept_up = min(cycles) >= 1
        target = {in_mem: (">=0.8x", 0.8)} if steady and kept_up else None
        if steady and not kept_up:
            sec.notes.append(
                f"c: {name}: {dist}: a run saw no background flush cycle finish during its "
                f"{seconds:g} s loop (cycles per run {cycles}), so its loop rate is not a steady "
                "state and the 0.8x target is not assessed"
            )
        loop_rows = rows_from_rates(
            "W5", "pull+push, loop (replica kept up)", dist, W5_BATCH, loop, name, target,
            unit="ids/s",
        )  # fmt: skip
        for row in loop_rows:
            assert row.median is not None
            row.extra = {
                "part": "c",
                "seconds": [r["loop_s"] for r in res[row.impl]],
                "runs": res[row.impl],
                "rate": f"{row.median / 1e6:.2f} M ids/s",
                "detail": (
                    f"{seconds:g} s loops; flush cycles finished during each loop: {cycles}; "
                    f"flush lag up to {max_lag:.1f} s; store so far: {info['idle_lifts']} idle "
                    f"writes lifted, {info['superseded_writes']} superseded by flush(), flush "
                    f"interval in use {interval:g} s"
                    if row.impl == name
                    else f"no replica (beside {name})"
                ),
            }
        sec.rows += loop_rows
        # The same runs timed to the end of the final flush(): a run of this length pays it
        # once; its floor is the table's bytes at the disk's write rate (for uniform ids nearly
        # every row changed since the last cycle).
        rates = {k: [r["ids"] / r["total_s"] for r in res[k]] for k in stores}
        rows = rows_from_rates(
            "W5", "pull+push, incl. final flush", dist, W5_BATCH, rates, name, unit="ids/s"
        )
        for row in rows:
            assert row.median is not None
            row.extra = {
                "part": "c",
                "seconds": [r["total_s"] for r in res[row.impl]],
                "rate": f"{row.median / 1e6:.2f} M ids/s",
                "detail": (
                    f"final flush {flush_s:.2f} s"
                    + (
                        f"; the table's {table_bytes / 1e9:.2f} GB of rows take "
                        f"{table_bytes / disk_rate:.1f} s at the disk's {disk_rate / 1e6:.0f} "
                        "MB/s (one writer, fsync)"
                        if "async" in name
                        else ""
                    )
                    if row.impl == name
                    else f"no replica: flush() has nothing to write (beside {name})"
                ),
            }
        sec.rows += rows


def _w5_reopen(
    ctx: Context, sec: Section, path: Path, write_s: float, mem_table: Any, n: int
) -> None:
    pstore = ctx.pstore
    all_ids = _w5_all_ids(n)

    def reopen() -> dict[str, float]:
        t0 = time.perf_counter()
        store = pstore.Store(path, durability="async", flush_interval=W5_FLUSH_INTERVAL)
        t1 = time.perf_counter()
        table = store.sparse_table(W5_TABLE)
        before = table.stats()["rows_unloaded"]
        t2 = time.perf_counter()
        for b in all_ids:
            table.pull(b)
        t3 = time.perf_counter()
        after = table.stats()["rows_unloaded"]
        rows = len(table)
        store.close()
        return {
            "open_s": t1 - t0,
            "pull_s": t3 - t2,
            "unloaded_before": before,
            "unloaded_after": after,
            "rows": rows,
        }

    def pull_loaded() -> dict[str, float]:
        t0 = time.perf_counter()
        for b in all_ids:
            mem_table.pull(b)
        return {"pull_s": time.perf_counter() - t0}

    reo, loaded = "durable, reopened", "in-memory (loaded)"
    log(f"W5d: reopen + full pull, {ctx.reps} reps")
    res = measure_phases({reo: reopen, loaded: pull_loaded}, ctx.reps)
    rs = res[reo]
    open_s = [r["open_s"] for r in rs]
    pull_s = [r["pull_s"] for r in rs]
    both_s = [r["open_s"] + r["pull_s"] for r in rs]
    mem_s = [r["pull_s"] for r in res[loaded]]
    before = sorted({r["unloaded_before"] for r in rs})
    after = sorted({r["unloaded_after"] for r in rs})
    of = "this/first write"

    def row(case: str, impl: str, secs: list[float], detail: str, rate: bool = True) -> Row:
        m = statistics.median(secs)
        return Row("W5", case, "-", None, impl, "s", secs, ratio=m / write_s, ratio_of=of,
                   extra={"part": "d", "seconds": secs, "ratio_fmt": "pct", "detail": detail,
                          "rate": f"{n / m / 1e6:.2f} M rows/s" if rate else ""})  # fmt: skip

    sec.rows += [
        Row("W5", "first write: Store(path), push every id once, flush()", "-", None,
            "durable async", "s", [write_s],
            extra={"part": "d", "seconds": [write_s], "rate": f"{n / write_s / 1e6:.2f} M rows/s",
                   "detail": "one run"}),
        row("reopen: Store(path)", reo, open_s, f"rows_unloaded after open: {before}", False),
        row("first pull of every row", reo, pull_s, f"rows_unloaded after the pull: {after}"),
        row("reopen + first pull of every row", reo, both_s, ""),
        row("pull of every row", loaded, mem_s, "rows already in memory"),
    ]  # fmt: skip
    if before != [n]:
        sec.notes.append(f"d: rows_unloaded right after reopening = {before}, expected {n:,}")
    if after != [0] or any(r["rows"] != n for r in rs):
        sec.notes.append(f"d: after pulling every row: rows_unloaded {after}, len {rs[0]['rows']}")


def w5_durability(ctx: Context) -> Section:
    pstore = ctx.pstore
    state_len = W5_DIM  # Adagrad: one accumulator per weight
    row_bytes = 8 + 4 + 8 + 4 + 4 + 4 * (W5_DIM + state_len)  # one row of a snapshot file
    parent = ctx.tmp_parent or REPO_ROOT / "bench-results"
    parent.mkdir(parents=True, exist_ok=True)
    n, room, notes = _w5_fit(ctx.sizes.w5_rows, row_bytes, parent)
    sec = Section(
        "W5",
        f"durability and snapshots, {n:,} rows x {W5_DIM} float32, Adagrad (lr {W5_LR}, "
        f"acc {W5_INIT_ACC}: {state_len} state floats per row)",
        {"rows": n, "requested_rows": ctx.sizes.w5_rows, "dim": W5_DIM,
         "snapshot_row_bytes": row_bytes, "raw_gb": n * row_bytes / 1e9, "batch": W5_BATCH,
         "flush_interval": W5_FLUSH_INTERVAL, **room, "parts": W5_PARTS},
    )  # fmt: skip
    sec.notes += notes
    if n < W5_MIN_ROWS:
        sec.notes.append(f"skipped: {n:,} rows is too few to measure anything")
        return sec
    tmp = Path(tempfile.mkdtemp(prefix="w5-", dir=parent))
    sec.config["tmp_parent"] = str(parent)
    opened: list[Any] = []

    def durable(durability: str, environments: int = 1) -> tuple[Any, Any, float]:
        fi = W5_FLUSH_INTERVAL
        label = durability if environments == 1 else f"{durability}_{environments}_envs"
        store = pstore.Store(
            tmp / label, durability=durability, flush_interval=fi, environments=environments
        )
        opened.append(store)
        table = _w5_table(pstore, store)
        log(f"W5: populating a durable {label} store ({n:,} rows)")
        write_s = _w5_fill(store, table, n)
        sec.config[f"durable_{label}_write_s"] = write_s
        info = store.storage_info()
        sec.config[f"durable_{label}_file_bytes"] = info["file_bytes"]
        sec.config[f"durable_{label}_idle_writes"] = info["idle_writes"]
        return store, table, write_s

    peak_ok = reset_peak_rss()
    low_water = _MemLowWater()
    try:
        mem = pstore.Store()
        opened.append(mem)
        mem_t = _w5_table(pstore, mem)
        log(f"W5: populating an in-memory store ({n:,} rows)")
        sec.config["in_memory_write_s"] = _w5_fill(mem, mem_t, n)
        sec.config["bytes_used_per_row"] = mem_t.stats()["bytes_used"] / n
        _w5_snapshot_restore(ctx, sec, tmp, mem, mem_t, n)
        gc.collect()

        # As many bytes as the table (up to 4 GiB): a short write can finish in the page cache
        # faster than the disk sustains.
        disk_rate = _disk_fsync_rate(tmp, min(4 * GIB, mem_t.stats()["bytes_used"]))
        sec.config["disk_fsync_bytes_per_s"] = disk_rate
        asy, asy_t, write_s = durable("async")
        both = {"in-memory": (mem, mem_t), "durable async": (asy, asy_t)}
        _w5_incremental(ctx, sec, tmp, both, n)

        _w5_training(ctx, sec, (mem, mem_t), "durable async", (asy, asy_t), n, disk_rate)
        t0 = time.perf_counter()
        asy.close()
        sec.config["durable_async_close_s"] = time.perf_counter() - t0
        del both, asy, asy_t
        opened[:] = [mem]
        _w5_reopen(ctx, sec, tmp / "async", write_s, mem_t, n)
        shutil.rmtree(tmp / "async")
        gc.collect()

        syn, syn_t, _ = durable("sync")
        _w5_training(ctx, sec, (mem, mem_t), "durable sync", (syn, syn_t), n, disk_rate)
        syn.close()
        del syn, syn_t
        opened[:] = [mem]
        shutil.rmtree(tmp / "sync")
        gc.collect()

        # The same with the replica split into two LMDB environments, a writer thread each
        # (Store(environments=2); docs/FORMAT.md, "Several environments"): reported beside the
        # default of one, whose crash guarantees are stronger.
        for durability in ("async", "sync"):
            st2, st2_t, _ = durable(durability, environments=2)
            name = f"durable {durability}, 2 environments"
            _w5_training(ctx, sec, (mem, mem_t), name, (st2, st2_t), n, disk_rate)
            st2.close()
            del st2, st2_t
            opened[:] = [mem]
            shutil.rmtree(tmp / f"{durability}_2_envs")
            gc.collect()
    finally:
        for store in opened:
            try:
                store.close()
            except Exception as exc:  # report, then clean up anyway
                sec.notes.append(f"closing a store: {exc!r}")
        opened.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        sec.config["mem_available_min_gib"] = round(low_water.stop() / GIB, 1)
    peak = status_bytes("self", "VmHWM") if peak_ok else None
    if peak is not None:
        sec.config["peak_rss_gib"] = round(peak / GIB, 1)
    return sec


W6_DIM = 64
W6_LR = 0.01
W6_BATCHES = (1, 256, 4096, 65536)
W6_THREADS = (1, 4)
W6_TABLE = "w6"
W6_REF = "pstore server"
W6_LOCAL = "in-process"
W6_REDIS = {"pull": ("redis MGET",), "push": ("redis SET pipeline", "redis MSET")}
W6_FLOOR = "loopback TCP floor"
# Memory per row: the server's table, the in-process table and Redis's copy (~400 B each).
W6_MEM_PER_ROW = 3 * 400


class _W6Stop(Exception):
    """The pstore server is gone: the remaining cases cannot run."""


def _w6_fit(requested: int) -> tuple[int, list[str]]:
    mem = mem_available_bytes()
    fit = int((0.8 * mem - GIB) / W6_MEM_PER_ROW)
    if fit >= requested:
        return requested, []
    n = max(fit // POPULATE_BATCH * POPULATE_BATCH, 0)
    need = (requested * W6_MEM_PER_ROW + GIB) / GIB
    return n, [
        f"SCALED DOWN from {requested:,} to {n:,} rows: about {need:.1f} GiB of memory needed, "
        f"{mem / GIB:.1f} GiB available"
    ]


def _w6_run(
    fn: Callable[[int], Any], sizes: list[int], threads: int, cap_s: float
) -> dict[str, Any]:
    """One repetition: `threads` threads (1: the calling thread) each call fn(i) for their share
    of the batches (thread j: j, j + threads, ...), one call per batch, timing every call, and
    stop early once `cap_s` seconds have passed since they started. Returns the ids done, the
    wall seconds from the first start to the last end, and the calls' seconds."""
    lats: list[list[float]] = [[] for _ in range(threads)]
    spans: list[tuple[float, float, int]] = []
    errors: list[BaseException] = []

    def worker(j: int) -> None:
        lat = lats[j]
        done = 0
        start = time.perf_counter()
        try:
            for i in range(j, len(sizes), threads):
                t0 = time.perf_counter()
                fn(i)
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                done += sizes[i]
                if t1 - start >= cap_s:
                    break
        except BaseException as exc:
            errors.append(exc)
        spans.append((start, time.perf_counter(), done))

    if threads == 1:
        worker(0)
    else:
        barrier = threading.Barrier(threads)

        def go(j: int) -> None:
            barrier.wait()
            worker(j)

        pool = [threading.Thread(target=go, args=(j,)) for j in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    if errors:
        raise errors[0]
    begin = min(s[0] for s in spans)
    end = max(s[1] for s in spans)
    return {
        "ids": sum(s[2] for s in spans),
        "seconds": end - begin,
        "calls": sum(len(x) for x in lats),
        "lat": [x for lat in lats for x in lat],
    }


def _w6_case(
    sec: Section,
    op: str,
    threads: int,
    batch: int,
    calls: dict[str, Callable[[int], Any]],
    sizes: list[int],
    reps: int,
    cap_s: float,
    skipped: dict[str, str],
    server: ServerProcess,
) -> None:
    """Time one (op, threads, batch) case for every contender, interleaved, and add its rows."""
    case = f"{op}, {threads} thread{'s' if threads > 1 else ''}"
    targets: dict[str, tuple[str, float]] = {}
    if batch == 4096:
        targets = {name: (">=5x", 5.0) for name in W6_REDIS[op]}
    if batch == 65536 and op == "pull":
        targets[W6_LOCAL] = (">=0.5x", 0.5)
    fns = {name: functools.partial(_w6_run, f, sizes, threads, cap_s) for name, f in calls.items()}
    log(f"W6: {case}, batch {batch}: {len(sizes)} calls (at most {cap_s:g} s) x {reps} reps")
    try:
        for fn in calls.values():  # warm-up: a quarter of the time cap each
            _w6_run(fn, sizes, threads, cap_s / 4)
        res = measure_phases(fns, reps, warmup=0)
    except Exception as exc:
        msg = f"{case}, batch {batch}: {type(exc).__name__}: {exc}"
        sec.notes.append(f"FAILED {msg}")
        log(f"W6: FAILED {msg}")
        for name in calls:
            target = targets.get(name, ("", None))[0]
            sec.rows.append(
                Row("W6", case, "zipf", batch, name, status="failed", target=target,
                    extra={"threads": threads, "error": repr(exc)})
            )  # fmt: skip
        if not server.running():
            raise _W6Stop(f"the pstore server exited ({server.log_tail()})") from exc
        return
    rates = {name: [r["ids"] / r["seconds"] for r in rs] for name, rs in res.items()}
    if W6_FLOOR in rates:
        sec.notes.append(_w6_floor_note(case, batch, rates))
    rows = rows_from_rates("W6", case, "zipf", batch, rates, W6_REF, targets, skipped)
    for row in rows:
        row.extra["threads"] = threads
        if row.status != "ok":
            continue
        row.extra.update(latency_extra(res[row.impl]))
    sec.rows += rows


def _w6_floor_note(case: str, batch: int, rates: dict[str, list[float]]) -> str:
    """What the bare loopback transfer of the same answers allows: the best ratio against each
    target's peer that any pull over TCP could reach here."""
    med = {name: statistics.median(r) for name, r in rates.items()}
    floor = med[W6_FLOOR]
    what = "answers" if case.startswith("pull") else "requests"
    head = f"{case}, batch {batch}: a bare TCP transfer of the {what} runs at {floor:,.0f} ids/s"
    parts = [head]
    for peer in ("redis MGET", "redis MSET", W6_LOCAL):
        if peer in med:
            parts.append(f"{floor / med[peer]:.2f}x {peer}")
    parts.append(f"the pstore server reaches {med[W6_REF] / floor:.2f} of it")
    return "; ".join(parts)


def _w6_calls(
    op: str,
    rt: Any,
    lt: Any,
    peer: RedisRows | None,
    ids: list[np.ndarray],
    keys: list[list[bytes]],
    grads: list[np.ndarray],
) -> dict[str, Callable[[int], Any]]:
    """The contenders' calls for batch i: the same ids (and gradients) for every contender."""
    ng = len(grads)
    if op == "pull":
        calls = {W6_REF: lambda i: rt.pull(ids[i]), W6_LOCAL: lambda i: lt.pull(ids[i])}
        if peer is not None:
            calls["redis MGET"] = lambda i: peer.pull(keys[i])
        return calls
    calls = {
        W6_REF: lambda i: rt.push(ids[i], grads[i % ng]),
        W6_LOCAL: lambda i: lt.push(ids[i], grads[i % ng]),
    }
    if peer is not None:
        calls["redis SET pipeline"] = lambda i: peer.push_set_pipeline(keys[i], grads[i % ng])
        calls["redis MSET"] = lambda i: peer.push_mset(keys[i], grads[i % ng])
    return calls


def w6_network(ctx: Context) -> Section:
    pstore = ctx.pstore
    sz = ctx.sizes
    reps = min(ctx.reps, sz.w6_reps)
    n, notes = _w6_fit(sz.w6_rows)
    sec = Section(
        "W6",
        f"loopback: a pstore server process against the in-process Store() and Redis; pull and "
        f"push of Zipf batches, {n:,} rows x {W6_DIM} float32, SGD (lr {W6_LR})",
        {"rows": n, "requested_rows": sz.w6_rows, "dim": W6_DIM, "batches": W6_BATCHES,
         "threads": W6_THREADS, "reps": reps, "cap_s": sz.w6_cap_s,
         "calls_per_rep": dict(sz.w6_calls)},
    )  # fmt: skip
    sec.notes += notes
    if not hasattr(pstore, "connect"):
        sec.notes.append(
            f"skipped: this pstore ({pstore.__file__}) has no pstore.connect, so no server; "
            "run with --source-tree to measure the repository's build"
        )
        return sec
    redis = import_redis()
    redis_path = redis_server_path()
    redis_skip = None
    if redis_path is None:
        redis_skip = "redis-server not found"
    elif redis is None:
        redis_skip = "redis (redis-py) not installed"
    if redis_skip is not None:
        sec.notes.append(f"skipped: {redis_skip}; the Redis peer is not measured")
    work = Path(tempfile.mkdtemp(prefix="pstore-w6-"))
    servers: list[ServerProcess] = []
    local = pstore.Store()
    try:
        # Its rows port (decision 0128), when the benchmarked pstore has one: pulls use it.
        server_mod = importlib.import_module(pstore.__name__ + ".server")
        rows = "rows_port" in inspect.signature(server_mod.Server).parameters
        log(f"W6: starting a pstore server{' with a rows port' if rows else ''}")
        server = start_pstore_server(pstore, pstore_search_dir(pstore), work, rows_port=rows)
        servers.append(server)
        sec.config["pstore_server"] = f"{server.address} pid {server.pid}"
        sec.config["pstore_server_rows_port"] = rows
        log("W6: starting the bare-TCP floor server")
        floor_server = start_tcp_floor(work)
        servers.append(floor_server)
        floor = TcpFloor(floor_server.address)
        remote = pstore.connect([server.address])
        sgd = pstore.optim.SGD(lr=W6_LR)
        rt = remote.create_sparse_table(W6_TABLE, W6_DIM, optimizer=sgd)
        lt = local.create_sparse_table(W6_TABLE, W6_DIM, optimizer=pstore.optim.SGD(lr=W6_LR))
        sec.config["in_process_threads"] = local.threads
        log(f"W6: populating the server's table ({n:,} pulls of new ids)")
        sec.config["server_populate_ids_per_s"] = _populate(rt, n)
        log(f"W6: populating the in-process table ({n:,} rows)")
        sec.config["in_process_populate_ids_per_s"] = _populate(lt, n)
        peer = None
        if redis_skip is None:
            assert redis is not None and redis_path is not None
            log(f"W6: starting {redis_path}")
            rserver, client = start_redis(redis, redis_path, work)
            servers.append(rserver)
            peer = RedisRows(client, W6_DIM)
            info = client.info("server")
            hiredis = bool(getattr(getattr(redis, "utils", None), "HIREDIS_AVAILABLE", False))
            sec.config.update(
                redis_server=f"{redis_path} {info.get('redis_version')} at {rserver.address} "
                f"pid {rserver.pid}",
                redis_py=redis.__version__,
                redis_py_parser="hiredis" if hiredis else "pure Python (hiredis not installed)",
            )
            log(f"W6: populating Redis with the in-process table's rows ({n:,}, MSETs)")
            t0 = time.perf_counter()
            for start in range(0, n, POPULATE_BATCH):
                ids = ids_of(np.arange(start, min(start + POPULATE_BATCH, n), dtype=np.int64))
                peer.populate(RedisRows.keys(ids), lt.pull(ids))
            sec.config["redis_populate_ids_per_s"] = n / (time.perf_counter() - t0)
            sec.config["redis_keys"] = client.dbsize()
            sec.config["redis_used_memory"] = client.info("memory").get("used_memory_human")
            probe = ids_of(PositionSampler(n, seed=60).sample("zipf", 4096))
            if not np.array_equal(peer.pull(RedisRows.keys(probe)), lt.pull(probe)):
                sec.notes.append("Redis's rows differ from the in-process table's after populating")
        if len(rt) != n or (peer is not None and sec.config["redis_keys"] != n):
            sec.notes.append(
                f"after populating: server rows {len(rt):,}, Redis keys "
                f"{sec.config.get('redis_keys')}, expected {n:,}"
            )
        sampler = PositionSampler(n, seed=61)
        for batch in W6_BATCHES:
            count = sz.w6_calls[batch]
            ids = [ids_of(sampler.sample("zipf", batch)) for _ in range(count)]
            sizes = [batch] * count
            sec.config[f"unique_frac_{batch}"] = _unique_frac(ids)
            grads = _grads(batch, W6_DIM, 4, seed=62)
            keys = [RedisRows.keys(b) for b in ids] if peer is not None else []
            for op in ("pull", "push"):
                calls = _w6_calls(op, rt, lt, peer, ids, keys, grads)
                skipped = {name: redis_skip for name in W6_REDIS[op]} if redis_skip else {}
                for threads in W6_THREADS:
                    calls.pop(W6_FLOOR, None)
                    if op == "pull" and threads == 1:
                        # One thread only: Python threads sharing the GIL would measure the GIL.
                        nbytes = batch * W6_DIM * 4
                        calls[W6_FLOOR] = lambda i, nbytes=nbytes: floor.pull(nbytes)
                    elif threads == 1:
                        # A push sends its ids and gradients.
                        nbytes = batch * (8 + W6_DIM * 4)
                        calls[W6_FLOOR] = lambda i, nbytes=nbytes: floor.push(nbytes)
                    _w6_case(
                        sec, op, threads, batch, calls, sizes, reps, sz.w6_cap_s, skipped, server
                    )
            del ids, keys, grads
        if len(rt) != n or len(lt) != n:
            sec.notes.append(f"after W6: rows {len(rt):,} (server), {len(lt):,} (in-process)")
        remote.close()
        floor.close()
    except _W6Stop as exc:
        sec.notes.append(f"stopped early: {exc}")
    finally:
        for srv in reversed(servers):
            rc = srv.stop()
            sec.config[f"{srv.name}_exit_code"] = rc
            if rc != 0:
                sec.notes.append(f"{srv.name} (pid {srv.pid}) exited with {rc}: {srv.log_tail()}")
            errs = srv.log_errors()
            if errs:
                sec.notes.append(f"{srv.name} logged {len(errs)} error/warning line(s): {errs[0]}")
        local.close()
        shutil.rmtree(work, ignore_errors=True)
    return sec


WORKLOADS: dict[str, Callable[[Context], Section]] = {
    "W1": w1_pull,
    "W2": w2_push,
    "W3": w3_growth,
    "W4": w4_concurrency,
    "W5": w5_durability,
    "W6": w6_network,
}
