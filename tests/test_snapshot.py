"""Snapshots: full and incremental Arrow IPC snapshots, restore from a chain, damage, misuse."""

import json
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pytest
from _data import F32, grads, random_ids, u64
from _netutil import child_env

import pstore
from pstore import init, optim

SPARSE_STATS = (
    "rows",
    "pushes",
    "pulls",
    "ids_pushed",
    "ids_pulled",
    "rows_updated",
    "rows_created",
    "rows_evicted",
    "seq",
    "lr",
)
DENSE_STATS = ("pushes", "pulls", "rows_updated", "seq", "lr", "step")
PART_COLUMNS = ["id", "step", "version", "updated_at", "freq", "weights", "state"]


# --- reading snapshot files -----------------------------------------------------------------


def entry_of(manifest: dict, name: str) -> dict:
    (entry,) = [e for e in manifest["tables"] if e["name"] == name]
    return entry


def read_rows(snap: Path, entry: dict) -> pa.Table:
    """All rows of a table's part files, read with pyarrow."""
    tables = [pa.ipc.open_file(snap / f["name"]).read_all() for f in entry["files"]]
    return pa.concat_tables(tables)


def read_tombstones(snap: Path, entry: dict) -> np.ndarray:
    assert entry["tombstones"] is not None
    table = pa.ipc.open_file(snap / entry["tombstones"]["name"]).read_all()
    assert table.column_names == ["id"]
    return table.column("id").to_numpy()


def floats(table: pa.Table, column: str, width: int) -> np.ndarray:
    """A fixed-size-list column as a (rows, width) float32 array."""
    values = table.column(column).combine_chunks().flatten().to_numpy()
    return values.reshape(-1, width)


# --- what a store looks like, taken without creating rows -----------------------------------


def capture(store: pstore.Store, universe: dict[str, set[int]]) -> dict:
    """Everything observable about a store: config, counters and every row of every table.

    ``universe`` holds, per sparse table, every id the test ever touched. Stats are read first and
    rows are pulled only where ``contains`` says they exist, so capturing creates no rows.
    """
    out: dict = {"tables": store.tables()}
    for name in store.tables():
        t = store.table(name)
        if isinstance(t, pstore.DenseTable):
            s = t.stats()
            out[name] = {
                "stats": {k: s[k] for k in DENSE_STATS},
                "config": (t.shape, t.optimizer, t.initializer, t.seed),
                "lr": t.lr,
                "step": t.step,
                "value": t.pull(),
            }
        else:
            s = t.stats()
            ids = u64(sorted(universe[name]))
            present = ids[t.contains(ids)]
            out[name] = {
                "stats": {k: s[k] for k in SPARSE_STATS},
                "config": (
                    t.dim,
                    t.optimizer,
                    t.initializer,
                    t.seed,
                    t.admit_after,
                    t.max_rows,
                    t.evict_policy,
                ),
                "len": len(t),
                "lr": t.lr,
                "seq": t.seq,
                "present": present,
                "rows": t.pull(present),
            }
            assert out[name]["len"] == len(present), f"{name}: rows outside the test's ids"
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got["tables"] == want["tables"]
    for name in want["tables"]:
        g, w = got[name], want[name]
        assert g.keys() == w.keys()
        for key, value in w.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(g[key], value, err_msg=f"{name}.{key}")
            else:
                assert g[key] == value, f"{name}.{key}"


# --- a store with a history: full snapshot, changes, two increments --------------------------


