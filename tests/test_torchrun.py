"""Workers started by a launcher: ``pstore.connect`` takes the rank, the number of workers and
the job from torchrun's environment (RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID) or a Kubernetes
indexed Job's (JOB_COMPLETION_INDEX, WORLD_SIZE, PSTORE_JOB).

The end-to-end tests run ``examples/bsp_train.py`` (no rank or world arguments) under
``python -m torch.distributed.run --standalone`` and as plain processes, against two real
``pstore serve`` processes on 127.0.0.1 with a token. The example's model has a known gradient,
so every loss and every trained row is checked exactly against a closed form computed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _netutil import (
    CAN_UNSHARE_NET,
    UNSHARE_REASON,
    ServerProcess,
    child_env,
    run_in_loopback_namespace,
    stop_all,
)

import pstore

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "bsp_train.py"
TOKEN = "torchrun-test-token"
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "JOB_COMPLETION_INDEX",
    "PSTORE_JOB",
    "PSTORE_TOKEN",
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# The example's model (examples/bsp_train.py): SGD with this rate, rows starting at 0, the
# fixed map W, ids 0..7 shared by every worker and 8 of each worker's own.
LR = 0.5
W = np.array([1.0, 0.5, 0.25, 2.0], np.float32)
SHARED = np.arange(8)


def own(rank: int) -> np.ndarray:
    return 1000 * (rank + 1) + np.arange(8)


def scale(rank: int, world: int, steps: int) -> tuple[float, float]:
    """How far (in units of -LR * W) a shared row and worker ``rank``'s own row have moved after
    ``steps`` BSP steps: every step applies the sum of the workers' gradients, (r + 1) * W each."""
    return steps * world * (world + 1) / 2, steps * (rank + 1)


def loss(rank: int, world: int, step: int) -> float:
    shared, mine = scale(rank, world, step)
    w2 = float(np.dot(W, W))
    return (rank + 1) * -LR * w2 * (len(SHARED) * shared + 8 * mine)


@contextlib.contextmanager
def two_servers(tmp_path: Path) -> Iterator[Path]:
    """Two servers with a token, and a cluster file naming them and the token file."""
    procs = [ServerProcess(env={"PSTORE_TOKEN": TOKEN}) for _ in range(2)]
    try:
        for p in procs:
            p.wait_ready(TOKEN)
        (tmp_path / "token").write_text(TOKEN)
        path = tmp_path / "cluster.json"
        path.write_text(json.dumps({"servers": [p.address for p in procs], "token_file": "token"}))
        yield path
    finally:
        stop_all(procs)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Path]:
    with two_servers(tmp_path) as path:
        yield path


def env(**launcher: str) -> dict[str, str]:
    """The environment of a worker: this one without any launcher's variables, plus these."""
    out = {k: v for k, v in child_env().items() if k not in LAUNCHER_VARS}
    out.update(launcher)
    return out


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_workers(cluster: Path, steps: int, envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The example as plain processes, one per environment, all at once."""
    argv = [sys.executable, "-P", str(EXAMPLE), "--cluster", str(cluster), "--steps", str(steps)]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
        for e in envs
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr
        out += records(stdout)
    return out


def check_run(cluster: Path, out: list[dict[str, Any]], world: int, steps: int) -> dict[str, Any]:
    """Every worker printed steps 0..steps-1 with the closed-form loss, ended at clock
    ``steps`` in one job without torch.distributed, and the servers hold the closed-form rows.
    Returns the last record of worker 0."""
    ends = {r["rank"]: r for r in out if "clock" in r}
    assert sorted(ends) == list(range(world))
    assert {(r["job"], r["world"], r["clock"], r["distributed"]) for r in ends.values()} == {
        (ends[0]["job"], world, steps, False)
    }
    for rank in range(world):
        seen = [(r["step"], r["loss"]) for r in out if r["rank"] == rank and "step" in r]
        assert seen == [(s, loss(rank, world, s)) for s in range(steps)], rank
    store = pstore.connect(str(cluster), retries=0)
    table = store.table(ends[0]["table"])
    assert isinstance(table, pstore.SparseTable)
    for rank in range(world):
        shared, mine = scale(rank, world, steps)
        rows = table.pull(np.concatenate([SHARED, own(rank)]).astype(np.int64))
        np.testing.assert_array_equal(rows[:8], np.tile(-LR * shared * W, (8, 1)))
        np.testing.assert_array_equal(rows[8:], np.tile(-LR * mine * W, (8, 1)))
    store.close()
    return ends[0]


def run_torchrun_here(tmp: str) -> None:
    """The torchrun launch, its checks and the servers, in this process's network namespace
    (see the test below); prints "torchrun ok" when every check passed."""
    with two_servers(Path(tmp)) as cluster:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            str(EXAMPLE),
            "--cluster",
            str(cluster),
            "--steps",
            "4",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=300)
        assert done.returncode == 0, done.stderr
        end = check_run(cluster, records(done.stdout), world=2, steps=4)
        # Worker 0 made the job; the others found it on the coordinator.
        assert re.fullmatch(r"[0-9a-f]{16}", end["job"]), end["job"]
    print("torchrun ok")


@pytest.mark.skipif(not CAN_UNSHARE_NET, reason=UNSHARE_REASON)
def test_torchrun_workers_train_in_bsp_without_rank_arguments(tmp_path: Path) -> None:
    """torchrun itself, in a network namespace that has only loopback: torch's rendezvous asks
    the system resolver for names of 127.0.0.1, and no such query may leave this machine. There
    it fails at once (no route), the servers and the workers talk over that namespace's own
    loopback, and the namespace goes away with the processes."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
        f"import test_torchrun as t; t.run_torchrun_here({str(tmp_path)!r})"
    )
    done = run_in_loopback_namespace([sys.executable, "-c", code], env=child_env(), timeout=400)
    assert done.returncode == 0 and "torchrun ok" in done.stdout, done.stdout + done.stderr


