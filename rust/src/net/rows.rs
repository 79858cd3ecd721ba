//! The rows protocol: pulls over a plain TCP connection, from a model server (decision 0120)
//! or a store server (decision 0128; docs/PROTOCOL.md "Rows port"), beside `pstore.v1` over
//! gRPC.
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
//! (UTF-8), the token, and the ids (u64 each). A request with `b"PSq2"` has 8 more bytes of
//! head, the length of its metadata (u32) and a u32 0, and its metadata after the token: pairs
//! of a key and a value (each a u32 length and its ASCII bytes), the gRPC metadata a `Pull` over
//! gRPC would carry (a store server's routing epoch and layout).
//!
//! A call (decision 0129): a 24-byte head, `b"PSc1"`, the method (u32, [`METHOD_PUSH`]), the
//! token's length (u32), the metadata's length (u32), the message's length (u64); then the
//! token, the metadata (pairs as above) and the method's request message (protobuf, as gRPC
//! carries it in its frames). Its answer's head has dtype, width and generation 0 and is
//! followed by the answer's message (protobuf).
//!
//! Answer: a 32-byte head, `b"PSa1"`, the gRPC status code (u32, 0: OK), the dtype (u32), the
//! row width (u32), the generation read (u64, a pull's `seq` and `version`), the length of what
//! follows (u64). After an OK head: the rows, as `PullResponse.rows` holds them. After an
//! error: the message, the error's kind and the table it names (each a u32 length and its
//! UTF-8 bytes), what the gRPC status carries in its message and metadata.

use crate::net::{ERROR_KIND, MAX_MESSAGE_BYTES};

/// The first bytes of a request.
pub const REQUEST_MAGIC: [u8; 4] = *b"PSq1";
/// The first bytes of a request with metadata.
pub const REQUEST_MAGIC_META: [u8; 4] = *b"PSq2";
/// Bytes of head a request with metadata has after the first [`REQUEST_HEAD`].
pub const META_HEAD: usize = 8;
/// The most bytes of metadata a request may carry.
pub const MAX_META: usize = 4096;
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

/// The first bytes of a call.
pub const CALL_MAGIC: [u8; 4] = *b"PSc1";
/// A call's method: `Push`.
pub const METHOD_PUSH: u32 = 1;

/// A call's head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallHead {
    /// What is called ([`METHOD_PUSH`]).
    pub method: u32,
    /// Bytes of the token.
    pub token: usize,
    /// Bytes of metadata.
    pub meta: usize,
    /// Bytes of the request message.
    pub body: u64,
}

