"""W8: DeepFM click-through training with every sparse field in torch or in pstore.

The model, data, batch size and optimizer settings of `pstore.apps.ctr`, trained side by side in
one process: the pure-torch twin (`nn.Embedding(sparse=True)` over the whole id space and
`torch.optim.Adagrad`, `ctr.train_deepfm_torch`), pstore embedded (`ctr.train_deepfm` on a
`pstore.Store()`: with the modules' defaults, the store's work on torch's OpenMP threads and each
push applied in the backward pass; with `share_threads=False`, the store's own pool, at staleness 1
(asynchronous pushes) and 0; and with `prefetch=True`: the next batch's rows pulled during each
backward pass), and pstore remote (`ctr.train_deepfm` on `pstore.connect` to two `pstore serve`
processes on loopback).
Reports training samples/s, test AUC, rows held, table bytes per row and resident memory.

Run by run.py (`--only W8`).
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from harness import (
    Row,
    fmt_ids,
    format_table,
    log,
    measure_phases,
    mem_available_bytes,
    pstore_search_dir,
    reset_peak_rss,
    rss_bytes,
    status_bytes,
)
from net import ServerProcess, start_pstore_server
from workloads import GIB, Context, Section

W8_TORCH = "torch"
W8_EMBEDDED = "pstore embedded"
W8_OWN = "pstore embedded, own pool"
W8_SYNC = "pstore embedded, own pool, staleness 0"
W8_PREFETCH = "pstore embedded, prefetch"
W8_REMOTE = "pstore remote, 2 servers"
W8_SERVERS = 2
W8_SEED = 0
W8_TEST_FRACTION = 0.1
W8_AUC_TOL = 0.005
W8_SPEED_TARGET = 1.3
W8_TEN_MILLION = 10_000_000
# Memory while W8 runs, for the fit check: the torch twin's tables (weights and Adagrad state of
# every row of the id space, float32) with room for its step's temporaries, and per sample the
# data, its id copies and the rows a store creates for it.
W8_TORCH_FACTOR = 1.3
W8_BYTES_PER_SAMPLE = 1500
W8_MIN_SCALE = 0.001
W8_PARTS = {
    "a": "training: samples/s over the training loops (each epoch ends with a flush), test AUC "
    "after the last epoch",
    "b": "memory: the tables' bytes and this process's resident memory",
}


@dataclass(frozen=True)
class W8Sizes:
    samples: int  # before the train/test split
    epochs: int
    reps: int
    scale: float = 1.0  # multiplies Criteo's cardinalities (1.0: 33.8M ids)


W8_SIZES = {
    "quick": W8Sizes(samples=400_000, epochs=1, reps=3),
    "full": W8Sizes(samples=2_000_000, epochs=2, reps=3),
}


# ---------------------------------------------------------------------------------------------
# Memory of this process and of the servers


def _measured(train: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Call `train` (a `ctr.train_deepfm*` call) and add its wall seconds, this process's RSS
    before, its peak RSS during the call (VmHWM, reset before) and the load average."""
    rss0 = rss_bytes()
    peak_ok = reset_peak_rss()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    m = train()
    wall = time.perf_counter() - t0
    peak = status_bytes("self", "VmHWM") if peak_ok else None
    m.update(
        wall_s=wall,
        rss_before=rss0,
        rss_peak=peak,
        rss_growth=(peak if peak is not None else rss_bytes()) - rss0,
        rss_growth_is_peak=peak is not None,
        loadavg_1m=load,
    )
    return m


# ---------------------------------------------------------------------------------------------
# The contenders: each call is one training run, from new tables


def _train_torch(ctr: ModuleType, train: Any, test: Any, kw: dict[str, Any]) -> dict[str, Any]:
    return _measured(lambda: ctr.train_deepfm_torch(train, test, **kw))


def _train_embedded(
    pstore: ModuleType,
    ctr: ModuleType,
    train: Any,
    test: Any,
    kw: dict[str, Any],
    staleness: int,
    prefetch: bool = False,
    share_threads: bool = True,
) -> dict[str, Any]:
    store = pstore.Store()
    opts = {"staleness": staleness, "prefetch": prefetch, "share_threads": share_threads}
    try:
        return _measured(lambda: ctr.train_deepfm(store, train, test, **opts, **kw))
    finally:
        store.close()


