"""The peers pstore is measured against: numpy, a Python dict index, torch, pyarrow and Redis.

Each peer does what a user without pstore would write, in its fastest ordinary form.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from harness import fsync_path


class NumpyTake:
    """A dense float32 array indexed by row position: no hashing at all."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def pull(self, pos: np.ndarray) -> np.ndarray:
        return self.table.take(pos, axis=0)


class DictTake:
    """A Python dict id -> row position, then `take` on the dense array."""

    def __init__(self, ids: np.ndarray, table: np.ndarray) -> None:
        self.index = dict(zip(ids.tolist(), range(len(ids)), strict=True))
        self.table = table

    def pull(self, ids: np.ndarray) -> np.ndarray:
        idx = np.fromiter(map(self.index.__getitem__, ids.tolist()), np.int64, len(ids))
        return self.table.take(idx, axis=0)


class TorchEmbeddingPull:
    """torch.nn.functional.embedding on a tensor sharing the numpy table's memory."""

    def __init__(self, torch: ModuleType, table: np.ndarray) -> None:
        self.torch = torch
        self.weight = torch.from_numpy(table)
        self.embedding = torch.nn.functional.embedding

    def pull(self, pos: np.ndarray):
        return self.embedding(self.torch.from_numpy(pos), self.weight)


class NumpyAddAt:
    """SGD as `np.add.at(table, idx, -lr * grads)`; duplicates accumulate."""

    def __init__(self, table: np.ndarray, lr: float) -> None:
        self.table = table
        self.lr = np.float32(lr)

    def push(self, pos: np.ndarray, grads: np.ndarray) -> None:
        np.add.at(self.table, pos, -self.lr * grads)


class TorchSparseStep:
    """nn.Embedding(sparse=True) plus a torch optimizer doing a full sparse step per batch:
    build the sparse COO gradient from (positions, grads), optimizer.step(), zero_grad()."""

    def __init__(self, torch: ModuleType, table: np.ndarray, optimizer: str, **kw: float) -> None:
        self.torch = torch
        # Explicitly what torch does by default (no invariant checks), minus its warning per step.
        torch.sparse.check_sparse_tensor_invariants.disable()
        self.emb = torch.nn.Embedding.from_pretrained(
            torch.from_numpy(table), freeze=False, sparse=True
        )
        self.weight = self.emb.weight
        self.shape = tuple(table.shape)
        params = [self.weight]
        if optimizer == "SGD":
            self.opt = torch.optim.SGD(params, lr=kw["lr"])
        elif optimizer == "Adagrad":
            self.opt = torch.optim.Adagrad(
                params, lr=kw["lr"], initial_accumulator_value=kw["init_acc"], eps=kw["eps"]
            )
        elif optimizer == "Adam":
            self.opt = torch.optim.SparseAdam(
                params, lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"]
            )
        else:
            raise ValueError(optimizer)

    def push(self, pos: np.ndarray, grads: np.ndarray) -> None:
        torch = self.torch
        idx = torch.from_numpy(pos).unsqueeze(0)
        self.weight.grad = torch.sparse_coo_tensor(
            idx, torch.from_numpy(grads), self.shape, check_invariants=False
        )
        self.opt.step()
        self.opt.zero_grad()

    def prefault_state(self) -> None:
        """Write every page of the optimizer state once (SparseAdam allocates it lazily with
        zeros_like, whose untouched pages would fault during the timed steps); pstore's state
        is likewise allocated when the table is populated before timing."""
        for state in self.opt.state.values():
            for value in state.values():
                if isinstance(value, self.torch.Tensor) and value.numel() > 1:
                    value.add_(0)


