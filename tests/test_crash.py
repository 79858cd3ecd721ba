"""Crash safety, for real: a training process is killed with SIGKILL at random moments.

Each trial starts ``_crash_worker.py`` on a store directory, waits a random time after its first
acknowledged push, kills it (SIGKILL, only the pid started here) and then checks what the
replica holds, with ``lmdb`` (the row words, decoded as docs/FORMAT.md says) and with pstore
(reopening the store). Several trials run on the same directory, each resuming the training where
the replica left it.

The worker pushes a gradient of ones to the same 2000 ids with Adagrad, so after ``k`` updates
every row is a known function of ``k`` and of its initial value: a torn row (weights of one
update, accumulator of another) or a row that moved backwards cannot go unnoticed.
"""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import _crash_worker as worker
import numpy as np
import pytest
from _netutil import child_env
from test_lmdb_format import decode_row, read_replica

import pstore
from pstore import optim

F32 = np.float32
F64 = np.float64
WORKER = Path(worker.__file__).resolve()
N_IDS = 2000
IDS = np.arange(N_IDS, dtype=np.uint64)
FLUSH_INTERVAL = 0.2  # async mode
LOSS_SLACK = 0.5  # seconds allowed past the interval: the cycle in progress, fsync, scheduling
EPS = 1e-10  # optim.Adagrad's default
STARTUP_TIMEOUT = 60.0

# Known bug: a flush cycle copies a table shard by shard while pushes go on, so in async mode a
# push that runs during the copy can be split between two cycles, and a crash then leaves rows of
# one push at different steps (docs/FORMAT.md, "What a crash leaves"). Until the flusher takes a
# consistent cut, the async test reports such trials as an expected failure once everything else
# has passed; set this to False to make them fail.
ASYNC_PUSHES_MAY_TEAR = False


