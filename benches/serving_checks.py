"""Serving row checks A/B (issue 32, decisions 0117 and 0119): the cost of the row and slot
checks of a serving artifact's row file (the layout each build writes: 2 or 3) against the same
rows in layout 1 (no checks), for two builds of pstore side by side.

One table of ROWS x 64 rows is snapshotted once and exported by each build (float32, its own
layout); a copy of an artifact gets its row file rewritten in layout 1 (docs/FORMAT.md, "Row
files": slots without their check, rows without their CRC-32). Each measurement is a fresh
process of one build (its own Python) that opens one artifact and times, in its CPU time
(`time.process_time`, all threads):
  - cold: the first pass over every row, once each, in a random order (each row's first read);
  - warm: then Zipf(1.05) ids over the same rows (every row already read once), PASSES passes,
    the median pass. A build with the background check (0119) first waits until it has ended
    (the cold pass's CPU time includes the check's, where they overlap).
Builds and layouts alternate within each round (the layouts' order by round); the ratio of a
round is the checked layout over layout 1 of the same build, and the table gives the median over
the rounds.

    python benches/serving_checks.py --python-a A/bin/python --python-b B/bin/python \\
        [--rows 1000000] [--rounds 5] [--dir DIR] [--scan-only]

`--scan-only` times build B's background check instead: a fresh process opens its checked
artifact, looks up one id (which maps the row file and queues the check), then waits for the
check to end; it reports the opening's wall time, the check's wall time and the process's CPU
time meanwhile (the check's thread; the waiting thread sleeps), `--rounds` processes.

The child (`python benches/serving_checks.py child '{"path": ..., "batch": ...}'`) prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

DIM = 64
TABLE = "emb"
BATCHES = (1, 256, 4096)
PASSES = 3
HEADER = 4096
SLOT = 16
INDEX_MASK = (1 << 40) - 1


def stride(row_bytes: int) -> int:
    """The row stride of rust/src/serving/rowfile.rs's `stride`."""
    if row_bytes <= 64:
        return max(1 << (row_bytes - 1).bit_length(), 4)
    lines = -(-row_bytes // 64)
    s = -(-row_bytes // 4) * 4
    while True:
        g = np.gcd(s, 64)
        if -(-(row_bytes + 64 - g) // 64) == lines:
            return s
        s += 4


def to_layout_1(rows_file: Path) -> None:
    """Rewrites a layout 2 or 3 row file in place as layout 1: slots keep their row index only,
    rows lose their checksum (after each row, or the array after the rows) and take the stride
    of their bytes."""
    raw = rows_file.read_bytes()
    version, dtype, dim, stride2, rows, slots = struct.unpack_from("<IIIIQQ", raw, 8)
    assert version in (2, 3) and dtype == 0, (version, dtype)
    row_bytes = 4 * dim
    stride1 = stride(row_bytes)
    rows_at = -(-(HEADER + SLOT * slots) // 4096) * 4096
    slot_words = np.frombuffer(raw, np.uint64, 2 * slots, HEADER).reshape(slots, 2).copy()
    slot_words[:, 1] &= np.uint64(INDEX_MASK)
    old = np.frombuffer(raw, np.uint8, rows * stride2, rows_at).reshape(rows, stride2)
    new = np.zeros((rows, stride1), np.uint8)
    new[:, :row_bytes] = old[:, :row_bytes]
    length = rows_at + rows * stride1
    head = bytearray(raw[:HEADER])
    struct.pack_into("<I", head, 8, 1)
    struct.pack_into("<I", head, 20, stride1)
    struct.pack_into("<Q", head, 48, length)
    struct.pack_into("<I", head, 64, zlib.crc32(bytes(head[:64])))
    with open(rows_file, "wb") as f:
        f.write(head)
        f.write(slot_words.tobytes())
        f.write(b"\0" * (rows_at - HEADER - SLOT * slots))
        f.write(new.tobytes())
    assert rows_file.stat().st_size == length


def build(
    root: Path, rows: int, pythons: dict[str, str], layout_1: bool = True
) -> tuple[dict[str, Path], Path, np.ndarray]:
    """The artifacts of one table exported by each build of `pythons` (its own layout), the
    artifact rewritten as layout 1 (unless not `layout_1`), and the table's ids."""
    import pstore
    import pstore.serving
    from pstore import optim

    ids = np.unique(np.random.default_rng(1).integers(1, 1 << 62, rows, dtype=np.uint64))
    with pstore.Store(root / "store", durability="none") as store:
        t = store.create_sparse_table(TABLE, DIM, optimizer=optim.SGD(lr=0.1), seed=1)
        g = np.random.default_rng(2)
        for k in range(0, len(ids), 65536):
            part = ids[k : k + 65536]
            t.push(part, g.standard_normal((len(part), DIM)).astype(np.float32))
        store.snapshot(root / "snap")
    shutil.rmtree(root / "store")
    outs = {}
    for name, py in pythons.items():
        outs[name] = root / f"checked-{name}"
        code = "import sys, pstore.serving; pstore.serving.export(sys.argv[1], sys.argv[2])"
        subprocess.run(
            [py, "-c", code, str(root / "snap"), str(outs[name])],
            check=True,
            cwd=tempfile.gettempdir(),
        )
    shutil.rmtree(root / "snap")
    one = root / "layout1"
    if layout_1:
        shutil.copytree(outs[next(iter(outs))], one)
        (rows_file,) = (one / "tables").glob("*.rows")
        to_layout_1(rows_file)
    return outs, one, ids


def child(args: dict) -> None:
    import pstore
    import pstore.serving

    ids = np.load(args["ids"])
    batch = args["batch"]
    rng = np.random.default_rng(args["seed"])
    cold_ids = rng.permutation(ids)
    ranks = np.minimum(rng.zipf(1.05, len(ids)), len(ids)) - 1
    warm_ids = rng.permutation(ids)[ranks]
    s = pstore.serving.ServingStore(args["path"])
    s.lookup(TABLE, ids[:1])
    t0 = time.process_time()
    for k in range(0, len(cold_ids), batch):
        s.lookup(TABLE, cold_ids[k : k + batch])
    cold = time.process_time() - t0
    wait_scan(s)
    n = min(len(warm_ids), args["warm_ids"])
    passes = []
    for _ in range(PASSES):
        t0 = time.process_time()
        for k in range(0, n, batch):
            s.lookup(TABLE, warm_ids[k : k + batch])
        passes.append(time.process_time() - t0)
    v = s.verified(TABLE) if hasattr(s, "verified") else None
    out = {
        "cold_ns": cold / len(cold_ids) * 1e9,
        "warm_ns": statistics.median(passes) / n * 1e9,
        "pstore": pstore.__file__,
        "verified": v,
    }
    print(json.dumps(out))


def wait_scan(s: object) -> dict | None:
    """Waits for a build with the background check (0119) to end it; its `verified()`."""
    v = s.verified(TABLE) if hasattr(s, "verified") else None  # type: ignore[attr-defined]
    while v is not None and v.get("scan") == "running":
        time.sleep(0.001)
        v = s.verified(TABLE)  # type: ignore[attr-defined]
    return v


def scan_child(args: dict) -> None:
    import pstore
    import pstore.serving

    w0 = time.perf_counter()
    s = pstore.serving.ServingStore(args["path"])
    s.lookup(TABLE, np.array([1], np.uint64))
    opened = time.perf_counter() - w0
    c0, w0 = time.process_time(), time.perf_counter()
    v = wait_scan(s)
    out = {
        "open_ms": opened * 1e3,
        "scan_s": time.perf_counter() - w0,
        "scan_cpu_s": time.process_time() - c0,
        "verified": v,
        "pstore": pstore.__file__,
    }
    print(json.dumps(out))


def run_child(python: str, **kw: object) -> dict:
    p = subprocess.run(
        [python, str(Path(__file__).resolve()), "child", json.dumps(kw)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python-a", required=True, help="Python of build A (the reference)")
    ap.add_argument("--python-b", required=True, help="Python of build B")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--scan-only", action="store_true", help="time B's background check")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pstore-checks-", dir=a.dir))
    try:
        pythons = {"B": a.python_b} if a.scan_only else {"A": a.python_a, "B": a.python_b}
        outs, one, ids = build(root, a.rows, pythons, layout_1=not a.scan_only)
        np.save(root / "ids.npy", ids)
        print(f"rows {len(ids)}, load {os.getloadavg()}", flush=True)
        if a.scan_only:
            runs = []
            for _ in range(a.rounds):
                p = subprocess.run(
                    [
                        a.python_b,
                        str(Path(__file__).resolve()),
                        "scan",
                        json.dumps({"path": str(outs["B"])}),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=tempfile.gettempdir(),
                )
                runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
            for key in ("open_ms", "scan_s", "scan_cpu_s"):
                print(key, "median", f"{statistics.median(r[key] for r in runs):.4f}")
            print(f"load {os.getloadavg()}")
            return
        res: dict[tuple[str, int, int], list[dict]] = {}
        for rnd in range(a.rounds):
            for batch in BATCHES:
                warm = {1: 100_000, 256: len(ids), 4096: len(ids)}[batch]
                for build_name, py in (("A", a.python_a), ("B", a.python_b)):
                    pair = [(1, one), (2, outs[build_name])]
                    # The order of the two layouts alternates by round.
                    for layout, path in pair if rnd % 2 == 0 else pair[::-1]:
                        r = run_child(
                            py,
                            path=str(path),
                            ids=str(root / "ids.npy"),
                            batch=batch,
                            seed=rnd,
                            warm_ids=warm,
                        )
                        res.setdefault((build_name, batch, layout), []).append(r)
                        print(rnd, build_name, batch, layout, json.dumps(r), flush=True)
            print(f"round {rnd} done, load {os.getloadavg()}", flush=True)
        print(
            "| batch | build | cold L1 / checked ns | cold ratio | warm L1 / checked ns"
            " | warm ratio |"
        )
        print("|---|---|---|---|---|---|")
        for batch in BATCHES:
            for b in ("A", "B"):
                one_r, two_r = res[(b, batch, 1)], res[(b, batch, 2)]
                cells = []
                for key in ("cold_ns", "warm_ns"):
                    l1 = statistics.median(r[key] for r in one_r)
                    l2 = statistics.median(r[key] for r in two_r)
                    ratio = statistics.median(
                        y[key] / x[key] for x, y in zip(one_r, two_r, strict=True)
                    )
                    cells += [f"{l1:.0f} / {l2:.0f}", f"{ratio:.3f}x"]
                print(f"| {batch} | {b} | " + " | ".join(cells) + " |")
        print(f"load {os.getloadavg()}")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(json.loads(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == "scan":
        scan_child(json.loads(sys.argv[2]))
    else:
        main()