def test_a_restarted_group_is_a_new_job(cluster: Path) -> None:
    """RANK and WORLD_SIZE as torchrun sets them, twice with the same run id (a restart of the
    group): each launch is a job of its own, which starts at clock 0 with fresh leases
    (docs/decisions/0097)."""
    runs = []
    for restart in ("0", "1"):
        envs = [
            env(
                RANK=str(r),
                WORLD_SIZE="2",
                TORCHELASTIC_RUN_ID="run-7",
                TORCHELASTIC_RESTART_COUNT=restart,
            )
            for r in (1, 0)
        ]
        runs.append(check_run(cluster, run_workers(cluster, 2, envs), world=2, steps=2))
    jobs = [r["job"] for r in runs]
    assert jobs[0] != jobs[1] and all(re.fullmatch(r"[0-9a-f]{16}", j) for j in jobs), jobs


def test_an_indexed_job_gives_the_rank_and_the_job(cluster: Path) -> None:
    """What the Kubernetes manifest's pods get: JOB_COMPLETION_INDEX, WORLD_SIZE from the
    manifest, and PSTORE_JOB (the Job's uid)."""
    envs = [env(JOB_COMPLETION_INDEX=str(r), WORLD_SIZE="3", PSTORE_JOB="uid-1") for r in range(3)]
    end = check_run(cluster, run_workers(cluster, 2, envs), world=3, steps=2)
    assert end["job"] == "uid-1"


# ---------------------------------------------------------------------------------------------
# The environment checked before anything is sent


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# An address nothing listens on: each of these fails before the client connects.
NOWHERE = ["127.0.0.1:9"]


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' in the environment is not an integer"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' in the environment is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' in the environment is not an"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 in the environment is not below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment"),
        ({"RANK": "0"}, "RANK is set in the environment but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "needs worker and num_workers (or RANK"),
        (
            {"JOB_COMPLETION_INDEX": "x1", "WORLD_SIZE": "2"},
            "JOB_COMPLETION_INDEX='x1' in the environment",
        ),
        (
            {"JOB_COMPLETION_INDEX": "4", "WORLD_SIZE": "4", "RANK": "4"},
            "RANK=4 in the environment is not below WORLD_SIZE=4",
        ),
    ],
)
def test_a_bad_launcher_environment_is_named(
    clean_env: pytest.MonkeyPatch, variables: dict[str, str], message: str
) -> None:
    for k, v in variables.items():
        clean_env.setenv(k, v)
    for mode in ("bsp", "ssp"):
        with pytest.raises(pstore.InvalidArgumentError) as e:
            pstore.connect(NOWHERE, mode=mode, retries=0)
        assert message in str(e.value)


def test_arguments_win_over_the_environment_and_are_checked_against_it(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("RANK", "not a rank")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(pstore.InvalidArgumentError, match=r"worker=3 is not below WORLD_SIZE=2"):
        pstore.connect(NOWHERE, mode="bsp", worker=3, retries=0)
    clean_env.setenv("RANK", "3")
    with pytest.raises(pstore.InvalidArgumentError, match=r"RANK=3 .* not below num_workers=2"):
        pstore.connect(NOWHERE, mode="bsp", num_workers=2, retries=0)


def test_async_mode_leaves_the_launcher_environment_alone(
    cluster: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("RANK", "not a rank")
    clean_env.setenv("WORLD_SIZE", "2")
    store = pstore.connect(str(cluster), retries=0)
    assert (store.mode, store.worker, store.num_workers, store.job) == ("async", None, None, None)
    store.close()
    assert os.environ["RANK"] == "not a rank"


def test_the_job_argument_wins_over_pstore_job(
    cluster: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("PSTORE_JOB", "from-env")
    store = pstore.connect(str(cluster), mode="bsp", retries=0)
    assert (store.worker, store.num_workers, store.job) == (0, 1, "from-env")
    store.close()
    store = pstore.connect(str(cluster), mode="ssp", job="given", retries=0)
    assert (store.worker, store.num_workers, store.job) == (0, 1, "given")
    store.close()