class AdagradReference:
    """The rows after ``k`` pushes of a gradient of ones, as rust/src/optimizer/mod.rs computes.

    ``sum = sum + 1`` and ``w = w - lr * (1 / (sqrt(sum) + eps))``, in float32 as the store's
    Adagrad computes. Steps only grow, so the reference walks forward and keeps its place.
    """

    def __init__(self, initial: np.ndarray):
        self.k = 0
        self.w = initial.astype(F32)
        self.acc = F32(worker.INITIAL_ACCUMULATOR)

    @staticmethod
    def _step(w: np.ndarray, acc: np.float32) -> tuple[np.ndarray, np.float32]:
        total = F32(acc) + F32(1.0) * F32(1.0)
        d = F32(worker.LR) * (F32(1.0) / (np.sqrt(total) + F32(EPS)))
        return w - d, total

    def rows_at(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Weights ``(n, dim)`` and accumulators ``(n,)`` of every row at its own step."""
        lo, hi = int(steps.min()), int(steps.max())
        assert lo >= self.k, f"a row went back from step {self.k} to {lo}"
        while self.k < lo:
            self.w, self.acc = self._step(self.w, self.acc)
            self.k += 1
        out_w, out_acc = np.empty_like(self.w), np.empty(steps.size, F32)
        w, acc = self.w, self.acc
        for k in range(lo, hi + 1):
            at = steps == k
            out_w[at], out_acc[at] = w[at], acc
            if k < hi:
                w, acc = self._step(w, acc)
        return out_w, out_acc


@dataclass
class Chain:
    """Trials on one store directory, each resuming from what the previous one left."""

    path: Path
    ref: AdagradReference
    steps: np.ndarray = field(default_factory=lambda: np.zeros(N_IDS, dtype=np.int64))


@dataclass
class Outcome:
    trial: int
    acked: int  # pushes this run acknowledged
    present_min: int  # pushes of this run that are in the replica, over the rows
    present_max: int
    steps: tuple[int, int]  # lowest and highest row step in the replica
    seq: int  # table.seq after reopening
    newest: int  # the highest row version in the replica (the seq of the newest push held)
    loss: float  # seconds: kill time - ack time of the last push wholly present
    wait: float


def run_worker(
    path: Path, mode: str, options: list[str], wait: float, log: Path
) -> tuple[int, float, dict[int, float], float]:
    """Starts a worker, kills it ``wait`` s after its first ack; (start, t_start, acks, t_kill).

    ``options`` are more options of the worker (``--flush-every N``, ...).
    """
    cmd = [sys.executable, str(WORKER), str(path), "--durability", mode]
    cmd += ["--flush-interval", str(FLUSH_INTERVAL), "--ids", str(N_IDS), *options]
    lines: list[str] = []
    first_ack = threading.Event()
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=child_env(), text=True, bufsize=1
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("ack "):
                    first_ack.set()
            first_ack.set()  # end of output: the worker is gone

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            first_ack.wait(STARTUP_TIMEOUT)
            if proc.poll() is not None or not any(x.startswith("ack ") for x in lines):
                raise AssertionError(f"the worker did not get going:\n{log.read_text()}")
            time.sleep(wait)
            assert proc.poll() is None, f"the worker stopped by itself:\n{log.read_text()}"
            t_kill = time.time()
            proc.kill()  # SIGKILL, this pid only
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            reader.join(10)
            if proc.stdout is not None:
                proc.stdout.close()
    start, t_start, acks = None, math.nan, {}
    for line in lines:
        parts = line.split()
        if len(parts) != 3 or not line.endswith("\n"):
            continue  # a line cut by the kill
        if parts[0] == "start":
            start, t_start = int(parts[1]), float(parts[2])
        elif parts[0] == "ack":
            acks[int(parts[1])] = float(parts[2])
    assert start is not None, lines[:3]
    assert sorted(acks) == list(range(start + 1, start + 1 + len(acks))), "acks in order"
    return start, t_start, acks, t_kill


def check_replica(chain: Chain, mode: str, split_ok: bool = False) -> tuple[np.ndarray, int, int]:
    """Every row is whole and where the reference says; returns the steps, table.seq and the
    highest row version.

    ``split_ok``: an earlier trial may have left a push in part of the rows (a store of several
    environments), so a row's version need not equal its step.
    """
    rep = read_replica(chain.path)
    rec = rep.records[worker.TABLE]
    assert rec["config"]["dim"] == worker.DIM
    rows = rep.rows[worker.TABLE]
    assert set(rows) <= set(range(N_IDS)), "only the ids pushed have rows"
    steps = np.zeros(N_IDS, dtype=np.int64)
    weights = np.empty((N_IDS, worker.DIM), F32)
    acc = np.empty((N_IDS, worker.DIM), F32)
    present = np.zeros(N_IDS, dtype=bool)
    newest = 0
    for i, value in rows.items():
        row = decode_row(value, worker.DIM, worker.DIM)
        steps[i], weights[i], acc[i], present[i] = row.step, row.weights, row.state, True
        assert row.freq == row.step, f"id {i}: every push hits every id once"
        assert row.reserved == 0
        # A row's version is the table's seq at its update: its step, unless a crash left seq
        # ahead of the rows (see Outcome.seq) and later pushes numbered from there.
        exact = mode == "sync" and not split_ok
        assert row.version == row.step if exact else row.version >= row.step
        newest = max(newest, row.version)
    # Absent rows were never written: their id is at step 0, and stays so until it is.
    assert not (chain.steps[~present] > 0).any(), "a row disappeared"
    assert (steps >= chain.steps).all(), "a row went back"
    want_w, want_acc = chain.ref.rows_at(steps)
    bad = present & (
        (weights.view(np.uint32) != want_w.view(np.uint32)).any(axis=1)
        | (acc.view(np.uint32) != want_acc[:, None].view(np.uint32)).any(axis=1)
    )
    assert not bad.any(), (
        f"torn rows: ids {np.flatnonzero(bad)[:10]} at steps {steps[bad][:10]} do not hold the "
        f"weights and accumulator of that many updates"
    )

    # pstore opens the store and serves the same rows.
    with pstore.Store(chain.path, durability="none", threads=2) as store:
        table = store.sparse_table(worker.TABLE)
        assert len(table) == int(present.sum())
        assert not table.contains(IDS[~present]).any()
        got = table.pull(IDS[present])
        assert (got.view(np.uint32) == weights[present].view(np.uint32)).all()
        seq = table.seq
    assert seq >= steps.max(), "the record never lags its rows"
    return steps, seq, newest


def run_chains(
    tmp_path: Path,
    mode: str,
    chains: int,
    trials: int,
    options: list[str],
    seed: int,
    split_ok: bool = False,
) -> list[Outcome]:
    """``chains`` store directories, ``trials`` killed workers on each; what every trial left."""
    rng = random.Random(seed)
    initial = (
        pstore.Store(num_shards=1, threads=1)
        .create_sparse_table(
            worker.TABLE,
            worker.DIM,
            optimizer=optim.Adagrad(lr=worker.LR, initial_accumulator_value=0.1),
            seed=worker.SEED,
        )
        .initial_rows(IDS)
    )
    outcomes = []
    for c in range(chains):
        chain = Chain(tmp_path / f"{mode}-{c}", AdagradReference(initial))
        for t in range(trials):
            wait = rng.uniform(0.2, 1.5)
            log = tmp_path / f"{mode}-{c}-{t}.stderr"
            start, t_start, acks, t_kill = run_worker(chain.path, mode, options, wait, log)
            steps, seq, newest = check_replica(chain, mode, split_ok)
            present = steps - chain.steps
            lo, hi = int(present.min()), int(present.max())
            acked = len(acks)
            assert hi <= acked + 1, "at most the push in flight when killed is unacknowledged"
            last = start + lo  # the last push of this run that every row holds
            t_last = t_start if lo == 0 else acks.get(last, t_kill)
            outcomes.append(
                Outcome(
                    trial=len(outcomes),
                    acked=acked,
                    present_min=lo,
                    present_max=hi,
                    steps=(int(steps.min()), int(steps.max())),
                    seq=seq,
                    newest=newest,
                    loss=t_kill - t_last,
                    wait=wait,
                )
            )
            chain.steps = steps
    return outcomes


def describe(outcomes: list[Outcome]) -> str:
    lines = [
        f"  trial {o.trial:2d}: killed {o.wait:.2f} s after the first ack, {o.acked} pushes "
        f"acked, {o.present_min}..{o.present_max} present, steps {o.steps[0]}..{o.steps[1]}, "
        f"seq {o.seq}, newest row {o.newest}, loss window {o.loss:.3f} s"
        for o in outcomes
    ]
    return "\n".join(lines)


def test_sigkill_in_sync_mode_loses_no_acknowledged_push(tmp_path):
    options = ["--flush-every", "25"]
    outcomes = run_chains(tmp_path, "sync", chains=3, trials=4, options=options, seed=20261129)
    report = describe(outcomes)
    print(f"\nsync mode, {len(outcomes)} trials:\n{report}")
    for o in outcomes:
        assert o.present_min == o.present_max, f"a push is split:\n{report}"
        assert o.steps[0] == o.steps[1], f"rows at different steps:\n{report}"
        assert o.acked <= o.present_min <= o.acked + 1, f"an acknowledged push is lost:\n{report}"
        assert o.seq == o.steps[1] == o.newest, f"the record does not match its rows:\n{report}"


def test_sigkill_in_sync_mode_with_two_environments(tmp_path):
    """Two LMDB environments commit each cycle in two transactions, on two threads.

    A kill between the commits may leave the push in flight (never acknowledged) in part of
    its rows (docs/FORMAT.md, "What a crash leaves"); every row is still whole, every
    acknowledged push is there, and the reopened table's seq is that of its newest row.
    """
    options = ["--flush-every", "25", "--environments", "2"]
    outcomes = run_chains(
        tmp_path, "sync", chains=2, trials=4, options=options, seed=20261130, split_ok=True
    )
    report = describe(outcomes)
    split = sum(o.present_min != o.present_max for o in outcomes)
    print(f"\nsync mode, two environments, {len(outcomes)} trials, {split} split:\n{report}")
    for o in outcomes:
        assert o.acked <= o.present_min, f"an acknowledged push is lost:\n{report}"
        assert o.present_max <= o.acked + 1, f"more than the push in flight:\n{report}"
        # Not the highest step: once a kill has split a push, the rows of one environment hold
        # one push fewer than the table has numbered, for good (their steps trail its seq).
        assert o.seq == o.newest, f"the table's seq is not its newest row's:\n{report}"


def test_sigkill_in_async_mode_loses_at_most_one_interval(tmp_path):
    options = ["--flush-every", "2500"]  # about every half second
    outcomes = run_chains(tmp_path, "async", chains=2, trials=4, options=options, seed=1129)
    report = describe(outcomes)
    losses = [o.loss for o in outcomes]
    summary = (
        f"async mode, flush_interval {FLUSH_INTERVAL} s, {len(outcomes)} trials: loss window "
        f"min {min(losses):.3f} s, median {statistics.median(losses):.3f} s, "
        f"max {max(losses):.3f} s"
    )
    print(f"\n{summary}\n{report}")
    for o in outcomes:
        assert o.loss <= FLUSH_INTERVAL + LOSS_SLACK, f"{summary}\n{report}"
    torn = [o for o in outcomes if o.present_min != o.present_max]
    if torn:
        message = (
            f"{len(torn)} of {len(outcomes)} trials left a push split between cycles "
            f"(trials {[o.trial for o in torn]})\n{summary}\n{report}"
        )
        if ASYNC_PUSHES_MAY_TEAR:
            pytest.xfail(f"known bug: {message}")
        raise AssertionError(message)


def test_sigkill_during_snapshots_leaves_whole_snapshots_or_none(tmp_path):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    options = ["--snapshot-every", "10", "--snapshots", str(snaps)]
    outcomes = run_chains(tmp_path, "sync", chains=1, trials=4, options=options, seed=4242)
    report = describe(outcomes)
    for o in outcomes:
        assert o.acked <= o.present_min == o.present_max <= o.acked + 1, report
    complete = sorted(d for d in snaps.iterdir() if (d / "manifest.json").exists())
    partial = [d for d in snaps.iterdir() if not (d / "manifest.json").exists()]
    # A snapshot interrupted by the kill is a hidden temporary directory, never a snapshot.
    assert all(d.name.startswith(".snap-") and ".tmp-" in d.name for d in partial), partial
    assert len(complete) >= 4, report
    print(f"\n{len(complete)} snapshots, {len(partial)} interrupted by a kill\n{report}")
    for d in complete[-3:]:
        pstore._native.verify_snapshot(str(d))
        store = pstore.Store.restore(d, num_shards=3)
        table = store.sparse_table(worker.TABLE)
        assert len(table) == N_IDS
        # One read transaction: every row of a snapshot is at the same step, the one its name
        # says (snap-<k> is taken after push k).
        pulled = table.pull(IDS)
        k = int(d.name.split("-")[1])
        assert table.seq == k, (d.name, table.seq)
        rows = AdagradReference(
            store.create_sparse_table(
                "probe",
                worker.DIM,
                optimizer=optim.Adagrad(lr=worker.LR, initial_accumulator_value=0.1),
                seed=worker.SEED,
            ).initial_rows(IDS)
        ).rows_at(np.full(N_IDS, k))[0]
        assert (pulled.view(np.uint32) == rows.view(np.uint32)).all(), d.name
