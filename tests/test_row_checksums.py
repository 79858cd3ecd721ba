"""Row checksums (issue 32): single-bit flips in the rows of a store's data.mdb and of a serving
artifact's row file give the right row or a CorruptError naming the table and the row, never a
wrong row. Real stores and artifacts on disk; the bytes of each row are found in the files as
docs/FORMAT.md lays them out."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

import pstore
import pstore.serving
from pstore import optim
from pstore.exceptions import CorruptError, InvalidArgumentError
from pstore.inspection import inspect_store

F32 = np.float32
DIM = 8
# Adam keeps 2 * dim state floats; a row value is the id, 6 header words, weights, state and
# the checksum.
VALUE_BYTES = 8 + 4 * (6 + DIM + 2 * DIM) + 4
FLIPS = 128
MAX_DBS = 3072


def build_store(path: Path, ids: np.ndarray) -> None:
    """A store whose rows were written by one commit (durability "none", closed)."""
    with pstore.Store(path, durability="none", num_shards=4, threads=2) as store:
        t = store.create_sparse_table("emb", DIM, optimizer=optim.Adam(lr=0.01), seed=3)
        g = np.random.default_rng(1)
        for _ in range(3):
            t.push(ids, g.standard_normal((len(ids), DIM)).astype(F32))


def expected(path: Path, ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `ids`, and the rows after one more push of `grads` (which reads the rows'
    step and Adam state), from a copy of the store at `path`."""
    work = path.parent / "expected"
    shutil.copytree(path, work)
    try:
        with pstore.Store(work, durability="none") as store:
            t = store.sparse_table("emb")
            before = t.pull(ids)
            t.push(ids, grads)
            return before, t.pull(ids)
    finally:
        shutil.rmtree(work)


def row_offsets(data: bytes, ids: np.ndarray) -> dict[int, list[int]]:
    """Where each id's row value starts in `data`: a value begins with its id (u64 LE), then
    `step` (3 pushes) and a reserved 0 (a `changed/` value holds the id too, after a cycle).
    Besides the live value, LMDB may leave stale copies in a page's free space (a page split
    within the transaction moves nodes without zeroing what they leave); flips there change
    nothing."""
    out = {}
    for i in ids.tolist():
        head = struct.pack("<QII", i, 3, 0)
        out[i] = [m.start() for m in re.finditer(re.escape(head), data)]
        assert out[i], f"row {i} is not in data.mdb"
    return out


def check_outcome(
    work: Path, ids: np.ndarray, grads: np.ndarray, want: tuple[np.ndarray, np.ndarray], hit: int
) -> bool:
    """Opens the damaged copy: either every row is right (before and after a push), or a
    CorruptError names table "emb" and row `hit`. True when it raised."""
    try:
        with pstore.Store(work, durability="none") as store:
            t = store.sparse_table("emb")
            before = t.pull(ids)
            t.push(ids, grads)
            after = t.pull(ids)
    except CorruptError as e:
        msg = str(e)
        assert f"row {hit} " in msg and '"emb"' in msg and "data.mdb" in msg, msg
        return True
    np.testing.assert_array_equal(before, want[0])
    np.testing.assert_array_equal(after, want[1])
    return False


def test_bit_flips_in_rows_of_the_replica_never_give_a_wrong_row(tmp_path):
    rng = np.random.default_rng(20260332)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 48, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    grads = rng.standard_normal((len(ids), DIM)).astype(F32)
    want = expected(path, ids, grads)
    pristine = (path / "data.mdb").read_bytes()
    offsets = row_offsets(pristine, ids)
    raised = 0
    work = tmp_path / "work"
    for k in range(FLIPS):
        hit = int(ids[k % len(ids)])
        bit = int(rng.integers(0, VALUE_BYTES * 8))
        copies = offsets[hit]
        at = copies[int(rng.integers(0, len(copies)))] + bit // 8
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(path, work)
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << (bit % 8)
        (work / "data.mdb").write_bytes(bytes(damaged))
        raised += check_outcome(work, ids, grads, want, hit)
    # Most rows are in the file once: most flips hit a live row and were caught.
    copies = sum(len(c) for c in offsets.values())
    assert raised >= FLIPS * len(ids) / copies / 2, (raised, copies)


