"""Power loss, for real ordering: the store runs on a file system that drops unsynced writes.

``_dropfs.py`` mounts a FUSE view of a directory whose file contents reach the directory only
through fsync (or an O_DSYNC descriptor). Each trial runs ``_crash_worker.py`` (the training
process of tests/test_crash.py) on the mount, kills it with SIGKILL at a random moment and then
kills the file system's process too: every write not yet synced is gone, as after a power cut.
What is left must be a store that opens, with whole rows, no row of a push that was not
committed, and, in sync mode, every acknowledged push.

A SIGKILL of the process alone (tests/test_crash.py) cannot show a missing fsync or a wrong write
order: the kernel's page cache keeps every write the process made. This test can.

It needs root, /dev/fuse and libfuse 3 (``make install`` installs libfuse3 where it is missing);
without them it is skipped with the reason.
"""

from __future__ import annotations

import ctypes.util
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import _crash_worker as worker
import numpy as np
import pytest
from _netutil import child_env
from test_crash import (
    IDS,
    AdagradReference,
    Chain,
    check_replica,
    run_worker,
)

import pstore
from pstore import optim

DROPFS = Path(__file__).resolve().parent / "_dropfs.py"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "mounting a FUSE file system needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is not installed (make install installs it)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class PowerCut:
    """A mounted ``_dropfs.py``; :meth:`cut` loses what was not synced and unmounts it."""

    def __init__(self, backing: Path, mount: Path, log: Path) -> None:
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(DROPFS), str(backing), str(mount)],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=child_env(),
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready", or EOF if the mount failed
        if line.strip() != "ready":
            self.cut()
            raise AssertionError(f"the FUSE mount did not come up:\n{log.read_text()}")

    def cut(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: the unsynced writes in its memory are lost
        self.proc.wait()
        # A mount whose process is gone answers ENOTCONN (os.path.ismount says False): look it
        # up in the mount table instead.
        if _mounted(self.mount):
            subprocess.run(["umount", "-l", str(self.mount)], check=True)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def _initial() -> np.ndarray:
    return (
        pstore.Store(num_shards=1, threads=1)
        .create_sparse_table(
            worker.TABLE,
            worker.DIM,
            optimizer=optim.Adagrad(
                lr=worker.LR, initial_accumulator_value=worker.INITIAL_ACCUMULATOR
            ),
            seed=worker.SEED,
        )
        .initial_rows(IDS)
    )


def run_power_cuts(tmp_path: Path, mode: str, trials: int, seed: int) -> list[tuple[int, int, int]]:
    """``trials`` power cuts on one store; (acked, present_min, present_max) of each."""
    rng = random.Random(seed)
    backing, mount = tmp_path / "disk", tmp_path / "mnt"
    backing.mkdir()
    chain = Chain(backing / "store", AdagradReference(_initial()))
    out = []
    for t in range(trials):
        fs = PowerCut(backing, mount, tmp_path / f"dropfs-{t}.stderr")
        try:
            wait = rng.uniform(0.3, 1.5)
            log = tmp_path / f"{mode}-{t}.stderr"
            _, _, acks, _ = run_worker(mount / "store", mode, ["--flush-every", "0"], wait, log)
        finally:
            fs.cut()
        steps, _, _ = check_replica(chain, mode)
        present = steps - chain.steps
        out.append((len(acks), int(present.min()), int(present.max())))
        chain.steps = steps
    return out


def describe(mode: str, outcomes: list[tuple[int, int, int]]) -> str:
    rows = (
        f"  trial {i}: {a} pushes acked, {lo}..{hi} present"
        for i, (a, lo, hi) in enumerate(outcomes)
    )
    return f"{mode} mode, power cut, {len(outcomes)} trials:\n" + "\n".join(rows)


def test_power_loss_in_sync_mode_loses_no_acknowledged_push(tmp_path):
    outcomes = run_power_cuts(tmp_path, "sync", trials=5, seed=20261203)
    report = describe("sync", outcomes)
    print(f"\n{report}")
    for acked, lo, hi in outcomes:
        assert lo == hi, f"a push is split:\n{report}"
        assert acked <= lo <= acked + 1, f"an acknowledged push is lost:\n{report}"
    assert sum(a for a, _, _ in outcomes) > 0, "no push was acknowledged: the test tested nothing"


def test_power_loss_in_async_mode_leaves_a_whole_prefix(tmp_path):
    """Async mode loses the pushes since the last committed cycle, never a part of one."""
    outcomes = run_power_cuts(tmp_path, "async", trials=4, seed=1203)
    report = describe("async", outcomes)
    print(f"\n{report}")
    for acked, lo, hi in outcomes:
        assert lo == hi, f"a push is split:\n{report}"
        assert hi <= acked + 1, f"more than the pushes made:\n{report}"


def test_the_file_system_drops_unsynced_writes(tmp_path):
    """The layer itself: a write without fsync is gone after the cut, a synced one is kept."""
    backing, mount = tmp_path / "disk", tmp_path / "mnt"
    backing.mkdir()
    fs = PowerCut(backing, mount, tmp_path / "dropfs.stderr")
    try:
        fd = os.open(mount / "f", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.pwrite(fd, b"kept", 0)
            os.fsync(fd)
            os.pwrite(fd, b"LOST", 0)
            os.pwrite(fd, b"tail", 8192)
            assert os.pread(fd, 4, 0) == b"LOST", "reads see unsynced writes, as a page cache"
            assert os.fstat(fd).st_size == 8196
        finally:
            os.close(fd)
        dsync = os.open(mount / "g", os.O_CREAT | os.O_WRONLY | os.O_DSYNC, 0o644)
        try:
            os.write(dsync, b"durable at once")
        finally:
            os.close(dsync)
    finally:
        fs.cut()
    assert (backing / "f").read_bytes() == b"kept"
    assert (backing / "g").read_bytes() == b"durable at once"
    shutil.rmtree(backing)
