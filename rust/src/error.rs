//! The one error type of the core. User errors (bad arguments, unknown names) are kept apart from
//! internal ones so the binding layer can map each to the exception a Python user expects.

/// Every error the core reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A configuration value or argument is out of range (dim 0, lr <= 0, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// Lengths or shapes of the inputs do not agree with each other or with the table.
    #[error("{0}")]
    Shape(String),
    /// A gradient holds NaN or an infinity.
    #[error("{0}")]
    NonFinite(String),
    /// An input has the wrong element type (raised by the binding layer).
    #[error("{0}")]
    Dtype(String),
    /// No table of this name exists.
    #[error("unknown table {}", quoted_name(.0))]
    UnknownTable(String),
    /// A table of this name exists already.
    #[error("table {} already exists", quoted_name(.0))]
    TableExists(String),
    /// A declaration of an existing table differs from it: the message names the field; the
    /// second value is the table's name. Nothing was changed.
    #[error("{0}")]
    TableMismatch(String, String),
    /// A push spread over several servers was applied by some and failed on others. Retrying
    /// the same call (same ids and gradients) sends only the parts that did not apply.
    #[error("{message}")]
    PartialPush {
        /// What happened, naming the servers.
        message: String,
        /// The servers whose parts were applied.
        applied: Vec<String>,
        /// The servers whose parts failed.
        failed: Vec<String>,
    },
    /// A table was used as the other kind (a dense table where a sparse one is needed).
    #[error("{0}")]
    WrongKind(String),
    /// Reading or writing the disk failed (no space, permissions, an LMDB error): the message
    /// names the path and the cause. What was in memory is unchanged.
    #[error("{0}")]
    Storage(String),
    /// A file on disk is not what pstore wrote (truncated, altered, unknown format version): the
    /// message names the file.
    #[error("{0}")]
    Corrupt(String),
    /// A worker of a synchronous job stopped calling for longer than its lease, and the job
    /// was started to fail then: the message names the worker and the job.
    #[error("{0}")]
    WorkerLost(String),
    /// A store server could not be reached or answered with a transport-level error (timeout,
    /// connection refused, unauthenticated, permission denied, ...).
    #[error("server {server}: {message}")]
    Remote {
        /// The server's address as the client was given it.
        server: String,
        /// The gRPC status code.
        code: i32,
        /// What went wrong.
        message: String,
    },
    /// A bug or a broken invariant inside pstore, never the caller's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The result type of the core.
pub type Result<T> = std::result::Result<T, Error>;

/// The longest table name, in bytes (UTF-8).
pub const MAX_NAME_BYTES: usize = 255;
/// How much of a name longer than [`MAX_NAME_BYTES`] an error quotes.
const QUOTED_PREFIX_BYTES: usize = 64;

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub(crate) fn prefix(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A table name as errors quote it: whole up to [`MAX_NAME_BYTES`], else a bounded prefix and
/// the name's length (an error echoing a name of megabytes would be one too; over the wire,
/// its reply headers would overflow).
pub fn quoted_name(name: &str) -> String {
    if name.len() <= MAX_NAME_BYTES {
        format!("{name:?}")
    } else {
        format!(
            "{:?}... ({} bytes)",
            prefix(name, QUOTED_PREFIX_BYTES),
            name.len()
        )
    }
}

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

pub(crate) fn shape(msg: impl Into<String>) -> Error {
    Error::Shape(msg.into())
}

pub(crate) fn storage(msg: impl Into<String>) -> Error {
    Error::Storage(msg.into())
}

pub(crate) fn corrupt(msg: impl Into<String>) -> Error {
    Error::Corrupt(msg.into())
}