impl CallHead {
    /// The head's bytes.
    pub fn encode(&self) -> [u8; REQUEST_HEAD] {
        let mut b = [0u8; REQUEST_HEAD];
        b[..4].copy_from_slice(&CALL_MAGIC);
        b[4..8].copy_from_slice(&self.method.to_le_bytes());
        b[8..12].copy_from_slice(&(self.token as u32).to_le_bytes());
        b[12..16].copy_from_slice(&(self.meta as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.body.to_le_bytes());
        b
    }

    /// The call head in `b` (whose first bytes are [`CALL_MAGIC`]), or what is wrong with it
    /// (then the connection cannot be read on).
    pub fn parse(b: &[u8; REQUEST_HEAD]) -> Result<Self, String> {
        let h = Self {
            method: u32_at(b, 4),
            token: u32_at(b, 8) as usize,
            meta: u32_at(b, 12) as usize,
            body: u64_at(b, 16),
        };
        if h.token > MAX_TOKEN {
            return Err(format!(
                "a token of {} bytes (at most {MAX_TOKEN})",
                h.token
            ));
        }
        if h.meta > MAX_META {
            return Err(format!("{} bytes of metadata (at most {MAX_META})", h.meta));
        }
        Ok(h)
    }
}

/// The metadata pairs, encoded as requests carry them, appended to `out`.
pub fn encode_meta(out: &mut Vec<u8>, meta: &[(&str, &str)]) {
    for (k, v) in meta {
        for part in [k, v] {
            out.extend_from_slice(&(part.len() as u32).to_le_bytes());
            out.extend_from_slice(part.as_bytes());
        }
    }
}

/// Writes `parts` in order, with as few calls as the socket takes.
pub fn write_parts(sock: &mut std::net::TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    use std::io::{IoSlice, Write};
    let mut at = 0;
    let mut first = parts.first().copied().unwrap_or(&[]);
    while at < parts.len() {
        let mut slices = Vec::with_capacity(parts.len() - at);
        slices.push(IoSlice::new(first));
        slices.extend(parts[at + 1..].iter().map(|p| IoSlice::new(p)));
        let mut n = match sock.write_vectored(&slices) {
            Ok(0) if slices.iter().any(|s| !s.is_empty()) => {
                return Err(std::io::ErrorKind::WriteZero.into())
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        // Skips what was written: whole parts, then into the first one left.
        while at < parts.len() && n >= first.len() {
            n -= first.len();
            at += 1;
            first = parts.get(at).copied().unwrap_or(&[]);
        }
        first = &first[n..];
    }
    Ok(())
}

/// Writes as much of `buf` as the socket takes without waiting: the bytes written (0 when
/// its buffers are full).
pub fn send_some(sock: &std::net::TcpStream, buf: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut at = 0;
    while at < buf.len() {
        // SAFETY: the kernel reads at most `buf.len() - at` bytes from `buf + at`.
        let n = unsafe {
            libc::send(
                sock.as_raw_fd(),
                buf[at..].as_ptr().cast::<libc::c_void>(),
                buf.len() - at,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            at += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => break,
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
    Ok(at)
}

/// Reads exactly `len` bytes into `dst`, which need not be initialised.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes.
pub unsafe fn recv_raw(
    sock: &std::net::TcpStream,
    dst: *mut u8,
    len: usize,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut got = 0;
    while got < len {
        // SAFETY: the caller's `dst` is writable for `len` bytes; the kernel writes at most
        // `len - got` bytes from `dst + got`.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                dst.add(got).cast::<libc::c_void>(),
                len - got,
                0,
            )
        };
        match n {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => got += n as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

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
    /// Whether [`META_HEAD`] bytes of head follow (`b"PSq2"`).
    pub meta: bool,
}

/// The request for `ids` of `table`, head and body, appended to `out` (cleared first); with
/// `meta` (key, value pairs), a `b"PSq2"` request that carries them.
pub fn encode_request(
    out: &mut Vec<u8>,
    table: &str,
    token: Option<&str>,
    meta: &[(&str, &str)],
    dtype: i32,
    ids: &[u64],
) {
    let token = token.unwrap_or("").as_bytes();
    let pairs: usize = meta.iter().map(|(k, v)| 8 + k.len() + v.len()).sum();
    out.clear();
    out.reserve(REQUEST_HEAD + META_HEAD + table.len() + token.len() + pairs + ids.len() * 8);
    out.extend_from_slice(if meta.is_empty() {
        &REQUEST_MAGIC
    } else {
        &REQUEST_MAGIC_META
    });
    out.extend_from_slice(&(dtype as u32).to_le_bytes());
    out.extend_from_slice(&(table.len() as u32).to_le_bytes());
    out.extend_from_slice(&(token.len() as u32).to_le_bytes());
    out.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    if !meta.is_empty() {
        out.extend_from_slice(&(pairs as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
    }
    out.extend_from_slice(table.as_bytes());
    out.extend_from_slice(token);
    encode_meta(out, meta);
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
    if b[..4] != REQUEST_MAGIC && b[..4] != REQUEST_MAGIC_META {
        return Err(format!(
            "not a pstore rows request (it starts with {:?}, not {:?}, {:?} or {:?})",
            String::from_utf8_lossy(&b[..4]),
            String::from_utf8_lossy(&REQUEST_MAGIC),
            String::from_utf8_lossy(&REQUEST_MAGIC_META),
            String::from_utf8_lossy(&CALL_MAGIC)
        ));
    }
    let h = RequestHead {
        dtype: u32_at(b, 4) as i32,
        table: u32_at(b, 8) as usize,
        token: u32_at(b, 12) as usize,
        ids: u64_at(b, 16),
        meta: b[..4] == REQUEST_MAGIC_META,
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

/// The length of a `b"PSq2"` request's metadata from the rest of its head, or what is wrong
/// with it (then the connection cannot be read on).
pub fn parse_meta_head(b: &[u8; META_HEAD]) -> Result<usize, String> {
    let (len, zero) = (u32_at(b, 0) as usize, u32_at(b, 4));
    if zero != 0 {
        return Err(format!("a request head's reserved word is {zero}, not 0"));
    }
    if len > MAX_META {
        return Err(format!("{len} bytes of metadata (at most {MAX_META})"));
    }
    Ok(len)
}

/// A request's metadata: its (key, value) pairs, or what is wrong with them.
pub fn parse_meta(b: &[u8]) -> Result<Vec<(&str, &str)>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    let part = |at: &mut usize| -> Result<&str, String> {
        let n = (*at + 4 <= b.len())
            .then(|| u32_at(b, *at) as usize)
            .filter(|&n| *at + 4 + n <= b.len())
            .ok_or("the metadata ends inside a key or a value")?;
        let text = std::str::from_utf8(&b[*at + 4..*at + 4 + n])
            .ok()
            .filter(|t| t.is_ascii())
            .ok_or("a metadata key or value is not ASCII")?;
        *at += 4 + n;
        Ok(text)
    };
    while at < b.len() {
        let k = part(&mut at)?;
        let v = part(&mut at)?;
        out.push((k, v));
    }
    Ok(out)
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
    /// The artifact generation read (a store server: the table version).
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
        encode_request(&mut b, "emb", Some("tok"), &[], 1, &[7, u64::MAX]);
        assert_eq!(b.len(), REQUEST_HEAD + 3 + 3 + 16);
        let head: [u8; REQUEST_HEAD] = b[..REQUEST_HEAD].try_into().unwrap();
        let h = parse_request_head(&head).unwrap();
        assert_eq!(
            h,
            RequestHead {
                dtype: 1,
                table: 3,
                token: 3,
                ids: 2,
                meta: false,
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

        // With metadata: 8 more bytes of head, the pairs after the token.
        encode_request(&mut b, "t", None, &[("x-a", "1"), ("k", "")], 0, &[3]);
        let head: [u8; REQUEST_HEAD] = b[..REQUEST_HEAD].try_into().unwrap();
        let h = parse_request_head(&head).unwrap();
        assert!(h.meta);
        let more: [u8; META_HEAD] = b[REQUEST_HEAD..REQUEST_HEAD + META_HEAD]
            .try_into()
            .unwrap();
        let n = parse_meta_head(&more).unwrap();
        let at = REQUEST_HEAD + META_HEAD + 1;
        assert_eq!(
            parse_meta(&b[at..at + n]).unwrap(),
            vec![("x-a", "1"), ("k", "")]
        );
        assert_eq!(&b[at + n..], &3u64.to_le_bytes());
        assert!(parse_meta(&b[at..at + n - 1]).is_err());
        assert!(parse_meta(&[1, 0, 0, 0, 0xff, 0, 0, 0, 0]).is_err());
        let mut big = more;
        big[..4].copy_from_slice(&(MAX_META as u32 + 1).to_le_bytes());
        assert!(parse_meta_head(&big).unwrap_err().contains("metadata"));
        big = more;
        big[4] = 1;
        assert!(parse_meta_head(&big).unwrap_err().contains("reserved"));

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
