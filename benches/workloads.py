"""The four workloads W1-W4. Each returns a Section: its configuration and result rows."""

from __future__ import annotations

import gc
import statistics
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
    PositionSampler,
    Row,
    ids_of,
    log,
    measure_interleaved,
    pstore_search_dir,
    rows_from_rates,
    run_child,
)
from peers import DictTake, NumpyAddAt, NumpyTake, TorchEmbeddingPull, TorchSparseStep

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
)


@dataclass
class Context:
    pstore: ModuleType
    torch: ModuleType | None
    sizes: Sizes
    reps: int


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
    sec.config["pstore_bytes_used_per_row"] = pt.stats()["bytes_used"] / max(len(pt), 1)
    log("W1: building the dict peer")
    t0 = time.perf_counter()
    dict_peer = DictTake(ids_of(np.arange(n, dtype=np.int64)), table)
    sec.config["dict_build_s"] = time.perf_counter() - t0
    np_peer = NumpyTake(table)
    torch_peer = TorchEmbeddingPull(torch, table) if torch is not None else None
    skipped = {} if torch is not None else {"torch_embedding": "torch not installed"}
    targets = {"numpy_take": (">=1.0x", 1.0), "dict_take": (">=5x", 5.0)}
    sampler = PositionSampler(n, seed=11)
    for dist in DISTS:
        for batch in batch_sizes:
            nb = max(1, ctx.sizes.w1_ids_per_rep // batch)
            pos = [sampler.sample(dist, batch) for _ in range(nb)]
            ids = [ids_of(p) for p in pos]
            sec.config[f"unique_frac_{dist}_{batch}"] = _unique_frac(pos)
            fns = {
                "pstore": _loop(pt.pull, ids),
                "numpy_take": _loop(np_peer.pull, pos),
                "dict_take": _loop(dict_peer.pull, ids),
            }
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


WORKLOADS: dict[str, Callable[[Context], Section]] = {
    "W1": w1_pull,
    "W2": w2_push,
    "W3": w3_growth,
    "W4": w4_concurrency,
}
