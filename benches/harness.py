"""Shared pieces of the pstore peer benchmarks: imports, ids, timing, environment and tables."""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
ZIPF_EXPONENT = 1.05
DISTS = ("zipf", "uniform")


def log(msg: str) -> None:
    """Progress goes to stderr so stdout holds only the result tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def import_pstore(search_dir: str | None = None, source_tree: bool = False) -> ModuleType:
    """Import pstore: the installed package, else a snapshot of the source tree's pstore/.

    The source tree is copied to a temporary directory first, because a rebuild that rewrites
    pstore/_native*.so in place while a long run has it mapped kills the run with SIGBUS.
    `source_tree` skips the installed package; `search_dir` (used by child processes) imports
    from a given directory instead.
    """
    if search_dir is not None:
        sys.path.insert(0, search_dir)
        return importlib.import_module("pstore")
    if not source_tree:
        try:
            mod = importlib.import_module("pstore")
            if hasattr(mod, "Store"):
                return mod
        except ImportError:
            pass
    for name in [m for m in sys.modules if m == "pstore" or m.startswith("pstore.")]:
        del sys.modules[name]
    source = REPO_ROOT / "pstore"
    if not list(source.glob("_native*.so")):
        raise SystemExit(f"pstore is not installed and {source}/_native*.so is not built")
    snapshot = Path(tempfile.mkdtemp(prefix="pstore-bench-"))
    atexit.register(shutil.rmtree, snapshot, ignore_errors=True)
    shutil.copytree(source, snapshot / "pstore", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(snapshot))
    mod = importlib.import_module("pstore")
    if not hasattr(mod, "Store"):
        raise SystemExit(f"pstore from {source} has no Store")
    return mod


def pstore_search_dir(pstore: ModuleType) -> str:
    """The sys.path entry pstore was imported from, for child processes."""
    return str(Path(pstore.__file__).resolve().parent.parent)


def native_build_info(pstore: ModuleType) -> dict[str, Any]:
    """Size and mtime of the imported native module and of the source tree's, to tie results
    to a build (a snapshot keeps the source file's mtime)."""
    info = {}
    dirs = {"imported": Path(pstore.__file__).resolve().parent, "source_tree": REPO_ROOT / "pstore"}
    for where, d in dirs.items():
        for so in sorted(d.glob("_native*.so")):
            st = so.stat()
            mtime = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime))
            info[where] = {"path": str(so), "bytes": st.st_size, "mtime": mtime}
    return info


def import_torch() -> ModuleType | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def import_pyarrow() -> ModuleType | None:
    try:
        pa = importlib.import_module("pyarrow")
        importlib.import_module("pyarrow.ipc")
        return pa
    except ImportError:
        return None


def import_redis() -> ModuleType | None:
    try:
        return importlib.import_module("redis")
    except ImportError:
        return None


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a snapshot's files and directory are fsynced by pstore; the
    file peers do the same so that every contender's write has reached the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def status_bytes(pid: int | str, key: str) -> int | None:
    """A `kB` line of /proc/<pid>/status (VmRSS, VmHWM) in bytes, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: "5" to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def ids_of(pos: np.ndarray) -> np.ndarray:
    """Map row positions to scattered 64-bit ids.

    The splitmix64 finaliser is a bijection on uint64, so distinct positions give distinct ids.
    pstore and the dict peer see these ids; the numpy and torch peers see the positions.
    """
    x = pos.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


class PositionSampler:
    """Row positions in [0, n): uniform, or Zipf(1.05) ranks mapped through a random permutation."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)
        self._cdf: np.ndarray | None = None
        self._perm: np.ndarray | None = None

    def sample(self, dist: str, size: int) -> np.ndarray:
        if dist == "uniform":
            return self.rng.integers(0, self.n, size=size, dtype=np.int64)
        if dist != "zipf":
            raise ValueError(dist)
        if self._cdf is None:
            cdf = np.cumsum(np.arange(1, self.n + 1, dtype=np.float64) ** -ZIPF_EXPONENT)
            cdf /= cdf[-1]
            self._cdf = cdf
            self._perm = self.rng.permutation(self.n).astype(np.int64)
        assert self._perm is not None
        rank = np.searchsorted(self._cdf, self.rng.random(size), side="right")
        np.minimum(rank, self.n - 1, out=rank)
        return self._perm[rank]


