//! Pulls from a server's rows port (`net/rows.rs`, decisions 0120 and 0128): a blocking socket
//! per call on the calling thread, the request in one write, a float32 answer read straight
//! into the caller's output. Connections are kept for the next call.
//!
//! Whatever goes wrong with the transport (refused, reset, timed out, a foreign answer) is not
//! the caller's error: the pull goes over gRPC instead (with its retries), and the port is left
//! alone for a while. A store server's refusal goes over gRPC too (`Endpoint::store`).

use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::Status;

use crate::net::proto::Dtype;
use crate::net::rows::{decode_error, encode_request, AnswerHead, ANSWER_HEAD};
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

/// Reads exactly `len` bytes into `dst`.
///
/// SAFETY: `dst` must be valid for writes of `len` bytes.
unsafe fn recv_raw(sock: &TcpStream, dst: *mut u8, len: usize) -> std::io::Result<()> {
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
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()))
    }

    /// Pulls `ask` into `out`: on a kept connection, and once more on a new one if that fails;
    /// a second failure rests the port.
    pub(super) fn pull(
        &self,
        ask: &Ask<'_>,
        out: &mut [MaybeUninit<f32>],
        timeout: Duration,
    ) -> Pulled {
        let kept = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let fresh = kept.is_none();
        let mut conn = match kept.map_or_else(|| self.connect(timeout), Ok) {
            Ok(c) => c,
            Err(_) => return self.failed(),
        };
        let mut r = self.call(&mut conn, ask, out);
        if r.is_none() && !fresh {
            // A kept connection the server may have closed meanwhile.
            conn = match self.connect(timeout) {
                Ok(c) => c,
                Err(_) => return self.failed(),
            };
            r = self.call(&mut conn, ask, out);
        }
        match r {
            None => self.failed(),
            Some((p, reusable)) => {
                if reusable {
                    let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                    if idle.len() < KEEP {
                        idle.push(conn);
                    }
                }
                p
            }
        }
    }

    fn failed(&self) -> Pulled {
        *self.rest.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + REST);
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Pulled::Transport
    }

    /// One request and its answer; `None` when the transport failed, else how it ended and
    /// whether the connection can take another call.
    fn call(
        &self,
        conn: &mut Conn,
        ask: &Ask<'_>,
        out: &mut [MaybeUninit<f32>],
    ) -> Option<(Pulled, bool)> {
        let Ask {
            table,
            token,
            dtype,
            ids,
            dim,
            meta,
        } = *ask;
        encode_request(&mut conn.req, table, token, meta, dtype as i32, ids);
        conn.sock.write_all(&conn.req).ok()?;
        if conn.req.capacity() > 1 << 20 {
            conn.req = Vec::new();
        }
        let mut head = [0u8; ANSWER_HEAD];
        conn.sock.read_exact(&mut head).ok()?;
        let h = AnswerHead::parse(&head).ok()?;
        if h.code != 0 {
            if h.len > MAX_ERROR {
                return None;
            }
            let mut body = vec![0u8; h.len as usize];
            conn.sock.read_exact(&mut body).ok()?;
            return Some((Pulled::Failed(decode_error(h.code, &body)), true));
        }
        if h.dim as usize != dim {
            // The rows are not read: the connection is not used again.
            return Some((Pulled::Dim(h.dim), false));
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
        Some((Pulled::Rows(h.generation), true))
    }
}
