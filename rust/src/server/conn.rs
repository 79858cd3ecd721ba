//! The servers' own accept loop, shared by the gRPC and the metrics port: it caps the open
//! connections, backs off when accepting fails (out of file descriptors, say) instead of trying
//! again at once, and closes a connection that sends no request within the handshake timeout.
//! Each port counts what it accepted, refused and timed out, for the metrics.

use std::fmt::Write as _;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

/// File descriptors the default connection cap leaves to the rest of the process (the store's
/// files, the metrics port, the runtime).
const FD_RESERVE: u64 = 64;
/// The default connection cap when the file descriptor limit allows more.
const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// The first and the longest pause after a failed accept.
const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How many connections a port keeps open, and how long a connection may stay silent.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Connections open at once on a port; further ones are accepted and closed at once.
    pub max_connections: u64,
    /// Seconds a connection may stay open before its first request (TLS handshake included);
    /// then it is closed.
    pub handshake_timeout: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            handshake_timeout: 10.0,
        }
    }
}

impl Limits {
    /// Checks the values.
    pub fn validate(&self) -> crate::Result<()> {
        if self.max_connections == 0 {
            return Err(crate::error::invalid("max_connections must be at least 1"));
        }
        let t = self.handshake_timeout;
        if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
            return Err(crate::error::invalid(format!(
                "handshake_timeout must be > 0 and at most 86400 seconds, got {t}"
            )));
        }
        Ok(())
    }
}

/// The soft limit of open files less [`FD_RESERVE`], at most [`DEFAULT_MAX_CONNECTIONS`] and at
/// least 1.
pub fn default_max_connections() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes the limit into `r`, a valid `rlimit`.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    let soft: u64 = if ok && r.rlim_cur != libc::RLIM_INFINITY {
        r.rlim_cur
    } else {
        u64::MAX
    };
    soft.saturating_sub(FD_RESERVE)
        .clamp(1, DEFAULT_MAX_CONNECTIONS)
}

/// What one port counted.
#[derive(Default)]
pub struct ConnStats {
    accepted: AtomicU64,
    refused: AtomicU64,
    open: AtomicU64,
    timed_out: AtomicU64,
    accept_errors: AtomicU64,
}

impl ConnStats {
    /// Connections open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }
}

/// A metric: name, type, help, and its value in a port's counters.
type Series = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ConnStats) -> u64,
);

/// Appends the connection counters of `ports` (name, stats) in the Prometheus text format.
pub fn render(o: &mut String, ports: &[(&str, &ConnStats)]) {
    let series: [Series; 5] = [
        (
            "pstore_connections_accepted_total",
            "counter",
            "Connections accepted and served.",
            |s| s.accepted.load(Ordering::Relaxed),
        ),
        (
            "pstore_connections_refused_total",
            "counter",
            "Connections closed at once because the port had max_connections open.",
            |s| s.refused.load(Ordering::Relaxed),
        ),
        (
            "pstore_connections_open",
            "gauge",
            "Connections open now.",
            |s| s.open.load(Ordering::Relaxed),
        ),
        (
            "pstore_connections_timed_out_total",
            "counter",
            "Connections closed because no request came within the handshake timeout.",
            |s| s.timed_out.load(Ordering::Relaxed),
        ),
        (
            "pstore_accept_errors_total",
            "counter",
            "Failed accepts (out of file descriptors, say); each is followed by a pause.",
            |s| s.accept_errors.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, get) in series {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (port, s) in ports {
            let _ = writeln!(o, "{name}{{port=\"{port}\"}} {}", get(s));
        }
    }
}

/// The accepted connections of a listener, as a stream for tonic's `serve_with_incoming`.
/// Never yields an error: failed accepts are counted and followed by a growing pause.
pub struct Incoming {
    listener: TcpListener,
    limits: Limits,
    stats: Arc<ConnStats>,
    backoff: Option<Pin<Box<Sleep>>>,
    delay: Duration,
}

impl Incoming {
    /// Accepts from `listener` under `limits`, counting in `stats`.
    pub fn new(listener: TcpListener, limits: Limits, stats: Arc<ConnStats>) -> Self {
        Self {
            listener,
            limits,
            stats,
            backoff: None,
            delay: BACKOFF_MIN,
        }
    }

    /// The next connection (what the stream yields), for loops that are not tonic's.
    pub async fn accept(&mut self) -> Conn {
        std::future::poll_fn(|cx| self.poll_conn(cx)).await
    }

    fn poll_conn(&mut self, cx: &mut Context<'_>) -> Poll<Conn> {
        loop {
            if let Some(pause) = self.backoff.as_mut() {
                std::task::ready!(pause.as_mut().poll(cx));
                self.backoff = None;
            }
            match self.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok((sock, _))) => {
                    self.delay = BACKOFF_MIN;
                    if self.stats.open.load(Ordering::Acquire) >= self.limits.max_connections {
                        // Refused: closed at once, so the client sees the connection end
                        // instead of waiting in the backlog.
                        self.stats.refused.fetch_add(1, Ordering::Relaxed);
                        drop(sock);
                        continue;
                    }
                    // Without it a small answer waits ~40 ms for a delayed ACK.
                    let _ = sock.set_nodelay(true);
                    return Poll::Ready(Conn::new(sock, &self.limits, &self.stats));
                }
                Poll::Ready(Err(e)) => {
                    self.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::Interrupted
                    ) {
                        // Out of descriptors or memory: trying again at once would spin on the
                        // pending connection. Pause, longer each time, until an accept works.
                        self.backoff = Some(Box::pin(tokio::time::sleep(self.delay)));
                        self.delay = (self.delay * 2).min(BACKOFF_MAX);
                    }
                }
            }
        }
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_conn(cx).map(|c| Some(Ok(c)))
    }
}