def _train_remote(
    pstore: ModuleType,
    ctr: ModuleType,
    train: Any,
    test: Any,
    kw: dict[str, Any],
    sec: Section,
    work: Path,
) -> dict[str, Any]:
    """Two new `pstore serve` processes (in memory) for this run, stopped at its end; their
    resident memory is read from /proc before training and after it."""
    servers: list[ServerProcess] = []
    remote = None
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    try:
        for i in range(W8_SERVERS):
            server_dir = run_dir / f"server{i}"
            server_dir.mkdir()
            servers.append(start_pstore_server(pstore, pstore_search_dir(pstore), server_dir))
        start = {s.pid: status_bytes(s.pid, "VmRSS") for s in servers}
        remote = pstore.connect([s.address for s in servers])
        m = _measured(lambda: ctr.train_deepfm(remote, train, test, **kw))
        m["servers"] = [
            {
                "address": s.address,
                "pid": s.pid,
                "rss_start": start[s.pid],
                "rss_end": status_bytes(s.pid, "VmRSS"),
                "rss_peak": status_bytes(s.pid, "VmHWM"),
            }
            for s in servers
        ]
        return m
    finally:
        if remote is not None:
            remote.close()
        _stop_servers(sec, servers)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop_servers(sec: Section, servers: list[ServerProcess]) -> None:
    for s in servers:
        rc = s.stop()
        if rc != 0:
            sec.notes.append(f"pstore server (pid {s.pid}) exited with {rc}: {s.log_tail()}")
        errs = s.log_errors()
        if errs:
            sec.notes.append(f"pstore server (pid {s.pid}) logged {len(errs)} error/warning "
                             f"line(s): {errs[0]}")  # fmt: skip


