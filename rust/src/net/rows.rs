//! The rows protocol: a model server's pulls over a plain TCP connection (decision 0120,
//! docs/PROTOCOL.md "Rows port"), beside `pstore.v1` over gRPC.
//!
//! A batch of 4096 rows is about 0.25 ms of table work in process; over gRPC the HTTP/2
//! framing, the runtime's hand-offs, the answer's extra copies and the zero fill cost several
//! times that. On the rows port a connection is one blocking thread on each side: a request is
//! one write, its answer one write, the server looks the rows up into the buffer it sends from
//! (kept across calls, so no fill and no page fault), and the client reads a float32 answer
//! straight into its output array.
//!
//! All integers are little-endian.
//!
//! Request: a 24-byte head, `b"PSq1"`, the wire dtype (u32, `pstore.v1.Dtype`), the table
//! name's length (u32), the token's length (u32), the number of ids (u64); then the name
//! (UTF-8), the token, and the ids (u64 each).
//!
//! Answer: a 32-byte head, `b"PSa1"`, the gRPC status code (u32, 0: OK), the dtype (u32), the
//! row width (u32), the generation read (u64, a pull's `seq` and `version`), the length of what
//! follows (u64). After an OK head: the rows, as `PullResponse.rows` holds them. After an
//! error: the message, the error's kind and the table it names (each a u32 length and its
//! UTF-8 bytes), what the gRPC status carries in its message and metadata.

use crate::net::{ERROR_KIND, MAX_MESSAGE_BYTES};

/// The first bytes of a request.
pub const REQUEST_MAGIC: [u8; 4] = *b"PSq1";
/// The first bytes of an answer.
pub const ANSWER_MAGIC: [u8; 4] = *b"PSa1";
/// Bytes of a request's head.
pub const REQUEST_HEAD: usize = 24;
/// Bytes of an answer's head.
pub const ANSWER_HEAD: usize = 32;
/// The longest table name a request may carry.
pub const MAX_TABLE: usize = 4096;
/// The longest token a request may carry.
pub const MAX_TOKEN: usize = 4096;

/// A request's head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestHead {
    /// The wire dtype asked for (`pstore.v1.Dtype`).
    pub dtype: i32,
    /// Bytes of the table name.
    pub table: usize,
    /// Bytes of the token.
    pub token: usize,
    /// Ids in the request.
    pub ids: u64,
}

/// The request for `ids` of `table`, head and body, appended to `out` (cleared first).
pub fn encode_request(
    out: &mut Vec<u8>,
    table: &str,
    token: Option<&str>,
    dtype: i32,
    ids: &[u64],
) {
    let token = token.unwrap_or("").as_bytes();
    out.clear();
    out.reserve(REQUEST_HEAD + table.len() + token.len() + ids.len() * 8);
    out.extend_from_slice(&REQUEST_MAGIC);
    out.extend_from_slice(&(dtype as u32).to_le_bytes());
    out.extend_from_slice(&(table.len() as u32).to_le_bytes());
    out.extend_from_slice(&(token.len() as u32).to_le_bytes());
    out.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    out.extend_from_slice(table.as_bytes());
    out.extend_from_slice(token);
    if cfg!(target_endian = "little") {
        // SAFETY: any u64 is valid as 8 bytes; the length is in bytes.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(ids.as_ptr().cast::<u8>(), ids.len() * 8)
        });
    } else {
        for id in ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// A request's head, or what is wrong with it (then the connection cannot be read on).
pub fn parse_request_head(b: &[u8; REQUEST_HEAD]) -> Result<RequestHead, String> {
    if b[..4] != REQUEST_MAGIC {
        return Err(format!(
            "not a pstore rows request (it starts with {:?}, not {:?})",
            String::from_utf8_lossy(&b[..4]),
            String::from_utf8_lossy(&REQUEST_MAGIC)
        ));
    }
    let h = RequestHead {
        dtype: u32_at(b, 4) as i32,
        table: u32_at(b, 8) as usize,
        token: u32_at(b, 12) as usize,
        ids: u64_at(b, 16),
    };
    if h.table > MAX_TABLE {
        return Err(format!(
            "a table name of {} bytes (at most {MAX_TABLE})",
            h.table
        ));
    }
    if h.token > MAX_TOKEN {
        return Err(format!(
            "a token of {} bytes (at most {MAX_TOKEN})",
            h.token
        ));
    }
    Ok(h)
}

/// An answer's head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnswerHead {
    /// gRPC status code; 0 for rows.
    pub code: i32,
    /// The rows' wire dtype.
    pub dtype: i32,
    /// The row width.
    pub dim: u32,
    /// The artifact generation read.
    pub generation: u64,
    /// Bytes after the head.
    pub len: u64,
}