/// What a request learns of its connection (in its extensions): marking it served lifts the
/// handshake timeout.
#[derive(Clone)]
pub struct ConnInfo {
    served: Arc<AtomicBool>,
    remote: Option<std::net::SocketAddr>,
}

impl ConnInfo {
    /// Marks the connection as having sent a request: it may stay open.
    pub fn served(&self) {
        self.served.store(true, Ordering::Release);
    }

    /// The peer's address.
    pub fn remote(&self) -> Option<std::net::SocketAddr> {
        self.remote
    }
}

/// An accepted connection: counted open while it lives, closed (its reads fail) when the
/// handshake timeout passes before it is marked served.
pub struct Conn {
    io: TcpStream,
    stats: Arc<ConnStats>,
    info: ConnInfo,
    deadline: Option<Pin<Box<Sleep>>>,
    /// The handshake timeout passed: every read fails.
    timed_out: bool,
}

impl Conn {
    fn new(io: TcpStream, limits: &Limits, stats: &Arc<ConnStats>) -> Self {
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_add(1, Ordering::AcqRel);
        let remote = io.peer_addr().ok();
        Self {
            io,
            stats: Arc::clone(stats),
            info: ConnInfo {
                served: Arc::new(AtomicBool::new(false)),
                remote,
            },
            deadline: Some(Box::pin(tokio::time::sleep(Duration::from_secs_f64(
                limits.handshake_timeout,
            )))),
            timed_out: false,
        }
    }

    /// What requests on this connection see.
    pub fn info(&self) -> &ConnInfo {
        &self.info
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(d) = this.deadline.as_mut() {
            if this.info.served.load(Ordering::Acquire) {
                this.deadline = None;
            } else if d.as_mut().poll(cx).is_ready() {
                this.deadline = None;
                this.timed_out = true;
                this.stats.timed_out.fetch_add(1, Ordering::Relaxed);
            }
        }
        if this.timed_out {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no request within the handshake timeout",
            )));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_checked() {
        let ok = Limits::default();
        assert!(ok.validate().is_ok());
        assert!((1..=DEFAULT_MAX_CONNECTIONS).contains(&ok.max_connections));
        for bad in [
            Limits {
                max_connections: 0,
                ..ok
            },
            Limits {
                handshake_timeout: 0.0,
                ..ok
            },
            Limits {
                handshake_timeout: f64::NAN,
                ..ok
            },
            Limits {
                handshake_timeout: -1.0,
                ..ok
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn counters_render_per_port() {
        let (g, m) = (ConnStats::default(), ConnStats::default());
        g.refused.fetch_add(2, Ordering::Relaxed);
        m.open.fetch_add(1, Ordering::Relaxed);
        let mut o = String::new();
        render(&mut o, &[("grpc", &g), ("metrics", &m)]);
        assert!(o.contains("pstore_connections_refused_total{port=\"grpc\"} 2\n"));
        assert!(o.contains("pstore_connections_open{port=\"metrics\"} 1\n"));
        assert!(o.contains("# TYPE pstore_connections_open gauge\n"));
    }

    #[test]
    fn a_silent_connection_is_closed_and_a_refused_one_at_once() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            use tokio::io::AsyncReadExt;
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let stats = Arc::new(ConnStats::default());
            let limits = Limits {
                max_connections: 1,
                handshake_timeout: 0.2,
            };
            let mut inc = Incoming::new(l, limits, Arc::clone(&stats));
            let _a = TcpStream::connect(addr).await.unwrap();
            let mut conn = inc.accept().await;
            let mut b = TcpStream::connect(addr).await.unwrap();
            // Over the cap: accepted and closed while the loop waits for the next one.
            let pending = tokio::time::timeout(Duration::from_millis(300), inc.accept()).await;
            assert!(pending.is_err());
            assert_eq!(b.read(&mut [0u8; 1]).await.unwrap(), 0);
            assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
            let err = conn.read(&mut [0u8; 1]).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert_eq!(stats.timed_out.load(Ordering::Relaxed), 1);
            drop(conn);
            assert_eq!(stats.open(), 0);
        });
    }
}
