# Hand-written stub of the native module (rust/src/python/). `make lint` checks it with
# mypy.stubtest against the built extension.
from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__all__ = [
    "MAX_DIM",
    "Artifact",
    "Client",
    "Counter",
    "DenseTable",
    "PushHandle",
    "ReferenceRows",
    "Server",
    "SparseTable",
    "StepSnapshot",
    "Store",
    "StoreApi",
    "__version__",
    "config_schema",
    "export_artifact",
    "inspect_store",
    "newest_snapshot",
    "openmp_bind",
    "openmp_bound",
    "openmp_join",
    "openmp_joined",
    "promote",
    "snapshot_chain",
    "sum_rows",
    "unique_inverse",
    "verify_snapshot",
]

MAX_DIM: int
__version__: str

def config_schema() -> str: ...
def unique_inverse(
    ids: npt.NDArray[np.uint64],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]: ...
def sum_rows(
    src: npt.NDArray[np.float32], index: npt.NDArray[np.int64], rows: int
) -> npt.NDArray[np.float32]: ...
def openmp_bind(path: str) -> None: ...
def openmp_bound() -> str | None: ...
def openmp_join(on: bool) -> None: ...
def openmp_joined() -> bool: ...
def snapshot_chain(dir: str) -> list[tuple[str, str]]: ...
def verify_snapshot(dir: str) -> int: ...
def inspect_store(path: str) -> dict[str, Any]: ...