def test_bit_flips_in_rows_of_the_replica_never_reach_a_snapshot(tmp_path):
    """A snapshot reads the replica whole, its rows checked a group at a time (storage/
    groupsum.rs): a flipped bit in any row of a group fails the snapshot naming that row, or
    (a stale copy) changes nothing the snapshot holds."""
    rng = np.random.default_rng(20261204)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 40, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    want = expected(path, ids, np.zeros((len(ids), DIM), F32))[0]
    pristine = (path / "data.mdb").read_bytes()
    offsets = row_offsets(pristine, ids)
    work = tmp_path / "work"
    raised = 0
    for k in range(48):
        hit = int(ids[k % len(ids)])
        bit = int(rng.integers(0, VALUE_BYTES * 8))
        at = offsets[hit][0] + bit // 8
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp_path / "snap", ignore_errors=True)
        shutil.copytree(path, work)
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << (bit % 8)
        (work / "data.mdb").write_bytes(bytes(damaged))
        with pstore.Store(work, durability="none") as store:
            try:
                store.snapshot(tmp_path / "snap")
            except CorruptError as e:
                assert f"row {hit} " in str(e) and '"emb"' in str(e), str(e)
                raised += 1
                continue
        restored = pstore.Store.restore(tmp_path / "snap")
        np.testing.assert_array_equal(restored.sparse_table("emb").pull(ids), want)
        restored.close()
    # The first copy of most rows is the live one: most flips were caught.
    assert raised >= 24, raised


def test_a_damaged_row_is_refused_where_it_is_read_and_others_are_served(tmp_path):
    rng = np.random.default_rng(7)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 16, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    data = bytearray((path / "data.mdb").read_bytes())
    bad = int(ids[5])
    for at in row_offsets(bytes(data), ids)[bad]:
        data[at + 40] ^= 0x10  # a weight, in every copy
    (path / "data.mdb").write_bytes(bytes(data))
    others = np.delete(ids, 5)
    with pstore.Store(path, durability="none") as store:
        t = store.sparse_table("emb")
        assert t.pull(others).shape == (len(others), DIM)
        for touch in (
            lambda: t.pull(ids[5:6]),
            lambda: t.push(ids[5:6], np.ones((1, DIM), F32)),
            lambda: t.contains(ids[5:6]),
            lambda: store.snapshot(tmp_path / "snap"),
        ):
            with pytest.raises(CorruptError, match=rf'"emb": row {bad} is damaged'):
                touch()
        # Refused, not loaded: asking again is refused again, and the rest is still served.
        with pytest.raises(CorruptError, match=rf"row {bad} "):
            t.pull(ids[5:6])
        assert t.pull(others).shape == (len(others), DIM)
    assert not (tmp_path / "snap").exists()


def strip_checksums(path: Path, version: int) -> None:
    """Rewrites the store at `path` as format `version` (1 or 2) wrote it: row values without
    their checksum (docs/FORMAT.md), the format record of that version."""
    env = lmdb.open(str(path), max_dbs=MAX_DBS, subdir=True)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            rec = json.loads(txn.get(b"format", db=meta))
            assert rec["version"] == 3
            old = {"format": "pstore-lmdb", "version": version}
            if version == 2:
                old["environments"] = 1
            txn.put(b"format", json.dumps(old).encode(), db=meta)
            names = [k for k, _ in txn.cursor() if k.startswith(b"rows/")]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                for k, v in rows:
                    assert len(v) == VALUE_BYTES
                    txn.put(k, v[:-4], db=db)
    finally:
        env.close()


