"""Hardening (issue 32): no silent corruption, no crash on a damaged file, errors that mean what
they say. Every test drives real components: LMDB on disk (a small tmpfs that fills up, where the
test may mount one), `pstore serve` processes on loopback ports, child processes for files that
could kill the process that maps them."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, free_port, start_servers, stop_all
from hypothesis import given, settings
from hypothesis import strategies as st

import pstore
import pstore.serving
from pstore import init, optim

# --- a small file system that fills up -----------------------------------------------------------


@contextlib.contextmanager
def small_disk(size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` MiB mounted on a new temporary directory, unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system needs root")
    d = Path(tempfile.mkdtemp(prefix="pstore-small-disk-"))
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(d)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        with contextlib.suppress(OSError):
            d.rmdir()


def fill(disk: Path) -> Path:
    """Fills what is left of `disk` with one file; removing it frees the space again."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 64 << 10, 4096, 512):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size) > 0:
                    pass
    finally:
        os.close(fd)
    return filler


DIM = 8
# Enough new rows that the replica must grow: a full disk refuses the commit.
BIG = np.arange(1, 20001, dtype=np.uint64)


def sgd_table(store: Any, name: str = "t") -> Any:
    return store.create_sparse_table(
        name, DIM, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
    )


DENSE = 300_000  # a dense value of 1.2 MB: each push rewrites it


def test_a_sync_push_refused_by_a_full_disk_changes_nothing_and_its_retry_applies_once():
    with small_disk(16) as disk:
        path = disk / "s"
        s = pstore.Store(path, durability="sync")
        t = sgd_table(s)
        d = s.create_dense_table(
            "d", [DENSE], optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
        )
        t.push(np.array([0], np.uint64), np.ones((1, DIM), np.float32))  # -1, committed
        filler = fill(disk)
        g = np.ones((len(BIG), DIM), np.float32)
        with pytest.raises(pstore.StorageError) as e:
            t.push(BIG, g)
        msg = str(e.value)
        assert "not applied" in msg and "not durable yet" not in msg, msg
        # Nothing of it is in memory: not the rows it created, not its updates.
        assert len(t) == 1
        assert np.array_equal(t.pull(BIG[:100]), np.zeros((100, DIM), np.float32))
        assert np.array_equal(t.pull(np.array([0], np.uint64)), -np.ones((1, DIM), np.float32))
        # A dense push refused by the full disk changes nothing either.
        with pytest.raises(pstore.StorageError, match="not applied"):
            d.push(np.ones(DENSE, np.float32))
        assert np.array_equal(d.pull(), np.zeros(DENSE, np.float32))
        filler.unlink()  # space is freed
        t.push(BIG, g)  # the retry the error asked for
        d.push(np.ones(DENSE, np.float32))
        want = -np.ones((len(BIG), DIM), np.float32)
        assert np.array_equal(t.pull(BIG), want)  # -1, not -2
        assert np.array_equal(d.pull(), -np.ones(DENSE, np.float32))
        s.close()
        s = pstore.Store(path)
        assert np.array_equal(s.sparse_table("t").pull(BIG), want)
        assert np.array_equal(s.table("d").pull(), -np.ones(DENSE, np.float32))
        s.close()


def test_a_server_refusing_a_sync_push_for_a_full_disk_applies_its_retry_once():
    with small_disk(16) as disk:
        srv = ServerProcess("--path", str(disk / "s"), "--durability", "sync")
        try:
            c = srv.wait_ready()
            t = sgd_table(c)
            t.push(np.array([0], np.uint64), np.ones((1, DIM), np.float32))
            filler = fill(disk)
            g = np.ones((len(BIG), DIM), np.float32)
            with pytest.raises(pstore.StorageError, match="not applied"):
                t.push(BIG, g)
            assert np.array_equal(t.pull(BIG[:50]), np.zeros((50, DIM), np.float32))
            filler.unlink()
            t.push(BIG, g)  # the same call again (the client keeps a failed push's request id)
            assert np.array_equal(t.pull(BIG), -np.ones((len(BIG), DIM), np.float32))
        finally:
            assert srv.stop() == 0
        srv = ServerProcess("--path", str(disk / "s"), "--durability", "sync", port=srv.port)
        try:
            t = srv.wait_ready().sparse_table("t")
            assert np.array_equal(t.pull(BIG), -np.ones((len(BIG), DIM), np.float32))
        finally:
            assert srv.stop() == 0


