"""The LMDB replica of a durable store, decoded with the ``lmdb`` package and docs/FORMAT.md only.

Everything after ``store.close()`` in these tests reads the store directory with ``lmdb``,
``numpy``, ``json`` and ``struct``, following the document, and compares what it finds with what
pstore reported through its API before closing.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
import pytest
from _data import mix64

import pstore
from pstore import init, optim
from pstore.exceptions import CorruptError, InvalidArgumentError, StorageError

F32 = np.float32
F64 = np.float64
U64_MAX = np.iinfo(np.uint64).max
MAX_DBS = 3072
DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


# --- a reader written from docs/FORMAT.md ----------------------------------------------------


@dataclass
class Row:
    step: int
    reserved: int
    version: int
    updated_at: int
    freq: int
    weights: np.ndarray
    state: np.ndarray


@dataclass
class Replica:
    format: dict
    cycle: int
    records: dict[str, dict] = field(default_factory=dict)
    dense: dict[str, bytes] = field(default_factory=dict)
    other_meta: dict[bytes, bytes] = field(default_factory=dict)
    rows: dict[str, dict[int, bytes]] = field(default_factory=dict)
    changed: dict[str, dict[int, int]] = field(default_factory=dict)
    removed: dict[str, dict[int, int]] = field(default_factory=dict)
    databases: set[bytes] = field(default_factory=set)
    # The named databases of each environment k >= 1 (docs/FORMAT.md, "Several environments").
    part_databases: list[set[bytes]] = field(default_factory=list)
    # Their own ``meta``: the last cycle that wrote to each, and the tables' seq there.
    part_cycles: list[int] = field(default_factory=list)
    part_seqs: list[dict[str, int]] = field(default_factory=list)


def open_env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), readonly=True, lock=False, max_dbs=MAX_DBS, subdir=True)


def read_tables(env: lmdb.Environment, txn: lmdb.Transaction, rep: Replica, k: int, n: int):
    """The ``rows/``, ``changed/`` and ``removed/`` entries of environment ``k`` of ``n``."""
    for name in rep.records:
        for prefix, into in (
            (b"rows/", rep.rows),
            (b"changed/", rep.changed),
            (b"removed/", rep.removed),
        ):
            db = env.open_db(prefix + name.encode(), txn=txn, create=False)
            entries = into.setdefault(name, {})
            for key, value in txn.cursor(db=db):
                if prefix == b"rows/":
                    # The id, the row's words, then the checksum: CRC-32 of all before it.
                    (row_id,) = struct.unpack_from("<Q", value)
                    (crc,) = struct.unpack_from("<I", value, len(value) - 4)
                    assert crc == zlib.crc32(value[:-4]), f"row {row_id}: checksum"
                    entries[row_id] = bytes(value[:-4])
                else:
                    assert len(value) == 16
                    cycle, row_id = struct.unpack("<QQ", value)
                    entries[row_id] = cycle
                assert key == mix64(row_id).to_bytes(8, "big"), "keyed by mix64(id)"
                assert mix64(row_id) * n >> 64 == k, "in the environment of its key range"


def read_replica(path: Path) -> Replica:
    """Every database of a closed store, decoded as docs/FORMAT.md says."""
    env = open_env(path)
    try:
        with env.begin() as txn:
            databases = {k for k, _ in txn.cursor()}
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw_cycle = txn.get(b"cycle", db=meta)
            rep = Replica(
                format=json.loads(txn.get(b"format", db=meta)),
                cycle=0 if raw_cycle is None else struct.unpack("<Q", raw_cycle)[0],
                databases=databases,
            )
            for key, value in txn.cursor(db=meta):
                if key.startswith(b"table/"):
                    rep.records[key[len(b"table/") :].decode()] = json.loads(value)
                elif key.startswith(b"dense/"):
                    rep.dense[key[len(b"dense/") :].decode()] = bytes(value)
                elif key not in (b"format", b"cycle"):
                    rep.other_meta[bytes(key)] = bytes(value)
            n = rep.format.get("environments", 1)
            read_tables(env, txn, rep, 0, n)
    finally:
        env.close()
    for k in range(1, n):
        part = open_env(path / f"env-{k}")
        try:
            with part.begin() as txn:
                rep.part_databases.append({key for key, _ in txn.cursor()})
                meta = part.open_db(b"meta", txn=txn, create=False)
                record = json.loads(txn.get(b"part", db=meta))
                assert record == {"format": "pstore-lmdb", "environment": k, "environments": n}
                raw_cycle = txn.get(b"cycle", db=meta)
                rep.part_cycles.append(
                    0 if raw_cycle is None else struct.unpack("<Q", raw_cycle)[0]
                )
                seqs = {}
                for key, value in txn.cursor(db=meta):
                    if key.startswith(b"seq/"):
                        seqs[key[len(b"seq/") :].decode()] = struct.unpack("<Q", value)[0]
                    else:
                        assert key in (b"part", b"cycle"), key
                assert set(seqs) <= set(rep.records), "seq/ keys of live tables only"
                rep.part_seqs.append(seqs)
                read_tables(part, txn, rep, k, n)
        finally:
            part.close()
    return rep


def state_len(optimizer: dict, n: int) -> int:
    """``state_len`` of docs/FORMAT.md's optimizer table, from a record's optimizer."""
    ((kind, hp),) = optimizer["kind"].items()
    if kind == "sgd":
        return n if hp["momentum"] > 0 else 0
    return {"adagrad": n, "adam": 2 * n, "ftrl": 2 * n}[kind]


def decode_row(value: bytes, dim: int, n_state: int) -> Row:
    """A value of ``rows/<name>``: id, step, reserved, version, updated_at, freq, floats."""
    assert len(value) == 32 + 4 * (dim + n_state)
    _, step, reserved, version, updated_at, freq = struct.unpack_from("<QIIQII", value)
    vlo, vhi = struct.unpack_from("<2I", value, 16)  # the version is two words, low first
    assert version == vlo | vhi << 32
    floats = np.frombuffer(value, dtype="<f4", offset=32)
    return Row(step, reserved, version, updated_at, freq, floats[:dim], floats[dim:])


def decode_dense(value: bytes, numel: int, n_state: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    assert len(value) == 8 + 4 * (numel + n_state)
    step, reserved = struct.unpack_from("<2I", value, 0)
    floats = np.frombuffer(value, dtype="<f4", offset=8)
    return step, reserved, floats[:numel], floats[numel:]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


# --- a reference of the optimizers (rust/src/optimizer/mod.rs), float64 then float32 ---------


def reference_update(kind: str, hp: dict, lr: float, step: int, w, s, g):
    """One update of float32 weights ``w`` and state ``s`` by the float64 gradient ``g``."""
    wf = w.astype(F64)
    g, g0 = g + hp.get("weight_decay", 0.0) * wf, g
    if kind == "sgd":
        assert hp["momentum"] == 0
        return (wf - lr * g).astype(F32), s
    if kind == "adagrad":  # in float32, as the store computes it
        g32 = g0.astype(F32) + F32(hp["weight_decay"]) * w
        total = s + g32 * g32
        d = F32(lr) * (g32 / (np.sqrt(total) + F32(hp["eps"])))
        return w - d, total
    if kind == "adam":
        b1, b2, n = hp["beta1"], hp["beta2"], w.size
        step_size = lr / (1.0 - b1**step)
        bc2_sqrt = np.sqrt(1.0 - b2**step)
        m = b1 * s[:n].astype(F64) + (1.0 - b1) * g
        v = b2 * s[n:].astype(F64) + (1.0 - b2) * g * g
        w_new = (wf - step_size * m / (np.sqrt(v) / bc2_sqrt + hp["eps"])).astype(F32)
        return w_new, np.concatenate([m.astype(F32), v.astype(F32)])
    raise AssertionError(kind)


@dataclass
class RefRow:
    weights: np.ndarray
    state: np.ndarray
    step: int = 0
    version: int = 0
    freq: int = 0


@dataclass
class Expected:
    ids: np.ndarray
    weights: np.ndarray
    stats: dict
    seq: int
    lr: float
    len: int
    dim: int
    seed: int


class RefTable:
    """What a sparse table should hold, computed without pstore's arithmetic."""

    def __init__(self, table: pstore.SparseTable, kind: str, hp: dict, init_state: float):
        self.table, self.kind, self.hp, self.init_state = table, kind, hp, init_state
        self.rows: dict[int, RefRow] = {}
        self.seq = 0
        self.removed: set[int] = set()  # ids removed and not created again

    def _row(self, i: int) -> RefRow:
        if i not in self.rows:
            w0 = self.table.initial_rows(np.array([i], dtype=np.uint64))[0]
            n = state_len({"kind": {self.kind: self.hp}}, w0.size)
            self.rows[i] = RefRow(w0.copy(), np.full(n, self.init_state, F32), version=self.seq)
            self.removed.discard(i)
        return self.rows[i]

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        self.table.push(ids, grads)
        self.seq += 1
        summed: dict[int, np.ndarray] = {}
        hits: dict[int, int] = {}
        for i, g in zip(ids.tolist(), grads, strict=True):
            summed[i] = summed.get(i, 0.0) + g.astype(F64)  # in the order of the batch
            hits[i] = hits.get(i, 0) + 1
        for i, g in summed.items():
            r = self._row(i)
            r.step += 1
            r.weights, r.state = reference_update(
                self.kind, self.hp, self.table.lr, r.step, r.weights, r.state, g
            )
            r.version, r.freq = self.seq, r.freq + hits[i]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        for i in ids.tolist():
            self._row(i)
        return self.table.pull(ids)

    def remove(self, ids: np.ndarray) -> None:
        expect = sum(i in self.rows for i in set(ids.tolist()))
        assert self.table.remove(ids) == expect
        for i in ids.tolist():
            if self.rows.pop(i, None) is not None:
                self.removed.add(i)