def measure_interleaved(
    fns: dict[str, Callable[[], int]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every contender `reps` times, interleaved, and return units/s per repetition.

    Each callable does one measurement's work and returns the number of units (ids, inserts) it
    processed. Repetition r starts with contender r mod k so no contender always runs first.
    The garbage collector is paused during each timed call, for every contender alike.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                units = fns[name]()
                elapsed = time.perf_counter() - t0
            finally:
                gc.enable()
            rates[name].append(units / elapsed)
    return rates


def measure_phases(
    fns: dict[str, Callable[[], dict[str, float]]], reps: int, warmup: int = 1
) -> dict[str, list[dict[str, float]]]:
    """Interleaved like `measure_interleaved`, for contenders that time their own phases.

    Each callable does one repetition's work, times its phases itself (setup and cleanup, such
    as deleting the files it wrote, stay outside those timings) and returns a dict of numbers
    (seconds per phase, bytes written, checks). Returns the dicts of the timed repetitions.
    """
    names = list(fns)

    def call(name: str) -> dict[str, float]:
        gc.collect()
        gc.disable()
        try:
            return fns[name]()
        finally:
            gc.enable()

    for _ in range(warmup):
        for name in names:
            call(name)
    out: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(call(name))
    return out


def run_child(script: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Run `python script '<json args>'` and parse the JSON on the last line of its stdout."""
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Row:
    """One line of a result table: a contender's median rate and its ratio against a reference."""

    workload: str
    case: str
    dist: str
    batch: int | None
    impl: str
    unit: str = "ids/s"
    samples: list[float] = field(default_factory=list)
    ratio: float | None = None
    ratio_of: str = ""
    target: str = ""
    target_min: float | None = None
    target_max: float | None = None
    status: str = "ok"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def met(self) -> bool | None:
        if self.ratio is None:
            return None
        if self.target_max is not None:
            return self.ratio <= self.target_max
        if self.target_min is None:
            return None
        return self.ratio >= self.target_min

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["median"] = self.median
        d["min"] = min(self.samples) if self.samples else None
        d["max"] = max(self.samples) if self.samples else None
        d["target_met"] = self.met
        return d


def rows_from_rates(
    workload: str,
    case: str,
    dist: str,
    batch: int | None,
    rates: dict[str, list[float]],
    reference: str,
    targets: dict[str, tuple[str, float]] | None = None,
    skipped: dict[str, str] | None = None,
    unit: str = "ids/s",
) -> list[Row]:
    """Rows for one interleaved measurement: the reference first, then each peer with
    ratio = median(reference) / median(peer). Skipped peers get a row with their reason."""
    targets = targets or {}
    ref_median = statistics.median(rates[reference])
    rows = [Row(workload, case, dist, batch, reference, unit, rates[reference])]
    for name, samples in rates.items():
        if name == reference:
            continue
        target, target_min = targets.get(name, ("", None))
        rows.append(
            Row(
                workload,
                case,
                dist,
                batch,
                name,
                unit,
                samples,
                ratio=ref_median / statistics.median(samples),
                ratio_of=f"{reference}/{name}",
                target=target,
                target_min=target_min,
            )
        )
    for name, reason in (skipped or {}).items():
        target, target_min = targets.get(name, ("", None))
        rows.append(
            Row(workload, case, dist, batch, name, unit, status=f"skipped: {reason}", target=target)
        )
    return rows


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def format_table(headers: list[str], lines: Iterable[list[str]]) -> str:
    lines = list(lines)
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(headers)]
    numeric = ("batch", "M ", "M/s", "B/key", "ratio", "RSS/raw", "max ms", "s ", "rate", "p50")
    numeric += ("p99", "calls", "threads", "ids/s")
    right = [i for i, h in enumerate(headers) if h.startswith(numeric) and h != "ratio of"]

    def fmt(row: list[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in pairs]
        return "  ".join(cells).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(headers), sep, *(fmt(r) for r in lines)])


def format_rows(rows: list[Row]) -> str:
    headers = ["case", "dist", "batch", "impl", "M/s median", "M/s min-max", "ratio", "ratio of"]
    headers += ["target", "met"]
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append(
                [r.case, r.dist, str(r.batch or "-"), r.impl, "-", "-", "-", "", r.target, r.status]
            )
            continue
        spread = f"{_fmt_rate(min(r.samples))}-{_fmt_rate(max(r.samples))}"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        met = {None: "", True: "yes", False: "NO"}[r.met]
        lines.append(
            [
                r.case,
                r.dist,
                str(r.batch or "-"),
                r.impl,
                _fmt_rate(r.median),
                spread,
                ratio,
                r.ratio_of,
                r.target,
                met,
            ]
        )
    return format_table(headers, lines)


def environment(pstore: ModuleType, torch: ModuleType | None) -> dict[str, Any]:
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env_vars = {
        k: os.environ[k]
        for k in (
            "OPENBLAS_CORETYPE",
            "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "RAYON_NUM_THREADS",
        )
        if k in os.environ
    }
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "mem_total_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "loadavg_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "pstore": getattr(pstore, "__version__", "?"),
        "pstore_path": getattr(pstore, "__file__", None),
        "pstore_native": native_build_info(pstore),
        "env": env_vars,
    }
    return info


def fmt_ids(x: float) -> str:
    """A rate for the tables: 3 significant digits with k or M."""
    if x >= 1e6:
        return f"{x / 1e6:.3g}M"
    if x >= 1e3:
        return f"{x / 1e3:.3g}k"
    return f"{x:.3g}"
