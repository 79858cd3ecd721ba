"""A reader process for tests/test_serving.py: looks rows up in a serving artifact, read-only.

    python _serving_reader.py MODEL_DIR TABLE N READY_FILE STOP_FILE

Opens MODEL_DIR read-only and looks ids 0..N-1 of TABLE up in one call, again and again, until
STOP_FILE exists (or 120 s pass). Every row of one version of the table holds one value, so a
batch holding two values mixes versions. After its first lookup it creates READY_FILE. Prints
one JSON line: reads done, the values seen in order of first sight, the batches that mixed
values, versions seen going backwards, and the error that ended it, if any.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from pstore.serving import ServingStore


def main(argv: list[str]) -> int:
    model_dir, table, n, ready, stop = argv[0], argv[1], int(argv[2]), argv[3], argv[4]
    out: dict = {"reads": 0, "versions": [], "mixed": [], "backwards": [], "error": None}
    deadline = time.monotonic() + 120.0
    try:
        model = ServingStore(model_dir)
        out["writable"] = model.writable
        ids = np.arange(n, dtype=np.uint64)
        last = None
        while time.monotonic() < deadline:
            rows = model.lookup(table, ids)
            out["reads"] += 1
            values = np.unique(rows)
            if len(values) != 1 or rows.shape[0] != n:
                out["mixed"].append([float(v) for v in values[:8]])
            v = float(values[0])
            if v not in out["versions"]:
                out["versions"].append(v)
            # Rows go -1, -2, -3, ... version after version: a value above the last is older.
            if last is not None and v > last:
                out["backwards"].append([last, v])
            last = v
            if out["reads"] == 1:
                with open(ready, "w") as f:
                    f.write("ready\n")
            if os.path.exists(stop):
                break
    except Exception as e:  # reported to the test, which fails on it
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