class History:
    """A store that goes through a full snapshot and two increments, with every kind of change.

    ``kind`` is "memory" or a durability mode (a durable store under ``tmp``). After each snapshot
    ``states`` gets the store's :func:`capture`.
    """

    def __init__(self, kind: str, tmp: Path, rng: np.random.Generator) -> None:
        self.kind, self.tmp, self.rng = kind, tmp, rng
        self.store = self.open()
        self.universe: dict[str, set[int]] = {}
        self.snaps: list[Path] = []
        self.manifests: list[dict] = []
        self.states: list[dict] = []

    def open(self) -> pstore.Store:
        if self.kind == "memory":
            return pstore.Store(num_shards=4, threads=2)
        return pstore.Store(self.tmp / "source", durability=self.kind, num_shards=4, threads=2)

    def t(self, name: str):
        return self.store.table(name)

    def push(self, name: str, ids) -> None:
        ids = u64(ids)
        self.universe.setdefault(name, set()).update(int(i) for i in ids)
        self.t(name).push(ids, grads(self.rng, len(ids), self.t(name).dim))

    def pull(self, name: str, ids) -> None:
        ids = u64(ids)
        self.universe.setdefault(name, set()).update(int(i) for i in ids)
        self.t(name).pull(ids)

    def present(self, name: str) -> np.ndarray:
        ids = u64(sorted(self.universe[name]))
        return ids[self.t(name).contains(ids)]

    def new_ids(self, name: str, n: int) -> np.ndarray:
        return random_ids(self.rng, n, avoid=self.universe.get(name, ()))

    def pick(self, ids: np.ndarray, n: int) -> np.ndarray:
        return self.rng.choice(ids, n, replace=False)

    def snapshot(self, incremental: bool) -> None:
        snap = self.tmp / f"snap-{len(self.snaps)}"
        manifest = self.store.snapshot(snap, incremental=incremental)
        self.snaps.append(snap)
        self.manifests.append(manifest)
        self.states.append(capture(self.store, self.universe))

    def run(self) -> "History":
        s, rng = self.store, self.rng
        s.create_sparse_table(
            "adagrad",
            8,
            optimizer=optim.Adagrad(lr=0.05),
            initializer=init.Normal(0.0, 0.5),
            seed=3,
        )
        s.create_sparse_table(
            "adam", 4, optimizer=optim.Adam(lr=0.01), initializer=init.Uniform(-1.0, 1.0), seed=5
        )
        s.create_sparse_table(
            "sgd", 3, optimizer=optim.SGD(lr=0.1), initializer=init.Constant(0.25), seed=7
        )
        s.create_dense_table("dense", (3, 5), optimizer=optim.Adam(lr=0.01))

        # Before the full snapshot. Duplicates in a push are coalesced; ids reach past 2**63.
        base = self.new_ids("adagrad", 300)
        self.push("adagrad", np.concatenate([base, base[:40]]))
        self.push("adagrad", base[100:200])
        adam = self.new_ids("adam", 200)
        for k in range(3):  # per-row Adam steps of 1, 2 and 3
            self.push("adam", adam[: 200 - 60 * k])
        self.push("sgd", self.new_ids("sgd", 100))
        self.pull("sgd", self.new_ids("sgd", 20))  # rows created by a pull only
        for _ in range(3):
            self.t("dense").push(rng.standard_normal((3, 5)).astype(F32))
        self.snapshot(incremental=False)

        if self.kind != "memory":
            # The parent of the next increment survives closing and reopening the store.
            s.close()
            self.store = s = self.open()

        # Changes for the first increment.
        old = self.present("adagrad")
        pushed = self.pick(old, 50)
        self.push("adagrad", np.concatenate([pushed, self.new_ids("adagrad", 30)]))
        gone = self.pick(np.setdiff1d(old, pushed), 40)
        assert self.t("adagrad").remove(gone) == 40
        back = gone[:5]  # removed, then created again by a push: a fresh row
        self.push("adagrad", back)
        self.t("adagrad").lr = 0.02
        adam = self.present("adam")
        self.push("adam", adam[:100])
        for _ in range(3):
            self.push("adam", adam[:20])
        # The rows none of the last 4 pushes updated go: half the table.
        assert self.t("adam").evict(not_updated_for_steps=4) == 100
        s.create_sparse_table(
            "late",
            5,
            optimizer=optim.Adagrad(lr=0.1, clip_norm=1.0),
            initializer=init.TruncatedNormal(0.0, 0.1),
            seed=11,
            max_rows=200,
            evict_policy="lfu",
        )
        self.push("late", self.new_ids("late", 250))  # the budget evicts rows
        assert len(self.t("late")) <= 200
        assert self.t("late").stats()["rows_evicted"] >= 50
        s.drop_table("sgd")
        self.t("dense").push(rng.standard_normal((3, 5)).astype(F32))
        self.snapshot(incremental=True)

        # Changes for the second increment.
        old = self.present("adagrad")
        self.push("adagrad", self.pick(old, 40))
        self.pull("adagrad", self.new_ids("adagrad", 25))
        self.t("adagrad").remove(self.pick(old, 30))
        evicted = np.setdiff1d(adam, self.present("adam"))
        self.push(
            "adam", np.concatenate([self.pick(evicted, 30), self.pick(self.present("adam"), 30)])
        )
        self.t("adam").lr = 0.005
        self.push("late", self.new_ids("late", 30))
        self.t("late").remove(self.pick(self.present("late"), 5))
        s.create_dense_table("late_dense", 4, optimizer=optim.SGD(lr=0.5, momentum=0.9))
        self.t("late_dense").push(np.arange(4, dtype=F32))
        self.t("dense").lr = 0.02
        self.t("dense").push(rng.standard_normal((3, 5)).astype(F32))
        self.snapshot(incremental=True)
        return self


SOURCES = ["memory", "async", "none"]


@pytest.fixture(scope="module", params=SOURCES)
def history(request, tmp_path_factory) -> History:
    """A History shared by the tests that only read it."""
    rng = np.random.default_rng(zlib.crc32(request.param.encode()))
    h = History(request.param, tmp_path_factory.mktemp(f"history-{request.param}"), rng).run()
    yield h
    h.store.close()


@pytest.fixture(params=SOURCES)
def own_history(request, tmp_path, rng) -> History:
    """A History for a test that changes it."""
    h = History(request.param, tmp_path, rng).run()
    yield h
    h.store.close()


# --- 1. round trip --------------------------------------------------------------------------


def test_manifests_describe_the_chain(history):
    full, inc1, inc2 = history.manifests
    for m in history.manifests:
        assert m["format"] == "pstore-snapshot"
        assert m["version"] == 2 and m["checksum"].startswith("crc32:")
        assert m["bytes"] > 0
    assert len({m["id"] for m in history.manifests}) == 3
    assert (full["kind"], full["parent"]) == ("full", None)
    assert inc1["kind"] == inc2["kind"] == "incremental"
    assert inc1["parent"]["id"] == full["id"]
    assert inc2["parent"]["id"] == inc1["id"]
    # Siblings name their parent by its directory name: the chain can be moved as a whole.
    assert inc1["parent"]["path"] == "snap-0"
    assert inc2["parent"]["path"] == "snap-1"
    assert [e["name"] for e in full["tables"]] == ["adagrad", "adam", "dense", "sgd"]
    assert [e["name"] for e in inc2["tables"]] == ["adagrad", "adam", "dense", "late", "late_dense"]
    for snap, m in zip(history.snaps, history.manifests, strict=True):
        on_disk = json.loads((snap / "manifest.json").read_text())
        assert on_disk == {k: v for k, v in m.items() if k != "bytes"}
        files = [f for e in m["tables"] for f in e["files"] + [e["tombstones"]] if f]
        assert (
            m["bytes"] == sum(f["bytes"] for f in files) + (snap / "manifest.json").stat().st_size
        )
        for f in files:
            assert (snap / f["name"]).stat().st_size == f["bytes"]
        for e in m["tables"]:
            assert e["rows"] == sum(f["rows"] for f in e["files"])
            assert (e["tombstones"] is None) == (m["kind"] == "full" or "dense" in e["name"])
    state = history.states[-1]
    for e in inc2["tables"]:
        if "dense" not in e["name"]:
            assert e["total_rows"] == state[e["name"]]["len"]
            assert e["record"]["seq"] == state[e["name"]]["seq"]


