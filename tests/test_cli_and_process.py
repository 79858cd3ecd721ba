"""The command line entry point and the store's behaviour across fork()."""

import multiprocessing as mp
import subprocess
import sys

import numpy as np
import pytest

import pstore
from pstore import cli


def test_version_command_prints_versions(capsys):
    assert cli.main(["version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pstore {pstore.__version__}")
    assert "numpy" in out


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "pstore", "version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pstore ")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _use_inherited_store(store, queue):
    try:
        store.table("t").pull(np.array([1], dtype=np.uint64))
        queue.put("no error")
    except pstore.PstoreError as e:
        queue.put(f"{type(e).__name__}: {e}")


@pytest.mark.skipif(
    "fork" not in mp.get_all_start_methods(), reason="fork() is not available on this platform"
)
# Python >= 3.12 warns on fork() with threads running: that hazard is what this test is about.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_gets_a_clear_error_not_a_hang():
    store = pstore.Store(num_shards=2, threads=2)
    store.create_sparse_table("t", 2).pull(np.arange(10, dtype=np.uint64))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_use_inherited_store, args=(store, queue))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    message = queue.get(timeout=10)
    assert "InvalidArgumentError" in message
    assert "fork" in message
    # The parent's store is unaffected.
    assert len(store.table("t")) == 10