@disjoint_base
class StoreApi:
    # The methods of every store; made only as a Store or a Client.
    def create_sparse_table(
        self,
        name: str,
        dim: int,
        optimizer: dict[str, Any],
        initializer: str | dict[str, Any],
        seed: int,
        admit_after: int = 0,
        max_rows: int | None = None,
        evict_policy: str = "lru",
        stale_policy: str | None = None,
        max_staleness: int | None = None,
        refuse_nonfinite: bool = False,
    ) -> SparseTable: ...
    def create_dense_table(
        self,
        name: str,
        shape: list[int],
        optimizer: dict[str, Any],
        initializer: str | dict[str, Any],
        seed: int,
        stale_policy: str | None = None,
        max_staleness: int | None = None,
    ) -> DenseTable: ...
    def table(self, name: str) -> SparseTable | DenseTable: ...
    def tables(self) -> list[str]: ...
    def drop_table(self, name: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...

@final
class Store(StoreApi):
    def __new__(
        cls,
        num_shards: int | None = None,
        threads: int | None = None,
        max_inflight_bytes: int | None = None,
        path: str | None = None,
        durability: str = "async",
        flush_interval: float = 1.0,
        map_size: int | None = None,
        environments: int | None = None,
    ) -> Store: ...
    @property
    def path(self) -> str | None: ...
    @property
    def durability(self) -> str | None: ...
    def storage_info(self) -> dict[str, Any] | None: ...
    @staticmethod
    def restore(
        snapshot: str,
        num_shards: int | None = None,
        threads: int | None = None,
        max_inflight_bytes: int | None = None,
        path: str | None = None,
        durability: str = "async",
        flush_interval: float = 1.0,
        map_size: int | None = None,
        environments: int | None = None,
        counter: Counter | None = None,
    ) -> Store: ...
    def snapshot(
        self, dir: str, incremental: bool = False, counter: Counter | None = None
    ) -> tuple[str, int]: ...
    @property
    def num_shards(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def max_inflight_bytes(self) -> int: ...

@final
class Counter:
    def __new__(cls) -> Counter: ...
    @property
    def value(self) -> int: ...

@final
class PushHandle:
    def wait(self, timeout: float | None = None) -> bool: ...
    def done(self) -> bool: ...

@final
class SparseTable:
    @property
    def name(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def num_shards(self) -> int: ...
    @property
    def in_process(self) -> bool: ...
    @property
    def optimizer_name(self) -> str: ...
    @property
    def lr(self) -> float: ...
    def optimizer_spec(self) -> dict[str, Any]: ...
    def initializer_spec(self) -> str | dict[str, Any]: ...
    def set_lr(self, lr: float) -> None: ...
    def __len__(self) -> int: ...
    def pull(self, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.float32]: ...
    def pull_versioned(
        self, ids: npt.NDArray[np.uint64]
    ) -> tuple[npt.NDArray[np.float32], list[int]]: ...
    def push(
        self,
        ids: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        version: Sequence[int] | None = None,
    ) -> None: ...
    def push_async(
        self,
        ids: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        version: Sequence[int] | None = None,
    ) -> PushHandle: ...
    def contains(self, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]: ...
    def remove(self, ids: npt.NDArray[np.uint64]) -> int: ...
    def evict(self, steps: int | None = None, seconds: float | None = None) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def lifecycle(self) -> tuple[int, int | None, str]: ...
    def initial_rows(self, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.float32]: ...
    def stats(self) -> dict[str, Any]: ...

@final
class DenseTable:
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def seed(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def optimizer_name(self) -> str: ...
    @property
    def lr(self) -> float: ...
    def optimizer_spec(self) -> dict[str, Any]: ...
    def initializer_spec(self) -> str | dict[str, Any]: ...
    def set_lr(self, lr: float) -> None: ...
    def pull(self) -> npt.NDArray[np.float32]: ...
    def pull_versioned(self) -> tuple[npt.NDArray[np.float32], list[int]]: ...
    def push(self, grad: npt.NDArray[np.float32], version: Sequence[int] | None = None) -> None: ...
    def push_async(
        self, grad: npt.NDArray[np.float32], version: Sequence[int] | None = None
    ) -> PushHandle: ...
    def stats(self) -> dict[str, Any]: ...

@final
class Server:
    def __new__(
        cls,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        token: str | None = None,
        read_token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_message: int | None = None,
        net: str | None = None,
    ) -> Server: ...
    @property
    def port(self) -> int: ...
    @property
    def metrics_port(self) -> int | None: ...
    @property
    def rows_port(self) -> int | None: ...
    @property
    def running(self) -> bool: ...
    def stop(self, grace: float = 10.0) -> None: ...

@final
class Client(StoreApi):
    def __new__(
        cls,
        servers: list[str],
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        wire_dtype: str = "float32",
        tls_ca: bytes | None = None,
        tls_domain: str | None = None,
        max_message: int | None = None,
        max_inflight_bytes: int | None = None,
        slots: str | None = None,
        ack: str = "primary",
        replicas: list[list[str]] | None = None,
        read_from: str = "primary",
        failover_timeout: float = 30.0,
    ) -> Client: ...
    @property
    def servers(self) -> list[str]: ...
    @property
    def slots(self) -> str: ...
    @property
    def wire_dtype(self) -> str: ...
    def publish_routing(self, slots: str) -> None: ...
    def move_slots(
        self, slots: str, max_rows_per_second: float | None = None
    ) -> dict[str, Any]: ...
    def add_server(
        self, members: list[str], max_rows_per_second: float | None = None
    ) -> dict[str, Any]: ...
    def remove_server(
        self, which: str, max_rows_per_second: float | None = None
    ) -> dict[str, Any]: ...
    def publish_members(self, groups: list[list[str]]) -> int | None: ...
    def health(self) -> list[str]: ...
    def groups(self) -> str: ...
    def status(self) -> list[dict[str, Any]]: ...
    def snapshot(self, dir: str, incremental: bool = False) -> list[tuple[str, int]]: ...
    def cluster_snapshot(self, dest: str, incremental: bool = False) -> str: ...
    def snapshot_at_step(
        self,
        dest: str,
        step: int | None = None,
        incremental: bool = False,
        timeout: float = 300.0,
    ) -> StepSnapshot: ...
    def restore_cluster(self, snapshot: str, via: str = "servers") -> tuple[int, int, int]: ...
    def drain(self) -> None: ...
    def clock(
        self,
        worker: int,
        num_workers: int,
        clock: int,
        staleness: int | None = None,
        timeout: float = 300.0,
    ) -> list[int]: ...
    def join_job(
        self,
        job: str | None,
        worker: int,
        num_workers: int,
        synced: bool,
        lease: float,
        continue_on_loss: bool,
        mean: bool,
        timeout: float,
    ) -> tuple[str, int]: ...
    def end_job_step(self, staleness: int, timeout: float) -> int: ...

@final
class StepSnapshot:
    @property
    def job(self) -> str: ...
    @property
    def step(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def result(self) -> str: ...

# Serving artifacts (rust/src/python/serving.rs).
def export_artifact(
    snapshot: str,
    out: str,
    tables: list[str] | None = None,
    dtype: str = "float32",
    progress: Counter | None = None,
) -> str: ...
def newest_snapshot(root: str) -> str | None: ...

@final
class Artifact:
    def __new__(cls, path: str, writable: bool = False, verify: str | None = None) -> Artifact: ...
    @property
    def writable(self) -> bool: ...
    @property
    def file_bytes(self) -> int: ...
    def state_json(self) -> str: ...
    def lookup(
        self,
        table: str,
        ids: npt.NDArray[np.uint64],
        default: str = "zeros",
        row: npt.NDArray[np.float32] | None = None,
        mask: bool = False,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_] | None, int]: ...
    def contains(self, table: str, ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]: ...
    def verified(self, table: str) -> tuple[int, int, int, str] | None: ...
    def dense(self, table: str) -> npt.NDArray[np.float32]: ...
    def scan(
        self, table: str
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8], int, str]: ...
    def apply(self, dir: str) -> str | None: ...
    def follow(self, root: str) -> str: ...
    def pending(self, root: str) -> list[str]: ...
    def serve(
        self,
        default: str = "initial",
        row: npt.NDArray[np.float32] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        token: str | None = None,
        read_token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        max_message: int | None = None,
        net: str | None = None,
    ) -> Server: ...

@final
class ReferenceRows:
    def __new__(cls, init: npt.NDArray[np.float32], words: int, fill: float) -> ReferenceRows: ...
    @property
    def huge_pages(self) -> bool: ...
    def gather(
        self,
        positions: npt.NDArray[np.uint64],
        out: npt.NDArray[np.float32],
        threads: int = 1,
        prefetch: bool = True,
    ) -> None: ...
    def index(self, ids: npt.NDArray[np.uint64]) -> bool: ...
    def lookup(
        self,
        ids: npt.NDArray[np.uint64],
        out: npt.NDArray[np.float32],
        threads: int = 1,
        prefetch: bool = True,
    ) -> int: ...
    def adagrad(
        self,
        positions: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        lr: float,
        threads: int = 1,
        prefetch: bool = True,
    ) -> None: ...
    def adam(
        self,
        positions: npt.NDArray[np.uint64],
        grads: npt.NDArray[np.float32],
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        step: int,
        threads: int = 1,
        prefetch: bool = True,
    ) -> None: ...

def promote(
    address: str,
    token: str | None = None,
    expected_primary: str | None = None,
    force: bool = False,
    timeout: float = 30.0,
) -> dict[str, Any]: ...
