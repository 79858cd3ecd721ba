//! A server's rows port (`net/rows.rs`, decisions 0120 and 0128): one blocking thread per
//! connection reads a request, has the handler look its rows up into the connection's answer
//! buffer (a model server) or answer them in a buffer of its own (a store server, whose `Pull`
//! fills one), and sends head and rows with one write. The buffer is kept across calls (no
//! fill, no page faults); the request is handled on the thread that read it. A handler may send
//! the answer itself (`Out`): a store server's pull of 512 KiB to 2 MiB goes out a slice at a
//! time as its pool looks the rows up (`Streamed`, decision 0133).
//!
//! A store server also takes calls (`PSc1`, decision 0129): a push's protobuf message read
//! into a buffer kept across calls and decoded in place (the gradients stay where the socket
//! put them), answered by the same `Push` handler as over gRPC.
//!
//! A request the server cannot frame (a foreign protocol, a name or token over the limits, ids
//! over the message limit) is answered with an error and its connection closed; any other
//! failure is an error answer and the connection goes on.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tonic::Status;

use super::conn::Limits;
use crate::error::{invalid, Error, Result};
use crate::net::rows::{
    encode_error, parse_meta, parse_meta_head, parse_request_head, recv_raw, write_parts,
    AnswerHead, CallHead, ANSWER_HEAD, CALL_MAGIC, META_HEAD, REQUEST_HEAD,
};

/// Floats of the answer buffer in front of the rows: the answer's head.
pub const HEAD_WORDS: usize = ANSWER_HEAD / 4;

/// Answers above this many bytes do not keep their buffer for the next call (a 4096 x 64
/// float32 answer is 1 MiB): an idle connection holds at most this much.
const KEEP_BYTES: usize = 2 << 20;

/// Call messages up to this many bytes keep their buffer for the next call: pstore's client
/// sends pushes in messages of at most 4 MiB of ids and gradients (`CHUNK_BYTES`), each of
/// which would otherwise fault a fresh buffer in.
const KEEP_CALL_BYTES: usize = 5 << 20;

/// One pull as the rows port received it.
pub struct Call<'a> {
    /// The request's token, if it carries one.
    pub token: Option<&'a [u8]>,
    /// The table.
    pub table: &'a str,
    /// The wire dtype asked for.
    pub dtype: i32,
    /// The ids.
    pub ids: &'a [u64],
    /// The request's metadata (key, value), as a `Pull` over gRPC carries it.
    pub meta: &'a [(&'a str, &'a str)],
}

/// What the handler wrote after [`HEAD_WORDS`] floats of the buffer.
pub struct Rows {
    /// The rows' wire dtype.
    pub dtype: i32,
    /// The row width.
    pub dim: u32,
    /// The artifact generation read.
    pub generation: u64,
    /// Bytes of rows written.
    pub bytes: usize,
    /// The rows in a buffer of their own (then nothing was written after the head's floats).
    pub own: Option<bytes::Bytes>,
}

impl Rows {
    /// The head of the answer that carries these rows.
    pub fn head(&self) -> [u8; ANSWER_HEAD] {
        AnswerHead {
            code: 0,
            dtype: self.dtype,
            dim: self.dim,
            generation: self.generation,
            len: self.bytes as u64,
        }
        .encode()
    }
}

/// Looks a call's rows up into `buf` (after its first [`HEAD_WORDS`] floats, growing it as
/// needed), or fails with the status the gRPC path would answer. A handler may instead send
/// the answer itself through the [`Out`] (a store server's large pull, sent as its rows are
/// looked up): then nothing more is sent, and a failure after the first byte closes the
/// connection (the client, short of an answer, pulls over gRPC).
pub type Handler = dyn Fn(&Call<'_>, &mut Vec<f32>, &mut Out<'_>) -> std::result::Result<Rows, Status>
    + Send
    + Sync
    + 'static;