def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One run of a contender, logged; a failure becomes {"error": ...} so the others go on."""
    log(f"W8: training {name}")
    try:
        m = fn()
    except Exception as exc:
        log(f"W8: {name} FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    log(f"W8: {name}: {m['samples_per_s']:,.0f} samples/s, test AUC {m['test_auc']:.4f}, "
        f"{m['wall_s']:.1f} s")  # fmt: skip
    return m


# ---------------------------------------------------------------------------------------------
# The workload


def _fit(sz: W8Sizes, id_space: int, dim: int) -> tuple[float, dict[str, Any], list[str]]:
    """The cardinality scale whose torch twin fits 80% of the available memory."""
    mem = mem_available_bytes()
    torch_bytes = W8_TORCH_FACTOR * 2 * 4 * (1 + dim) * id_space * sz.scale
    other = W8_BYTES_PER_SAMPLE * sz.samples + GIB
    info = {
        "mem_available_gib": round(mem / GIB, 1),
        "mem_needed_gib": round((torch_bytes + other) / GIB, 1),
    }
    if torch_bytes + other <= 0.8 * mem:
        return sz.scale, info, []
    scale = max(sz.scale * (0.8 * mem - other) / torch_bytes, W8_MIN_SCALE)
    note = (
        f"SCALED DOWN: cardinalities x{scale:.3g} instead of x{sz.scale:g}: about "
        f"{info['mem_needed_gib']} GiB of memory needed, {info['mem_available_gib']} GiB available"
    )
    return scale, info, [note]


def _imports(pstore: ModuleType, torch: ModuleType | None) -> tuple[Any, Any, str | None]:
    """pstore.apps.ctr and pstore.apps.datasets, or why W8 cannot run."""
    if torch is None:
        return None, None, "torch is not installed"
    try:
        ctr = importlib.import_module("pstore.apps.ctr")
        datasets = importlib.import_module("pstore.apps.datasets")
        datasets.criteo_like, ctr.train_deepfm_torch  # noqa: B018
    except (ImportError, AttributeError) as exc:
        why = (
            f"this pstore ({pstore.__file__}) has no pstore.apps.ctr or criteo_like ({exc}); run "
            "with --source-tree to measure the repository's build"
        )
        return None, None, why
    return ctr, datasets, None


def w8_torch_ctr(ctx: Context) -> Section:
    pstore, torch = ctx.pstore, ctx.torch
    sz = W8_SIZES[ctx.sizes.mode]
    reps = min(ctx.reps, sz.reps)
    sec = Section(
        "W8",
        "DeepFM (pstore.apps.ctr) on Criteo-shaped data: sparse fields in torch (nn.Embedding("
        "sparse=True) + torch.optim.Adagrad) against pstore embedded and remote (2 servers on "
        "loopback)",
        {"reps": reps, "sizes": asdict(sz), "parts": dict(W8_PARTS)},
    )
    ctr, datasets, why = _imports(pstore, torch)
    if why is not None:
        sec.notes.append(f"skipped: {why}")
        return sec
    assert torch is not None
    id_space_full = sum(int(c) for c in datasets.CRITEO_CARDINALITIES)
    scale, room, notes = _fit(sz, id_space_full, ctr.DEFAULT_DIM)
    sec.notes += notes
    log(f"W8: generating {sz.samples:,} Criteo-like samples (cardinalities x{scale:g})")
    t0 = time.perf_counter()
    data = datasets.criteo_like(sz.samples, seed=W8_SEED, scale=scale)
    train, test = data.split(W8_TEST_FRACTION, seed=W8_SEED)
    gen_s = time.perf_counter() - t0
    del data
    id_space = int(sum(train.cardinalities))
    trained = np.unique(ctr.global_ids(train))
    ids_trained = int(trained.size)
    ids_seen = int(np.union1d(trained, ctr.global_ids(test)).size)
    del trained
    batch = ctr.DEFAULT_BATCH_SIZE
    steps = sz.epochs * -(-len(train) // batch)
    sec.config.update(
        samples=sz.samples, train=len(train), test=len(test), scale=scale, id_space=id_space,
        id_space_10M_plus="yes" if id_space >= W8_TEN_MILLION else "NO",
        ids_trained=ids_trained, ids_seen=ids_seen, epochs=sz.epochs, batch=batch, steps=steps,
        dim=ctr.DEFAULT_DIM, hidden=list(ctr.DEFAULT_HIDDEN), lr=ctr.DEFAULT_LR,
        dense_lr=ctr.DEFAULT_DENSE_LR,
        initial_accumulator=ctr.DEFAULT_INITIAL_ACCUMULATOR, oracle_auc=round(test.oracle_auc, 4),
        torch_threads=torch.get_num_threads(), data_s=round(gen_s, 1), **room,
        data={"cardinalities": list(train.cardinalities), "source": train.source,
              "ctr": train.ctr},
    )  # fmt: skip
    kw: dict[str, Any] = {"epochs": sz.epochs, "batch_size": batch, "seed": W8_SEED}
    kw["progress"] = False
    contenders: dict[str, Callable[[], dict[str, Any]]] = {
        W8_TORCH: functools.partial(_train_torch, ctr, train, test, kw),
        # The store's work on torch's OpenMP threads, pushes applied in the backward pass.
        W8_EMBEDDED: functools.partial(_train_embedded, pstore, ctr, train, test, kw, 1),
        # The store's own pool: asynchronous pushes (staleness 1), then synchronous ones.
        W8_OWN: functools.partial(_train_embedded, pstore, ctr, train, test, kw, 1, False, False),
        W8_SYNC: functools.partial(_train_embedded, pstore, ctr, train, test, kw, 0, False, False),
        # The next batch's rows pulled during each backward pass (staleness 1 still bounds it).
        W8_PREFETCH: functools.partial(_train_embedded, pstore, ctr, train, test, kw, 1, True),
    }
    skipped: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="pstore-w8-"))
    if hasattr(pstore, "connect"):
        contenders[W8_REMOTE] = functools.partial(
            _train_remote, pstore, ctr, train, test, kw, sec, work
        )
    else:
        skipped[W8_REMOTE] = "this pstore has no pstore.connect (use --source-tree)"
    try:
        fns = {name: functools.partial(_guarded, name, fn) for name, fn in contenders.items()}
        res = measure_phases(fns, reps, warmup=0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sec.rows += _rows(sec, res, ids_trained, skipped)
    for row in sec.rows:
        held = row.extra.get("rows")
        if row.impl != W8_TORCH and held is not None and held != ids_trained:
            sec.notes.append(f"{row.impl} holds {held:,} rows; the training data has "
                             f"{ids_trained:,} distinct ids")  # fmt: skip
    loads = [m["loadavg_1m"] for ms in res.values() for m in ms if "loadavg_1m" in m]
    if loads:
        sec.config["loadavg_1m_at_runs"] = f"{min(loads):.2f}-{max(loads):.2f}"
    return sec


def _rows(
    sec: Section, res: dict[str, list[dict[str, Any]]], ids_trained: int, skipped: dict[str, str]
) -> list[Row]:
    """One row per contender: samples/s per repetition, the ratio to torch's median, the test
    AUC and its difference to torch's, and the memory figures."""
    ok = {name: [m for m in ms if "error" not in m] for name, ms in res.items()}
    for name, ms in res.items():
        for m in ms:
            if "error" in m:
                sec.notes.append(f"FAILED {name}: {m['error']}")
    ref = ok.get(W8_TORCH) or []
    ref_sps = statistics.median(m["samples_per_s"] for m in ref) if ref else None
    ref_auc = statistics.median(m["test_auc"] for m in ref) if ref else None
    rows = []
    for name, ms in ok.items():
        row = Row("W8", "DeepFM training", "criteo-like", sec.config["batch"], name, "samples/s")
        if not ms:
            row.status = "failed"
            rows.append(row)
            continue
        row.samples = [m["samples_per_s"] for m in ms]
        if name.startswith(W8_EMBEDDED):
            row.target, row.target_min = f">={W8_SPEED_TARGET}x", W8_SPEED_TARGET
        if name != W8_TORCH and ref_sps is not None:
            row.ratio = statistics.median(row.samples) / ref_sps
            row.ratio_of = f"{name}/{W8_TORCH}"
        row.extra.update(_memory(ms, ids_trained))
        aucs = [m["test_auc"] for m in ms]
        row.extra.update(auc=aucs, auc_median=statistics.median(aucs))
        if name != W8_TORCH and ref_auc is not None:
            diff = statistics.median(aucs) - ref_auc
            row.extra.update(auc_diff=diff, auc_met=abs(diff) <= W8_AUC_TOL)
        row.extra.update(
            staleness=ms[0]["staleness"],
            prefetch=ms[0].get("prefetch", False),
            share_threads=ms[0].get("share_threads", False),
            steps=-(-ms[0]["n_train"] // ms[0]["batch_size"]) * ms[0]["epochs"],
            wall_s=[m["wall_s"] for m in ms],
            train_s=[m["train_seconds"] for m in ms],
            loadavg_1m=[m["loadavg_1m"] for m in ms],
            store_threads=ms[0]["store_threads"],
            history=[m["history"] for m in ms],
        )
        rows.append(row)
    for name, reason in skipped.items():
        rows.append(Row("W8", "DeepFM training", "criteo-like", sec.config["batch"], name,
                        "samples/s", status=f"skipped: {reason}"))  # fmt: skip
    return rows


def _memory(ms: list[dict[str, Any]], ids_trained: int) -> dict[str, Any]:
    """Rows held (the embedding table's; the first-order table has the same), the two tables'
    bytes, per row held and per distinct id of the training data, and the largest resident
    growth of the runs."""
    m = ms[0]
    rows = int(m["rows"]["embedding"])
    table_bytes = int(sum(m["table_bytes"].values()))
    out: dict[str, Any] = {
        "rows": rows,
        "rows_per_table": m["rows"],
        "table_bytes": table_bytes,
        "table_bytes_per_table": m["table_bytes"],
        "bytes_per_row": table_bytes / rows if rows else None,
        "bytes_per_id_trained": table_bytes / ids_trained,
        "rss_growth": [x["rss_growth"] for x in ms],
        "rss_growth_median": statistics.median(x["rss_growth"] for x in ms),
        "rss_growth_is_peak": m["rss_growth_is_peak"],
    }
    if "servers" in m:
        per_run = [x["servers"] for x in ms]
        out["servers"] = per_run
        growth = [sum((s["rss_end"] or 0) - (s["rss_start"] or 0) for s in run) for run in per_run]
        out["servers_rss_growth"] = growth
        out["servers_rss_end_max"] = max(sum(s["rss_end"] or 0 for s in run) for run in per_run)
        out["servers_rss_peak_max"] = max(sum(s["rss_peak"] or 0 for s in run) for run in per_run)
    return out


# ---------------------------------------------------------------------------------------------
# The printed tables


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _gbs(xs: list[float]) -> str:
    """Byte counts of the repetitions (in the order they ran) as "0.61/0.32 GB"."""
    return "/".join(f"{x / 1e9:.2f}" for x in xs) + " GB"


def _rjust(headers: list[str], lines: list[list[str]], cols: set[int]) -> list[list[str]]:
    """Right-align the given columns (format_table left-aligns headers it does not know)."""
    for i in cols:
        width = max(len(headers[i]), *(len(line[i]) for line in lines))
        for line in lines:
            line[i] = line[i].rjust(width)
    return lines


def _threads(impl: str, e: dict[str, Any]) -> str:
    """Where a contender's sparse work ran."""
    if impl == W8_TORCH:
        return "torch"
    if impl == W8_REMOTE:
        return "servers"
    return "torch's" if e.get("share_threads") else "own pool"


def format_w8(sec: Section) -> str:
    rows = sec.rows
    if not rows:
        return "   (no rows)"
    parts = sec.config.get("parts", {})
    headers = ["impl", "staleness", "threads", "samples/s median", "samples/s min-max", "ratio"]
    headers += ["ratio of", "target", "met", "test AUC", "AUC min-max", "dAUC", "AUC target", "met"]
    headers += ["wall s each"]
    met = {None: "", True: "yes", False: "NO"}
    lines = []
    for r in rows:
        e = r.extra
        if r.status != "ok":
            lines.append([r.impl, "", "", "-", "-", "", "", r.target, r.status, *[""] * 6])
            continue
        aucs = e["auc"]
        diff = e.get("auc_diff")
        lines.append(
            [r.impl, str(e["staleness"]), _threads(r.impl, e),
             fmt_ids(statistics.median(r.samples)),
             f"{fmt_ids(min(r.samples))}-{fmt_ids(max(r.samples))}",
             "" if r.ratio is None else f"{r.ratio:.2f}x", r.ratio_of, r.target, met[r.met],
             f"{e['auc_median']:.4f}", f"{min(aucs):.4f}-{max(aucs):.4f}",
             "" if diff is None else f"{diff:+.4f}", "" if diff is None else f"|d|<={W8_AUC_TOL}",
             met[e.get("auc_met")], "/".join(f"{s:.3g}" for s in e["wall_s"])]
        )  # fmt: skip
    lines = _rjust(headers, lines, {1, 3, 4, 5, 9, 10, 11, 14})
    out = [f"-- a: {parts.get('a', '')}\n" + format_table(headers, lines)]
    headers = ["impl", "rows held", "table bytes", "B/row", "B/id trained", "RSS growth each"]
    headers += ["RSS growth/row", "servers' RSS growth", "detail"]
    lines = []
    for r in rows:
        if r.status != "ok":
            continue
        e = r.extra
        detail = ", ".join(f"{k} {v:,}" for k, v in e["table_bytes_per_table"].items())
        servers = "-"
        if "servers" in e:
            servers = _gbs(e["servers_rss_growth"])
            detail += (f"; servers' RSS at the end {_gb(e['servers_rss_end_max'])}, peak "
                       f"{_gb(e['servers_rss_peak_max'])} (sum of {W8_SERVERS})")  # fmt: skip
        lines.append(
            [r.impl, f"{e['rows']:,}", f"{e['table_bytes']:,}", f"{e['bytes_per_row']:.1f}",
             f"{e['bytes_per_id_trained']:.1f}", _gbs(e["rss_growth"]),
             f"{e['rss_growth_median'] / e['rows']:.1f}", servers, detail]
        )  # fmt: skip
    if lines:
        lines = _rjust(headers, lines, {1, 2, 3, 4, 5, 6, 7})
        out.append(f"-- b: {parts.get('b', '')}\n" + format_table(headers, lines))
    return "\n".join(out)
