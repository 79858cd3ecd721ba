"""W7: read-only serving. One table exported from a snapshot as serving artifacts (float32,
float16, int8) and as an ONNX model, then opened and looked up by every way a server could read
it: `pstore.serving.ServingStore` in process, a model server process on loopback, onnxruntime,
and the `lmdb` package reading the same rows from an LMDB file of its own (keys the ids
big-endian, values the float32 rows, as format 1 artifacts stored them). Then the open time of a
10M-row artifact and the memory of 1 and 4 serving processes on one artifact.

Run by run.py (`--only W7`). This file is also W7's child process, for the open times (each
opening is timed in a fresh process, since a process shares one opening of an artifact):
    python benches/serving.py '{"impl": ..., "path": ..., ...}'   # prints one JSON line
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from harness import (
    REPO_ROOT,
    PositionSampler,
    Row,
    fmt_ids,
    format_table,
    ids_of,
    import_pstore,
    log,
    measure_phases,
    mem_available_bytes,
    pstore_search_dir,
    run_child,
)
from net import ServerProcess, free_port, wait_serving
from workloads import (
    GIB,
    POPULATE_BATCH,
    Context,
    Section,
    _populate,
    _unique_frac,
    _w6_run,
    latency_extra,
    scaled_down,
)

W7_DIM = 64
W7_TABLE = "w7"
W7_LR = 0.01
W7_DTYPES = ("float32", "float16", "int8")
W7_BATCHES = (1, 256, 4096)
W7_FIRST_BATCH = 4096  # the child's first batch after opening
W7_ERR_SAMPLE = 65536  # ids compared across dtypes
W7_REF = "ServingStore float32"
W7_SERVER = "model server"
W7_LMDB = "lmdb package"
W7_ORT = "onnxruntime"
W7_PARTS = {
    "a": "artifacts on disk: one export of one full snapshot per dtype, and the ONNX model",
    "b": "open: a fresh process opens the {rows}-row artifact (or ONNX model), looks up 1 id",
    "c": "lookups of Zipf batches, 1 client thread; ids/s, per-call latency",
    "d": "memory: N processes each open the float32 artifact (or ONNX model) and read every "
    "row once; the machine's used memory (MemTotal - MemAvailable) and the processes' PSS",
}
W7_ARTIFACT = "artifact (data.mdb + row file)"
W7_BIG_ROWS = 10_000_000  # the open time at this many rows (dim 8 when the table is smaller)
W7_BIG_DIM = 8
W7_PROCS = (1, 4)
# Bytes per row while W7 runs: memory for the training store that builds the table (~450 B)
# and for onnxruntime's copy of the weights and its id map; disk for the snapshot, the three
# artifacts and the ONNX model (~1.1 kB together at dim 64).
W7_MEM_PER_ROW = 1400
W7_DISK_PER_ROW = 1400
W7_MIN_ROWS = 65536


@dataclass(frozen=True)
class W7Sizes:
    rows: int
    ort_fallback_rows: int  # the ONNX model's rows if the whole table cannot be exported
    calls: dict[int, int]  # batch size -> calls per repetition
    cap_s: float  # a repetition's calls stop after this many seconds
    reps: int
    open_reps: int


W7_SIZES = {
    "quick": W7Sizes(
        rows=1_000_000,
        ort_fallback_rows=1_000_000,
        calls={1: 2000, 256: 200, 4096: 40},
        cap_s=2.0,
        reps=4,
        open_reps=5,
    ),
    "full": W7Sizes(
        rows=10_000_000,
        ort_fallback_rows=4_000_000,
        calls={1: 4000, 256: 400, 4096: 80},
        cap_s=5.0,
        reps=7,
        open_reps=7,
    ),
}

CHILD_SCRIPT = Path(__file__).resolve()

# The model server when the benchmarked pstore has no `serve-model` command: serve until SIGTERM.
# ---------------------------------------------------------------------------------------------
# Peers


class LmdbRows:
    """An LMDB file of the table's rows read with the `lmdb` PyPI package (written by
    `write_lmdb_rows`): one read transaction per call, keys = the ids' 8 bytes big-endian, one
    `Cursor.getmulti` for the batch, the float32 values joined into an (n, dim) array.

    Only float32 artifacts (values are the row's float32 little-endian bytes). The keys are
    made inside every call (the caller holds numpy ids, as with pstore). getmulti leaves out
    keys it does not find; then the batch is read again key by key, zeros for missing ids.
    """

    def __init__(self, lmdb: ModuleType, path: str, table: str, dim: int) -> None:
        self.env = lmdb.open(path, readonly=True, lock=False, max_dbs=16)
        self.db = self.env.open_db(f"rows/{table}".encode(), create=False)
        self.dim = dim

    @staticmethod
    def keys(ids: np.ndarray) -> list[bytes]:
        return np.ascontiguousarray(ids, dtype=">u8").view("V8").ravel().tolist()

    def pull(self, ids: np.ndarray) -> np.ndarray:
        keys = self.keys(ids)
        with self.env.begin(db=self.db, buffers=False) as txn:
            found = txn.cursor().getmulti(keys)
            if len(found) == len(keys):
                data = b"".join([v for _, v in found])
                return np.frombuffer(data, "<f4").reshape(len(keys), self.dim)
            out = np.zeros((len(keys), self.dim), np.float32)
            for i, k in enumerate(keys):
                v = txn.get(k)
                if v is not None:
                    out[i] = np.frombuffer(v, "<f4")
            return out

    def close(self) -> None:
        self.env.close()


def write_lmdb_rows(lmdb: ModuleType, model: Any, out: Path) -> None:
    """The float32 artifact's rows in a new LMDB environment `out` (database `rows/<table>`,
    key the id's 8 bytes big-endian, value the float32 row), written in key order with the
    `lmdb` package: what a user of the package would build, and the layout format 1 artifacts
    had."""
    ids, rows = model.stored_rows(W7_TABLE)
    out.mkdir()
    env = lmdb.open(str(out), max_dbs=16, map_size=max(1 << 30, 4 * rows.nbytes))
    db = env.open_db(f"rows/{W7_TABLE}".encode())
    keys = LmdbRows.keys(ids)
    step = 1 << 16
    for start in range(0, len(keys), step):
        with env.begin(write=True, db=db) as txn:
            cur = txn.cursor()
            for k, r in zip(keys[start : start + step], rows[start : start + step], strict=True):
                cur.put(k, r.tobytes(), append=True)
    env.sync(True)
    env.close()


class OrtRows:
    """onnxruntime on the ONNX model pstore exported: input `{table}_ids` int64 (the uint64 ids'
    bits), output `{table}` float32 (n, dim); CPU execution provider, default threads."""

    def __init__(self, ort: ModuleType, model: str, table: str) -> None:
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.input = f"{table}_ids"
        self.output = [table]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        feed = {self.input: np.ascontiguousarray(ids, dtype=np.uint64).view(np.int64)}
        return self.session.run(self.output, feed)[0]


# ---------------------------------------------------------------------------------------------
# The model server process


def start_model_server(
    pstore: ModuleType, search_dir: str, model_dir: Path, workdir: Path
) -> tuple[ServerProcess, str]:
    """`python -m pstore serve-model` of `model_dir` on a free 127.0.0.1 port, ready. Returns it
    and how it was started."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (search_dir, env.get("PYTHONPATH")) if p)
    host = "127.0.0.1"
    how = "python -m pstore serve-model"
    argv = [sys.executable, "-m", "pstore", "serve-model", str(model_dir)]
    argv += ["--host", host, "--port", str(port)]
    # Its rows port (decision 0120), when the benchmarked pstore has one: the client uses it.
    serving_mod = importlib.import_module(pstore.__name__ + ".serving")
    if "rows_port" in inspect.signature(serving_mod.ModelServer).parameters:
        argv += ["--rows-port", "0"]
        how += " --rows-port 0"
    server = ServerProcess("model-server", argv, workdir, f"{host}:{port}", env)
    wait_serving(pstore, server)
    return server, how


# ---------------------------------------------------------------------------------------------
# Files


def _file_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _files_of(path: Path) -> list[Path]:
    """The files of an artifact directory, or of the directory an ONNX model file is in (the
    model and its external data)."""
    d = path if path.is_dir() else path.parent
    return sorted(p for p in d.rglob("*") if p.is_file())


def _drop_cache(files: list[Path]) -> None:
    """Drop files from the page cache: posix_fadvise(DONTNEED) (the pages of these files
    only; no privileges needed). Pages a process has mapped stay, and a VM's host may still
    cache the data."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_cache(files: list[Path]) -> None:
    """Read files once, so that their pages are in the page cache."""
    buf = bytearray(1 << 23)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _fit(requested: int, parent: Path) -> tuple[int, dict[str, Any], list[str]]:
    """The row count that fits 80% of the available memory and 90% of the free disk."""
    mem = mem_available_bytes()
    disk = shutil.disk_usage(parent).free
    fit_mem = int((0.8 * mem - GIB) / W7_MEM_PER_ROW)
    fit_disk = int((0.9 * disk - GIB) / W7_DISK_PER_ROW)
    n = min(requested, fit_mem, fit_disk)
    info = {
        "mem_available_gib": round(mem / GIB, 1),
        "disk_free_gib": round(disk / GIB, 1),
        "mem_needed_gib": round((requested * W7_MEM_PER_ROW + GIB) / GIB, 1),
        "disk_needed_gib": round((requested * W7_DISK_PER_ROW + GIB) / GIB, 1),
    }
    n, notes = scaled_down(requested, n, POPULATE_BATCH, fit_mem <= fit_disk, info)
    return n, info, notes


# ---------------------------------------------------------------------------------------------
# The workload


def _build(
    pstore: ModuleType, sec: Section, tmp: Path, n: int, name: str, dim: int = W7_DIM
) -> Path:
    """A table of positions 0..n-1 (rows made by pulling every id once: the initializer's
    values), snapshotted to tmp/name; the training store is closed before returning."""
    store = pstore.Store()
    try:
        table = store.create_sparse_table(
            W7_TABLE, dim, optimizer=pstore.optim.SGD(lr=W7_LR), seed=7
        )
        log(f"W7: populating {name} ({n:,} rows)")
        sec.config[f"{name}_populate_ids_per_s"] = _populate(table, n)
        snap = tmp / name
        t0 = time.perf_counter()
        manifest = store.snapshot(snap)
        sec.config[f"{name}_s"] = time.perf_counter() - t0
        sec.config[f"{name}_bytes"] = manifest["bytes"]
    finally:
        store.close()
    return snap


def _size_row(
    what: str, impl: str, nbytes: int, n: int, seconds: float, detail: str, **extra: Any
) -> Row:
    raw = n * W7_DIM * 4
    row = Row("W7", what, "-", None, impl, "bytes", [float(nbytes)])
    row.ratio = nbytes / raw
    row.ratio_of = "bytes/raw float32"
    row.extra.update(part="a", rows=n, bytes=nbytes, bytes_per_row=nbytes / n, seconds=seconds)
    row.extra.update(detail=detail, **extra)
    return row


def _export_artifacts(
    pstore: ModuleType, sec: Section, tmp: Path, snap: Path, n: int
) -> dict[str, Path]:
    arts = {}
    for dtype in W7_DTYPES:
        out = tmp / f"artifact-{dtype}"
        log(f"W7: exporting a {dtype} artifact")
        t0 = time.perf_counter()
        info = pstore.serving.export(snap, out, dtype=dtype)
        secs = time.perf_counter() - t0
        arts[dtype] = out
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        detail = f"files: {', '.join(files)}"
        sec.rows.append(
            _size_row(W7_ARTIFACT, dtype, _file_bytes(out), n, secs, detail,
                      export_info_file_bytes=info.get("file_bytes"))
        )  # fmt: skip
    return arts


def _onnx_model(
    pstore: ModuleType, sec: Section, tmp: Path, artifact: Path, n: int, fallback: int
) -> tuple[Path | None, int, str | None]:
    """The ONNX model of the float32 artifact, its rows, and why there is none. If the whole
    table cannot be exported, a model of the first `fallback` rows (the same ids and values:
    rows are the initializer's function of (seed, id)), with a note."""
    try:
        ort = importlib.import_module("onnxruntime")
    except ImportError:
        return None, 0, "onnxruntime not installed"
    try:
        onnx_mod = importlib.import_module("pstore.serving.onnx")
    except ImportError as exc:
        return None, 0, f"this pstore has no pstore.serving.onnx ({exc})"
    sec.config["onnxruntime"] = ort.__version__
    path, err = _export_onnx(onnx_mod, sec, tmp / "onnx", artifact, n)
    if path is not None:
        return path, n, None
    if fallback >= n:
        return None, 0, err
    sec.notes.append(
        f"onnxruntime runs on a {fallback:,}-row model: the {n:,}-row table could not be "
        f"exported ({err})"
    )
    snap = _build(pstore, sec, tmp, fallback, "onnx_snapshot")
    small = tmp / "onnx-artifact"
    pstore.serving.export(snap, small, dtype="float32")
    shutil.rmtree(snap)
    path, err = _export_onnx(onnx_mod, sec, tmp / "onnx-small", small, fallback)
    shutil.rmtree(small)
    return path, fallback, err


def _export_onnx(
    onnx_mod: ModuleType, sec: Section, out_dir: Path, source: Path, n: int
) -> tuple[Path | None, str | None]:
    """The ONNX model of `source` (an artifact) in `out_dir`, or None and why not."""
    out = out_dir / "model.onnx"
    out.parent.mkdir()
    log(f"W7: exporting an ONNX model ({n:,} rows)")
    t0 = time.perf_counter()
    try:
        info = onnx_mod.export_onnx(source, out, tables=[W7_TABLE], default="zeros")
    except Exception as exc:
        shutil.rmtree(out.parent, ignore_errors=True)
        log(f"W7: export_onnx of {n:,} rows failed: {type(exc).__name__}: {exc}")
        return None, f"export_onnx failed: {type(exc).__name__}: {exc}"
    secs = time.perf_counter() - t0
    files = sorted(p.name for p in out.parent.iterdir())
    total = _file_bytes(out.parent)
    ext = info.get("external_data")
    detail = f"{len(files)} file(s){', external data' if ext else ''}"
    sec.rows.append(
        _size_row("ONNX model", "float32", total, n, secs, detail, files=files,
                  info={k: v for k, v in info.items() if k != "path"})
    )  # fmt: skip
    return out, None


def _open_child(impl: str, path: Path, n: int, search_dir: str, cold: bool) -> dict[str, Any]:
    if cold:
        _drop_cache(_files_of(path))
    args = {"impl": impl, "path": str(path), "table": W7_TABLE, "n": n, "dim": W7_DIM}
    args["pstore_dir"] = search_dir
    return run_child(CHILD_SCRIPT, args)


def _open_times(
    sec: Section,
    targets: dict[str, Path],
    n: int,
    ort_n: int,
    search_dir: str,
    reps: int,
) -> None:
    """Each of `targets` opened in fresh processes: warm (its files read into the page cache
    once before the warm runs), then cold (its files dropped from the page cache before every
    run); the contenders take turns within each."""
    rows_of = {impl: (ort_n if impl == W7_ORT else n) for impl in targets}
    impls = list(targets)
    res: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for cold in (False, True):
        log(f"W7: open times, {'cold' if cold else 'warm'}: {len(impls)} x {reps} fresh processes")
        if not cold:
            for impl, path in targets.items():
                _warm_cache(_files_of(path))
                _open_child(impl, path, rows_of[impl], search_dir, False)  # warm-up
        for impl in impls:
            res[(impl, cold)] = []
        for r in range(reps):
            k = r % len(impls)
            for impl in impls[k:] + impls[:k]:
                res[(impl, cold)].append(
                    _open_child(impl, targets[impl], rows_of[impl], search_dir, cold)
                )
    ref = {c: statistics.median(x["total_s"] for x in res[(W7_REF, c)]) for c in (False, True)}
    for (impl, cold), xs in res.items():
        total = [x["total_s"] for x in xs]
        row = Row("W7", "open + first lookup", "cold" if cold else "warm", None, impl, "s", total)
        if impl != W7_REF:
            row.ratio = statistics.median(total) / ref[cold]
            row.ratio_of = f"{impl}/{W7_REF} s"
        med = {k: statistics.median(x[k] for x in xs) for k in ("open_s", "first_s", "batch_s")}
        detail = (
            f"open {_ms(med['open_s'])} + 1 id {_ms(med['first_s'])} ms; then "
            f"{W7_FIRST_BATCH} ids {_ms(med['batch_s'])} ms"
        )
        if rows_of[impl] != n:
            detail += f" ({rows_of[impl]:,}-row model)"
        row.extra.update(part="b", seconds=total, runs=xs, detail=detail, rows=rows_of[impl])
        sec.rows.append(row)


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _lookup_case(
    sec: Section,
    batch: int,
    calls: dict[str, Callable[[int], Any]],
    sizes: list[int],
    reps: int,
    cap_s: float,
    skipped: dict[str, str],
    ratio_of: dict[str, tuple[str, str]],
    server: ServerProcess | None,
) -> None:
    """Time one batch size for every contender, interleaved (W6's timing: a quarter of the cap
    as warm-up, then `reps` repetitions of at most `cap_s` seconds), and add its rows."""
    fns = {name: functools.partial(_w6_run, f, sizes, 1, cap_s) for name, f in calls.items()}
    log(f"W7: lookups, batch {batch}: {len(sizes)} calls (at most {cap_s:g} s) x {reps} reps")
    failed: dict[str, str] = {}
    for name, fn in list(calls.items()):
        try:
            _w6_run(fn, sizes, 1, cap_s / 4)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
            del fns[name]
            detail = f" ({server.log_tail()})" if name == W7_SERVER and server else ""
            sec.notes.append(f"FAILED {name}, batch {batch}: {failed[name]}{detail}")
    try:
        res = measure_phases(fns, reps, warmup=0)
    except Exception as exc:
        alive = "" if server is None or server.running() else "; the model server exited"
        sec.notes.append(f"FAILED lookups, batch {batch}: {type(exc).__name__}: {exc}{alive}")
        for name in calls:
            sec.rows.append(Row("W7", "lookup", "zipf", batch, name, status="failed",
                                extra={"part": "c", "error": repr(exc)}))  # fmt: skip
        return
    rates = {name: [r["ids"] / r["seconds"] for r in rs] for name, rs in res.items()}
    med = {name: statistics.median(v) for name, v in rates.items()}
    case = "lookup"
    for name in list(calls) + list(skipped):
        if name in skipped or name in failed:
            status = f"skipped: {skipped[name]}" if name in skipped else "failed"
            sec.rows.append(Row("W7", case, "zipf", batch, name, status=status,
                                extra={"part": "c", "error": failed.get(name)}))  # fmt: skip
            continue
        row = Row("W7", case, "zipf", batch, name, "ids/s", rates[name])
        num, den = ratio_of.get(name, ("", ""))
        if num in med and den in med:
            row.ratio = med[num] / med[den]
            row.ratio_of = f"{num}/{den}"
        row.extra.update(part="c", **latency_extra(res[name]))
        sec.rows.append(row)


def _check(
    sec: Section, ref: Any, contenders: dict[str, Callable[[np.ndarray], np.ndarray]], n: int
) -> None:
    """Every contender's rows of one Zipf batch against the in-process float32 lookup: bit for
    bit for float32 readers; within the dtype's bound for the quantized artifacts."""
    ids = ids_of(PositionSampler(n, seed=70).sample("zipf", 4096))
    want = ref.lookup(W7_TABLE, ids)
    for name, fn in contenders.items():
        try:
            got = np.asarray(fn(ids))
        except Exception as exc:
            sec.notes.append(f"check {name}: {type(exc).__name__}: {exc}")
            continue
        if got.shape != want.shape:
            sec.notes.append(f"check {name}: shape {got.shape}, expected {want.shape}")
        elif "float16" in name or "int8" in name:
            bound = np.abs(want).max(axis=1, keepdims=True) * (1 / 254 if "int8" in name else 1e-3)
            if np.any(np.abs(got - want) > bound * (1 + 1e-6) + 1e-12):
                sec.notes.append(f"check {name}: rows beyond the dtype's error bound")
        elif not np.array_equal(got, want):
            sec.notes.append(f"check {name}: rows differ from {W7_REF}'s")


def _touch_all(sec: Section, readers: dict[str, Callable[[np.ndarray], Any]], n: int) -> None:
    """Every row read once by every contender (batches of 65536), so that the lookups measure
    a process whose mapping of the artifact is complete, not first touches of pages (part b
    has those). onnxruntime holds its rows in its own memory already."""
    for name, fn in readers.items():
        if name == W7_ORT:
            continue
        log(f"W7: {name}: reading every row once")
        t0 = time.perf_counter()
        for start in range(0, n, POPULATE_BATCH):
            fn(ids_of(np.arange(start, min(start + POPULATE_BATCH, n), dtype=np.int64)))
        rates = sec.config.setdefault("touch_all_ids_per_s", {})
        rates[name] = n / (time.perf_counter() - t0)


def _quant_errors(sec: Section, models: dict[str, Any], n: int) -> None:
    """Max abs error of each dtype's rows against float32 over a sample of ids (into part a)."""
    pos = np.random.default_rng(72).choice(n, size=min(n, W7_ERR_SAMPLE), replace=False)
    ids = ids_of(pos)
    want = models["float32"].lookup(W7_TABLE, ids)
    scale = float(np.abs(want).max())
    for row in sec.rows:
        if row.extra.get("part") == "a" and row.case == W7_ARTIFACT:
            got = models[row.impl].lookup(W7_TABLE, ids)
            err = float(np.abs(got - want).max())
            row.extra["max_abs_err"] = err
            row.extra["max_abs_err_rel"] = err / scale if scale else 0.0
            row.extra["detail"] = (
                f"max |err| {err:.2g} ({err / scale:.2g} of max|w|) over {len(ids):,} rows; "
                + row.extra["detail"]
            )


def w7_serving(ctx: Context) -> Section:
    pstore = ctx.pstore
    sz = W7_SIZES[ctx.sizes.mode]
    reps = min(ctx.reps, sz.reps)
    open_reps = min(ctx.reps, sz.open_reps)
    parent = ctx.tmp_parent or REPO_ROOT / "bench-results"
    parent.mkdir(parents=True, exist_ok=True)
    n, room, notes = _fit(sz.rows, parent)
    sec = Section(
        "W7",
        f"read-only serving: a {n:,} x {W7_DIM} float32 table exported from a snapshot, "
        f"looked up in process, through a model server on loopback, with onnxruntime and with "
        f"the lmdb package",
        {"rows": n, "requested_rows": sz.rows, "dim": W7_DIM,
         "batches": W7_BATCHES, "reps": reps, "open_reps": open_reps, "cap_s": sz.cap_s,
         "calls_per_rep": dict(sz.calls), **room, "sizes": asdict(sz), "parts": dict(W7_PARTS)},
    )  # fmt: skip
    sec.config["parts"]["b"] = W7_PARTS["b"].format(rows=f"{n:,}")
    sec.notes += notes
    if n < W7_MIN_ROWS:
        sec.notes.append(f"skipped: {n:,} rows is too few to measure anything")
        return sec
    try:
        serving = importlib.import_module("pstore.serving")
        serving.ServingStore, pstore.connect  # noqa: B018
    except (ImportError, AttributeError):
        sec.notes.append(
            f"skipped: this pstore ({pstore.__file__}) has no pstore.serving or pstore.connect; "
            "run with --source-tree to measure the repository's build"
        )
        return sec
    search_dir = pstore_search_dir(pstore)
    tmp = Path(tempfile.mkdtemp(prefix="w7-", dir=parent))
    sec.config["tmp_parent"] = str(parent)
    models: dict[str, Any] = {}
    server: ServerProcess | None = None
    peers: list[Any] = []
    try:
        # a: the artifacts and their bytes
        snap = _build(pstore, sec, tmp, n, "snapshot")
        sec.rows.append(
            _size_row("snapshot (Arrow IPC)", "float32", sec.config["snapshot_bytes"], n,
                      sec.config["snapshot_s"], "weights + SGD's (empty) state, ids, metadata")
        )  # fmt: skip
        arts = _export_artifacts(pstore, sec, tmp, snap, n)
        shutil.rmtree(snap)
        onnx_path, ort_n, ort_skip = _onnx_model(pstore, sec, tmp, arts["float32"], n,
                                                 sz.ort_fallback_rows)  # fmt: skip
        sec.config["onnx_rows"] = ort_n
        if ort_skip is not None:
            sec.notes.append(f"skipped onnxruntime: {ort_skip}")

        # b: open times, in fresh processes, before this process maps any artifact
        targets: dict[str, Path] = {W7_REF: arts["float32"]}
        lmdb_skip = None
        try:
            lmdb = importlib.import_module("lmdb")
            sec.config["lmdb_package"] = f"{lmdb.__version__} (LMDB {lmdb.version()})"
            log("W7: writing the rows into an LMDB file with the lmdb package")
            lmdb_dir = tmp / "lmdb-rows"
            t0 = time.perf_counter()
            with pstore.serving.ServingStore(arts["float32"]) as m:
                write_lmdb_rows(lmdb, m, lmdb_dir)
            sec.rows.append(
                _size_row("LMDB file (lmdb package)", "float32", _file_bytes(lmdb_dir), n,
                          time.perf_counter() - t0, "rows/w7: id big-endian -> float32 row")
            )  # fmt: skip
            targets[W7_LMDB] = lmdb_dir
        except ImportError:
            lmdb, lmdb_skip = None, "the lmdb package is not installed"
            sec.notes.append(f"skipped {W7_LMDB}: {lmdb_skip}")
        if onnx_path is not None:
            targets[W7_ORT] = onnx_path
        _open_times(sec, targets, n, ort_n, search_dir, open_reps)

        # c: lookups
        log("W7: reading the artifacts and the ONNX model into the page cache")
        for path in [*arts.values(), *([onnx_path] if onnx_path is not None else [])]:
            _warm_cache(_files_of(path))
        if W7_LMDB in targets:
            _warm_cache(_files_of(targets[W7_LMDB]))
        for dtype, path in arts.items():
            models[dtype] = pstore.serving.ServingStore(path)
        _quant_errors(sec, models, n)
        f32, f16, i8 = models["float32"], models["float16"], models["int8"]
        readers: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            W7_REF: lambda ids: f32.lookup(W7_TABLE, ids),
            "ServingStore float16": lambda ids: f16.lookup(W7_TABLE, ids),
            "ServingStore int8": lambda ids: i8.lookup(W7_TABLE, ids),
        }
        skipped: dict[str, str] = {}
        log("W7: starting a model server")
        work = tmp / "server"
        work.mkdir()
        remote = None
        try:
            server, how = start_model_server(pstore, search_dir, arts["float32"], work)
            sec.config["model_server"] = f"{how}, {server.address} pid {server.pid}"
            remote = pstore.connect([server.address])
            peers.append(remote)
            readers[W7_SERVER] = remote.table(W7_TABLE).pull
        except Exception as exc:
            skipped[W7_SERVER] = "the model server did not start"
            sec.notes.append(f"FAILED to start the model server: {type(exc).__name__}: {exc}")
        if lmdb is not None:
            lm = LmdbRows(lmdb, str(targets[W7_LMDB]), W7_TABLE, W7_DIM)
            peers.append(lm)
            readers[W7_LMDB] = lm.pull
        ort_small: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        if onnx_path is not None:
            ort = importlib.import_module("onnxruntime")
            t0 = time.perf_counter()
            o = OrtRows(ort, str(onnx_path), W7_TABLE)
            sec.config["onnxruntime_session_s"] = time.perf_counter() - t0
            (readers if ort_n == n else ort_small)[W7_ORT] = o.pull
        _check(sec, f32, {k: v for k, v in readers.items() if k != W7_REF}, n)
        _check(sec, f32, ort_small, ort_n)
        _touch_all(sec, readers, n)
        ratio_of = {
            "ServingStore float16": ("ServingStore float16", W7_REF),
            "ServingStore int8": ("ServingStore int8", W7_REF),
            W7_LMDB: (W7_REF, W7_LMDB),
            W7_SERVER: (W7_SERVER, W7_REF),
            W7_ORT: (W7_ORT, W7_REF),
        }
        if lmdb_skip is not None:
            skipped[W7_LMDB] = lmdb_skip
        if ort_skip is not None:
            skipped[W7_ORT] = ort_skip
        sampler = PositionSampler(n, seed=71)
        for batch in W7_BATCHES:
            count = sz.calls[batch]
            ids = [ids_of(sampler.sample("zipf", batch)) for _ in range(count)]
            sec.config[f"unique_frac_{batch}"] = _unique_frac(ids)
            calls = {name: functools.partial(_call, fn, ids) for name, fn in readers.items()}
            _lookup_case(sec, batch, calls, [batch] * count, reps, sz.cap_s, skipped, ratio_of,
                         server)  # fmt: skip
        if ort_small:
            # The ONNX model holds a prefix of the table: ORT against the in-process float32
            # artifact on ids of that prefix only.
            small_sampler = PositionSampler(ort_n, seed=73)
            for batch in W7_BATCHES:
                count = sz.calls[batch]
                ids = [ids_of(small_sampler.sample("zipf", batch)) for _ in range(count)]
                small = {W7_REF: readers[W7_REF], **ort_small}
                calls = {name: functools.partial(_call, fn, ids) for name, fn in small.items()}
                _lookup_case(sec, batch, calls, [batch] * count, reps, sz.cap_s, {}, ratio_of,
                             None)  # fmt: skip
                for row in sec.rows[-len(calls) :]:
                    row.case = f"lookup (first {ort_n:,} rows)"
        if remote is not None:
            remote.close()
            peers.remove(remote)
        if server is not None:
            rc = server.stop()
            sec.config["model_server_exit_code"] = rc
            if rc != 0:
                sec.notes.append(f"model server (pid {server.pid}) exited with {rc}: "
                                 f"{server.log_tail()}")  # fmt: skip
            server = None

        # d: memory of 1 and 4 processes (this process's mappings closed first)
        for m in models.values():
            m.close()
        models.clear()
        mem_targets = {W7_REF: arts["float32"]}
        if onnx_path is not None:
            mem_targets[W7_ORT] = onnx_path
        _memory(sec, mem_targets, n, search_dir)

        # b, continued: the open time of a 10M-row artifact
        _big_open(pstore, sec, tmp, n, search_dir, open_reps)
    finally:
        for p in peers:
            try:
                p.close()
            except Exception as exc:
                sec.notes.append(f"closing {type(p).__name__}: {exc!r}")
        if server is not None:
            rc = server.stop()
            sec.config["model_server_exit_code"] = rc
            if rc != 0:
                sec.notes.append(f"model server (pid {server.pid}) exited with {rc}: "
                                 f"{server.log_tail()}")  # fmt: skip
            errs = server.log_errors()
            if errs:
                sec.notes.append(f"model server logged {len(errs)} error/warning line(s): "
                                 f"{errs[0]}")  # fmt: skip
        for m in models.values():
            m.close()
        models.clear()
        shutil.rmtree(tmp, ignore_errors=True)
    return sec


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


def _used_bytes() -> int:
    m = _meminfo()
    return m["MemTotal"] - m["MemAvailable"]


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _memory(sec: Section, targets: dict[str, Path], n: int, search_dir: str) -> None:
    """For each target and each count in W7_PROCS: that many processes open it and read every
    row once, then hold it; the machine's used memory before and after, and their PSS/RSS."""
    for impl, path in targets.items():
        for k in W7_PROCS:
            log(f"W7: memory, {k} x {impl}")
            args = {"impl": impl, "path": str(path), "table": W7_TABLE, "n": n, "dim": W7_DIM,
                    "pstore_dir": search_dir, "hold": True}  # fmt: skip
            before = _used_bytes()
            procs = [
                subprocess.Popen([sys.executable, str(CHILD_SCRIPT), json.dumps(args)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(k)
            ]  # fmt: skip
            try:
                for p in procs:
                    assert p.stdout is not None
                    p.stdout.readline()  # ready: every row read once
                time.sleep(0.5)
                used = _used_bytes() - before
                sm = [_smaps(p.pid) for p in procs]
            finally:
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.close()
                    p.wait(60)
            pss = sum(x.get("Pss", 0) for x in sm)
            rss = sum(x.get("Rss", 0) for x in sm)
            row = Row("W7", "memory", f"{k} proc", None, impl, "bytes", [float(used)])
            row.extra.update(part="d", procs=k, used=used, pss=pss, rss=rss,
                             pss_anon=sum(x.get("Pss_Anon", 0) for x in sm),
                             pss_file=sum(x.get("Pss_File", 0) for x in sm))  # fmt: skip
            sec.rows.append(row)


def _big_open(
    pstore: ModuleType, sec: Section, tmp: Path, n: int, search_dir: str, reps: int
) -> None:
    """Warm open + first lookup of a W7_BIG_ROWS-row artifact in fresh processes (when the
    table has fewer rows: one of dim W7_BIG_DIM, built for this)."""
    if n >= W7_BIG_ROWS:
        return
    snap = _build(pstore, sec, tmp, W7_BIG_ROWS, "big_snapshot", dim=W7_BIG_DIM)
    art = tmp / "artifact-big"
    log(f"W7: exporting a {W7_BIG_ROWS:,} x {W7_BIG_DIM} artifact")
    pstore.serving.export(snap, art)
    shutil.rmtree(snap)
    _warm_cache(_files_of(art))
    _open_child(W7_REF, art, W7_BIG_ROWS, search_dir, False)  # warm-up
    xs = [_open_child(W7_REF, art, W7_BIG_ROWS, search_dir, False) for _ in range(reps)]
    total = [x["total_s"] for x in xs]
    case = f"open + first lookup, {W7_BIG_ROWS:,} x {W7_BIG_DIM}"
    row = Row("W7", case, "warm", None, W7_REF, "s", total)
    med = {k: statistics.median(x[k] for x in xs) for k in ("open_s", "first_s", "batch_s")}
    detail = f"open {_ms(med['open_s'])} + 1 id {_ms(med['first_s'])} ms; then "
    detail += f"{W7_FIRST_BATCH} ids {_ms(med['batch_s'])} ms; {_file_bytes(art):,} B"
    row.extra.update(part="b", seconds=total, runs=xs, rows=W7_BIG_ROWS, detail=detail)
    sec.rows.append(row)
    shutil.rmtree(art)


def _call(fn: Callable[[np.ndarray], Any], ids: list[np.ndarray], i: int) -> Any:
    return fn(ids[i])


# ---------------------------------------------------------------------------------------------
# The printed tables


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return ""
    if r >= 100:
        return f"{r:.0f}x"
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def format_w7(sec: Section) -> str:
    out = []
    parts = sec.config.get("parts", {})
    rows_a = [r for r in sec.rows if r.extra.get("part") == "a"]
    if rows_a:
        headers = ["what", "dtype", "bytes", "B/row", "ratio", "ratio of", "s build", "detail"]
        lines = [
            [r.case, r.impl, f"{r.extra['bytes']:,}", f"{r.extra['bytes_per_row']:.1f}",
             _fmt_ratio(r.ratio), r.ratio_of, f"{r.extra['seconds']:.3g}", r.extra["detail"]]
            for r in rows_a
        ]  # fmt: skip
        out.append(f"-- a: {parts.get('a', '')}\n" + format_table(headers, lines))
    rows_b = [r for r in sec.rows if r.extra.get("part") == "b"]
    if rows_b:
        headers = ["case", "cache", "impl", "ms median", "ms min-max", "ratio", "ratio of"]
        headers += ["detail"]
        lines = []
        for r in rows_b:
            lines.append(
                [r.case, r.dist, r.impl, _ms(statistics.median(r.samples)),
                 f"{_ms(min(r.samples))}-{_ms(max(r.samples))}", _fmt_ratio(r.ratio),
                 r.ratio_of, r.extra["detail"]]
            )  # fmt: skip
        out.append(f"-- b: {parts.get('b', '')}\n" + format_table(headers, lines))
    rows_c = [r for r in sec.rows if r.extra.get("part") == "c"]
    if rows_c:
        headers = ["case", "batch", "impl", "ids/s median", "ids/s min-max", "ratio", "ratio of"]
        headers += ["p50 ms", "p99 ms", "calls"]
        lines = []
        for r in rows_c:
            if r.status != "ok":
                lines.append([r.case, str(r.batch), r.impl, "-", "-", "", r.status, "", "", ""])
                continue
            e = r.extra
            lines.append(
                [r.case, str(r.batch), r.impl, fmt_ids(statistics.median(r.samples)),
                 f"{fmt_ids(min(r.samples))}-{fmt_ids(max(r.samples))}", _fmt_ratio(r.ratio),
                 r.ratio_of, _ms(e["p50_ms"] / 1e3), _ms(e["p99_ms"] / 1e3), str(e["calls"])]
            )  # fmt: skip
        out.append(f"-- c: {parts.get('c', '')}\n" + format_table(headers, lines))
    rows_d = [r for r in sec.rows if r.extra.get("part") == "d"]
    if rows_d:
        headers = ["impl", "procs", "used MB", "PSS MB", "PSS anon MB", "PSS file MB", "RSS MB"]
        mb = 1 << 20
        lines = [
            [r.impl, str(r.extra["procs"]), f"{r.extra['used'] / mb:.0f}",
             f"{r.extra['pss'] / mb:.0f}", f"{r.extra['pss_anon'] / mb:.0f}",
             f"{r.extra['pss_file'] / mb:.0f}", f"{r.extra['rss'] / mb:.0f}"]
            for r in rows_d
        ]  # fmt: skip
        out.append(f"-- d: {parts.get('d', '')}\n" + format_table(headers, lines))
    return "\n".join(out) if out else "   (no rows)"


# ---------------------------------------------------------------------------------------------
# The child: one opening, timed in a fresh process


def _child(args: dict[str, Any]) -> dict[str, Any]:
    impl, path, table, n = args["impl"], args["path"], args["table"], args["n"]
    first = ids_of(np.array([0], dtype=np.int64))
    batch = ids_of(PositionSampler(n, seed=74).sample("zipf", W7_FIRST_BATCH))
    if impl == W7_REF:
        pstore = import_pstore(args["pstore_dir"])
        importlib.import_module("pstore.serving")
        t0 = time.perf_counter()
        model = pstore.serving.ServingStore(path)
        t1 = time.perf_counter()
        row = model.lookup(table, first)
        t2 = time.perf_counter()
        model.lookup(table, batch)
        t3 = time.perf_counter()
    elif impl == W7_LMDB:
        lmdb = importlib.import_module("lmdb")
        t0 = time.perf_counter()
        rows = LmdbRows(lmdb, path, table, args["dim"])
        t1 = time.perf_counter()
        row = rows.pull(first)
        t2 = time.perf_counter()
        rows.pull(batch)
        t3 = time.perf_counter()
    elif impl == W7_ORT:
        ort = importlib.import_module("onnxruntime")
        t0 = time.perf_counter()
        rows = OrtRows(ort, path, table)
        t1 = time.perf_counter()
        row = rows.pull(first)
        t2 = time.perf_counter()
        rows.pull(batch)
        t3 = time.perf_counter()
    else:
        raise SystemExit(f"unknown impl {impl!r}")
    if args.get("hold"):
        lookup = model.lookup if impl == W7_REF else None
        for start in range(0, n, POPULATE_BATCH):
            ids = ids_of(np.arange(start, min(start + POPULATE_BATCH, n), dtype=np.int64))
            if lookup is not None:
                lookup(table, ids)
            else:
                rows.pull(ids)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()  # until the parent closes it
    return {
        "impl": impl,
        "open_s": t1 - t0,
        "first_s": t2 - t1,
        "batch_s": t3 - t2,
        "total_s": t2 - t0,
        "row_sum": float(np.asarray(row, dtype=np.float64).sum()),
    }


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print(json.dumps(_child(json.loads(sys.argv[1]))))


if __name__ == "__main__":
    main()