impl AnswerHead {
    /// The head's bytes.
    pub fn encode(&self) -> [u8; ANSWER_HEAD] {
        let mut b = [0u8; ANSWER_HEAD];
        b[..4].copy_from_slice(&ANSWER_MAGIC);
        b[4..8].copy_from_slice(&(self.code as u32).to_le_bytes());
        b[8..12].copy_from_slice(&(self.dtype as u32).to_le_bytes());
        b[12..16].copy_from_slice(&self.dim.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The head in `b`, or what is wrong with it.
    pub fn parse(b: &[u8; ANSWER_HEAD]) -> Result<Self, String> {
        if b[..4] != ANSWER_MAGIC {
            return Err("the server's answer is not a pstore rows answer".to_string());
        }
        Ok(Self {
            code: u32_at(b, 4) as i32,
            dtype: u32_at(b, 8) as i32,
            dim: u32_at(b, 12),
            generation: u64_at(b, 16),
            len: u64_at(b, 24),
        })
    }
}

/// The whole answer (head and body) for a failed request.
pub fn encode_error(s: &tonic::Status) -> Vec<u8> {
    let meta = |k: &str| {
        s.metadata()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let message = s.message();
    let message = if message.len() > MAX_MESSAGE_BYTES {
        crate::error::prefix(message, MAX_MESSAGE_BYTES)
    } else {
        message
    };
    let mut body = Vec::new();
    for part in [message, &meta(ERROR_KIND), &meta("pstore-table")] {
        body.extend_from_slice(&(part.len() as u32).to_le_bytes());
        body.extend_from_slice(part.as_bytes());
    }
    let head = AnswerHead {
        code: (s.code() as i32).max(2),
        dtype: 0,
        dim: 0,
        generation: 0,
        len: body.len() as u64,
    };
    let mut out = head.encode().to_vec();
    out.extend_from_slice(&body);
    out
}

/// The status an error answer's body carries (as the gRPC path would have it).
pub fn decode_error(code: i32, body: &[u8]) -> tonic::Status {
    let mut parts = Vec::new();
    let mut at = 0;
    while parts.len() < 3 && at + 4 <= body.len() {
        let n = u32_at(body, at) as usize;
        at += 4;
        let end = at.saturating_add(n).min(body.len());
        parts.push(String::from_utf8_lossy(&body[at..end]).into_owned());
        at = end;
    }
    parts.resize(3, String::new());
    let code = match tonic::Code::from(code) {
        tonic::Code::Ok => tonic::Code::Unknown,
        c => c,
    };
    let mut s = tonic::Status::new(code, parts[0].clone());
    for (k, v) in [(ERROR_KIND, &parts[1]), ("pstore-table", &parts[2])] {
        if !v.is_empty() {
            if let Ok(v) = v.parse() {
                s.metadata_mut().insert(k, v);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip() {
        let mut b = Vec::new();
        encode_request(&mut b, "emb", Some("tok"), 1, &[7, u64::MAX]);
        assert_eq!(b.len(), REQUEST_HEAD + 3 + 3 + 16);
        let head: [u8; REQUEST_HEAD] = b[..REQUEST_HEAD].try_into().unwrap();
        let h = parse_request_head(&head).unwrap();
        assert_eq!(
            h,
            RequestHead {
                dtype: 1,
                table: 3,
                token: 3,
                ids: 2
            }
        );
        assert_eq!(&b[REQUEST_HEAD..REQUEST_HEAD + 6], b"embtok");
        assert_eq!(&b[REQUEST_HEAD + 6..REQUEST_HEAD + 14], &7u64.to_le_bytes());
        let mut bad = head;
        bad[0] = b'G';
        assert!(parse_request_head(&bad)
            .unwrap_err()
            .contains("not a pstore"));
        let mut long = head;
        long[8..12].copy_from_slice(&(MAX_TABLE as u32 + 1).to_le_bytes());
        assert!(parse_request_head(&long)
            .unwrap_err()
            .contains("table name"));

        let a = AnswerHead {
            code: 0,
            dtype: 2,
            dim: 64,
            generation: 9,
            len: 1 << 40,
        };
        assert_eq!(AnswerHead::parse(&a.encode()).unwrap(), a);
        assert!(AnswerHead::parse(&[0; ANSWER_HEAD]).is_err());

        let e = crate::net::status_of(&crate::Error::UnknownTable("nope".into()));
        let wire = encode_error(&e);
        let h = AnswerHead::parse(wire[..ANSWER_HEAD].try_into().unwrap()).unwrap();
        assert_eq!(h.code, tonic::Code::NotFound as i32);
        assert_eq!(h.len as usize, wire.len() - ANSWER_HEAD);
        let back = decode_error(h.code, &wire[ANSWER_HEAD..]);
        assert_eq!(back.code(), e.code());
        assert_eq!(back.message(), e.message());
        assert!(matches!(
            crate::net::error_of(&back, "s"),
            crate::Error::UnknownTable(t) if t == "nope"
        ));
        // A truncated body still gives a status.
        assert_eq!(decode_error(5, &[9, 0]).code(), tonic::Code::NotFound);
    }
}
