"""pstore: an embedding-table parameter store for recommender systems.

>>> import numpy as np, pstore
>>> store = pstore.Store()
>>> user = store.create_sparse_table(
...     "user", dim=4, optimizer=pstore.optim.Adagrad(lr=0.05), initializer=pstore.init.Zeros()
... )
>>> user.pull(np.array([1, 2])).shape
(2, 4)
"""

from __future__ import annotations

from pstore import init, inspection, optim, server
from pstore._native import MAX_DIM
from pstore._native import __version__ as __version__
from pstore.client import RemoteStore, SnapshotHandle, connect, promote, restore_cluster
from pstore.exceptions import (
    AuthenticationError,
    CorruptError,
    DtypeError,
    InternalError,
    InvalidArgumentError,
    NonFiniteError,
    PartialPushError,
    PstoreError,
    ServerError,
    ServerTimeoutError,
    ShapeError,
    StorageError,
    TableExistsError,
    UnknownTableError,
    WorkerLostError,
    WrongTableKindError,
)
from pstore.store import DenseTable, PushHandle, SparseTable, Store

__all__ = [
    "MAX_DIM",
    "AuthenticationError",
    "CorruptError",
    "DenseTable",
    "DtypeError",
    "InternalError",
    "InvalidArgumentError",
    "NonFiniteError",
    "PartialPushError",
    "PstoreError",
    "PushHandle",
    "RemoteStore",
    "ServerError",
    "ServerTimeoutError",
    "ShapeError",
    "SnapshotHandle",
    "SparseTable",
    "StorageError",
    "Store",
    "TableExistsError",
    "UnknownTableError",
    "WorkerLostError",
    "WrongTableKindError",
    "connect",
    "init",
    "inspection",
    "optim",
    "promote",
    "restore_cluster",
    "server",
]