/// The connection's socket, for a handler that sends its answer itself.
pub struct Out<'a> {
    sock: &'a mut TcpStream,
    /// Some bytes of the answer went out (or were attempted).
    started: bool,
    /// A write failed.
    broken: bool,
}

impl Out<'_> {
    /// Writes `parts` in order; false when the connection failed (nothing more can be sent).
    pub fn send(&mut self, parts: &[&[u8]]) -> bool {
        self.started = true;
        if !self.broken && write_parts(self.sock, parts).is_err() {
            self.broken = true;
        }
        !self.broken
    }
}

/// The float32 rows of one pull, looked up on the store's pool a slice at a time while the
/// connection's thread sends the slices already done (decision 0133). The lookup side calls
/// [`begin`](Self::begin), then [`advance`](Self::advance) after each slice, and the pull's
/// end is reported by [`finish`](Self::finish); the connection's side waits with
/// [`wait`](Self::wait). The buffer lives as long as either side holds the `Arc`.
#[derive(Default)]
pub struct Streamed {
    state: Mutex<Filled>,
    cond: Condvar,
}

#[derive(Default)]
struct Filled {
    /// The answer's dtype, row width and generation, set once its checks passed.
    head: Option<(i32, u32, u64)>,
    /// The rows' buffer: its capacity holds them all; the lookup writes past `done` only, the
    /// connection reads before `done` only.
    rows: Vec<u32>,
    /// Bytes of rows written, from the start.
    done: usize,
    /// How the pull ended (None: still going); only the first end counts.
    end: Option<std::result::Result<(), Status>>,
}

/// What [`Streamed::wait`] saw.
pub struct Progress<'a> {
    /// The answer's dtype, row width and generation; None: the pull ended before any row.
    pub head: Option<(i32, u32, u64)>,
    /// The rows' bytes written so far, from the start.
    pub rows: &'a [u8],
    /// How the pull ended, once it has.
    pub end: Option<std::result::Result<(), Status>>,
}

impl Streamed {
    /// Sets the answer's head and makes room for `floats` rows' floats: where to write them.
    /// Each float must be written before [`advance`](Self::advance) passes it. Called once.
    pub fn begin(&self, dtype: i32, dim: u32, generation: u64, floats: usize) -> *mut f32 {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // A second buffer would free the first under the rows the sender holds.
        assert!(s.head.is_none(), "a streamed pull begins once");
        s.rows = crate::net::wire::pooled(floats);
        s.head = Some((dtype, dim, generation));
        self.cond.notify_all();
        s.rows.as_mut_ptr().cast::<f32>()
    }

    /// The first `bytes` bytes of rows are written.
    pub fn advance(&self, bytes: usize) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.done = bytes.min(s.rows.capacity() * 4);
        self.cond.notify_all();
    }

    /// The pull ended (the first end reported counts).
    pub fn finish(&self, end: std::result::Result<(), Status>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.end.is_none() {
            s.end = Some(end);
        }
        self.cond.notify_all();
    }

    /// Waits until more than `sent` bytes of rows are written or the pull ended.
    pub fn wait(&self, sent: usize) -> Progress<'_> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.end.is_none() && (s.head.is_none() || s.done <= sent) {
            s = self.cond.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        // SAFETY: the buffer is allocated once (`begin`) and freed only when `self` drops,
        // which the returned borrow outlives; its first `done` bytes are written and are not
        // written again.
        let rows = unsafe { std::slice::from_raw_parts(s.rows.as_ptr().cast::<u8>(), s.done) };
        Progress {
            head: s.head,
            rows,
            end: s.end.clone(),
        }
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        let s = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        crate::net::wire::give_back(std::mem::take(&mut s.rows));
    }
}

/// A call as the rows port received it (`PSc1`).
pub struct UnaryCall<'a> {
    /// The method ([`crate::net::rows::METHOD_PUSH`]).
    pub method: u32,
    /// The request's token, if it carries one.
    pub token: Option<&'a [u8]>,
    /// The request's metadata (key, value), as the same call over gRPC carries it.
    pub meta: &'a [(&'a str, &'a str)],
    /// The request message (protobuf).
    pub body: bytes::Bytes,
}