def test_increments_hold_changed_rows_and_tombstones(history):
    for k in (1, 2):
        before, after = history.states[k - 1], history.states[k]
        snap, manifest = history.snaps[k], history.manifests[k]
        for e in manifest["tables"]:
            name = e["name"]
            if "dense" in name:
                continue
            now = set(after[name]["present"].tolist())
            rows = read_rows(snap, e)
            ids = set(rows.column("id").to_numpy().tolist())
            assert len(ids) == rows.num_rows == e["rows"]
            assert ids <= now
            tombstones = set(read_tombstones(snap, e).tolist())
            assert not tombstones & now
            if name not in before["tables"]:  # created since the parent: every row
                assert ids == now
                continue
            prev = dict(
                zip(
                    before[name]["present"].tolist(),
                    before[name]["rows"],
                    strict=True,
                )
            )
            values = dict(zip(after[name]["present"].tolist(), after[name]["rows"], strict=True))
            changed = {i for i in now if i not in prev or not np.array_equal(prev[i], values[i])}
            assert changed
            assert changed <= ids
            assert set(prev) - now <= tombstones


@pytest.mark.parametrize("num_shards", [1, 7, 64])
def test_restore_last_increment_in_memory(history, num_shards):
    restored = pstore.Store.restore(history.snaps[-1], num_shards=num_shards, threads=2)
    assert restored.path is None
    assert restored.num_shards == num_shards
    assert_same(capture(restored, history.universe), history.states[-1])
    assert "sgd" not in restored


def test_restore_last_increment_into_a_durable_store(history, tmp_path):
    target = tmp_path / "restored"
    restored = pstore.Store.restore(history.snaps[-1], target, num_shards=5, durability="sync")
    assert restored.path is not None
    assert restored.durability == "sync"
    assert_same(capture(restored, history.universe), history.states[-1])
    restored.close()
    # Reopened, it holds the same (and counts the pulls of the capture above).
    twin = pstore.Store.restore(history.snaps[-1], threads=2)
    capture(twin, history.universe)
    with pstore.Store(target, num_shards=5) as reopened:
        assert_same(capture(reopened, history.universe), capture(twin, history.universe))


@pytest.mark.parametrize("k", [0, 1])
def test_restore_an_earlier_snapshot_gives_the_state_of_its_time(history, k):
    restored = pstore.Store.restore(history.snaps[k], num_shards=3, threads=2)
    assert_same(capture(restored, history.universe), history.states[k])
    assert not np.array_equal(
        history.states[k]["dense"]["value"], history.states[-1]["dense"]["value"]
    )


def test_a_moved_chain_restores(history, tmp_path):
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for snap in history.snaps:
        shutil.copytree(snap, moved / snap.name)
    hidden = [snap.rename(snap.with_name(f"hidden-{snap.name}")) for snap in history.snaps]
    try:  # the originals are out of the way: nothing refers to them
        restored = pstore.Store.restore(moved / history.snaps[-1].name, threads=2)
    finally:
        for snap, h in zip(history.snaps, hidden, strict=True):
            h.rename(snap)
    assert_same(capture(restored, history.universe), history.states[-1])


def file_rows(snap: Path, entry: dict) -> dict[int, tuple]:
    """id -> (step, version, updated_at, freq, weights, state) of a table's files."""
    rows = read_rows(snap, entry)
    cols = [rows.column(c).to_numpy() for c in ("id", "step", "version", "updated_at", "freq")]
    weights = floats(rows, "weights", entry["dim"])
    state = floats(rows, "state", entry["state_len"]) if entry["state_len"] else weights[:, :0]
    return {
        int(i): (int(a), int(b), int(c), int(d), w.tobytes(), x.tobytes())
        for i, a, b, c, d, w, x in zip(*cols, weights, state, strict=True)
    }


def merge_chain(snaps: list[Path], manifests: list[dict]) -> dict[str, dict[int, tuple]]:
    """The tables at the last snapshot, rebuilt from the chain's files with pyarrow alone."""
    tables: dict[str, dict[int, tuple]] = {}
    for snap, m in zip(snaps, manifests, strict=True):
        tables = {e["name"]: tables.get(e["name"], {}) for e in m["tables"]}
        for e in m["tables"]:
            rows = tables[e["name"]]
            rows.update(file_rows(snap, e))
            if e["tombstones"] is not None:
                for i in read_tombstones(snap, e).tolist():
                    rows.pop(i, None)
            assert len(rows) == e["total_rows"], e["name"]
    return tables