# --- a damaged data file: an error, never SIGBUS -------------------------------------------------

OPEN_STORE = textwrap.dedent(
    """
    import sys
    import pstore
    try:
        s = pstore.Store(sys.argv[1])
        t = s.sparse_table("t")
        t.pull(list(range(0, 40000, 7)))
        s.close()
        print("opened")
    except pstore.PstoreError as e:
        print(type(e).__name__, e)
    try:
        pstore.inspection.inspect_store(sys.argv[1])
        print("inspected")
    except pstore.PstoreError as e:
        print(type(e).__name__, e)
    """
)


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("real") / "s"
    with pstore.Store(path) as s:
        t = s.create_sparse_table("t", 16, optimizer=optim.Adagrad(lr=0.1))
        ids = np.arange(0, 40000, dtype=np.uint64)
        t.push(ids, np.ones((len(ids), 16), np.float32))
    return path


def cut_points(size: int) -> list[int]:
    page = 4096
    return sorted(
        {0, 1, 100, page - 1, page, page + 100, 2 * page - 1, 2 * page, 3 * page}
        | {size // 4, size // 2, size - page, size - 1}
    )


def test_every_cut_of_a_data_file_is_refused_with_its_name_never_sigbus(real_store, tmp_path):
    size = (real_store / "data.mdb").stat().st_size
    assert size > 16 * 4096
    for cut in cut_points(size):
        copy = tmp_path / f"cut-{cut}"
        shutil.copytree(real_store, copy)
        os.truncate(copy / "data.mdb", cut)
        r = subprocess.run(
            [sys.executable, "-c", OPEN_STORE, str(copy)],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert r.returncode == 0, (cut, r.returncode, r.stderr[-2000:])
        lines = r.stdout.splitlines()
        assert len(lines) == 2, (cut, r.stdout)
        for line in lines:
            assert line.startswith("CorruptError"), (cut, line)
            assert str(copy / "data.mdb") in line, (cut, line)
        # An empty data file is not a new store: the directory is left as it was.
        if cut == 0:
            assert (copy / "data.mdb").stat().st_size == 0
        cli = subprocess.run(
            [sys.executable, "-m", "pstore", "inspect", str(copy)],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert cli.returncode not in (0, -signal.SIGBUS), (cut, cli.returncode)
        assert "data.mdb" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr


def test_a_server_on_a_cut_data_file_exits_with_the_reason(real_store, tmp_path):
    size = (real_store / "data.mdb").stat().st_size
    for cut in (0, size // 2, size - 1):
        copy = tmp_path / f"cut-{cut}"
        shutil.copytree(real_store, copy)
        os.truncate(copy / "data.mdb", cut)
        log = tmp_path / f"serve-{cut}.log"
        srv = ServerProcess("--path", str(copy), log=log)
        srv.proc.wait(timeout=120)
        code = srv.stop()  # already exited: collects the code, closes the log
        assert code not in (0, -signal.SIGBUS), (cut, code)
        text = log.read_text()
        assert "data.mdb" in text and "damaged" in text, text[-2000:]


def test_a_cut_serving_artifact_is_refused_never_sigbus(real_store, tmp_path):
    with pstore.Store(tmp_path / "s") as s:
        t = s.create_sparse_table("t", 16)
        t.pull(np.arange(5000, dtype=np.uint64))
        s.snapshot(tmp_path / "snap")
    pstore.serving.export(tmp_path / "snap", tmp_path / "art")
    size = (tmp_path / "art" / "data.mdb").stat().st_size
    script = textwrap.dedent(
        """
        import sys
        import pstore
        import pstore.serving
        try:
            a = pstore.serving.ServingStore(sys.argv[1])
            a.lookup("t", [1, 2, 3])
            print("opened")
        except pstore.PstoreError as e:
            print(type(e).__name__, e)
        """
    )
    for cut in (0, 4096, size // 2, size - 1):
        copy = tmp_path / f"art-{cut}"
        shutil.copytree(tmp_path / "art", copy)
        os.truncate(copy / "data.mdb", cut)
        r = subprocess.run(
            [sys.executable, "-c", script, str(copy)],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
        )
        assert r.returncode == 0, (cut, r.returncode, r.stderr[-2000:])
        assert r.stdout.startswith("CorruptError") and str(copy / "data.mdb") in r.stdout, (
            cut,
            r.stdout,
        )


# --- manifests carry their own checksum ----------------------------------------------------------


def leaves(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, (*at, i))
    else:
        yield at, value


def edited(value: Any) -> Any:
    """Another value of the same JSON type (one digit or character changed)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 9 if value else 0.5
    if isinstance(value, str):
        return value[:-1] + ("x" if not value.endswith("x") else "y") if value else "x"
    return 1  # null


def set_at(doc: Any, at: tuple[Any, ...], v: Any) -> None:
    for k in at[:-1]:
        doc = doc[k]
    doc[at[-1]] = v


def edit_in_place(path: Path, at: tuple[Any, ...], old: Any) -> None:
    """Changes one value, leaving every other byte of the file as written (a hand edit)."""
    text = path.read_text()
    doc = json.loads(text)
    set_at(doc, at, edited(old))
    path.write_text(json.dumps(doc, indent=2))


def test_every_edit_of_a_snapshot_manifest_is_refused_naming_the_file(tmp_path):
    s = pstore.Store()
    t = s.create_sparse_table(
        "emb", 4, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(0.0, 0.1), seed=42
    )
    t.push(np.arange(10, dtype=np.uint64), np.ones((10, 4), np.float32))
    s.create_dense_table("d", [3])
    s.snapshot(tmp_path / "snap")
    manifest = tmp_path / "snap" / "manifest.json"
    original = manifest.read_bytes()
    doc = json.loads(original)
    assert doc["version"] == 2 and doc["checksum"].startswith("crc32:")
    fields = [(at, v) for at, v in leaves(doc) if at != ("checksum",)]
    assert any("lr" in at for at, _ in fields) and any("seed" in at for at, _ in fields)
    # Written as the file is, the manifest restores.
    manifest.write_text(json.dumps(doc, indent=2))
    assert pstore.Store.restore(tmp_path / "snap").sparse_table("emb").seed == 42
    for at, v in fields:
        manifest.write_bytes(original)
        edit_in_place(manifest, at, v)
        with pytest.raises(pstore.CorruptError) as e:
            pstore.Store.restore(tmp_path / "snap")
        assert str(manifest) in str(e.value), at
    # One digit, by hand: lr 0.1 -> 0.9.
    text = original.decode()
    assert '"lr": 0.1' in text
    manifest.write_text(text.replace('"lr": 0.1', '"lr": 0.9', 1))
    with pytest.raises(pstore.CorruptError, match="checksum"):
        pstore.Store.restore(tmp_path / "snap")
    # Without its checksum a version 2 manifest is refused; a version 1 one still restores.
    del doc["checksum"]
    manifest.write_text(json.dumps(doc, indent=2))
    with pytest.raises(pstore.CorruptError, match="no checksum"):
        pstore.Store.restore(tmp_path / "snap")
    doc["version"] = 1
    manifest.write_text(json.dumps(doc, indent=2))
    assert pstore.Store.restore(tmp_path / "snap").sparse_table("emb").seed == 42


def test_every_edit_of_cluster_json_is_refused_naming_the_file(tmp_path):
    procs = start_servers(2)
    try:
        c = pstore.connect([p.address for p in procs])
        t = c.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=0.5))
        t.push(np.arange(50, dtype=np.uint64), np.ones((50, 4), np.float32))
        c.snapshot(tmp_path / "snap")
        cj = tmp_path / "snap" / "cluster.json"
        original = cj.read_bytes()
        doc = json.loads(original)
        assert doc["version"] == 3 and doc["checksum"].startswith("crc32:")
        for at, v in leaves(doc):
            if at == ("checksum",):
                continue
            cj.write_bytes(original)
            edit_in_place(cj, at, v)
            with pytest.raises(pstore.CorruptError) as e:
                pstore.restore_cluster(tmp_path / "snap", [p.address for p in procs])
            assert str(cj) in str(e.value), at
        cj.write_bytes(original)
        c.drop_table("emb")
        assert pstore.restore_cluster(tmp_path / "snap", [p.address for p in procs])["tables"] == 1
    finally:
        stop_all(procs)


# --- bad input -----------------------------------------------------------------------------------

OVERFLOWING = [
    init.Constant(1e39),
    init.Constant(-3.5e38),
    init.Normal(1e39, 0.0),
    init.Normal(0.0, 1e39),
    init.Normal(3e38, 1e37),
    init.Uniform(-1e39, 1e39),
    init.Uniform(0.0, 1e39),
    init.TruncatedNormal(0.0, 1e39),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    (srv,) = start_servers(1)
    yield srv
    stop_all([srv])


@pytest.mark.parametrize("ini", OVERFLOWING, ids=repr)
def test_initializers_beyond_float32_are_refused_embedded_and_remote(ini, server):
    for store in (pstore.Store(), pstore.connect([server.address])):
        with pytest.raises(pstore.InvalidArgumentError, match="float32"):
            store.create_sparse_table("t", 4, initializer=ini)
        with pytest.raises(pstore.InvalidArgumentError, match="float32"):
            store.create_dense_table("d", [4], initializer=ini)
        assert "t" not in store.tables() and "d" not in store.tables()


finite_f64 = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["constant", "normal", "uniform", "truncated"]),
    a=finite_f64,
    b=finite_f64,
)
def test_an_accepted_initializer_gives_finite_rows(kind, a, b):
    ini: init.Initializer
    if kind == "constant":
        ini = init.Constant(a)
    elif kind == "uniform":
        ini = init.Uniform(min(a, b), max(a, b))
    elif kind == "normal":
        ini = init.Normal(a, abs(b))
    else:
        ini = init.TruncatedNormal(a, abs(b))
    s = pstore.Store(num_shards=2, threads=1)
    try:
        t = s.create_sparse_table("t", 8, initializer=ini, seed=3)
    except pstore.InvalidArgumentError:
        return
    rows = t.pull(np.arange(64, dtype=np.uint64))
    assert np.isfinite(rows).all(), (ini, rows)


def test_long_table_names_are_bounded_in_errors_embedded_and_remote(server):
    long = "n" * 8192
    for store in (pstore.Store(), pstore.connect([server.address])):
        with pytest.raises(pstore.UnknownTableError) as e:
            store.table(long)
        assert len(str(e.value)) < 600 and "8192 bytes" in str(e.value), str(e.value)[:300]
        with pytest.raises(pstore.InvalidArgumentError) as e2:
            store.create_sparse_table(long, 4)
        assert len(str(e2.value)) < 600 and "255" in str(e2.value)
        # The longest name allowed works.
        name = "m" * 255
        store.create_sparse_table(name, 4)
        assert store.table(name).name == name
        store.drop_table(name)


def test_lr_must_be_a_number(sgd_table):
    for bad in ("0.1", b"0.1", None, True, [0.1]):
        with pytest.raises(pstore.DtypeError, match="lr must be a number"):
            sgd_table.lr = bad
        with pytest.raises(pstore.DtypeError):
            sgd_table.set_lr(bad)
    assert sgd_table.lr == 1.0
    sgd_table.lr = np.float32(0.5)
    sgd_table.lr = 2
    assert sgd_table.lr == 2.0


def test_an_empty_push_is_not_a_push(server, tmp_path):
    stores = [pstore.Store(), pstore.Store(tmp_path / "d", durability="sync")]
    stores.append(pstore.connect([server.address]))
    for i, store in enumerate(stores):
        t = store.create_sparse_table(f"e{i}", 4)
        before = t.stats()
        t.push(np.array([], np.uint64), np.zeros((0, 4), np.float32))
        t.push_async(np.array([], np.uint64), np.zeros((0, 4), np.float32)).wait()
        after = t.stats()
        assert (after["pushes"], after["seq"]) == (before["pushes"], before["seq"]), i
        t.push(np.array([1], np.uint64), np.ones((1, 4), np.float32))
        assert t.stats()["pushes"] == before["pushes"] + 1
        store.drop_table(f"e{i}")
    stores[1].close()


def overflow_push(t: Any) -> None:
    # Finite gradients, a finite learning rate: w = 0 - 1e38 * 1e38 overflows to -inf.
    t.push(np.array([5], np.uint64), np.full((1, 4), 1e38, np.float32))


def test_weights_driven_to_inf_are_counted_or_refused(server):
    mport = free_port()
    metrics_srv = ServerProcess("--metrics-port", str(mport))
    try:
        stores = [pstore.Store(), pstore.connect([server.address]), metrics_srv.wait_ready()]
        for i, store in enumerate(stores):
            lax = store.create_sparse_table(
                f"lax{i}", 4, optimizer=optim.SGD(lr=1e38), initializer=init.Zeros()
            )
            overflow_push(lax)
            assert np.isinf(lax.pull(np.array([5], np.uint64))).all()
            assert lax.stats()["rows_nonfinite"] == 1
            strict = store.create_sparse_table(
                f"strict{i}",
                4,
                optimizer=optim.SGD(lr=1e38),
                initializer=init.Zeros(),
                refuse_nonfinite=True,
            )
            strict.push(np.array([5, 6], np.uint64), np.full((2, 4), 0.5, np.float32))
            before = strict.pull(np.array([5, 6], np.uint64))
            with pytest.raises(pstore.NonFiniteError, match="nothing was applied"):
                strict.push(np.array([6, 5], np.uint64), np.full((2, 4), 1e38, np.float32))
            assert np.array_equal(strict.pull(np.array([5, 6], np.uint64)), before)
            st_ = strict.stats()
            assert st_["pushes"] == 1 and st_["rows_nonfinite"] == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'pstore_table_rows_nonfinite_total{table="lax2",kind="sparse"} 1' in text
        assert 'pstore_table_rows_nonfinite_total{table="strict2",kind="sparse"} 2' in text
    finally:
        assert metrics_srv.stop() == 0


def test_a_refusing_table_keeps_its_setting_through_a_reopen_and_a_snapshot(tmp_path):
    with pstore.Store(tmp_path / "s") as s:
        s.create_sparse_table("t", 4, optimizer=optim.SGD(lr=1e38), refuse_nonfinite=True)
        s.snapshot(tmp_path / "snap")
    for s in (pstore.Store(tmp_path / "s"), pstore.Store.restore(tmp_path / "snap")):
        t = s.sparse_table("t")
        with pytest.raises(pstore.NonFiniteError):
            overflow_push(t)
        assert math.isfinite(float(t.pull(np.array([5], np.uint64))[0, 0]))
        s.close()


def test_a_bulk_load_refused_by_a_full_disk_is_undone_and_its_retry_loads_it(tmp_path):
    (src,) = start_servers(1)
    try:
        c = pstore.connect([src.address])
        t = sgd_table(c)
        t.push(BIG, np.ones((len(BIG), DIM), np.float32))
        c.snapshot(tmp_path / "snap")
    finally:
        stop_all([src])
    with small_disk(16) as disk:
        dst = ServerProcess("--path", str(disk / "s"), "--durability", "sync")
        try:
            d = dst.wait_ready()
            sgd_table(d)  # the restore loads into it (creating a table needs space too)
            filler = fill(disk)
            # Both ways of loading: the client's BulkLoad and the server's own LoadSnapshot.
            for via in ("client", "servers"):
                with pytest.raises(pstore.StorageError, match="load was not applied"):
                    pstore.restore_cluster(tmp_path / "snap", [dst.address], via=via)
                assert len(d.sparse_table("t")) == 0, via
            filler.unlink()
            assert pstore.restore_cluster(tmp_path / "snap", [dst.address])["tables"] == 1
            assert np.array_equal(
                d.sparse_table("t").pull(BIG), -np.ones((len(BIG), DIM), np.float32)
            )
        finally:
            assert dst.stop() == 0