@pytest.mark.parametrize("version", [1, 2])
def test_a_store_of_an_older_format_opens_and_gets_checksums(tmp_path, version):
    rng = np.random.default_rng(version)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 32, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    grads = rng.standard_normal((len(ids), DIM)).astype(F32)
    want = expected(path, ids, grads)
    strip_checksums(path, version)
    assert inspect_store(path)["version"] == version
    # Opened: the rows are the same (weights, step and state), and now carry checksums.
    work = tmp_path / "work"
    shutil.copytree(path, work)
    assert not check_outcome(work, ids, grads, want, -1)
    with pstore.Store(path, durability="none") as store:
        np.testing.assert_array_equal(store.sparse_table("emb").pull(ids), want[0])
    assert inspect_store(path)["version"] == 3
    data = bytearray((path / "data.mdb").read_bytes())
    for at in row_offsets(bytes(data), ids)[int(ids[0])]:
        data[at + 16] ^= 1  # the version word of the row header, in every copy
    (path / "data.mdb").write_bytes(bytes(data))
    with (
        pstore.Store(path, durability="none") as store,
        pytest.raises(CorruptError, match=rf"row {int(ids[0])} is damaged"),
    ):
        store.sparse_table("emb").pull(ids[:1])


# --- serving artifacts --------------------------------------------------------------------------

ROW_SUM = 4
INDEX = (1 << 40) - 1


