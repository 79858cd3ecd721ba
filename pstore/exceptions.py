"""The exceptions pstore raises.

Every class derives from :class:`PstoreError` and also from the built-in exception a Python user
expects, so ``except ValueError`` and ``except KeyError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CorruptError",
    "DtypeError",
    "InternalError",
    "InvalidArgumentError",
    "NonFiniteError",
    "PartialPushError",
    "PstoreError",
    "ServerError",
    "ServerTimeoutError",
    "ShapeError",
    "StorageError",
    "TableExistsError",
    "UnknownTableError",
    "WorkerLostError",
    "WrongTableKindError",
]


class PstoreError(Exception):
    """Base class of every error pstore raises."""


class InvalidArgumentError(PstoreError, ValueError):
    """An argument or configuration value is out of range (dim 0, lr <= 0, ...)."""


class ShapeError(InvalidArgumentError):
    """Shapes or lengths disagree: ids and grads of different lengths, a wrong dim, ..."""


class NonFiniteError(InvalidArgumentError):
    """A gradient holds NaN or an infinity. Nothing of the push was applied."""


class DtypeError(PstoreError, TypeError):
    """An argument has the wrong type.

    Arrays of the wrong dtype (ids must be int64 or uint64, gradients float32), or a configuration
    that is not a ``pstore.optim`` / ``pstore.init`` object.
    """


class UnknownTableError(PstoreError, KeyError):
    """No table of this name exists."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TableExistsError(PstoreError, ValueError):
    """A table of this name exists already."""


class WrongTableKindError(PstoreError, TypeError):
    """A dense table was used where a sparse one is needed, or the reverse."""


class StorageError(PstoreError, OSError):
    """Reading or writing the disk failed: no space left, no permission, an LMDB error.

    The message names the path and the cause. What is in memory is unchanged, and once the cause
    is gone (space freed) the store goes on.
    """


class CorruptError(PstoreError, ValueError):
    """A file is not what pstore wrote: truncated, altered, or of an unknown format version.

    The message names the file. Nothing was loaded from it. A stored row whose checksum fails
    (in a store's replica or a serving artifact) is named by table and id; it is not served, and
    the table's other rows are.
    """


class InternalError(PstoreError, RuntimeError):
    """A bug in pstore, never the caller's fault: please report it."""


class ServerError(PstoreError, ConnectionError):
    """A store server could not be reached or failed the call (connection refused, server gone,
    an unexpected gRPC status). The message names the server; ``code`` is the gRPC status code.
    """

    @property
    def code(self) -> int | None:
        """The gRPC status code (14 is UNAVAILABLE, 4 DEADLINE_EXCEEDED, ...)."""
        return getattr(self, "_code", None)


class PartialPushError(ServerError):
    """A push spread over several servers was applied by some and failed on others.

    ``applied`` lists the servers whose parts were applied, ``failed`` those whose parts were
    not. Retrying the same call (the same ids and gradients, from the same connection) sends only
    the parts that were not applied: each part keeps its request id, so a server that applied
    its part answers the retry without applying it again.
    """

    applied: list[str]
    failed: list[str]


class ServerTimeoutError(ServerError, TimeoutError):
    """A call to a store server did not finish within its timeout."""


class WorkerLostError(PstoreError, RuntimeError):
    """A worker of a synchronous job (``mode="bsp"`` or ``"ssp"``) stopped calling for longer
    than its lease (``connect(lease=)``), and the job fails then (``on_worker_loss="fail"``, the
    default). The message names the worker and the job; restart that worker with the same rank
    and job to go on."""


class AuthenticationError(ServerError, PermissionError):
    """The server refused the call: no token, a wrong token, or a read-only token used to write."""