/// Answers a call with its answer message (protobuf), or fails with the status the gRPC path
/// would answer.
pub type CallHandler =
    dyn Fn(&UnaryCall<'_>) -> std::result::Result<Vec<u8>, Status> + Send + Sync + 'static;

/// What a port answers: pulls, and calls when it takes any.
#[derive(Clone)]
pub struct Handlers {
    /// Pulls (`PSq1`, `PSq2`).
    pub pull: Arc<Handler>,
    /// Calls (`PSc1`); None: every call is refused (a model server takes pulls only).
    pub call: Option<Arc<CallHandler>>,
}

/// The port's listener and connections; [`RowsPort::stop`] (or dropping it) closes them all.
pub struct RowsPort {
    addr: SocketAddr,
    /// The listening socket (shut down to wake the accept loop).
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

/// Binds the rows port (`addr`, port 0: any free port).
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .map_err(|e| invalid(format!("cannot listen on {addr} (rows port): {e}")))
}

/// The rows port `config` asks for, bound (None: it asks for none). Refused with TLS: the port
/// is plain TCP.
pub fn listen(config: &super::ServerConfig) -> Result<Option<TcpListener>> {
    if config.rows_addr.is_some() && config.tls.is_some() {
        return Err(invalid(
            "the rows port is plain TCP: it cannot be served with TLS (leave rows_port unset)",
        ));
    }
    config.rows_addr.map(bind).transpose()
}

/// The port `l` listens on.
pub fn port_of(l: &TcpListener) -> Result<u32> {
    l.local_addr()
        .map(|a| a.port().into())
        .map_err(|e| Error::Internal(e.to_string()))
}

/// Serves `listener` until stopped.
pub fn serve(
    listener: TcpListener,
    limits: Limits,
    max_message: usize,
    handler: Handlers,
) -> Result<RowsPort> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Internal(e.to_string()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
    let mine = listener
        .try_clone()
        .map_err(|e| Error::Internal(format!("starting the rows port: {e}")))?;
    let (st, cs) = (Arc::clone(&stop), Arc::clone(&conns));
    let accept = std::thread::Builder::new()
        .name("pstore-rows".into())
        .spawn(move || accept_loop(listener, limits, max_message, handler, st, cs))
        .map_err(|e| Error::Internal(format!("starting the rows port: {e}")))?;
    Ok(RowsPort {
        addr,
        listener: mine,
        stop,
        conns,
        accept: Some(accept),
    })
}

impl RowsPort {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and closes every connection (a call being answered ends with its
    /// connection; the client then pulls over gRPC).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.accept.take() {
            // Wakes the blocking accept: on Linux it fails at once on a listening socket that
            // is shut down (and the loop sees `stop`).
            // SAFETY: `shutdown` on the listener's own open descriptor.
            unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
            // Elsewhere a connection wakes it.
            let mut wake = self.addr;
            if wake.ip().is_unspecified() {
                wake.set_ip(match wake {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            if !t.is_finished() {
                let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
            }
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for s in conns.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for RowsPort {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: TcpListener,
    limits: Limits,
    max_message: usize,
    handler: Handlers,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
) {
    let next = AtomicU64::new(0);
    let mut pause = Duration::from_millis(5);
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        let sock = match accepted {
            Ok((s, _)) => {
                pause = Duration::from_millis(5);
                s
            }
            Err(_) => {
                // Out of file descriptors, say: a growing pause instead of a busy loop.
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let id = next.fetch_add(1, Ordering::Relaxed);
        {
            let mut open = conns.lock().unwrap_or_else(|e| e.into_inner());
            if open.len() as u64 >= limits.max_connections {
                continue;
            }
            match sock.try_clone() {
                Ok(c) => open.insert(id, c),
                Err(_) => continue,
            };
        }
        let (h, cs) = (handler.clone(), Arc::clone(&conns));
        let timeout = Duration::from_secs_f64(limits.handshake_timeout);
        let spawned = std::thread::Builder::new()
            .name("pstore-rows-conn".into())
            .spawn(move || {
                serve_conn(sock, timeout, max_message, &h);
                cs.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            });
        if spawned.is_err() {
            conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        }
    }
}

/// Sends `s` as the answer; the connection is then closed by the caller when `fatal`.
fn refuse(sock: &mut TcpStream, s: &Status) -> bool {
    sock.write_all(&encode_error(s)).is_ok()
}

/// `v`'s elements as bytes.
fn bytes_of_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: the element types used here (f32, u64) are plain data: any bytes are a valid
    // value and the slice covers exactly their memory.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Answers the requests of one connection until it closes or fails.
fn serve_conn(mut sock: TcpStream, handshake: Duration, max_message: usize, handlers: &Handlers) {
    let _ = sock.set_nodelay(true);
    // The first request must come within the handshake timeout; later ones may wait.
    let _ = sock.set_read_timeout(Some(handshake));
    let mut head = [0u8; REQUEST_HEAD];
    let mut text = Vec::new();
    let mut ids: Vec<u64> = Vec::new();
    let mut buf: Vec<f32> = Vec::new();
    let mut body = bytes::BytesMut::new();
    let mut first = true;
    loop {
        if sock.read_exact(&mut head).is_err() {
            return;
        }
        if first {
            first = false;
            let _ = sock.set_read_timeout(None);
        }
        if head[..4] == CALL_MAGIC {
            if serve_call(
                &mut sock,
                &head,
                max_message,
                handlers,
                &mut text,
                &mut body,
            ) {
                continue;
            }
            return;
        }
        let h = match parse_request_head(&head) {
            Ok(h) => h,
            Err(m) => {
                refuse(&mut sock, &Status::invalid_argument(m));
                return;
            }
        };
        let mut meta_len = 0;
        if h.meta {
            let mut more = [0u8; META_HEAD];
            if sock.read_exact(&mut more).is_err() {
                return;
            }
            match parse_meta_head(&more) {
                Ok(n) => meta_len = n,
                Err(m) => {
                    refuse(&mut sock, &Status::invalid_argument(m));
                    return;
                }
            }
        }
        let id_bytes = usize::try_from(h.ids)
            .ok()
            .and_then(|n| n.checked_mul(8))
            .unwrap_or(usize::MAX);
        let size = id_bytes.saturating_add(h.table + h.token + meta_len + 16);
        if size > max_message {
            refuse(&mut sock, &too_large(size, max_message));
            return;
        }
        text.resize(h.table + h.token + meta_len, 0);
        ids.resize(id_bytes / 8, 0);
        if sock.read_exact(&mut text).is_err() || sock.read_exact(bytes_of_mut(&mut ids)).is_err() {
            return;
        }
        if cfg!(target_endian = "big") {
            for id in ids.iter_mut() {
                *id = u64::from_le(*id);
            }
        }
        let (name, rest) = text.split_at(h.table);
        let (token, meta) = rest.split_at(h.token);
        let mut out = Out {
            sock: &mut sock,
            started: false,
            broken: false,
        };
        let answer = match (std::str::from_utf8(name), parse_meta(meta)) {
            (Err(_), _) => Err(Status::invalid_argument("the table name is not UTF-8")),
            (_, Err(m)) => Err(Status::invalid_argument(m)),
            (Ok(table), Ok(meta)) => (handlers.pull)(
                &Call {
                    token: (h.token > 0).then_some(token),
                    table,
                    dtype: h.dtype,
                    ids: &ids,
                    meta: &meta,
                },
                &mut buf,
                &mut out,
            ),
        };
        // A handler that sent the answer itself sent it whole when it answered rows, else
        // cut it short (the connection is then closed).
        let (started, broken) = (out.started, out.broken);
        let sent = match answer {
            _ if started => answer.is_ok() && !broken,
            Ok(r) => {
                let head = r.head();
                match &r.own {
                    Some(rows) => write_parts(&mut sock, &[&head, rows]).is_ok(),
                    None => {
                        let out = bytes_of_mut(&mut buf);
                        out[..ANSWER_HEAD].copy_from_slice(&head);
                        let ok = sock.write_all(&out[..ANSWER_HEAD + r.bytes]).is_ok();
                        if r.bytes > KEEP_BYTES {
                            buf = Vec::new();
                        }
                        ok
                    }
                }
            }
            Err(s) => refuse(&mut sock, &s),
        };
        if ids.len() > KEEP_BYTES / 8 {
            ids = Vec::new();
        }
        if !sent {
            return;
        }
    }
}

/// tonic's code and words for a request over the limit.
fn too_large(size: usize, max_message: usize) -> Status {
    Status::out_of_range(format!(
        "Error, decoded message length too large: found {size} bytes, the limit is: \
         {max_message} bytes"
    ))
}

/// Reads the rest of a call whose head is `head` and answers it; true when the connection
/// can take another request. `text` and `body` are the connection's buffers.
fn serve_call(
    sock: &mut TcpStream,
    head: &[u8; REQUEST_HEAD],
    max_message: usize,
    handlers: &Handlers,
    text: &mut Vec<u8>,
    body: &mut bytes::BytesMut,
) -> bool {
    let h = match CallHead::parse(head) {
        Ok(h) => h,
        Err(m) => {
            refuse(sock, &Status::invalid_argument(m));
            return false;
        }
    };
    let size = usize::try_from(h.body).unwrap_or(usize::MAX);
    if size > max_message {
        refuse(sock, &too_large(size, max_message));
        return false;
    }
    text.resize(h.token + h.meta, 0);
    if sock.read_exact(text).is_err() {
        return false;
    }
    // The message goes where the socket puts it, in a buffer the last call's message freed
    // (`reserve` takes it back once nothing holds it).
    body.clear();
    body.reserve(size);
    // SAFETY: `reserve` made room for `size` bytes after the (empty) buffer's start; the
    // kernel writes them all before the length is set.
    unsafe {
        if recv_raw(sock, body.as_mut_ptr(), size).is_err() {
            return false;
        }
        body.set_len(size);
    }
    let message = body.split().freeze();
    let (token, meta) = text.split_at(h.token);
    let answer = match (&handlers.call, parse_meta(meta)) {
        (None, _) => Err(Status::unimplemented(
            "this server's rows port answers pulls only",
        )),
        (_, Err(m)) => Err(Status::invalid_argument(m)),
        (Some(call), Ok(meta)) => call(&UnaryCall {
            method: h.method,
            token: (h.token > 0).then_some(token),
            meta: &meta,
            body: message,
        }),
    };
    let sent = match answer {
        Ok(a) => {
            let head = AnswerHead {
                code: 0,
                dtype: 0,
                dim: 0,
                generation: 0,
                len: a.len() as u64,
            }
            .encode();
            write_parts(sock, &[&head, &a]).is_ok()
        }
        Err(s) => refuse(sock, &s),
    };
    if size > KEEP_CALL_BYTES {
        *body = bytes::BytesMut::new();
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::rows::encode_request;

    /// A handler that sends `table`'s answer itself: "whole" in three writes, "cut" stopping
    /// after its head and some rows with a failure; "refused" fails before sending anything.
    fn handlers() -> Handlers {
        let pull: Arc<Handler> = Arc::new(|c: &Call<'_>, _: &mut Vec<f32>, out: &mut Out<'_>| {
            let rows: Vec<u8> = c
                .ids
                .iter()
                .flat_map(|&i| (i as f32).to_le_bytes())
                .collect();
            let answer = Rows {
                dtype: 0,
                dim: 1,
                generation: 7,
                bytes: rows.len(),
                own: None,
            };
            let head = answer.head();
            let third = rows.len() / 3;
            match c.table {
                "whole" => {
                    out.send(&[&head, &rows[..third]]);
                    out.send(&[&rows[third..2 * third]]);
                    out.send(&[&rows[2 * third..]]);
                    Ok(answer)
                }
                "cut" => {
                    out.send(&[&head, &rows[..third]]);
                    Err(Status::internal("failed after the first rows"))
                }
                _ => Err(Status::not_found("no such table")),
            }
        });
        Handlers { pull, call: None }
    }

    /// Sends a pull of `ids` of `table` and reads its answer's head and `len` bytes (fewer
    /// when the connection closes first).
    fn ask(sock: &mut TcpStream, table: &str, ids: &[u64]) -> (AnswerHead, Vec<u8>) {
        let mut req = Vec::new();
        encode_request(&mut req, table, None, &[], 0, ids);
        sock.write_all(&req).unwrap();
        let mut head = [0u8; ANSWER_HEAD];
        sock.read_exact(&mut head).unwrap();
        let h = AnswerHead::parse(&head).unwrap();
        let mut body = Vec::new();
        let _ = sock.take(h.len).read_to_end(&mut body);
        (h, body)
    }

    #[test]
    fn an_answer_sent_by_its_handler_is_whole_or_closes_the_connection() {
        let l = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = serve(l, Limits::default(), 1 << 20, handlers()).unwrap();
        let mut sock = TcpStream::connect(port.addr()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let ids: Vec<u64> = (0..3000).collect();
        let want: Vec<u8> = ids.iter().flat_map(|&i| (i as f32).to_le_bytes()).collect();
        for table in ["whole", "refused", "whole"] {
            let (h, body) = ask(&mut sock, table, &ids);
            if table == "whole" {
                assert_eq!((h.code, h.generation), (0, 7));
                assert_eq!(body, want);
            } else {
                // A refusal before any byte is an error answer; the connection goes on.
                assert_ne!(h.code, 0);
                assert!(String::from_utf8_lossy(&body).contains("no such table"));
            }
        }
        // Cut short: the rows that went out, then the end of the connection.
        let (h, body) = ask(&mut sock, "cut", &ids);
        assert_eq!((h.code, h.len), (0, want.len() as u64));
        assert_eq!(body, want[..want.len() / 3]);
        let mut more = [0u8; 1];
        assert_eq!(sock.read(&mut more).unwrap(), 0);
    }

    #[test]
    fn streamed_rows_reach_the_sender_in_order_and_an_end_before_any_row_is_its_failure() {
        let st = Arc::new(Streamed::default());
        let n = 10_000usize;
        let filler = {
            let st = Arc::clone(&st);
            std::thread::spawn(move || {
                let out = st.begin(0, 4, 9, n);
                for k in 0..10 {
                    for i in k * n / 10..(k + 1) * n / 10 {
                        // SAFETY: `begin` made room for n floats; positions past `advance`
                        // are this thread's.
                        unsafe { out.add(i).write(i as f32) };
                    }
                    st.advance((k + 1) * n / 10 * 4);
                    std::thread::sleep(Duration::from_millis(1));
                }
                st.finish(Ok(()));
                st.finish(Err(Status::internal("a later end does not count")));
            })
        };
        let (mut got, mut waits) = (Vec::new(), 0);
        loop {
            let p = st.wait(got.len());
            waits += 1;
            assert_eq!(p.head, Some((0, 4, 9)));
            got.extend_from_slice(&p.rows[got.len()..]);
            if let Some(end) = p.end {
                assert!(end.is_ok());
                break;
            }
        }
        filler.join().unwrap();
        let want: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
        assert_eq!(got, want);
        assert!(
            waits > 1,
            "the rows came in one piece: nothing was streamed"
        );

        let failed = Streamed::default();
        failed.finish(Err(Status::not_found("no such table")));
        let p = failed.wait(0);
        assert!(p.head.is_none() && p.rows.is_empty());
        assert_eq!(p.end.unwrap().unwrap_err().code(), tonic::Code::NotFound);
    }
}