def artifact_rows(
    out: Path, newest: bool = False
) -> tuple[Path, dict[int, tuple[int, int, int]], int]:
    """The row file of table "emb" (the only one, or the newest generation's) and, per id, (its
    slot's offset, its row's offset, its checksum's offset); the row's bytes (docs/FORMAT.md,
    "Row files": layout 3 keeps the checksums in an array after the rows)."""
    files = sorted((out / "tables").glob("*.rows"))
    if newest:
        rows_file = files[-1]
    else:
        (rows_file,) = files
    raw = rows_file.read_bytes()
    version, dtype, dim, stride, rows, slots = struct.unpack_from("<IIIIQQ", raw, 8)
    assert (version, dtype, dim) == (3, 0, DIM)
    rows_at = -(-(4096 + 16 * slots) // 4096) * 4096
    sums_at = rows_at + rows * stride
    assert len(raw) == sums_at + ROW_SUM * rows
    where = {}
    for i in range(slots):
        k, word = struct.unpack_from("<QQ", raw, 4096 + 16 * i)
        if word:
            r = (word & INDEX) - 1
            where[k] = (4096 + 16 * i, rows_at + r * stride, sums_at + ROW_SUM * r)
    assert len(where) == rows
    return rows_file, where, 4 * DIM


def test_bit_flips_in_an_artifacts_rows_never_give_a_wrong_row(tmp_path):
    rng = np.random.default_rng(32)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 40, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    with pstore.Store(path, durability="none") as store:
        want = store.sparse_table("emb").pull(ids)
        store.snapshot(tmp_path / "snap")
    out = tmp_path / "model"
    pstore.serving.export(tmp_path / "snap", out)
    rows_file, where, row_bytes = artifact_rows(out)
    pristine = rows_file.read_bytes()
    raised = {"row": 0, "slot": 0}
    for k in range(FLIPS):
        hit = int(ids[k % len(ids)])
        slot_at, row_at, sum_at = where[hit]
        # Three flips in four in the row and its checksum, one in its index slot.
        region = "slot" if k % 4 == 3 else "row"
        n = 16 if region == "slot" else row_bytes + ROW_SUM
        bit = int(rng.integers(0, n * 8))
        if region == "slot":
            at = slot_at + bit // 8
        elif bit // 8 < row_bytes:
            at = row_at + bit // 8
        else:
            at = sum_at + bit // 8 - row_bytes
        work = tmp_path / f"model-{k}"
        shutil.copytree(out, work)
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << (bit % 8)
        (work / rows_file.relative_to(out)).write_bytes(bytes(damaged))
        with pstore.serving.ServingStore(work) as s:
            try:
                got = s.lookup("emb", ids)
            except CorruptError as e:
                msg = str(e)
                assert f"id {hit}" in msg and '"emb"' in msg and ".rows" in msg, msg
                raised[region] += 1
            else:
                np.testing.assert_array_equal(got, want)
        shutil.rmtree(work)
    # Every bit of a row and its checksum is live: each flip there was caught. A flip in a
    # slot is caught or harmless (none is harmless in a slot in use).
    assert raised["row"] == FLIPS * 3 // 4
    assert raised["slot"] == FLIPS // 4


def damage_row(rows_file: Path, at: int) -> None:
    """Flips one bit of the byte at `at` in place (through the page cache a mapping shares)."""
    with open(rows_file, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


def test_serving_rows_are_checked_on_first_read_and_rewritten_rows_again(tmp_path):
    """A lookup verifies a row's checksum the first time this process reads it and remembers
    that (decision 0117): damage on disk before the first read is refused naming table and id;
    rows a snapshot rewrote (a new row file) are checked again on their first read, so damage to
    the new bytes before that read is refused too."""
    rng = np.random.default_rng(117)
    ids = np.unique(rng.integers(1 << 40, 1 << 62, 200, dtype=np.uint64))
    path = tmp_path / "store"
    build_store(path, ids)
    with pstore.Store(path, durability="none") as store:
        store.snapshot(tmp_path / "s0")
        out = tmp_path / "model"
        pstore.serving.export(tmp_path / "s0", out)
        changed = ids[::4]
        store.sparse_table("emb").push(changed, np.ones((len(changed), DIM), F32))
        want = store.sparse_table("emb").pull(ids)
        store.snapshot(tmp_path / "s1", incremental=True)
    rows_file, where, _ = artifact_rows(out)
    # Reads alone check rows here: no background check (decision 0119).
    with pstore.serving.ServingStore(out, writable=True, verify="on-read") as s:
        # One bit per row and one per index slot.
        (slots,) = struct.unpack_from("<Q", rows_file.read_bytes(), 32)
        bitmaps = 8 * (-(-len(ids) // 64) + -(-slots // 64))
        assert s.verified("emb") == {
            "rows_verified": 0,
            "rows": len(ids),
            "bitmap_bytes": bitmaps,
            "scan": "off",
        }
        # Damage before the first read of a row: refused, naming it; its neighbours are served.
        bad = int(ids[7])
        damage_row(rows_file, where[bad][1] + 2)
        with pytest.raises(CorruptError, match=f'"emb".*id {bad}|id {bad}.*"emb"'):
            s.lookup("emb", ids[7:8])
        first = ids[:7]
        s.lookup("emb", first)
        assert s.verified("emb")["rows_verified"] == len(first)
        s.lookup("emb", first)
        assert s.verified("emb")["rows_verified"] == len(first)
        # The refused row stays unverified: every later read refuses it again.
        with pytest.raises(CorruptError, match=f"id {bad}"):
            s.lookup("emb", ids[:10])
        damage_row(rows_file, where[bad][1] + 2)
        s.lookup("emb", ids)
        assert s.verified("emb")["rows_verified"] == len(ids)
        # A snapshot rewrites the table into a new row file: nothing of it is verified yet.
        s.apply(tmp_path / "s1")
        assert s.verified("emb")["rows_verified"] == 0
        new_file, new_where, _ = artifact_rows(out, newest=True)
        assert new_file != rows_file
        hit = int(changed[3])
        damage_row(new_file, new_where[hit][1] + 5)
        with pytest.raises(CorruptError, match=f'"emb".*id {hit}|id {hit}.*"emb"'):
            s.lookup("emb", ids)
        damage_row(new_file, new_where[hit][1] + 5)
        np.testing.assert_array_equal(s.lookup("emb", ids), want)
        assert s.verified("emb")["rows_verified"] == len(ids)


def wait_scan(s: pstore.serving.ServingStore) -> dict:
    """`verified("emb")` once the background check of the row file has ended (polled; the
    deadline only bounds a hang)."""
    deadline = time.monotonic() + 300
    while (v := s.verified("emb"))["scan"] == "running":
        assert time.monotonic() < deadline, v
        time.sleep(0.005)
    return v


def exported(tmp_path: Path, n: int) -> tuple[np.ndarray, np.ndarray, Path]:
    """Ids, their rows and an artifact of them (table "emb"), with an increment snapshot "s1"
    that changes every fourth row."""
    ids = np.unique(np.random.default_rng(119).integers(1 << 40, 1 << 62, n, dtype=np.uint64))
    build_store(tmp_path / "store", ids)
    with pstore.Store(tmp_path / "store", durability="none") as store:
        want = store.sparse_table("emb").pull(ids)
        store.snapshot(tmp_path / "s0")
        pstore.serving.export(tmp_path / "s0", tmp_path / "model")
        store.sparse_table("emb").push(ids[::4], np.ones((len(ids[::4]), DIM), F32))
        store.snapshot(tmp_path / "s1", incremental=True)
    return ids, want, tmp_path / "model"


def test_the_background_check_verifies_a_sound_row_file_whole(tmp_path):
    """Opening an artifact queues its row files for one background check (decision 0119): a
    sound file ends "verified", every row and slot with it, though lookups read one row."""
    ids, want, out = exported(tmp_path, 3000)
    with pstore.serving.ServingStore(out) as s:
        np.testing.assert_array_equal(s.lookup("emb", ids[:1]), want[:1])
        v = wait_scan(s)
        assert v["scan"] == "verified", v
        assert v["rows_verified"] == v["rows"] == len(ids)
        np.testing.assert_array_equal(s.lookup("emb", ids), want)
    # The environment setting turns it off.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSTORE_SERVING_VERIFY", "on-read")
        with pstore.serving.ServingStore(out) as s:
            s.lookup("emb", ids[:5])
            assert s.verified("emb")["scan"] == "off"
            assert s.verified("emb")["rows_verified"] == 5
        mp.setenv("PSTORE_SERVING_VERIFY", "sometimes")
        with pytest.raises(InvalidArgumentError, match="PSTORE_SERVING_VERIFY"):
            pstore.serving.ServingStore(out)
    with pytest.raises(InvalidArgumentError, match="on-read"):
        pstore.serving.ServingStore(out, verify="never")


def test_a_damaged_row_is_refused_before_and_after_the_background_check(tmp_path):
    """Damage found by the background check never lets it mark the file verified: the damaged
    row is refused on every read, before the check and after it, and the others are served."""
    ids, want, out = exported(tmp_path, 3000)
    rows_file, where, _ = artifact_rows(out)
    bad = int(ids[1234])
    damage_row(rows_file, where[bad][1] + 9)
    refused = f'"emb".*id {bad}|id {bad}.*"emb"'
    with pstore.serving.ServingStore(out, verify="on-read") as before:
        with pytest.raises(CorruptError, match=refused):
            before.lookup("emb", ids)
        assert before.verified("emb")["scan"] == "off"
        # A second opening that asks for the check shares the first, and checks its file.
        with pstore.serving.ServingStore(out) as s:
            v = wait_scan(s)
            assert v["scan"] == "damaged", v
            assert v["rows_verified"] == len(ids) - 1
            for _ in range(2):
                with pytest.raises(CorruptError, match=refused):
                    s.lookup("emb", ids[1000:2000])
            others = np.delete(np.arange(len(ids)), 1234)
            np.testing.assert_array_equal(s.lookup("emb", ids[others]), want[others])
            assert wait_scan(s)["scan"] == "damaged"


def test_an_increments_new_row_file_is_checked_anew(tmp_path):
    """A snapshot that changes a table writes a new row file: it starts unverified and gets its
    own check, so damage to it is found although the previous file was verified."""
    ids, _, out = exported(tmp_path, 3000)
    with pstore.Store(tmp_path / "store", durability="none") as store:
        want = store.sparse_table("emb").pull(ids)
    with pstore.serving.ServingStore(out, writable=True) as s:
        s.lookup("emb", ids[:1])
        assert wait_scan(s)["scan"] == "verified"
        s.apply(tmp_path / "s1")
        new_file, new_where, _ = artifact_rows(out, newest=True)
        hit = int(ids[::4][5])
        damage_row(new_file, new_where[hit][1] + 1)
        v = s.verified("emb")
        assert v["scan"] in ("running", "damaged"), v
        with pytest.raises(CorruptError, match=f"id {hit}"):
            s.lookup("emb", ids)
        assert wait_scan(s)["scan"] == "damaged"
        # Undone on disk (the same bytes again): the file's check stays "damaged" (it ran
        # once), and reads verify the row now.
        damage_row(new_file, new_where[hit][1] + 1)
        np.testing.assert_array_equal(s.lookup("emb", ids), want)
        assert s.verified("emb")["rows_verified"] == len(ids)
