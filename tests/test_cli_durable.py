"""`pstore snapshot`, `pstore restore` and `pstore inspect` on real stores and snapshots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _netutil import child_env

import pstore
from pstore import cli, optim


def make_store(path: Path, rows: int = 5000) -> np.ndarray:
    with pstore.Store(path, durability="none", num_shards=4) as store:
        t = store.create_sparse_table("emb", 8, optimizer=optim.Adagrad(lr=0.1), seed=3)
        ids = np.arange(rows, dtype=np.uint64)
        t.push(ids, np.ones((rows, 8), np.float32))
        store.create_dense_table("bias", (3,))
        return t.pull(ids)


def test_snapshot_inspect_restore_round_trip(tmp_path, capsys):
    store = tmp_path / "store"
    want = make_store(store)
    assert cli.main(["snapshot", str(store), str(tmp_path / "full"), "-q"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("full snapshot") and "2 tables, 5001 rows" in out

    # Change the store, then an increment.
    with pstore.Store(store, durability="none") as s:
        s.sparse_table("emb").remove(np.arange(10, dtype=np.uint64))
    assert cli.main(["snapshot", str(store), str(tmp_path / "inc"), "--incremental", "-q"]) == 0
    assert "incremental snapshot" in capsys.readouterr().out

    assert cli.main(["inspect", str(tmp_path / "inc"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "a chain of 2 (base first)" in out
    assert "10 tombstones" in out and "4990 rows" in out
    assert "verified" in out

    assert cli.main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert "format pstore-lmdb version 3, 1 LMDB environment," in out
    assert "emb" in out and "4990 rows" in out and "adagrad" in out

    assert cli.main(["inspect", str(tmp_path / "inc"), "--json"]) == 0
    chain = json.loads(capsys.readouterr().out)["chain"]
    assert [m["kind"] for m in chain] == ["full", "incremental"]

    target = tmp_path / "restored"
    assert cli.main(["restore", str(tmp_path / "inc"), str(target), "--num-shards", "3", "-q"]) == 0
    assert "restored 2 snapshot(s)" in capsys.readouterr().out
    with pstore.Store(target) as r:
        t = r.sparse_table("emb")
        assert len(t) == 4990
        np.testing.assert_array_equal(t.pull(np.arange(10, 5000, dtype=np.uint64)), want[10:])
        assert not t.contains(np.arange(10, dtype=np.uint64)).any()

    # Into a store of two LMDB environments: inspect counts the rows of both.
    split = tmp_path / "split"
    argv = ["restore", str(tmp_path / "inc"), str(split), "--environments", "2", "-q"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert (split / "env-1" / "data.mdb").is_file()
    assert cli.main(["inspect", str(split)]) == 0
    out = capsys.readouterr().out
    assert "format pstore-lmdb version 3, 2 LMDB environments," in out
    assert "4990 rows" in out
    with pstore.Store(split) as r:
        assert r.storage_info()["environments"] == 2
        t = r.sparse_table("emb")
        np.testing.assert_array_equal(t.pull(np.arange(10, 5000, dtype=np.uint64)), want[10:])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{tmp}/nowhere"], "no such file or directory"),
        (["inspect", "{tmp}"], "neither a pstore store"),
        (["snapshot", "{tmp}/nowhere", "{tmp}/out"], "no such directory"),
        (["snapshot", "{tmp}", "{tmp}/out"], "not a pstore store"),
        (["restore", "{tmp}", "{tmp}/out"], "not a snapshot"),
    ],
)
def test_bad_paths_give_clear_errors(tmp_path, capsys, argv, message):
    args = [a.format(tmp=tmp_path) for a in argv]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstore: error:") and message in err, err


def test_restore_refuses_an_existing_store_and_snapshot_an_existing_dir(tmp_path, capsys):
    store = tmp_path / "store"
    make_store(store, rows=10)
    assert cli.main(["snapshot", str(store), str(tmp_path / "s"), "-q"]) == 0
    assert cli.main(["snapshot", str(store), str(tmp_path / "s"), "-q"]) == 2
    assert "exists" in capsys.readouterr().err
    assert cli.main(["restore", str(tmp_path / "s"), str(store), "-q"]) == 2
    assert "holds a store already" in capsys.readouterr().err


def test_the_installed_command_shows_progress_and_results(tmp_path):
    store = tmp_path / "store"
    make_store(store, rows=50_000)
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-m", "pstore", "snapshot", str(store), str(tmp_path / "snap")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "50001 rows" in done.stdout
    # Not a terminal: the bar stays silent until its one summary line.
    assert "snapshot:" in done.stderr and "row" in done.stderr


def test_the_inspection_functions_behind_the_command(tmp_path):
    store = tmp_path / "store"
    make_store(store, rows=100)
    with pstore.Store(store, durability="none") as s:
        m = s.snapshot(tmp_path / "full")
    info = pstore.inspection.inspect_store(store)
    assert info["format"] == "pstore-lmdb" and info["version"] == 3
    assert info["environments"] == 1
    assert info["snapshot"]["id"] == m["id"]
    (emb,) = [t for t in info["tables"] if t["name"] == "emb"]
    assert emb["rows"] == 100 and emb["record"]["config"]["dim"] == 8
    assert emb["changed_since_snapshot"] == 0
    chain = pstore.inspection.snapshot_chain(tmp_path / "full")
    assert [c["id"] for _, c in chain] == [m["id"]]
    assert pstore.inspection.verify_snapshot(tmp_path / "full") == m["bytes"] - len(
        (tmp_path / "full" / "manifest.json").read_bytes()
    )
    with pytest.raises(pstore.InvalidArgumentError, match="no store"):
        pstore.inspection.inspect_store(tmp_path)