@pytest.mark.parametrize("target", ["memory", "durable"])
def test_restored_rows_keep_optimizer_state_and_metadata(history, tmp_path, target):
    """A full snapshot of the restored store holds exactly the rows of the chain: weights,
    optimizer state, step, version, update time and push count."""
    want = merge_chain(history.snaps, history.manifests)
    path = tmp_path / "restored" if target == "durable" else None
    restored = pstore.Store.restore(history.snaps[-1], path, num_shards=7, threads=2)
    again = restored.snapshot(tmp_path / "again")
    assert [e["name"] for e in again["tables"]] == sorted(want)
    for e in again["tables"]:
        assert file_rows(tmp_path / "again", e) == want[e["name"]], e["name"]
        assert e["record"] == entry_of(history.manifests[-1], e["name"])["record"]
    restored.close()


# --- 2. training resumes identically --------------------------------------------------------


def test_training_resumes_identically(own_history, tmp_path):
    history = own_history
    live = history.store
    twins = [
        pstore.Store.restore(history.snaps[-1], num_shards=7, threads=2),
        pstore.Store.restore(history.snaps[-1], tmp_path / "twin", durability="none"),
    ]
    for twin in twins:  # the live store was captured after the snapshot: so are the twins
        assert_same(capture(twin, history.universe), history.states[-1])
    # Adam's per-row steps are in the snapshot (so they can matter below).
    steps = read_rows(history.snaps[0], entry_of(history.manifests[0], "adam")).column("step")
    assert sorted(set(steps.to_numpy().tolist())) == [1, 2, 3]

    rng = np.random.default_rng(99)
    for _ in range(3):
        for name in ("adagrad", "adam", "late"):
            t = live.table(name)
            present = history.present(name)
            # No new rows in "late": past its row budget, which rows go among equals depends on
            # the shard layout (see the report), not on the snapshot.
            new = history.new_ids(name, 0 if name == "late" else 10)
            ids = np.concatenate([rng.choice(present, 40), new])
            g = grads(rng, len(ids), t.dim)
            history.universe[name].update(int(i) for i in ids)
            for store in [live, *twins]:
                store.table(name).push(ids, g)
        for name, shape in (("dense", (3, 5)), ("late_dense", (4,))):
            g = rng.standard_normal(shape).astype(F32)
            for store in [live, *twins]:
                store.table(name).push(g)
    want = capture(live, history.universe)
    for twin in twins:
        assert_same(capture(twin, history.universe), want)
    twins[1].close()


# --- 3. consistency while training goes on --------------------------------------------------

N_IDS, DIM, BATCH = 20_000, 16, 3_000
LR, ACC0, EPS = 0.1, 0.1, 1e-10