class DictNumpyGrowth:
    """A growing table in plain Python: dict id -> row, numpy weight and Adagrad accumulator
    arrays with capacity doubling; missing ids get Normal(0, 0.01) rows like pstore's default."""

    def __init__(self, dim: int, init_acc: float = 0.1, capacity: int = 1024, seed: int = 0):
        self.dim = dim
        self.init_acc = np.float32(init_acc)
        self.index: dict[int, int] = {}
        self.weights = np.empty((capacity, dim), np.float32)
        self.accum = np.empty((capacity, dim), np.float32)
        self.rows = 0
        self.rng = np.random.default_rng(seed)

    def _grow(self, need: int) -> None:
        cap = len(self.weights)
        while cap < need:
            cap *= 2
        if cap == len(self.weights):
            return
        for name in ("weights", "accum"):
            old = getattr(self, name)
            new = np.empty((cap, self.dim), np.float32)
            new[: self.rows] = old[: self.rows]
            setattr(self, name, new)

    def pull(self, ids: np.ndarray) -> np.ndarray:
        get = self.index.get
        idx = np.fromiter((get(k, -1) for k in ids.tolist()), np.int64, len(ids))
        missing = np.flatnonzero(idx < 0)
        if missing.size:
            new_ids, inverse = np.unique(ids[missing], return_inverse=True)
            start, m = self.rows, len(new_ids)
            self._grow(start + m)
            new_rows = np.arange(start, start + m, dtype=np.int64)
            self.index.update(zip(new_ids.tolist(), new_rows.tolist(), strict=True))
            self.weights[start : start + m] = self.rng.standard_normal(
                (m, self.dim), dtype=np.float32
            ) * np.float32(0.01)
            self.accum[start : start + m] = self.init_acc
            self.rows += m
            idx[missing] = new_rows[inverse]
        return self.weights.take(idx, axis=0)


class ArrowIpcFile:
    """pyarrow: the snapshot's columns as one table in one Arrow IPC file.

    The table is built once from the given numpy arrays (no copy: 2-D arrays become
    FixedSizeList columns). `write` writes it with `ipc.new_file` and fsyncs the file and its
    directory; `read` reads it back with `ipc.open_file(OSFile).read_all()` (an OSFile, not a
    memory map, so the bytes are read into memory) and returns numpy arrays over that memory.
    """

    def __init__(self, pa: ModuleType, columns: dict[str, np.ndarray], schema: object) -> None:
        self.pa = pa
        arrays = []
        for a in columns.values():
            if a.ndim == 2:
                flat = pa.array(a.reshape(-1))
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, a.shape[1]))
            else:
                arrays.append(pa.array(a))
        self.table = pa.Table.from_arrays(arrays, schema=schema)

    def write(self, d: Path) -> int:
        pa = self.pa
        d.mkdir()
        path = d / "table.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, self.table.schema) as w:
            w.write_table(self.table)
        fsync_path(path)
        fsync_path(d)
        return path.stat().st_size

    def read(self, d: Path) -> dict[str, np.ndarray]:
        pa = self.pa
        with pa.OSFile(str(d / "table.arrow")) as src:
            table = pa.ipc.open_file(src).read_all()
        out = {}
        for name in table.column_names:
            col = table.column(name)
            arr = col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)
            if pa.types.is_fixed_size_list(arr.type):
                out[name] = arr.flatten().to_numpy().reshape(len(arr), arr.type.list_size)
            else:
                out[name] = arr.to_numpy()
        return out

    def release(self) -> None:
        """Hand the memory of dropped reads back (untimed, after each repetition), so that each
        read allocates afresh like the other contenders' instead of reusing the pool's pages."""
        self.pa.default_memory_pool().release_unused()


