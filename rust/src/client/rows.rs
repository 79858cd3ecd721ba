//! Pulls from a server's rows port (`net/rows.rs`, decisions 0120, 0128 and 0133): a blocking
//! socket per call on the calling thread, each request written before the answer to the one
//! before is read, a float32 answer read straight into the caller's output. Connections are
//! kept for the next call.
//!
//! Whatever goes wrong with the transport (refused, reset, timed out, a foreign answer) is not
//! the caller's error: the pull goes over gRPC instead (with its retries), and the port is left
//! alone for a while. A store server's refusal goes over gRPC too (`Endpoint::store`).

use std::io::Read;
use std::mem::MaybeUninit;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::Status;

use crate::net::proto::Dtype;
use crate::net::proto::{PushRequest, PushResponse};
use crate::net::rows::{
    decode_error, encode_meta, encode_request, recv_raw, send_some, write_parts, AnswerHead,
    CallHead, ANSWER_HEAD, METHOD_PUSH,
};
use crate::net::wire;

/// How long a port whose transport failed is not used.
const REST: Duration = Duration::from_secs(5);
/// The longest error answer read.
const MAX_ERROR: u64 = 64 << 10;
/// Idle connections kept per port.
const KEEP: usize = 4;
/// The longest wait for a connection to the port (a firewalled port must not hold a pull for
/// the whole call timeout before it goes over gRPC).
const CONNECT: Duration = Duration::from_secs(1);

/// A server's rows port.
pub(super) struct Endpoint {
    addr: String,
    /// A store server's port: a refusal ("moved", a routing or layout check, ...) is not
    /// answered here but by the same pull over gRPC, whose retries and routing refreshes
    /// handle it; its pulls carry the routing's metadata.
    pub(super) store: bool,
    idle: Mutex<Vec<Conn>>,
    /// Until when the port is not used (its transport failed).
    rest: Mutex<Option<Instant>>,
}

struct Conn {
    sock: TcpStream,
    req: Vec<u8>,
    /// A pull request sent ahead whose end the socket did not take yet: its position in the
    /// exchange and the bytes of `req` sent.
    unsent: Option<(usize, usize)>,
}

/// A push part as it goes to the rows port: its message (whose own `ids` and `grads` are not
/// read) and the wire bytes of its ids and gradients, which go to the socket from where they
/// are (the caller's arrays, for a part that is a run of them).
pub(super) struct PushPart<'a> {
    pub(super) msg: &'a PushRequest,
    pub(super) ids: &'a [u8],
    pub(super) grads: &'a [u8],
}

/// A pull on the rows port: `ids` of `table`, rows `dim` wide, in `dtype` on the wire.
#[derive(Clone, Copy)]
pub(super) struct Ask<'a> {
    pub(super) table: &'a str,
    pub(super) token: Option<&'a str>,
    pub(super) dtype: Dtype,
    pub(super) ids: &'a [u64],
    pub(super) dim: usize,
    /// The metadata a gRPC `Pull` would carry (key, value).
    pub(super) meta: &'a [(&'a str, &'a str)],
}

/// How a pull on the rows port ended.
pub(super) enum Pulled {
    /// Every row written; the generation read.
    Rows(u64),
    /// The server's error, as the gRPC path would have it.
    Failed(Status),
    /// The rows are `dim` wide on the server, not as the caller expected.
    Dim(u32),
    /// The transport failed: nothing is known about the rows.
    Transport,
}

impl Endpoint {
    /// The rows port `port` of the server named `server` (`host:port`); `store`: a store
    /// server's.
    pub(super) fn new(server: &str, port: u32, store: bool) -> Self {
        let host = server.rsplit_once(':').map_or(server, |(h, _)| h);
        Self {
            addr: format!("{host}:{port}"),
            store,
            idle: Mutex::new(Vec::new()),
            rest: Mutex::new(None),
        }
    }

    /// False while the port rests after a failure.
    pub(super) fn usable(&self) -> bool {
        let mut r = self.rest.lock().unwrap_or_else(|e| e.into_inner());
        match *r {
            Some(t) if Instant::now() < t => false,
            Some(_) => {
                *r = None;
                true
            }
            None => true,
        }
    }