def adagrad_after(k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight and accumulator of a Zeros-initialised Adagrad element after k pushes of gradient 1.

    As in rust/src/optimizer: Adagrad computes in float32.
    """
    w = np.zeros(k_max + 1, dtype=F32)
    s = np.zeros(k_max + 1, dtype=F32)
    s[0] = F32(ACC0)
    for k in range(1, k_max + 1):
        s[k] = s[k - 1] + F32(1.0)
        w[k] = w[k - 1] - F32(LR) * (F32(1.0) / (np.sqrt(s[k]) + F32(EPS)))
    return w, s


def check_concurrent_snapshot(
    snap: Path, manifest: dict, seq_after: int, started: float
) -> tuple[int, int]:
    """Every row of the snapshot is the row after exactly ``step`` updates; returns the largest
    version and the number of distinct steps."""
    (e,) = manifest["tables"]
    assert e["rows"] == e["total_rows"] == N_IDS
    rows = read_rows(snap, e)
    ids = rows.column("id").to_numpy()
    np.testing.assert_array_equal(np.sort(ids), np.arange(N_IDS, dtype=np.uint64))
    step = rows.column("step").to_numpy()
    version = rows.column("version").to_numpy()
    w_ref, s_ref = adagrad_after(int(step.max()))
    weights, state = floats(rows, "weights", DIM), floats(rows, "state", DIM)
    np.testing.assert_array_equal(weights, np.repeat(w_ref[step][:, None], DIM, axis=1))
    np.testing.assert_array_equal(state, np.repeat(s_ref[step][:, None], DIM, axis=1))
    # No duplicates in a push: every update counts one hit.
    np.testing.assert_array_equal(rows.column("freq").to_numpy(), step)
    assert (version <= seq_after).all()
    # (Not version >= step: concurrent pushes may reach a row out of their seq order.)
    assert (version[step > 0] >= 1).all()
    assert (version[step == 0] == 0).all()
    updated_at = rows.column("updated_at").to_numpy()
    assert (updated_at >= int(started)).all()
    assert (updated_at <= time.time()).all()
    if manifest["source_path"] is not None:
        # A durable store's snapshot is one read transaction of its replica, where every push is
        # whole: the snapshot holds exactly the pushes 1..seq, each of BATCH rows.
        seq = e["record"]["seq"]
        assert int(version.max()) == seq
        assert int(step.sum()) == seq * BATCH
    return int(version.max()), len(np.unique(step))


@pytest.mark.parametrize("kind", ["memory", "async", "async, 2 environments"])
def test_rows_are_whole_updates_while_training_goes_on(tmp_path, kind):
    if kind == "memory":
        store = pstore.Store(threads=2)
    else:
        envs = 2 if "2 environments" in kind else 1
        store = pstore.Store(
            tmp_path / "store",
            durability="async",
            flush_interval=0.05,
            threads=2,
            environments=envs,
        )
    t = store.create_sparse_table(
        "emb",
        DIM,
        optimizer=optim.Adagrad(lr=LR, initial_accumulator_value=ACC0, eps=EPS),
        initializer=init.Zeros(),
    )
    started = time.time()
    t.pull(np.arange(N_IDS, dtype=np.uint64))
    stop = threading.Event()
    errors: list[BaseException] = []

    def train(seed: int) -> None:
        rng = np.random.default_rng(seed)
        g = np.ones((BATCH, DIM), dtype=F32)
        try:
            while not stop.is_set():
                t.push(rng.choice(N_IDS, BATCH, replace=False).astype(np.uint64), g)
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=train, args=(seed,)) for seed in (1, 2)]
    for w in workers:
        w.start()
    during = False
    try:
        while t.seq < 20 and not errors:
            time.sleep(0.01)
        for attempt in range(50):  # until one snapshot sees a push made while it ran
            seq_before = t.seq
            snap = tmp_path / f"snap-{attempt}"
            manifest = store.snapshot(snap)
            seq_after = t.seq
            max_version, distinct_steps = check_concurrent_snapshot(
                snap, manifest, seq_after, started
            )
            assert distinct_steps > 1
            # Rows hold updates made after the snapshot began: it did not stop training.
            if max_version > seq_before:
                during = True
                break
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not errors, errors
    assert during, "no snapshot saw an update made while it ran"
    # The snapshot restores to exactly the rows in its files.
    restored = pstore.Store.restore(snap, num_shards=3, threads=2)
    rows = read_rows(snap, manifest["tables"][0])
    got = restored.table("emb").pull(rows.column("id").to_numpy())
    np.testing.assert_array_equal(got, floats(rows, "weights", DIM))
    store.close()


# --- 4. readable by pyarrow, pandas and duckdb ----------------------------------------------


def test_files_are_readable_by_pyarrow_pandas_and_duckdb(history):
    snap, manifest, state = history.snaps[0], history.manifests[0], history.states[0]
    con = duckdb.connect()
    for e in manifest["tables"]:
        name, dim, state_len = e["name"], e["dim"], e["state_len"]
        if name == "dense":
            assert [f["name"] for f in e["files"]] == [f"{e['dir']}/value.arrow"]
        else:
            assert 1 <= len(e["files"]) <= 16
            for k, f in enumerate(e["files"]):
                assert f["name"] == f"{e['dir']}/part-{k:05d}.arrow"
        for f in e["files"]:
            reader = pa.ipc.open_file(snap / f["name"])
            table = reader.read_all()
            assert table.num_rows == f["rows"]
            schema = table.schema
            assert schema.metadata[b"pstore.format"] == b"1"
            assert schema.metadata[b"pstore.kind"] == b"rows"
            want = PART_COLUMNS if state_len else PART_COLUMNS[:-1]
            assert schema.names == want
            assert schema.field("id").type == pa.uint64()
            assert schema.field("step").type == pa.uint32()
            assert schema.field("version").type == pa.uint64()
            assert schema.field("updated_at").type == pa.uint32()
            assert schema.field("freq").type == pa.uint32()
            assert schema.field("weights").type == pa.list_(
                pa.field("item", pa.float32(), False), dim
            )
            if state_len:
                assert schema.field("state").type == pa.list_(
                    pa.field("item", pa.float32(), False), state_len
                )
            assert not any(field.nullable for field in schema)

            df = table.to_pandas()
            assert list(df.columns) == want
            assert [str(df[c].dtype) for c in want[:5]] == [
                "uint64",
                "uint32",
                "uint64",
                "uint32",
                "uint32",
            ]
            if len(df):
                cell = df["weights"].iloc[0]
                assert cell.dtype == np.float32
                assert cell.shape == (dim,)

            con.register("tbl", table)
            [(count, freq, distinct)] = con.execute(
                "select count(*), coalesce(sum(freq), 0), count(distinct id) from tbl"
            ).fetchall()
            assert count == distinct == f["rows"]
            assert freq == int(table.column("freq").to_numpy().sum())
            con.unregister("tbl")

        rows = pa.concat_tables([pa.ipc.open_file(snap / f["name"]).read_all() for f in e["files"]])
        con.register("tbl", rows)
        [(count,)] = con.execute("select count(*) from tbl").fetchall()
        con.unregister("tbl")
        assert count == e["rows"] == e["total_rows"]
        ids = rows.column("id").to_numpy()
        weights = floats(rows, "weights", dim)
        if name == "dense":
            np.testing.assert_array_equal(ids, [0])
            np.testing.assert_array_equal(weights.reshape(3, 5), state[name]["value"])
            assert rows.column("step").to_numpy()[0] == state[name]["step"] == 3
            assert state_len == 2 * dim  # Adam's two moments
        else:
            order = np.argsort(ids)
            np.testing.assert_array_equal(ids[order], state[name]["present"])
            np.testing.assert_array_equal(weights[order], state[name]["rows"])
            assert e["total_rows"] == state[name]["len"]
    assert entry_of(manifest, "sgd")["state_len"] == 0
    assert entry_of(manifest, "adagrad")["state_len"] == 8
    assert entry_of(manifest, "adam")["state_len"] == 8

    # The tombstones of an increment: one uint64 column.
    inc, e = history.snaps[1], entry_of(history.manifests[1], "adagrad")
    table = pa.ipc.open_file(inc / e["tombstones"]["name"]).read_all()
    assert table.schema.metadata[b"pstore.kind"] == b"ids"
    assert table.schema.field("id").type == pa.uint64()
    assert str(table.to_pandas()["id"].dtype) == "uint64"
    assert table.num_rows == e["tombstones"]["rows"] >= 35
    con.register("tomb", table)
    [(count,)] = con.execute("select count(distinct id) from tomb").fetchall()
    assert count == table.num_rows
    con.close()


# --- 5. damaged snapshots -------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path, rng):
    """A full snapshot and an increment of an in-memory store, siblings under ``tmp_path``."""
    store = pstore.Store(num_shards=4, threads=2)
    t = store.create_sparse_table("emb", 8, optimizer=optim.Adagrad(lr=0.1), seed=2)
    ids = random_ids(rng, 5000)
    t.push(ids, grads(rng, len(ids), 8))
    store.create_dense_table("d", 3).push(np.ones(3, dtype=F32))
    full = store.snapshot(tmp_path / "full")
    t.push(ids[:100], grads(rng, 100, 8))
    t.remove(ids[100:120])
    inc = store.snapshot(tmp_path / "inc", incremental=True)
    return tmp_path / "full", full, tmp_path / "inc", inc


def biggest_part(manifest: dict) -> str:
    e = entry_of(manifest, "emb")
    return max(e["files"], key=lambda f: f["rows"])["name"]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def damage(kind: str, chain, tmp_path: Path) -> tuple[Path, type, str]:
    """A damaged copy of the chain; returns the dir to restore, the error and what it names."""
    full, full_m, inc, inc_m = chain
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(full, copy / "full")
    shutil.copytree(inc, copy / "inc")
    full, inc = copy / "full", copy / "inc"
    part = biggest_part(full_m)
    if kind == "flip":
        flip_byte(full / part)
        return full, pstore.CorruptError, str(full / part)
    if kind == "truncate":
        data = (full / part).read_bytes()
        (full / part).write_bytes(data[: len(data) - 100])
        return full, pstore.CorruptError, str(full / part)
    if kind == "delete":
        (full / part).unlink()
        return full, pstore.CorruptError, str(full / part)
    if kind == "version":
        m = json.loads((full / "manifest.json").read_text())
        m["version"] = 99
        (full / "manifest.json").write_text(json.dumps(m))
        return full, pstore.CorruptError, str(full / "manifest.json")
    if kind == "no_manifest":
        (full / "manifest.json").unlink()
        return full, pstore.InvalidArgumentError, str(full)
    if kind == "parent_missing":
        shutil.rmtree(full)
        return inc, pstore.InvalidArgumentError, str(full)
    if kind == "parent_replaced":
        other = pstore.Store()
        other.create_sparse_table("emb", 8).pull([1])
        shutil.rmtree(full)
        other.snapshot(full)
        return inc, pstore.CorruptError, str(inc)
    if kind == "flip_in_base":  # the increment is fine, its parent is not
        flip_byte(full / part)
        return inc, pstore.CorruptError, str(full / part)
    if kind == "flip_increment":
        flip_byte(inc / biggest_part(inc_m))
        return inc, pstore.CorruptError, str(inc / biggest_part(inc_m))
    if kind == "flip_tombstones":
        name = entry_of(inc_m, "emb")["tombstones"]["name"]
        flip_byte(inc / name)
        return inc, pstore.CorruptError, str(inc / name)
    if kind == "flip_dense":
        name = entry_of(full_m, "d")["files"][0]["name"]
        flip_byte(full / name)
        return full, pstore.CorruptError, str(full / name)
    raise AssertionError(kind)


DAMAGE = [
    "flip",
    "truncate",
    "delete",
    "version",
    "no_manifest",
    "parent_missing",
    "parent_replaced",
    "flip_in_base",
    "flip_increment",
    "flip_tombstones",
    "flip_dense",
]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_snapshot_is_refused_and_leaves_nothing(chain, tmp_path, kind):
    snap, error, names = damage(kind, chain, tmp_path)
    with pytest.raises(error) as e:
        pstore.Store.restore(snap, threads=2)
    assert names in str(e.value)
    target = tmp_path / "target"
    with pytest.raises(error) as e:
        pstore.Store.restore(snap, target, durability="sync")
    assert names in str(e.value)
    assert not target.exists()  # nothing half loaded


def test_parent_missing_message_names_the_increment(chain, tmp_path):
    snap, _, _ = damage("parent_missing", chain, tmp_path)
    with pytest.raises(pstore.InvalidArgumentError, match="not a snapshot") as e:
        pstore.Store.restore(snap)
    assert str(snap) in str(e.value)


def test_failed_restore_into_an_existing_empty_directory_leaves_no_store(chain, tmp_path):
    snap, error, _ = damage("flip", chain, tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(error):
        pstore.Store.restore(snap, target)
    assert list(target.iterdir()) == []


_INTERRUPTED = """
import os, sys
import numpy as np
import pstore

N = 1_000_000
store = pstore.Store(sys.argv[1], durability="none", threads=2)
table = store.create_sparse_table("emb", 16, initializer=pstore.init.Zeros())
ids = np.arange(N, dtype=np.uint64)
table.pull(ids)
store.flush()
table.push(ids, np.ones((N, 16), dtype=np.float32))
# The snapshot first commits the pushed rows, then writes its files: die at the first progress
# report, 0.1 s in. (The commit of 1M rows takes several times that; with 200k rows of dim 8 it
# once finished within the first 0.1 s, and the snapshot was complete before the first report.)
store.snapshot(sys.argv[2], progress=lambda rows: os._exit(3))
"""


def test_an_interrupted_snapshot_is_not_a_snapshot(tmp_path):
    src = tmp_path / "store"
    snap = tmp_path / "snap"
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED, str(src), str(snap)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert not snap.exists()  # the directory appears only when complete
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".snap.tmp-")]
    assert not (leftover / "manifest.json").exists()
    for where in (leftover, snap):
        with pytest.raises(pstore.InvalidArgumentError, match="not a snapshot") as e:
            pstore.Store.restore(where, tmp_path / "target")
        assert str(where) in str(e.value)
        assert not (tmp_path / "target").exists()
    # The store is fine, and a new snapshot may take the name.
    ids = np.arange(0, 1_000_000, 997, dtype=np.uint64)
    with pstore.Store(src, threads=2) as store:
        m = store.snapshot(snap)
        assert entry_of(m, "emb")["rows"] == 1_000_000
        want = store.table("emb").pull(ids)
    restored = pstore.Store.restore(snap)
    np.testing.assert_array_equal(restored.table("emb").pull(ids), want)


# --- 6. increments are small ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "async", "async, 2 environments"])
def test_increment_holds_only_what_changed(tmp_path, rng, kind):
    n, dim = 100_000, 8
    if kind == "memory":
        store = pstore.Store(threads=2)
    else:
        envs = 2 if "2 environments" in kind else 1
        store = pstore.Store(tmp_path / "store", durability="async", threads=2, environments=envs)
    t = store.create_sparse_table("emb", dim, optimizer=optim.Adagrad(lr=0.1), seed=1)
    ids = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # spread over uint64
    t.push(ids, grads(rng, n, dim))
    full = store.snapshot(tmp_path / "full")
    assert entry_of(full, "emb")["rows"] == n

    order = rng.permutation(n)
    touched, removed = ids[order[:1000]], ids[order[1000:1100]]
    t.push(touched, grads(rng, 1000, dim))
    assert t.remove(removed) == 100
    inc = store.snapshot(tmp_path / "inc", incremental=True)
    e = entry_of(inc, "emb")
    assert e["rows"] == 1000
    assert e["total_rows"] == n - 100
    assert e["tombstones"]["rows"] == 100
    rows = read_rows(tmp_path / "inc", e)
    np.testing.assert_array_equal(np.sort(rows.column("id").to_numpy()), np.sort(touched))
    np.testing.assert_array_equal(np.sort(read_tombstones(tmp_path / "inc", e)), np.sort(removed))
    assert inc["bytes"] <= 0.05 * full["bytes"]

    # Nothing changed: an empty increment.
    quiet = store.snapshot(tmp_path / "quiet", incremental=True)
    e = entry_of(quiet, "emb")
    assert (e["rows"], e["tombstones"]["rows"], e["total_rows"]) == (0, 0, n - 100)

    restored = pstore.Store.restore(tmp_path / "quiet", num_shards=16, threads=2)
    r = restored.table("emb")
    assert len(r) == n - 100
    assert not r.contains(removed).any()
    kept = ids[np.isin(ids, removed, invert=True)]
    np.testing.assert_array_equal(r.pull(kept), t.pull(kept))
    store.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_increment_of_a_reopened_store_reads_its_rows_from_the_replica(tmp_path, rng, threads):
    """Rows changed before a reopen are not in memory: the increment reads them back from LMDB
    (with one read transaction per pool thread), beside rows it copies from memory."""
    n, dim = 6000, 4
    path = tmp_path / "store"
    store = pstore.Store(path, durability="async", threads=threads)
    t = store.create_sparse_table("emb", dim, optimizer=optim.Adam(lr=0.1), seed=2)
    ids = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    t.push(ids, grads(rng, n, dim))
    store.snapshot(tmp_path / "full")
    after = ids[n // 2 :]
    t.push(ids, grads(rng, n, dim))
    store.close()

    store = pstore.Store(path, durability="async", threads=threads)
    t = store.table("emb")
    t.push(after, grads(rng, len(after), dim))  # in memory again; the first half stays on disk
    want = t.pull(ids)
    inc = store.snapshot(tmp_path / "inc", incremental=True)
    e = entry_of(inc, "emb")
    assert e["rows"] == n
    rows = read_rows(tmp_path / "inc", e)
    np.testing.assert_array_equal(np.sort(rows.column("id").to_numpy()), np.sort(ids))
    store.close()
    restored = pstore.Store.restore(tmp_path / "inc", threads=2)
    r = restored.table("emb")
    np.testing.assert_array_equal(r.pull(ids), want)
    # The optimizer state travelled too: one more identical step gives identical rows.
    g = grads(rng, n, dim)
    again = pstore.Store(path, durability="async", threads=threads)
    a = again.table("emb")
    a.push(ids, g)
    r.push(ids, g)
    np.testing.assert_array_equal(r.pull(ids), a.pull(ids))
    again.close()
    restored.close()


# --- 7. misuse and progress -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "async"])
def test_increment_without_a_previous_snapshot(tmp_path, kind):
    path = tmp_path / "store"
    store = pstore.Store(path, threads=2) if kind == "async" else pstore.Store(threads=2)
    store.create_sparse_table("emb", 4).pull([1, 2])
    with pytest.raises(pstore.InvalidArgumentError, match="previous snapshot"):
        store.snapshot(tmp_path / "inc", incremental=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["store"] if kind == "async" else [])
    store.close()


def test_a_restored_store_needs_a_full_snapshot_first(tmp_path):
    store = pstore.Store(threads=2)
    store.create_sparse_table("emb", 4).pull([1, 2])
    store.snapshot(tmp_path / "full")
    restored = pstore.Store.restore(tmp_path / "full")
    with pytest.raises(pstore.InvalidArgumentError):
        restored.snapshot(tmp_path / "inc", incremental=True)
    assert not (tmp_path / "inc").exists()


def test_snapshot_into_an_existing_directory(tmp_path):
    store = pstore.Store(threads=2)
    store.create_sparse_table("emb", 4).pull([1, 2])
    store.snapshot(tmp_path / "snap")
    before = sorted(p.name for p in (tmp_path / "snap").rglob("*"))
    (tmp_path / "empty").mkdir()
    for target in ("snap", "empty"):
        for incremental in (False, True):
            with pytest.raises(pstore.InvalidArgumentError, match="exists"):
                store.snapshot(tmp_path / target, incremental=incremental)
    assert sorted(p.name for p in (tmp_path / "snap").rglob("*")) == before
    assert list((tmp_path / "empty").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "snap"]
    assert len(pstore.Store.restore(tmp_path / "snap").table("emb")) == 2
    # Missing parents are created (snaps/0001 with no snaps/ yet); a file in the way is refused.
    store.snapshot(tmp_path / "no" / "such" / "snap")
    assert len(pstore.Store.restore(tmp_path / "no" / "such" / "snap").table("emb")) == 2
    (tmp_path / "file").write_text("x")
    with pytest.raises(pstore.InvalidArgumentError, match="not a directory"):
        store.snapshot(tmp_path / "file" / "snap")
    with pytest.raises(pstore.StorageError, match="creating"):
        store.snapshot(tmp_path / "file" / "sub" / "snap")


def test_restore_into_a_path_holding_a_store(tmp_path):
    snap_src = pstore.Store(threads=2)
    snap_src.create_sparse_table("other", 2).pull([5])
    snap_src.snapshot(tmp_path / "snap")
    path = tmp_path / "store"
    with pstore.Store(path, threads=2) as store:
        store.create_sparse_table("emb", 4, initializer=init.Constant(1.5)).pull([1, 2, 3])
    with pytest.raises(pstore.InvalidArgumentError, match="holds a store") as e:
        pstore.Store.restore(tmp_path / "snap", path)
    assert str(path) in str(e.value)
    with pstore.Store(path, threads=2) as store:  # untouched
        assert store.tables() == ["emb"]
        np.testing.assert_array_equal(store.table("emb").pull([1, 2, 3]), 1.5)


def test_closed_store_cannot_snapshot(tmp_path):
    store = pstore.Store(tmp_path / "store", threads=2)
    store.create_sparse_table("emb", 4).pull([1])
    store.close()
    with pytest.raises(pstore.StorageError, match="closed"):
        store.snapshot(tmp_path / "snap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def check_progress(calls: list, total: int, seconds: float) -> None:
    """Calls every 0.1 s or so while the work runs, then one with the total."""
    assert all(isinstance(c, int) for c in calls)
    assert calls == sorted(calls)
    assert 0 <= calls[0]
    assert calls[-1] == total
    assert len(calls) >= 1 + int(seconds / 0.25), (seconds, calls)


@pytest.mark.parametrize(("kind", "n"), [("memory", 1_000_000), ("none", 300_000)])
def test_progress_reports_rows_up_to_the_total(tmp_path, kind, n):
    if kind == "memory":
        store = pstore.Store(threads=2)
    else:  # the snapshot first commits every row: slower
        store = pstore.Store(tmp_path / "store", durability=kind, threads=2)
    t = store.create_sparse_table("emb", 8, initializer=init.Zeros())
    t.pull(np.arange(n, dtype=np.uint64))
    store.create_dense_table("d", 4)  # no rows to count
    seen: list[int] = []
    start = time.perf_counter()
    manifest = store.snapshot(tmp_path / "snap", progress=seen.append)
    check_progress(seen, n, time.perf_counter() - start)
    assert entry_of(manifest, "emb")["rows"] == n
    loaded: list[int] = []
    target = None if kind == "memory" else tmp_path / "restored"
    start = time.perf_counter()
    restored = pstore.Store.restore(
        tmp_path / "snap", target, durability="none", threads=2, progress=loaded.append
    )
    check_progress(loaded, n, time.perf_counter() - start)
    assert len(restored.table("emb")) == n
    restored.close()
    store.close()


# --- tables dropped and created again -------------------------------------------------------


@pytest.mark.parametrize("dim", [4, 6])
def test_a_table_dropped_and_created_again_between_snapshots(tmp_path, dim):
    store = pstore.Store(num_shards=4, threads=2)
    t = store.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=0.1), initializer=init.Zeros())
    t.push(np.arange(10, dtype=np.uint64), np.ones((10, 4), dtype=F32))
    store.snapshot(tmp_path / "full")
    store.drop_table("emb")
    t = store.create_sparse_table("emb", dim, optimizer=optim.SGD(lr=0.1), initializer=init.Zeros())
    t.push(u64([5, 6]), np.ones((2, dim), dtype=F32))
    store.snapshot(tmp_path / "inc", incremental=True)
    r = pstore.Store.restore(tmp_path / "inc").table("emb")
    np.testing.assert_array_equal(r.contains(np.arange(10)), np.isin(np.arange(10), [5, 6]))
    np.testing.assert_array_equal(r.pull([5, 6]), t.pull([5, 6]))
