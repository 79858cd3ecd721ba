//! What the store server and the distributed client share: the generated wire contract
//! (`proto/pstore/v1/pstore.proto`), the array codecs, the routing of ids to servers and the
//! token check.

pub mod routing;
pub mod rows;
pub mod splice;
pub mod wire;

/// The generated messages and service stubs of `pstore.v1`.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("pstore.v1");
}

/// The version of the wire contract these stubs speak.
pub const PROTOCOL: u32 = 1;

/// The largest message a server accepts and a client sends, by default.
pub const DEFAULT_MAX_MESSAGE: usize = 64 << 20;

/// Compares two secrets in time that depends only on their lengths, not on where they differ.
pub fn token_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = (given.len() ^ expected.len()) as u64;
    for (i, &e) in expected.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(!e);
        diff |= (g ^ e) as u64;
    }
    std::hint::black_box(diff) == 0
}

/// The metadata key that carries the kind of a pstore error next to its gRPC status, so a
/// client raises the same exception the embedded store would.
pub const ERROR_KIND: &str = "pstore-error";

/// The most bytes of an error message a status carries.
pub const MAX_MESSAGE_BYTES: usize = 2048;

/// The gRPC status of a core error (code, message, and the error's kind in metadata).
pub fn status_of(e: &crate::Error) -> tonic::Status {
    use crate::Error as E;
    use tonic::Code;
    let (code, kind, msg) = match e {
        E::InvalidArgument(m) => (Code::InvalidArgument, "invalid_argument", m.clone()),
        E::Shape(m) => (Code::InvalidArgument, "shape", m.clone()),
        E::NonFinite(m) => (Code::InvalidArgument, "non_finite", m.clone()),
        E::Dtype(m) => (Code::InvalidArgument, "dtype", m.clone()),
        E::WrongKind(m) => (Code::InvalidArgument, "wrong_kind", m.clone()),
        E::UnknownTable(n) => (Code::NotFound, "unknown_table", n.clone()),
        E::TableExists(n) => (Code::AlreadyExists, "table_exists", n.clone()),
        E::Storage(m) => (Code::FailedPrecondition, "storage", m.clone()),
        E::Corrupt(m) => (Code::DataLoss, "corrupt", m.clone()),
        E::Internal(m) => (Code::Internal, "internal", m.clone()),
        E::WorkerLost(m) => (Code::Aborted, "worker_lost", m.clone()),
        E::TableMismatch(m, _) => (Code::AlreadyExists, "table_mismatch", m.clone()),
        E::PartialPush { message, .. } => (Code::Unavailable, "remote", message.clone()),
        E::Remote { message, .. } => (Code::Unavailable, "remote", message.clone()),
    };
    let shown = match e {
        E::UnknownTable(_) | E::TableExists(_) => e.to_string(),
        _ => msg.clone(),
    };
    // A reply's headers carry the message: bounded, so that no request (a name of megabytes)
    // makes them overflow and the client see a transport error instead of this one.
    let shown = if shown.len() > MAX_MESSAGE_BYTES {
        format!(
            "{}... ({} bytes in all)",
            crate::error::prefix(&shown, MAX_MESSAGE_BYTES),
            shown.len()
        )
    } else {
        shown
    };
    let mut s = tonic::Status::new(code, shown);
    if let Ok(v) = kind.parse() {
        s.metadata_mut().insert(ERROR_KIND, v);
    }
    if let E::UnknownTable(n) | E::TableExists(n) | E::TableMismatch(_, n) = e {
        let n = if n.len() > crate::error::MAX_NAME_BYTES {
            format!("{}... ({} bytes)", crate::error::prefix(n, 64), n.len())
        } else {
            n.clone()
        };
        if let Ok(v) = n.parse() {
            s.metadata_mut().insert("pstore-table", v);
        }
    }
    s
}

/// What to do about a TLS failure whose cause a client cannot guess from the transport's own
/// words (`invalid peer certificate: Other(...)`), if `s` is one. Such a failure is not retried:
/// the same certificate fails the same way.
pub fn tls_hint(s: &tonic::Status) -> Option<&'static str> {
    let mut chain = format!("{} {:?}", s.message(), s.message());
    let mut e: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(x) = e {
        chain.push_str(&format!(" {x} {x:?}"));
        e = x.source();
    }
    if chain.contains("CaUsedAsEndEntity") {
        Some(
            "the server's certificate is a CA certificate (basicConstraints CA:TRUE, what \
             `openssl req -x509` makes by default) used as the server's own certificate, which \
             this client refuses. Either make a CA and a server certificate signed by it and give \
             the client the CA (tls_ca), or make the self-signed certificate with \
             `-addext basicConstraints=critical,CA:FALSE -addext subjectAltName=DNS:<host>` \
             (docs/CLUSTER.md, \"TLS certificates\")",
        )
    } else if chain.contains("UnknownIssuer") {
        Some(
            "the server's certificate is not signed by the CA given to this client (tls_ca): \
             give the CA certificate that issued it",
        )
    } else if chain.contains("NotValidForName") {
        Some(
            "the server's certificate does not carry the name this client checks (the host of \
             the address, or tls_domain): reissue it with that name in subjectAltName, or give \
             tls_domain the name it carries",
        )
    } else if chain.contains("CertExpired") || chain.contains("CertNotValidYet") {
        Some("the server's certificate is outside its validity period (or a clock is wrong)")
    } else {
        None
    }
}

/// The core error a client reports for a status; `server` names who answered.
pub fn error_of(s: &tonic::Status, server: &str) -> crate::Error {
    use crate::Error as E;
    let kind = s
        .metadata()
        .get(ERROR_KIND)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let table = s
        .metadata()
        .get("pstore-table")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let m = s.message().to_string();
    if let Some(hint) = tls_hint(s) {
        return E::Remote {
            server: server.to_string(),
            code: s.code() as i32,
            message: format!("TLS: {hint} (the transport said: {m})"),
        };
    }
    match (kind, table) {
        ("invalid_argument", _) => E::InvalidArgument(m),
        ("shape", _) => E::Shape(m),
        ("non_finite", _) => E::NonFinite(m),
        ("dtype", _) => E::Dtype(m),
        ("wrong_kind", _) => E::WrongKind(m),
        ("unknown_table", Some(t)) => E::UnknownTable(t),
        ("table_exists", Some(t)) => E::TableExists(t),
        ("table_mismatch", Some(t)) => E::TableMismatch(m, t),
        ("storage", _) => E::Storage(format!("server {server}: {m}")),
        ("corrupt", _) => E::Corrupt(format!("server {server}: {m}")),
        ("worker_lost", _) => E::WorkerLost(m),
        _ => E::Remote {
            server: server.to_string(),
            code: s.code() as i32,
            message: format!("{:?}: {m}", s.code()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::token_eq;

    #[test]
    fn tokens_compare_exactly() {
        assert!(token_eq(b"secret", b"secret"));
        assert!(!token_eq(b"secreT", b"secret"));
        assert!(!token_eq(b"secret!", b"secret"));
        assert!(!token_eq(b"secre", b"secret"));
        assert!(!token_eq(b"", b"secret"));
        assert!(token_eq(b"", b""));
    }
}
