"""The demo (`pstore demo`), its data loaders and the progress bar."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pstore import _progress
from pstore.apps import datasets, demo

INTER = (
    "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    "196\t242\t3\t881250949\n"
    "186\t302\t3\t891717742\n"
    "22\t377\t1\t878887116\n"
    "196\t51\t2\t880606923\n"
    "\n"
    "186\t242\t5\t886397596\n"
)
_FIND_SPEC = importlib.util.find_spec


def _write_wheel(path: Path, text: str = INTER) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("recbole/__init__.py", "")
        zf.writestr(datasets.ML100K_MEMBER, text)
    return path


@pytest.fixture
def no_ml100k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No MovieLens-100k anywhere: no env var, no recbole, an empty cache directory."""
    monkeypatch.delenv(datasets.ML100K_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    return tmp_path / "cache" / "pstore"


def _check_small(r: datasets.Ratings) -> None:
    assert r.name == "ml-100k"
    assert (r.n_users, r.n_items, len(r)) == (3, 4, 5)
    # Tokens are mapped to dense ids in numeric order: users 22, 186, 196; items 51, 242, 302, 377.
    np.testing.assert_array_equal(r.users, [2, 1, 0, 2, 1])
    np.testing.assert_array_equal(r.items, [1, 2, 3, 0, 1])
    np.testing.assert_array_equal(r.ratings, np.array([3, 3, 1, 2, 5], dtype=np.float32))
    assert r.users.dtype == np.int64
    assert r.items.dtype == np.int64
    assert r.ratings.dtype == np.float32


# --- data loaders ---------------------------------------------------------------------------------


def test_parse_inter_reorders_columns_and_keeps_string_tokens() -> None:
    text = "rating:float\titem_id:token\tuser_id:token\n4\tb\tx\n2\ta\ty\n5\ta\tx\n"
    r = datasets.parse_inter(text)
    np.testing.assert_array_equal(r.users, [0, 1, 0])
    np.testing.assert_array_equal(r.items, [1, 0, 0])
    np.testing.assert_array_equal(r.ratings, [4, 2, 5])


@pytest.mark.parametrize(
    "text",
    ["", "user_id:token\titem_id:token\n1\t2\n", "user_id\titem_id\trating\n1\t2\n"],
)
def test_parse_inter_rejects_bad_files(text: str) -> None:
    with pytest.raises(ValueError):
        datasets.parse_inter(text)


def test_load_ml100k_from_inter_file_wheel_and_directories(tmp_path: Path) -> None:
    inter = tmp_path / "plain" / "ml-100k.inter"
    inter.parent.mkdir()
    inter.write_text(INTER)
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    wheel = _write_wheel(wheel_dir / "recbole-1.2.1-py3-none-any.whl")

    for place in (inter, inter.parent, wheel, wheel_dir):
        r = datasets.load_ml100k(place)
        _check_small(r)
    assert datasets.load_ml100k(wheel).source.endswith("!" + datasets.ML100K_MEMBER)


def test_find_ml100k_rejects_a_place_without_data(tmp_path: Path) -> None:
    not_a_wheel = tmp_path / "recbole-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(not_a_wheel, "w") as zf:
        zf.writestr("recbole/__init__.py", "")
    for place in (tmp_path / "missing.inter", tmp_path, not_a_wheel):
        with pytest.raises(FileNotFoundError):
            datasets.find_ml100k(place)


def test_find_ml100k_search_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ml100k: Path
) -> None:
    assert datasets.find_ml100k() is None

    # The cache directory: a recbole wheel, read without extraction.
    no_ml100k.mkdir(parents=True)
    cached = _write_wheel(no_ml100k / "recbole-1.2.1-py3-none-any.whl")
    assert datasets.find_ml100k() == cached

    # An installed recbole package wins over the cache; it is located, not imported.
    site = tmp_path / "site"
    package_inter = site / "recbole" / "dataset_example" / "ml-100k" / "ml-100k.inter"
    package_inter.parent.mkdir(parents=True)
    (site / "recbole" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    package_inter.write_text(INTER)
    monkeypatch.setattr(datasets.importlib.util, "find_spec", _FIND_SPEC)
    monkeypatch.syspath_prepend(str(site))
    assert datasets.find_ml100k() == package_inter

    # The environment variable wins over both, and an explicit path over everything.
    env_inter = tmp_path / "env.inter"
    env_inter.write_text(INTER)
    monkeypatch.setenv(datasets.ML100K_ENV, str(env_inter))
    assert datasets.find_ml100k() == env_inter
    assert datasets.find_ml100k(cached) == cached
    _check_small(datasets.load_ratings())


def test_fetch_runs_pip_download_into_the_cache(
    monkeypatch: pytest.MonkeyPatch, no_ml100k: Path
) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        _write_wheel(Path(cmd[cmd.index("-d") + 1]) / "recbole-1.2.1-py3-none-any.whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(datasets.subprocess, "run", fake_run)
    assert datasets.load_ratings().name == "synthetic"
    assert calls == []
    said: list[str] = []
    _check_small(datasets.load_ratings(fetch=True, log=said.append))
    assert len(said) == 1
    assert str(no_ml100k) in said[0]
    assert calls[0][1:] == ["-m", "pip", "download", "--no-deps", "recbole", "-d", str(no_ml100k)]
    # The next run finds the cached wheel without fetching.
    _check_small(datasets.load_ratings())
    assert len(calls) == 1


def test_synthetic_ratings_look_like_ml100k() -> None:
    r = datasets.synthetic_ratings(seed=3)
    assert (r.n_users, r.n_items, len(r)) == (943, 1682, 100_000)
    assert r.name == "synthetic"
    assert set(np.unique(r.ratings).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert len(np.unique(r.users * r.n_items + r.items)) == len(r)
    assert 0.9 < r.ratings.std() < 1.3
    again = datasets.synthetic_ratings(seed=3)
    np.testing.assert_array_equal(r.ratings, again.ratings)
    np.testing.assert_array_equal(r.users, again.users)
    assert datasets.load_ratings("synthetic", seed=3).source == r.source


def test_train_test_split_is_a_seeded_partition() -> None:
    r = datasets.synthetic_ratings(n_users=50, n_items=60, n_ratings=1000, seed=1)
    train, test = datasets.train_test_split(r, 0.1, seed=7)
    assert (len(train), len(test)) == (900, 100)
    pairs = np.concatenate([train.users * 60 + train.items, test.users * 60 + test.items])
    np.testing.assert_array_equal(np.sort(pairs), np.sort(r.users * 60 + r.items))
    np.testing.assert_array_equal(datasets.train_test_split(r, 0.1, seed=7)[1].items, test.items)


# --- the demo -------------------------------------------------------------------------------------


def test_run_demo_on_synthetic_data_beats_the_baseline() -> None:
    out = io.StringIO()
    m = demo.run_demo(data="synthetic", epochs=4, dim=16, seed=0, out=out, progress=False)
    assert m["dataset"] == "synthetic"
    assert (m["n_train"], m["n_test"]) == (90_000, 10_000)
    assert 1.05 < m["baseline_rmse"] < 1.2
    assert m["test_rmse"] < m["baseline_rmse"] - 0.12
    assert m["train_rmse"] < m["test_rmse"]
    assert [h["epoch"] for h in m["history"]] == [1, 2, 3, 4]
    assert m["history"][-1]["test_rmse"] < m["history"][0]["test_rmse"]
    assert m["rows"]["user_emb"] == m["rows"]["user_bias"] == 943
    text = out.getvalue()
    assert "synthetic" in text
    assert f"test RMSE {m['baseline_rmse']:.4f}" in text
    assert text.count("train RMSE") == 4
    json.dumps(m)


def test_run_demo_serves_from_an_artifact_and_exports_onnx(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from pstore import serving

    out = io.StringIO()
    m = demo.run_demo(
        data="synthetic",
        epochs=1,
        dim=8,
        seed=3,
        out=out,
        progress=False,
        model_dir=str(tmp_path / "run"),
        onnx=str(tmp_path / "mf.onnx"),
    )
    # The artifact's predictions are the trained store's, and ONNX's are within float rounding.
    assert m["serving_max_diff"] == 0.0
    assert m["onnx_max_diff"] < 1e-5
    art = serving.ServingStore(m["artifact"])
    assert set(art.tables()) == {"user_emb", "item_emb", "user_bias", "item_bias", "global_mean"}
    assert float(art.dense("global_mean")[0]) == pytest.approx(m["global_mean"], rel=1e-6)
    ratings = datasets.load_ratings("synthetic", seed=3)
    train, _ = datasets.train_test_split(ratings, 0.1, seed=3)
    assert len(m["recommendations"]) == 3
    for user, recs in m["recommendations"].items():
        items = [i for i, _ in recs]
        assert len(items) == 5 and len(set(items)) == 5
        assert not set(items) & set(train.items[train.users == user].tolist())
        scores = [r for _, r in recs]
        assert scores == sorted(scores, reverse=True)
    text = out.getvalue()
    assert "top 5 for user" in text and "onnxruntime" in text
    json.dumps(m)


def test_run_demo_with_adam_on_a_small_inter_file(tmp_path: Path) -> None:
    r = datasets.synthetic_ratings(n_users=100, n_items=150, n_ratings=4000, seed=2)
    lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    lines += [
        f"{u + 1}\t{i + 1}\t{x:g}\t0" for u, i, x in zip(r.users, r.items, r.ratings, strict=True)
    ]
    path = tmp_path / "ml-100k.inter"
    path.write_text("\n".join(lines))
    m = demo.run_demo(
        data=str(path), epochs=3, dim=8, optimizer="adam", out=io.StringIO(), progress=False
    )
    assert m["dataset"] == "ml-100k"
    assert m["optimizer"] == "adam"
    assert m["lr"] == demo.DEFAULT_LR["adam"]
    assert np.isfinite(m["test_rmse"])


def test_run_demo_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        demo.run_demo(data="synthetic", epochs=0, out=io.StringIO())
    with pytest.raises(ValueError):
        demo.run_demo(data="synthetic", optimizer="sgd", out=io.StringIO())


def test_cli_flags_parse() -> None:
    parser = argparse.ArgumentParser(prog="pstore")
    sub = parser.add_subparsers(dest="command")
    demo.add_arguments(sub.add_parser("demo"))

    ns = parser.parse_args(["demo"])
    assert ns.data is None
    assert not ns.fetch
    assert (ns.epochs, ns.dim, ns.seed) == (demo.DEFAULT_EPOCHS, demo.DEFAULT_DIM, 0)
    assert (ns.optimizer, ns.lr, ns.l2) == (demo.DEFAULT_OPTIMIZER, None, demo.DEFAULT_L2)
    assert not ns.no_progress
    assert not ns.json

    argv = "demo --data d.whl --fetch --epochs 3 --dim 8 --seed 5 --batch-size 64"
    argv += " --optimizer adam --lr 0.01 --l2 0.1 --threads 2 --no-progress --json"
    ns = parser.parse_args(argv.split())
    assert (ns.data, ns.fetch, ns.epochs, ns.dim, ns.seed) == ("d.whl", True, 3, 8, 5)
    assert (ns.batch_size, ns.optimizer, ns.lr, ns.l2) == (64, "adam", 0.01, 0.1)
    assert (ns.threads, ns.no_progress, ns.json) == (2, True, True)

    for bad in (["demo", "--epochs", "0"], ["demo", "--optimizer", "sgd"], ["demo", "--dim", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_main_runs_from_argv_and_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--data", "synthetic", "--epochs", "1", "--dim", "4", "--no-progress", "--json"]
    assert demo.main(argv) == 0
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["dataset"] == "synthetic"
    assert last["test_rmse"] < last["baseline_rmse"]
    assert captured.err == ""


def test_main_reports_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--data", str(tmp_path / "nowhere.inter"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "nowhere.inter" in captured.err
    assert captured.out == ""


# --- the progress bar -----------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_one_plain_line_when_not_a_tty() -> None:
    stream = io.StringIO()
    out = io.StringIO()
    with _progress.Progress(total=5, desc="work", unit="steps", stream=stream) as bar:
        for _ in range(5):
            bar.update(postfix="ok")
        bar.write("a message", file=out)
    assert out.getvalue() == "a message\n"
    text = stream.getvalue()
    assert "\r" not in text
    assert text.count("\n") == 1
    assert text.startswith("work: 5/5 steps in ")
    assert text.rstrip().endswith(", ok")


def test_progress_animates_on_a_tty() -> None:
    stream = _Tty()
    bar = _progress.Progress(total=4, desc="work", stream=stream, min_interval=0.0)
    bar.update(2)
    assert "\r" in stream.getvalue()
    assert " 50% [" in stream.getvalue()
    bar.write("between")
    bar.update(2)
    bar.close()
    bar.close()
    text = stream.getvalue()
    assert "between\n" in text
    assert "100% [" + "#" * 30 + "] 4/4" in text
    assert text.endswith("\n")
    assert text.count("\n") == 2


def test_progress_disabled_writes_nothing() -> None:
    stream = _Tty()
    with _progress.Progress(total=3, stream=stream, disable=True) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.5, "0.50 s"), (12.34, "12.3 s"), (187, "3:07"), (3723, "1:02:03")]
)
def test_format_seconds(seconds: float, text: str) -> None:
    assert _progress.format_seconds(seconds) == text