def spread_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` distinct ids over the whole u64 range, with small ones and the extremes."""
    ids = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
    ids[:4] = [0, 1, 2**63, U64_MAX]
    return np.unique(ids)


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("environments", [1, 3])
def test_a_closed_store_decodes_with_lmdb_and_the_document(tmp_path, rng, environments):
    path = tmp_path / "store"
    t0 = int(time.time())
    store = pstore.Store(
        path, durability="sync", num_shards=4, threads=2, environments=environments
    )
    ada = store.create_sparse_table("ada", 5, optimizer=optim.Adagrad(lr=0.1), seed=3)
    adam = store.create_sparse_table(
        "adam", 3, optimizer=optim.Adam(lr=0.01), initializer=init.Normal(0.0, 0.1), seed=5
    )
    sgd = store.create_sparse_table(
        "plain sgd", 4, optimizer=optim.SGD(lr=0.5), initializer=init.Uniform(-1.0, 1.0)
    )
    dense = store.create_dense_table("dense", (3, 4), optimizer=optim.Adam(lr=0.01), seed=9)
    ada_hp = {"initial_accumulator_value": 0.1, "eps": 1e-10, "weight_decay": 0.0}
    adam_hp = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    refs = {
        "ada": RefTable(ada, "adagrad", ada_hp, 0.1),
        "adam": RefTable(adam, "adam", adam_hp, 0.0),
        "plain sgd": RefTable(sgd, "sgd", {"momentum": 0.0, "weight_decay": 0.0}, 0.0),
    }
    pools = {name: spread_ids(rng, 40) for name in refs}
    for step in range(4):
        for name, ref in refs.items():
            if name == "plain sgd" and step >= 2:
                continue
            ids = rng.choice(pools[name], size=30)  # with duplicates
            dim = ref.table.dim
            ref.push(ids, rng.standard_normal((ids.size, dim)).astype(F32))
    dense_grads = [rng.standard_normal((3, 4)).astype(F32) for _ in range(3)]
    for g in dense_grads:
        dense.push(g)
    # Rows created by a pull (step 0), removals, and an id removed then pushed again.
    fresh = np.array([10**12 + 1, 10**12 + 2, 10**12 + 3], dtype=np.uint64)
    refs["ada"].pull(fresh)
    gone = np.array(sorted(set(refs["ada"].rows) - set(fresh.tolist()))[:5], dtype=np.uint64)
    # 777 has no row; fresh[2] has one in memory only (no cycle ran since the pull).
    refs["ada"].remove(np.concatenate([gone, np.array([777], dtype=np.uint64), fresh[2:]]))
    fresh = fresh[:2]
    refs["adam"].remove(np.array(sorted(refs["adam"].rows)[-2:], dtype=np.uint64))
    back = gone[:1]
    refs["ada"].push(back, np.full((1, 5), 0.25, F32))
    ada.set_lr(0.05)  # the record keeps the rate in force and the one of the config
    refs["ada"].push(gone[1:2], np.full((1, 5), -0.5, F32))

    # What pstore reports, read before closing.
    expected = {}
    for name, ref in refs.items():
        ids = np.array(sorted(ref.rows), dtype=np.uint64)
        t = ref.table
        weights = t.pull(ids)
        expected[name] = Expected(ids, weights, t.stats(), t.seq, t.lr, len(t), t.dim, t.seed)
    fresh_initial = ada.initial_rows(fresh)
    dense_expected = (dense.pull(), dense.step, dense.stats())
    store.close()
    t1 = int(time.time()) + 1

    rep = read_replica(path)
    assert rep.format == {"format": "pstore-lmdb", "version": 3, "environments": environments}
    names = ["ada", "adam", "dense", "plain sgd"]
    assert sorted(rep.records) == names
    tables = {f"{p}/{n}".encode() for n in names for p in ("rows", "changed", "removed")}
    assert rep.databases == {b"meta"} | tables
    assert rep.part_databases == [{b"meta"} | tables] * (environments - 1)
    assert rep.other_meta == {}
    assert sorted(rep.dense) == ["dense"]
    pushes = 4 + 4 + 2 + 2 + 3  # each sync push is committed by its own cycle
    assert rep.cycle >= pushes

    counters = ["pushes", "pulls", "ids_pushed", "ids_pulled"]
    counters += ["rows_updated", "rows_created", "rows_evicted", "rows_nonfinite"]
    for name, ref in refs.items():
        exp = expected[name]
        rec = rep.records[name]
        cfg = rec["config"]
        assert rec["kind"] == "sparse"
        assert rec["seq"] == exp.seq == exp.stats["seq"] == ref.seq
        assert rec["lr"] == exp.lr
        assert rec["counters"] == {k: exp.stats[k] for k in counters}
        assert (cfg["dim"], cfg["seed"]) == (exp.dim, exp.seed)
        assert cfg["lifecycle"] == {"admit_after": 0, "max_rows": None, "policy": "lru"}
        ((kind, hp),) = cfg["optimizer"]["kind"].items()
        assert kind == ref.kind
        assert hp == (ref.hp if kind != "sgd" else {**ref.hp, "nesterov": False})
        n_state = state_len(cfg["optimizer"], cfg["dim"])

        rows = rep.rows[name]
        assert sorted(rows) == exp.ids.tolist()
        assert len(rows) == exp.len == exp.stats["rows"]
        assert not set(rows) & ref.removed, "removed ids have no row"
        for k, i in enumerate(exp.ids.tolist()):
            row = decode_row(rows[i], cfg["dim"], n_state)
            want = ref.rows[i]
            what = f"table {name!r} id {i}"
            np.testing.assert_array_equal(bits(row.weights), bits(exp.weights[k]), what)
            assert (row.step, row.reserved, row.version, row.freq) == (
                want.step,
                0,
                want.version,
                want.freq,
            ), what
            assert t0 <= row.updated_at <= t1, what
            if kind == "adam":
                # Bias correction uses powi in Rust and pow here: the weights may differ in the
                # last bit; the moments may not.
                np.testing.assert_allclose(row.weights, want.weights, rtol=1e-6, err_msg=what)
            else:
                np.testing.assert_array_equal(bits(row.weights), bits(want.weights), what)
            np.testing.assert_array_equal(bits(row.state), bits(want.state), what)
            if kind == "adagrad":
                assert (row.state > 0).all(), what

        # changed/ and removed/: cycle numbers; the newer one tells what happened last.
        changed, removed = rep.changed[name], rep.removed[name]
        assert set(rows) <= set(changed)
        if name == "ada":
            # In sync mode a removal is committed when `remove` returns, so every removed id has
            # its entry; `back` and `gone[1]` were created again afterwards (see below).
            assert set(removed) == set(gone.tolist()) | {10**12 + 3}
        else:
            assert set(removed) == ref.removed
        assert all(1 <= c <= rep.cycle for c in [*changed.values(), *removed.values()])
        # Each other environment: its cycle, and the table's seq there, bound what it holds.
        for k, (cycle, seqs) in enumerate(
            zip(rep.part_cycles, rep.part_seqs, strict=True), start=1
        ):
            assert cycle <= rep.cycle
            mine = [i for i in rows if mix64(i) * environments >> 64 == k]
            assert mine, f"environment {k} holds rows of {name}"
            assert all(changed[i] <= cycle for i in mine)
            assert seqs[name] <= exp.seq
            assert all(decode_row(rows[i], cfg["dim"], n_state).version <= seqs[name] for i in mine)
        for i, c in removed.items():
            if i in rows:
                assert changed[i] > c, "an id created again after its removal"
            elif i in changed:
                assert c > changed[i]
            else:
                assert i == 10**12 + 3, "removed before a cycle wrote its row"
    assert {int(back[0]), int(gone[1])} <= set(rep.rows["ada"])
    assert rep.changed["ada"][int(gone[1])] > rep.removed["ada"][int(gone[1])]

    # Rows created by a pull: step 0, no push, initial weights and state.
    for k, i in enumerate(fresh.tolist()):
        row = decode_row(rep.rows["ada"][i], 5, 5)
        assert (row.step, row.freq, row.version) == (0, 0, refs["ada"].seq - 2)
        np.testing.assert_array_equal(bits(row.weights), bits(fresh_initial[k]))
        np.testing.assert_array_equal(row.state, np.full(5, 0.1, F32))
    assert rep.records["ada"]["lr"] == 0.05
    assert rep.records["ada"]["config"]["optimizer"]["lr"] == 0.1
    assert rep.records["plain sgd"]["config"]["initializer"] == {
        "uniform": {"low": -1.0, "high": 1.0}
    }
    assert state_len(rep.records["plain sgd"]["config"]["optimizer"], 4) == 0

    # The dense table: [step, 0, weights, exp_avg, exp_avg_sq].
    rec = rep.records["dense"]
    dense_weights, dense_step, dense_stats = dense_expected
    assert rec["kind"] == "dense"
    assert rec["config"]["shape"] == [3, 4]
    assert rec["config"]["initializer"] == "zeros"
    assert rec["seq"] == dense_stats["pushes"] == 3
    assert not rep.rows["dense"] and not rep.changed["dense"] and not rep.removed["dense"]
    n_state = state_len(rec["config"]["optimizer"], 12)
    step, reserved, w, s = decode_dense(rep.dense["dense"], 12, n_state)
    assert (step, reserved) == (dense_step, 0) == (3, 0)
    np.testing.assert_array_equal(bits(w), bits(dense_weights.ravel()))
    ref_w, ref_s = np.zeros(12, F32), np.zeros(24, F32)
    for k, g in enumerate(dense_grads, start=1):
        ref_w, ref_s = reference_update("adam", adam_hp, 0.01, k, ref_w, ref_s, g.ravel())
    np.testing.assert_array_equal(bits(s), bits(ref_s))
    np.testing.assert_allclose(w, ref_w, rtol=1e-6)

    # And pstore reads back what it wrote.
    with pstore.Store(path, durability="none") as again:
        for name, exp in expected.items():
            t = again.sparse_table(name)
            assert (len(t), t.seq) == (exp.len, exp.seq)
            np.testing.assert_array_equal(bits(t.pull(exp.ids)), bits(exp.weights))
        np.testing.assert_array_equal(bits(again.table("dense").pull()), bits(dense_weights))


def doc_blocks(info: str) -> list[str]:
    """The fenced code blocks of docs/FORMAT.md whose info string is ``info``."""
    assert DOC.is_file(), f"{DOC} is missing: the tests check the format document"
    blocks, current, kind = [], None, ""
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind == info:
                    blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_changed_holds_the_first_write_since_the_last_snapshot(tmp_path, rng):
    path = tmp_path / "store"
    ids = np.arange(1, 201, dtype=np.uint64)
    hot, cold = ids[:50], ids[50:]

    def push(which):
        t = store.table("emb")
        t.push(which, rng.standard_normal((len(which), 4)).astype(F32))
        store.flush()
        return store.storage_info()["cycle"]

    def changed():
        store.close()
        return read_replica(path).changed["emb"]

    store = pstore.Store(path, durability="none", num_shards=4, threads=2)
    store.create_sparse_table("emb", 4, optimizer=optim.Adagrad(lr=0.1))
    first = push(ids)
    second = push(hot)
    assert second > first
    # Written twice, entered once: the entry names the first cycle.
    assert changed() == dict.fromkeys(ids.tolist(), first)

    # Reopened: rows load from disk and their next write is entered anew.
    store = pstore.Store(path, durability="none", num_shards=4, threads=2)
    third = push(hot)
    entries = changed()
    assert {i: entries[i] for i in hot.tolist()} == dict.fromkeys(hot.tolist(), third)
    assert {i: entries[i] for i in cold.tolist()} == dict.fromkeys(cold.tolist(), first)

    # A snapshot prunes what it holds; rows written after it are entered anew, once.
    store = pstore.Store(path, durability="none", num_shards=4, threads=2)
    store.snapshot(tmp_path / "full")
    after = push(hot)
    push(hot)
    assert changed() == dict.fromkeys(hot.tolist(), after)

    # The increment holds every row written since the snapshot, at its last value.
    store = pstore.Store(path, durability="none", num_shards=4, threads=2)
    push(cold[:10])
    want = store.table("emb").pull(np.concatenate([hot, cold[:10]]))
    info = store.snapshot(tmp_path / "inc", incremental=True)
    assert info["tables"][0]["rows"] == 60
    store.close()
    restored = pstore.Store.restore(tmp_path / "inc", threads=2)
    np.testing.assert_array_equal(
        restored.table("emb").pull(np.concatenate([hot, cold[:10]])), want
    )
    restored.close()


def test_the_examples_of_the_document_are_real(tmp_path):
    path = tmp_path / "store"
    with pstore.Store(path, durability="sync", num_shards=4) as store:
        t = store.create_sparse_table(
            "user_emb",
            4,
            optimizer=optim.Adagrad(lr=0.05),
            initializer=init.Uniform(-0.01, 0.01),
            seed=42,
            max_rows=1_000_000,
        )
        d = store.create_dense_table("bias", (2, 3), optimizer=optim.Adam(lr=0.001))
        t.push(np.array([7, 9, 7], dtype=np.int64), np.full((3, 4), 0.5, F32))
        t.pull([11])
        t.remove([9])
        d.push(np.ones((2, 3), F32))
    rep = read_replica(path)
    records = [json.loads(b) for b in doc_blocks("json")]
    real = [dict(rep.records["user_emb"]), dict(rep.records["bias"])]
    for doc, rec in zip(records, real, strict=True):
        # A table's uid is drawn at random: the document shows one.
        assert isinstance(rec.pop("uid"), int) and doc.pop("uid") > 0
    assert records == real
    # The example row of id 7, every 4-byte group but updated_at (a time).
    (block,) = [b for b in doc_blocks("") if b.startswith("07000000")]
    words = [
        int.from_bytes(bytes.fromhex(w), "little")
        for line in block.splitlines()
        for w in line.split("  ")[0].split()
    ]
    row = np.frombuffer(rep.rows["user_emb"][7], dtype="<u4")
    # The last group is the checksum of the example's bytes (updated_at included, so the real
    # row's differs).
    assert len(words) == row.size + 1 == 17
    example = b"".join(w.to_bytes(4, "little") for w in words[:16])
    assert words.pop() == zlib.crc32(example)
    assert [w for k, w in enumerate(words) if k != 6] == [
        int(w) for k, w in enumerate(row) if k != 6
    ]
    assert f"key `{mix64(7):016x}`" in DOC.read_text()


def write_format(path: Path, record: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=MAX_DBS, subdir=True)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            assert txn.put(b"format", record, db=meta)
    finally:
        env.close()


def test_another_format_version_is_refused(tmp_path):
    path = tmp_path / "store"
    with pstore.Store(path, durability="sync") as store:
        store.create_sparse_table("emb", 2).push([1], np.ones((1, 2), F32))
    write_format(path, b'{"format":"pstore-lmdb","version":99}')
    with pytest.raises(CorruptError, match=r"version 99"):
        pstore.Store(path)
    write_format(path, b'{"format":"other","version":1}')
    with pytest.raises(CorruptError, match=r"other"):
        pstore.Store(path)
    # Refusing wrote nothing and released the directory: its own version opens again.
    write_format(path, b'{"format":"pstore-lmdb","version":3,"environments":1}')
    with pstore.Store(path) as store:
        assert len(store.sparse_table("emb")) == 1


def test_an_lmdb_environment_of_another_program_is_refused(tmp_path):
    path = tmp_path / "foreign"
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"their key", b"their value")
    env.close()
    try:
        with pytest.raises(CorruptError, match="not a pstore store"):
            pstore.Store(path).close()
    finally:
        env = open_env(path)
        with env.begin() as txn:
            keys = [k for k, _ in txn.cursor()]
        env.close()
    assert keys == [b"their key"], "the environment was left as it was"


def test_a_regular_file_is_not_a_store(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a directory")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        pstore.Store(path)
    assert path.read_bytes() == b"not a directory"


def test_one_store_per_directory_in_this_process_too(tmp_path):
    path = tmp_path / "store"
    first = pstore.Store(path, durability="sync")
    try:
        assert (path / "pstore.lock").is_file()
        with pytest.raises(StorageError, match="open in another process"):
            pstore.Store(path)
    finally:
        first.close()
    pstore.Store(path).close()  # closing released the lock
