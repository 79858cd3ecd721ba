"""Serving row checks A/B (issue 32, decision 0117): the cost of the row and slot checks of a
serving artifact's row file (layouts 2 and 3) against the same rows in layout 1 (no checks),
for two builds of pstore side by side (B must be one that writes layout 3).

One table of ROWS x 64 rows is exported once (float32, layout 3, by the pstore this script runs
with); copies of the artifact get their row file rewritten in layouts 1 and 2 (docs/FORMAT.md,
"Row files": layout 1 has no checks, layout 2 keeps each row's CRC-32 after it). Each
measurement is a fresh process of one build (its own Python) that opens the artifacts of the
layouts it reads and times, in its CPU time (`time.process_time`, all threads):
  - cold: per layout, the first pass over every row, once each, in a random order (each row's
    first read in the process);
  - warm: then REPS repetitions of one pass of Zipf(1.05) ids per layout, the layouts taking
    turns (every row was read once before); the ratio of each repetition to layout 1's.
Builds alternate within each round (build A reads layouts 1 and 2, build B 1, 2 and 3), the
order of the cold passes rotates with the round; ratios are to layout 1 in the same process,
and the table gives their median (cold: over the rounds; warm: over rounds x repetitions) and
range.

    python benches/serving_checks.py --python-a A/bin/python --python-b B/bin/python \\
        [--rows 1000000] [--rounds 5] [--dir DIR]

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
REPS = 7
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


def rewrite(rows_file: Path, version: int, dest: Path) -> None:
    """Writes the layout 3 row file `rows_file` (a float32 table) to `dest` in layout `version`:
    1 (slots keep their row index only, no checksums), 2 (each row followed by its checksum, at
    the stride of both) or 3 (a copy)."""
    raw = rows_file.read_bytes()
    v, dtype, dim, stride3, rows, slots = struct.unpack_from("<IIIIQQ", raw, 8)
    assert v == 3 and dtype == 0, (v, dtype)
    row_bytes = 4 * dim
    rows_at = -(-(HEADER + SLOT * slots) // 4096) * 4096
    slot_words = np.frombuffer(raw, np.uint64, 2 * slots, HEADER).reshape(slots, 2).copy()
    old = np.frombuffer(raw, np.uint8, rows * stride3, rows_at).reshape(rows, stride3)
    sums = np.frombuffer(raw, np.uint8, rows * 4, rows_at + rows * stride3).reshape(rows, 4)
    if version == 1:
        slot_words[:, 1] &= np.uint64(INDEX_MASK)
    st = stride(row_bytes + 4) if version == 2 else stride(row_bytes)
    new = np.zeros((rows, st), np.uint8)
    new[:, :row_bytes] = old[:, :row_bytes]
    if version == 2:
        new[:, row_bytes : row_bytes + 4] = sums
    length = rows_at + rows * st + (4 * rows if version == 3 else 0)
    head = bytearray(raw[:HEADER])
    struct.pack_into("<I", head, 8, version)
    struct.pack_into("<I", head, 20, st)
    struct.pack_into("<Q", head, 48, length)
    struct.pack_into("<I", head, 64, zlib.crc32(bytes(head[:64])))
    with open(dest, "wb") as f:
        f.write(head)
        f.write(slot_words.tobytes())
        f.write(b"\0" * (rows_at - HEADER - SLOT * slots))
        f.write(new.tobytes())
        if version == 3:
            f.write(sums.tobytes())
    assert dest.stat().st_size == length


def build(root: Path, rows: int) -> tuple[dict[int, Path], np.ndarray]:
    """Artifacts of one table in layouts 1, 2 and 3 (exported by this process's pstore, which
    writes layout 3, then rewritten), and its ids."""
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
    three = root / "layout3"
    pstore.serving.export(root / "snap", three)
    shutil.rmtree(root / "snap")
    (rows_file,) = (three / "tables").glob("*.rows")
    out = {3: three}
    for version in (1, 2):
        d = root / f"layout{version}"
        shutil.copytree(three, d)
        rewrite(rows_file, version, d / "tables" / rows_file.name)
        out[version] = d
    return out, ids


def child(args: dict) -> None:
    import pstore
    import pstore.serving

    ids = np.load(args["ids"])
    batch = args["batch"]
    rng = np.random.default_rng(args["seed"])
    cold_ids = rng.permutation(ids)
    ranks = np.minimum(rng.zipf(1.05, len(ids)), len(ids)) - 1
    warm_ids = rng.permutation(ids)[ranks][: args["warm_ids"]]
    layouts = list(args["paths"])
    stores = {k: pstore.serving.ServingStore(args["paths"][k]) for k in layouts}

    def one_pass(s: pstore.serving.ServingStore, ids: np.ndarray) -> float:
        t0 = time.process_time()
        for k in range(0, len(ids), batch):
            s.lookup(TABLE, ids[k : k + batch])
        return (time.process_time() - t0) / len(ids) * 1e9

    cold, warm = {}, {k: [] for k in layouts}
    turn = args["seed"] % len(layouts)
    for k in layouts[turn:] + layouts[:turn]:
        stores[k].lookup(TABLE, ids[:1])
        cold[k] = one_pass(stores[k], cold_ids)
    for rep in range(REPS):
        # The layouts take turns, in an order that rotates with each repetition.
        for k in layouts[rep % len(layouts) :] + layouts[: rep % len(layouts)]:
            warm[k].append(one_pass(stores[k], warm_ids))
    verified = {
        k: stores[k].verified(TABLE) if hasattr(stores[k], "verified") else None for k in layouts
    }
    print(json.dumps({"cold": cold, "warm": warm, "pstore": pstore.__file__, "verified": verified}))


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
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pstore-checks-", dir=a.dir))
    try:
        paths, ids = build(root, a.rows)
        np.save(root / "ids.npy", ids)
        print(f"rows {len(ids)}, load {os.getloadavg()}", flush=True)
        # Build A (the reference) reads layouts 1 and 2; build B layouts 1, 2 and 3.
        runs = (("A", a.python_a, ("1", "2")), ("B", a.python_b, ("1", "2", "3")))
        cold: dict[tuple[str, int, str], list[float]] = {}
        warm: dict[tuple[str, int, str], list[float]] = {}
        for rnd in range(a.rounds):
            for batch in BATCHES:
                for build_name, py, layouts in runs:
                    r = run_child(
                        py,
                        paths={k: str(paths[int(k)]) for k in layouts},
                        ids=str(root / "ids.npy"),
                        batch=batch,
                        seed=rnd,
                        warm_ids={1: 50_000, 256: len(ids), 4096: len(ids)}[batch],
                    )
                    for k in layouts:
                        c = cold.setdefault((build_name, batch, k), [])
                        c.append(r["cold"][k] / r["cold"]["1"])
                        w = warm.setdefault((build_name, batch, k), [])
                        w += [y / x for x, y in zip(r["warm"]["1"], r["warm"][k], strict=True)]
                    print(rnd, build_name, batch, json.dumps(r), flush=True)
            print(f"round {rnd} done, load {os.getloadavg()}", flush=True)
        print(
            "| batch | build, layout | cold: ratio to layout 1 (min-max) | warm: ratio (min-max) |"
        )
        print("|---|---|---|---|")
        for batch in BATCHES:
            for b, _, layouts in runs:
                for k in layouts[1:]:
                    cells = []
                    for d in (cold, warm):
                        v = d[(b, batch, k)]
                        cells.append(f"{statistics.median(v):.3f}x ({min(v):.2f}-{max(v):.2f})")
                    print(f"| {batch} | {b}, {k} | " + " | ".join(cells) + " |")
        print(f"load {os.getloadavg()}")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        child(json.loads(sys.argv[2]))
    else:
        main()