    fn connect(&self, timeout: Duration) -> std::io::Result<Conn> {
        let mut last = None;
        for a in self.addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout.min(CONNECT)) {
                Ok(sock) => {
                    sock.set_nodelay(true)?;
                    sock.set_read_timeout(Some(timeout))?;
                    sock.set_write_timeout(Some(timeout))?;
                    return Ok(Conn {
                        sock,
                        req: Vec::new(),
                        unsent: None,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()))
    }

    /// Sends `n` requests on one connection, request k once the answers before k - `ahead`
    /// are read (0: each after the answer to the one before): `send(conn, k)` writes request
    /// k, `recv(conn, k)` reads its answer and says whether the exchange goes on (an exchange
    /// that ends with requests still unanswered does not keep its connection). On a kept
    /// connection, and once more on a new one if that fails (every request again: a pull
    /// writes its rows again, a push's request ids make a second copy an answer, not a second
    /// application); false when the transport failed (the port then rests).
    ///
    /// Requests sent ahead wait in the sockets' buffers while the server answers the one
    /// before. A server blocked writing a large answer stops reading, and a client blocked
    /// writing a request would never read that answer: `send` may block on a request sent
    /// ahead only when its answers are a few bytes the server can always write (a push's);
    /// otherwise (a pull's rows) it writes what the socket takes at once and the rest once the
    /// answer before is read.
    fn exchange(
        &self,
        n: usize,
        ahead: usize,
        timeout: Duration,
        mut send: impl FnMut(&mut Conn, usize) -> Option<()>,
        mut recv: impl FnMut(&mut Conn, usize) -> Option<Step>,
    ) -> bool {
        let kept = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let fresh = kept.is_none();
        let mut conn = match kept.map_or_else(|| self.connect(timeout), Ok) {
            Ok(c) => c,
            Err(_) => return self.failed(),
        };
        let mut run = |conn: &mut Conn| -> Option<bool> {
            let mut sent = 0;
            for k in 0..n {
                while sent < n && sent <= k + ahead {
                    send(conn, sent)?;
                    sent += 1;
                }
                let step = recv(conn, k)?;
                if step != Step::Next {
                    return Some(step == Step::Stop && sent == k + 1);
                }
            }
            Some(true)
        };
        let mut r = run(&mut conn);
        if r.is_none() && !fresh {
            // A kept connection the server may have closed meanwhile.
            conn = match self.connect(timeout) {
                Ok(c) => c,
                Err(_) => return self.failed(),
            };
            r = run(&mut conn);
        }
        let Some(reusable) = r else {
            return self.failed();
        };
        if conn.req.capacity() > 1 << 20 {
            conn.req = Vec::new();
        }
        if reusable {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < KEEP {
                idle.push(conn);
            }
        }
        true
    }

    /// Pulls `asks` into `out`, in order, each request sent before the answer to the one
    /// before is read and each answer received into the next part of `out`: the oldest
    /// generation read, or how the first part that did not answer rows ended.
    pub(super) fn pull(
        &self,
        asks: &[Ask<'_>],
        out: &mut [MaybeUninit<f32>],
        timeout: Duration,
    ) -> Pulled {
        let mut at = Vec::with_capacity(asks.len());
        let mut end = 0;
        for a in asks {
            at.push(end);
            end += a.ids.len() * a.dim;
        }
        if end > out.len() {
            return Pulled::Transport;
        }
        let mut result = Pulled::Rows(u64::MAX);
        // Each request goes out before the answer to the one before is read, so the server
        // looks the next part's rows up while this part's are on their way. What the socket
        // does not take at once waits until that answer is read: the server reads request k
        // only after writing answer k - 1 whole.
        let ok = self.exchange(
            asks.len(),
            1,
            timeout,
            |conn, k| {
                finish_unsent(conn)?;
                let a = &asks[k];
                encode_request(
                    &mut conn.req,
                    a.table,
                    a.token,
                    a.meta,
                    a.dtype as i32,
                    a.ids,
                );
                if k == 0 {
                    return write_parts(&mut conn.sock, &[&conn.req]).ok();
                }
                let sent = send_some(&conn.sock, &conn.req).ok()?;
                if sent < conn.req.len() {
                    conn.unsent = Some((k, sent));
                }
                Some(())
            },
            |conn, k| {
                if k == 0 {
                    result = Pulled::Rows(u64::MAX);
                }
                if conn.unsent.is_some_and(|(j, _)| j == k) {
                    finish_unsent(conn)?;
                }
                let a = &asks[k];
                let (p, step) = read_rows(conn, a, &mut out[at[k]..at[k] + a.ids.len() * a.dim])?;
                match (p, &mut result) {
                    (Pulled::Rows(g), Pulled::Rows(min)) => *min = (*min).min(g),
                    (p, _) => result = p,
                }
                Some(step)
            },
        );
        if ok {
            result
        } else {
            Pulled::Transport
        }
    }

    /// Pushes `parts` (each a whole `Push` message; their ids and gradients go to the socket
    /// from where they are, not copied into the request), all sent before the first answer is
    /// read (the server applies them in order): each part's answer or refusal; None when the
    /// transport failed (nothing is known of the parts).
    pub(super) fn push(
        &self,
        parts: &[PushPart<'_>],
        token: Option<&str>,
        meta: &[(&str, &str)],
        timeout: Duration,
    ) -> Option<Vec<std::result::Result<PushResponse, Status>>> {
        use prost::Message;
        let token = token.unwrap_or("").as_bytes();
        let mut answers: Vec<std::result::Result<PushResponse, Status>> = Vec::new();
        // Every part goes out before the first answer is read: the server applies part k
        // while part k + 1 arrives (its answers are a few bytes each).
        let ok = self.exchange(
            parts.len(),
            parts.len(),
            timeout,
            |conn, k| {
                let m = &parts[k];
                let rest = PushRequest {
                    ids: bytes::Bytes::new(),
                    grads: bytes::Bytes::new(),
                    ..m.msg.clone()
                };
                let r = &mut conn.req;
                r.clear();
                r.extend_from_slice(&[0; crate::net::rows::REQUEST_HEAD]);
                r.extend_from_slice(token);
                encode_meta(r, meta);
                let body = r.len();
                rest.encode(r).ok()?;
                // The ids, then the gradients, each after a pad that puts it where the server
                // reads it in place (8- and 4-byte aligned from the message's start, which
                // the server's buffer aligns); they go to the socket from their own buffers.
                let at = r.len() - body;
                field_head(r, at, 2, m.ids.len(), 8);
                let mut mid = Vec::with_capacity(32);
                field_head(&mut mid, r.len() - body + m.ids.len(), 3, m.grads.len(), 4);
                let len = r.len() - body + m.ids.len() + mid.len() + m.grads.len();
                let head = CallHead {
                    method: METHOD_PUSH,
                    token: token.len(),
                    meta: body - crate::net::rows::REQUEST_HEAD - token.len(),
                    body: len as u64,
                };
                r[..crate::net::rows::REQUEST_HEAD].copy_from_slice(&head.encode());
                write_parts(&mut conn.sock, &[&conn.req, m.ids, &mid, m.grads]).ok()
            },
            |conn, k| {
                if k == 0 {
                    answers.clear();
                }
                let mut head = [0u8; ANSWER_HEAD];
                conn.sock.read_exact(&mut head).ok()?;
                let h = AnswerHead::parse(&head).ok()?;
                if h.len > MAX_ERROR {
                    return None;
                }
                let mut body = vec![0u8; h.len as usize];
                conn.sock.read_exact(&mut body).ok()?;
                answers.push(if h.code != 0 {
                    Err(decode_error(h.code, &body))
                } else {
                    Ok(PushResponse::decode(body.as_slice()).ok()?)
                });
                Some(Step::Next)
            },
        );
        (ok && answers.len() == parts.len()).then_some(answers)
    }

    fn failed(&self) -> bool {
        *self.rest.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + REST);
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        false
    }
}

/// Appends the head of protobuf field `num` (length-delimited, `len` bytes) to `out`, after a
/// `pad` field sized so that the field's bytes start a multiple of `align` bytes from the
/// message's start; `at` is where `out`'s end sits in the message. Nothing for an empty field.
fn field_head(out: &mut Vec<u8>, at: usize, num: u32, len: usize, align: usize) {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    if len == 0 {
        return;
    }
    const PAD: u32 = 127;
    // A pad field is its key, a one-byte length and that many bytes.
    let head = key_len(num) + encoded_len_varint(len as u64);
    let fill = (align - (at + key_len(PAD) + 1 + head) % align) % align;
    encode_key(PAD, WireType::LengthDelimited, out);
    encode_varint(fill as u64, out);
    out.resize(out.len() + fill, 0);
    encode_key(num, WireType::LengthDelimited, out);
    encode_varint(len as u64, out);
}

/// Sends the rest of a request sent ahead, if the socket did not take all of it; only once
/// the answers before that request are read.
fn finish_unsent(conn: &mut Conn) -> Option<()> {
    if let Some((_, at)) = conn.unsent.take() {
        write_parts(&mut conn.sock, &[&conn.req[at..]]).ok()?;
    }
    Some(())
}

/// How an answer of an exchange ended.
#[derive(Clone, Copy, PartialEq)]
enum Step {
    /// Read whole: the next request follows.
    Next,
    /// Read whole, but the exchange ends here (the connection can be kept).
    Stop,
    /// Not read (or not whole): the exchange ends here and the connection is not used again.
    Abandon,
}

/// Reads the answer to pull `ask` into `out`; `None` when the transport failed.
fn read_rows(
    conn: &mut Conn,
    ask: &Ask<'_>,
    out: &mut [MaybeUninit<f32>],
) -> Option<(Pulled, Step)> {
    let (ids, dim) = (ask.ids, ask.dim);
    let mut head = [0u8; ANSWER_HEAD];
    conn.sock.read_exact(&mut head).ok()?;
    let h = AnswerHead::parse(&head).ok()?;
    if h.code != 0 {
        if h.len > MAX_ERROR {
            return None;
        }
        let mut body = vec![0u8; h.len as usize];
        conn.sock.read_exact(&mut body).ok()?;
        return Some((Pulled::Failed(decode_error(h.code, &body)), Step::Stop));
    }
    if h.dim as usize != dim {
        // The rows are not read: the connection is not used again.
        return Some((Pulled::Dim(h.dim), Step::Abandon));
    }
    let dt = wire::dtype(h.dtype).ok()?;
    let want = ids.len() * dim * wire::width(dt);
    if h.len != want as u64 {
        return None;
    }
    if dt == Dtype::Float32 && cfg!(target_endian = "little") {
        // SAFETY: `out` holds ids.len() * dim floats, `want` bytes; the kernel writes them.
        unsafe { recv_raw(&conn.sock, out.as_mut_ptr().cast::<u8>(), want) }.ok()?;
    } else {
        let mut body = vec![0u8; want];
        conn.sock.read_exact(&mut body).ok()?;
        let pos: Vec<u32> = (0..ids.len() as u32).collect();
        wire::scatter_rows(&bytes::Bytes::from(body), dt, &pos, dim, out).ok()?;
    }
    Some((Pulled::Rows(h.generation), Step::Next))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn padded_fields_start_aligned_and_decode_as_the_message() {
        for table in ["", "t", "a longer table name"] {
            for n in [0usize, 1, 3, 4096] {
                let m = PushRequest {
                    table: table.into(),
                    ids: (0..n as u64).flat_map(u64::to_le_bytes).collect(),
                    grads: (0..n * 3).map(|i| i as u8).collect(),
                    request_id: Some(crate::net::proto::RequestId { client: 1, seq: 2 }),
                    ..Default::default()
                };
                let rest = PushRequest {
                    ids: bytes::Bytes::new(),
                    grads: bytes::Bytes::new(),
                    ..m.clone()
                };
                let mut out = rest.encode_to_vec();
                let at = out.len();
                field_head(&mut out, at, 2, m.ids.len(), 8);
                let ids_at = out.len();
                out.extend_from_slice(&m.ids);
                let at = out.len();
                field_head(&mut out, at, 3, m.grads.len(), 4);
                let grads_at = out.len();
                out.extend_from_slice(&m.grads);
                if n > 0 {
                    assert_eq!((ids_at % 8, grads_at % 4), (0, 0));
                }
                let back = PushRequest::decode(bytes::Bytes::from(out)).unwrap();
                assert_eq!(
                    PushRequest {
                        pad: bytes::Bytes::new(),
                        ..back
                    },
                    m
                );
            }
        }
    }
}