class NumpySave:
    """`np.save` / `np.load` of the id, weight and state arrays, one .npy file each (fsynced,
    like the other contenders' files)."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def write(self, d: Path) -> int:
        d.mkdir()
        nbytes = 0
        for name, a in self.arrays.items():
            path = d / f"{name}.npy"
            np.save(path, a)
            fsync_path(path)
            nbytes += path.stat().st_size
        fsync_path(d)
        return nbytes

    def read(self, d: Path) -> dict[str, np.ndarray]:
        return {name: np.load(d / f"{name}.npy") for name in self.arrays}


class RedisRows:
    """Rows as Redis strings through redis-py: key = the id's 8 bytes, value = the row's float32
    bytes (dim 64: 256 bytes). Redis does no optimizer math: a push stores the rows it is given.

    The keys of a batch are made once, before timing (`keys`); converting rows to and from
    values is part of every call, since the caller has and wants numpy arrays, as with pstore.
    - pull: one MGET of the batch's keys, the values joined into an (n, dim) float32 array;
    - push_set_pipeline: one pipeline (no MULTI/EXEC, one round trip) of a SET per row;
    - push_mset: one MSET of all the batch's (key, row) pairs, duplicates included.
    """

    def __init__(self, client: Any, dim: int) -> None:
        self.client = client
        self.dim = dim
        self.row_dtype = np.dtype((np.void, 4 * dim))

    @staticmethod
    def keys(ids: np.ndarray) -> list[bytes]:
        return np.ascontiguousarray(ids, dtype=np.uint64).view("V8").tolist()

    def values(self, rows: np.ndarray) -> list[bytes]:
        return np.ascontiguousarray(rows, dtype=np.float32).view(self.row_dtype).ravel().tolist()

    def pull(self, keys: list[bytes]) -> np.ndarray:
        vals = self.client.mget(keys)
        return np.frombuffer(b"".join(vals), np.float32).reshape(len(keys), self.dim)

    def push_set_pipeline(self, keys: list[bytes], rows: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(keys, self.values(rows), strict=True):
            pipe.set(k, v)
        pipe.execute()

    def push_mset(self, keys: list[bytes], rows: np.ndarray) -> None:
        pairs = zip(keys, self.values(rows), strict=True)
        self.client.execute_command("MSET", *itertools.chain.from_iterable(pairs))

    def populate(self, keys: list[bytes], rows: np.ndarray, chunk: int = 8192) -> None:
        """Store rows with MSETs of `chunk` rows, sent in one pipeline."""
        pipe = self.client.pipeline(transaction=False)
        for s in range(0, len(keys), chunk):
            pairs = zip(keys[s : s + chunk], self.values(rows[s : s + chunk]), strict=True)
            pipe.execute_command("MSET", *itertools.chain.from_iterable(pairs))
        pipe.execute()


class _KeptOutput:
    """An output array per batch length, made once and kept across calls (already mapped: a
    new array per call would time the kernel's page faults, which every other contender pays)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._out: dict[int, np.ndarray] = {}

    def out(self, n: int) -> np.ndarray:
        out = self._out.get(n)
        if out is None:
            out = self._out[n] = np.zeros((n, self.dim), dtype=np.float32)
        return out


class ReferenceGather(_KeptOutput):
    """The memory limit of a pull: pstore's reference kernel (rust/src/reference.rs) copies the
    rows at given positions out of a 64-byte aligned arena on huge pages, with no table logic,
    into an output it keeps across calls."""

    def __init__(self, rows: Any, dim: int, threads: int, prefetch: bool) -> None:
        super().__init__(dim)
        self.rows, self.threads, self.prefetch = rows, threads, prefetch

    def pull(self, pos: np.ndarray) -> np.ndarray:
        out = self.out(len(pos))
        self.rows.gather(pos.astype(np.uint64, copy=False), out, self.threads, self.prefetch)
        return out


class ReferenceLookup(_KeptOutput):
    """The hashed-lookup limit of a pull: the reference kernel's open-addressing index of
    {id, position} slots at load 0.3 over the same rows (``ReferenceRows.index``), each id hashed,
    probed and copied with the misses overlapped (rust/src/reference.rs). No locks, no row
    header, the whole id in the slot: the least a hashed table's pull can cost. Its output is
    kept across calls, as ReferenceGather's is."""

    def __init__(self, rows: Any, dim: int, threads: int) -> None:
        super().__init__(dim)
        self.rows, self.threads = rows, threads

    def pull(self, ids: np.ndarray) -> np.ndarray:
        out = self.out(len(ids))
        missing = self.rows.lookup(ids, out, self.threads, True)
        if missing:
            raise RuntimeError(f"the reference index has no row for {missing} ids")
        return out


class ReferenceAdagrad:
    """The memory limit of an Adagrad push: the reference kernel's read-modify-write of the
    weights and accumulators (2 x dim words per row) at the batch's positions, no table logic."""

    def __init__(self, rows: Any, lr: float, threads: int) -> None:
        self.rows, self.lr, self.threads = rows, lr, threads

    def push(self, pos: np.ndarray, grads: np.ndarray) -> None:
        self.rows.adagrad(pos.astype(np.uint64, copy=False), grads, self.lr, self.threads, True)


class ReferenceAdam:
    """The memory limit of an Adam push: the reference kernel's read-modify-write of the
    weights and both moments (3 x dim words per row) at the batch's positions, bias-corrected
    by this peer's count of its pushes (one count for all rows, as torch's SparseAdam keeps
    it), no table logic."""

    def __init__(self, rows: Any, lr: float, beta1: float, beta2: float, eps: float,
                 threads: int) -> None:  # fmt: skip
        self.rows, self.threads = rows, threads
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.step = 0

    def push(self, pos: np.ndarray, grads: np.ndarray) -> None:
        self.step += 1
        self.rows.adam(
            pos.astype(np.uint64, copy=False), grads, self.lr, self.beta1, self.beta2,
            self.eps, self.step, self.threads, True,
        )  # fmt: skip
