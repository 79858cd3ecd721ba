//! A pull's rows carried past tonic's message buffers, on both sides of the wire.
//!
//! tonic encodes every message into a buffer of its own and decodes every message out of one,
//! so a 65536-id pull's 16 MiB of rows was copied once more on the server (into the encode
//! buffer, freshly grown and faulted in for each answer) and twice more on the client (into the
//! growing decode buffer). Neither copy is needed: the bytes on the wire stay those of
//! `PullResponse` (docs/PROTOCOL.md), only the way they are produced and consumed changes.
//!
//! - Server: the handler leaves `rows` empty and puts the rows in the response's extensions
//!   ([`SplicedRows`]); [`splice_response`] wraps the answer's body so that the rows field goes
//!   on the wire in front of the small encoded rest, the rows' own buffer sent as it is.
//! - Client: [`Strip`] wraps the channel; a pull's answer body hands the rows field's bytes,
//!   as the received frames hold them, to a [`RowChunks`] in the response's extensions, and
//!   tonic decodes the small rest. The client scatters the rows from those frames straight
//!   into the caller's output.
//!
//! Pushes work the other way round: the client's [`Strip`] sends a push's [`SplicedGrads`] as
//! its `grads` field from their own buffer (in front of the other fields), and the server's
//! [`strip_push`] hands the field's received frames to the handler, which joins them once into
//! an aligned buffer ([`super::wire::join`]) instead of tonic copying the whole request.
//!
//! Protobuf lets a message's fields come in any order, so a server that encodes the rows
//! anywhere in the message, or several times (the last counts), is read the same way.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::Frame;
use tonic::body::Body;
use tonic::codegen::{http, Service};
use tonic::Status;

/// The path of the `Pull` method.
pub const PULL_PATH: &str = "/pstore.v1.PStore/Pull";

/// gRPC's message prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;

/// The path of the `Push` method.
pub const PUSH_PATH: &str = "/pstore.v1.PStore/Push";

/// The key of `PullResponse.rows`: field 1, length-delimited.
const ROWS_KEY: u64 = (1 << 3) | 2;

/// The key of `PushRequest.grads`: field 3, length-delimited.
const GRADS_KEY: u64 = (3 << 3) | 2;

/// The rows of a pull's answer, left out of the encoded message: the server sends them as the
/// message's `rows` field (see [`splice_response`]).
#[derive(Clone)]
pub struct SplicedRows(pub Bytes);

/// Puts a pull answer's [`SplicedRows`] back on the wire as its `rows` field, without copying
/// them; any other response passes unchanged.
pub fn splice_response(mut resp: http::Response<Body>) -> http::Response<Body> {
    match resp.extensions_mut().remove::<SplicedRows>() {
        Some(SplicedRows(rows)) if !rows.is_empty() => resp.map(|b| splice(b, ROWS_KEY, rows)),
        _ => resp,
    }
}

/// The gradients of a push, left out of the encoded request: the client sends them as the
/// message's `grads` field from their own buffer (see [`Strip`]).
#[derive(Clone)]
pub struct SplicedGrads(pub Bytes);

fn splice(inner: Body, key: u64, rows: Bytes) -> Body {
    Body::new(Splice {
        inner,
        key,
        rows: Some(rows),
        head: BytesMut::new(),
        out: VecDeque::new(),
    })
}

fn put_varint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

/// An answer body whose one message gets the rows field in front of its encoded fields.
struct Splice {
    inner: Body,
    /// The key of the field the rows go in.
    key: u64,
    /// The rows, until the message they belong to has been seen.
    rows: Option<Bytes>,
    /// The message's bytes as far as received.
    head: BytesMut,
    /// Data to send before polling `inner` again.
    out: VecDeque<Bytes>,
}

impl Splice {
    /// Once `head` holds the whole message: queues the new prefix and rows key, the rows, the
    /// message's own fields and whatever followed them.
    fn try_splice(&mut self) -> Result<(), Status> {
        if self.head.len() < PREFIX {
            return Ok(());
        }
        let len = u32::from_be_bytes([self.head[1], self.head[2], self.head[3], self.head[4]]);
        let len = len as usize;
        if self.head.len() < PREFIX + len {
            return Ok(());
        }
        if self.head[0] != 0 {
            return Err(Status::internal(
                "a compressed pull answer cannot carry its rows outside the message",
            ));
        }
        let Some(rows) = self.rows.take() else {
            return Ok(());
        };
        let mut field = BytesMut::with_capacity(16);
        put_varint(&mut field, self.key);
        put_varint(&mut field, rows.len() as u64);
        let total = len + field.len() + rows.len();
        let total = u32::try_from(total).map_err(|_| {
            Status::internal(format!(
                "a pull answer of {total} bytes is over gRPC's limit"
            ))
        })?;
        let mut prefix = BytesMut::with_capacity(PREFIX + field.len());
        prefix.put_u8(0);
        prefix.put_u32(total);
        prefix.extend_from_slice(&field);
        let mut message = self.head.split_to(PREFIX + len);
        message.advance(PREFIX);
        self.out.push_back(prefix.freeze());
        self.out.push_back(rows);
        if !message.is_empty() {
            self.out.push_back(message.freeze());
        }
        if !self.head.is_empty() {
            self.out.push_back(self.head.split().freeze());
        }
        Ok(())
    }
}

impl http_body::Body for Splice {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.rows.is_none() {
                return Pin::new(&mut this.inner).poll_frame(cx);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => {
                    this.rows = None;
                    if this.head.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Err(Status::internal(
                        "a pull answer ended inside its message",
                    ))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        this.head.extend_from_slice(&data);
                        if let Err(e) = this.try_splice() {
                            this.rows = None;
                            this.head.clear();
                            return Poll::Ready(Some(Err(e)));
                        }
                    }
                    // Trailers (an error status) before any message: passed on.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.out.is_empty() && self.rows.is_none() && self.inner.is_end_stream()
    }
}

/// Where a pull answer's rows (client) or a push's gradients (server) go: the bytes of the
/// field, as the frames that carried them hold them. `None` until the field is seen (a
/// compressed message keeps it in the decoded message).
#[derive(Clone, Default)]
pub struct RowChunks(Arc<Mutex<Option<Vec<Bytes>>>>);

impl RowChunks {
    /// The field's bytes, if the message had it outside the decoded message.
    pub fn take(&self) -> Option<Vec<Bytes>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn start(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    fn push(&self, b: Bytes) {
        if let Some(v) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            v.push(b);
        }
    }
}

/// A channel whose pull answers have their rows taken out of the message before tonic decodes
/// it, and whose pushes send their [`SplicedGrads`] from their own buffer (see the module's
/// note); every other call passes unchanged.
#[derive(Clone)]
pub struct Strip<S>(pub S);

impl<S> Service<http::Request<Body>> for Strip<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let pull = req.uri().path() == PULL_PATH;
        if let Some(SplicedGrads(g)) = req.extensions_mut().remove::<SplicedGrads>() {
            if !g.is_empty() {
                req = req.map(|b| splice(b, GRADS_KEY, g));
            }
        }
        let fut = self.0.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(if pull { strip_response(resp) } else { resp })
        })
    }
}

/// Wraps a pull answer's body so that its rows go to a [`RowChunks`] in its extensions.
pub fn strip_response(mut resp: http::Response<Body>) -> http::Response<Body> {
    let sink = RowChunks::default();
    resp.extensions_mut().insert(sink.clone());
    resp.map(|inner| strip(inner, ROWS_KEY, sink, usize::MAX))
}

/// On a server: wraps a push request's body so that its gradients go to a [`RowChunks`] in its
/// extensions (the handler reads them from there), refusing a message over `limit` bytes as
/// tonic would; any other request passes unchanged.
pub fn strip_push(mut req: http::Request<Body>, limit: usize) -> http::Request<Body> {
    if req.uri().path() != PUSH_PATH {
        return req;
    }
    let sink = RowChunks::default();
    req.extensions_mut().insert(sink.clone());
    req.map(|inner| strip(inner, GRADS_KEY, sink, limit))
}

fn strip(inner: Body, field: u64, sink: RowChunks, limit: usize) -> Body {
    Body::new(StripBody {
        inner,
        field,
        limit,
        sink,
        st: St::Prefix,
        prefix: BytesMut::new(),
        remaining: 0,
        kept: BytesMut::new(),
        key: Varint::default(),
        out: VecDeque::new(),
        failed: false,
    })
}

/// A varint being read a byte at a time.
#[derive(Default)]
struct Varint {
    value: u64,
    bytes: Vec<u8>,
}

impl Varint {
    /// Adds a byte; the value once it is the last.
    fn push(&mut self, b: u8) -> Result<Option<u64>, Status> {
        if self.bytes.len() >= 10 {
            return Err(malformed("a varint longer than 10 bytes"));
        }
        self.value |= u64::from(b & 0x7f) << (7 * self.bytes.len());
        self.bytes.push(b);
        Ok((b < 0x80).then_some(self.value))
    }

    fn clear(&mut self) {
        self.value = 0;
        self.bytes.clear();
    }
}

/// tonic's code and words for a message that does not decode (INTERNAL, as gRPC specifies).
fn malformed(what: &str) -> Status {
    Status::internal(format!("failed to decode Protobuf message: {what}"))
}

/// Where the parser of a message stands.
#[derive(Clone, Copy, PartialEq, Debug)]
enum St {
    /// Reading the 5-byte message prefix.
    Prefix,
    /// Reading a field's key.
    Key,
    /// Reading a length-delimited field's length (`rows`: the rows field, not kept).
    Len { rows: bool },
    /// Inside a varint field's value.
    Value,
    /// `n` more bytes of a field to keep.
    Keep(usize),
    /// `n` more bytes of the rows field.
    Rows(usize),
    /// A compressed message: everything from here on passes unchanged.
    Pass,
}

/// An answer body whose rows field is taken out of its messages (see [`strip_response`]).
struct StripBody {
    inner: Body,
    /// The key of the field taken out.
    field: u64,
    /// The largest message accepted.
    limit: usize,
    sink: RowChunks,
    st: St,
    prefix: BytesMut,
    /// Bytes of the current message still to come.
    remaining: usize,
    /// The message's other fields.
    kept: BytesMut,
    key: Varint,
    out: VecDeque<Bytes>,
    failed: bool,
}

impl StripBody {
    /// Runs the parser over one received data frame, queueing what tonic is to decode.
    fn feed(&mut self, mut d: Bytes) -> Result<(), Status> {
        while !d.is_empty() {
            match self.st {
                St::Pass => {
                    self.out.push_back(d);
                    return Ok(());
                }
                St::Prefix => {
                    let k = (PREFIX - self.prefix.len()).min(d.len());
                    self.prefix.extend_from_slice(&d.split_to(k));
                    if self.prefix.len() == PREFIX {
                        if self.prefix[0] != 0 {
                            self.st = St::Pass;
                            self.out.push_back(self.prefix.split().freeze());
                            continue;
                        }
                        let p = &self.prefix;
                        self.remaining = u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize;
                        if self.remaining > self.limit {
                            return Err(Status::out_of_range(format!(
                                "Error, decoded message length too large: found {} bytes, the \
                                 limit is: {} bytes",
                                self.remaining, self.limit
                            )));
                        }
                        self.prefix.clear();
                        self.kept.clear();
                        self.st = St::Key;
                        self.end_of_message();
                    }
                }
                St::Key => {
                    let b = d.get_u8();
                    self.remaining -= 1;
                    if let Some(key) = self.key.push(b)? {
                        if key == self.field {
                            self.st = St::Len { rows: true };
                        } else {
                            self.kept.extend_from_slice(&self.key.bytes);
                            self.st = match key & 7 {
                                0 => St::Value,
                                1 => St::Keep(8),
                                2 => St::Len { rows: false },
                                5 => St::Keep(4),
                                w => return Err(malformed(&format!("wire type {w}"))),
                            };
                            if let St::Keep(n) = self.st {
                                if n > self.remaining {
                                    return Err(malformed("a field longer than its message"));
                                }
                            }
                        }
                        self.key.clear();
                    } else if self.remaining == 0 {
                        return Err(malformed("a message ends inside a field's key"));
                    }
                }
                St::Len { rows } => {
                    let b = d.get_u8();
                    self.remaining -= 1;
                    if !rows {
                        self.kept.put_u8(b);
                    }
                    if let Some(n) = self.key.push(b)? {
                        self.key.clear();
                        let n = usize::try_from(n).unwrap_or(usize::MAX);
                        if n > self.remaining {
                            return Err(malformed("a field longer than its message"));
                        }
                        if rows {
                            self.sink.start();
                        }
                        self.st = match (n, rows) {
                            (0, _) => St::Key,
                            (_, true) => St::Rows(n),
                            (_, false) => St::Keep(n),
                        };
                    }
                }
                St::Value => {
                    let b = d.get_u8();
                    self.remaining -= 1;
                    self.kept.put_u8(b);
                    if b < 0x80 {
                        self.st = St::Key;
                    }
                }
                St::Keep(n) => {
                    let k = n.min(d.len());
                    self.kept.extend_from_slice(&d.split_to(k));
                    self.remaining -= k;
                    self.st = if k == n { St::Key } else { St::Keep(n - k) };
                }
                St::Rows(n) => {
                    let k = n.min(d.len());
                    self.sink.push(d.split_to(k));
                    self.remaining -= k;
                    self.st = if k == n { St::Key } else { St::Rows(n - k) };
                }
            }
            if self.remaining == 0 && self.st != St::Prefix && self.st != St::Pass {
                if self.st != St::Key || !self.key.bytes.is_empty() {
                    return Err(malformed("a message ends inside a field"));
                }
                self.end_of_message();
            }
        }
        Ok(())
    }

    /// At the end of a message (`remaining` is 0 at a field boundary): queues the message
    /// without its rows field.
    fn end_of_message(&mut self) {
        if self.remaining != 0 || self.st != St::Key {
            return;
        }
        let mut m = BytesMut::with_capacity(PREFIX + self.kept.len());
        m.put_u8(0);
        m.put_u32(self.kept.len() as u32);
        m.extend_from_slice(&self.kept);
        self.kept.clear();
        self.out.push_back(m.freeze());
        self.st = St::Prefix;
    }
}

impl http_body::Body for StripBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.failed {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None => {
                    if this.st != St::Prefix && this.st != St::Pass || !this.prefix.is_empty() {
                        this.failed = true;
                        return Poll::Ready(Some(Err(malformed(
                            "the answer ends inside a message",
                        ))));
                    }
                    return Poll::Ready(None);
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        if let Err(e) = this.feed(data) {
                            this.failed = true;
                            this.out.clear();
                            return Poll::Ready(Some(Err(e)));
                        }
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.out.is_empty() && (self.failed || self.inner.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::proto::{PullResponse, PushRequest};
    use http_body::Body as _;
    use prost::Message;

    /// A body of the given frames.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn body(chunks: Vec<Bytes>, trailers: bool) -> Body {
        let mut f: VecDeque<_> = chunks.into_iter().map(Frame::data).collect();
        if trailers {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-status", http::HeaderValue::from_static("0"));
            f.push_back(Frame::trailers(h));
        }
        Body::new(Frames(f))
    }

    /// A body's data and whether it ended with trailers, or its error.
    type Drained = Result<(Vec<u8>, bool), Status>;

    /// All data of a body, and whether it ended with trailers, or its error.
    fn drain(mut b: Body) -> Drained {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut data = Vec::new();
        let mut trailers = false;
        loop {
            match Pin::new(&mut b).poll_frame(&mut cx) {
                Poll::Ready(None) => return Ok((data, trailers)),
                Poll::Ready(Some(Err(e))) => return Err(e),
                Poll::Ready(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => data.extend_from_slice(&d),
                    Err(_) => trailers = true,
                },
                Poll::Pending => panic!("the test bodies are always ready"),
            }
        }
    }

    fn framed(m: &impl Message) -> Vec<u8> {
        let mut out = vec![0u8];
        let enc = m.encode_to_vec();
        out.extend_from_slice(&(enc.len() as u32).to_be_bytes());
        out.extend_from_slice(&enc);
        out
    }

    fn answer(rows: usize) -> PullResponse {
        PullResponse {
            rows: Bytes::from((0..rows).map(|i| (i * 7 % 251) as u8).collect::<Vec<u8>>()),
            dtype: 0,
            dim: 64,
            seq: 12345,
            version: u64::MAX - 3,
        }
    }

    /// `bytes` cut into pieces of the given sizes, cycled.
    fn cut(bytes: &[u8], sizes: &[usize]) -> Vec<Bytes> {
        let mut out = Vec::new();
        let mut at = 0;
        for &s in sizes.iter().cycle() {
            if at >= bytes.len() {
                break;
            }
            let end = (at + s).min(bytes.len());
            out.push(Bytes::copy_from_slice(&bytes[at..end]));
            at = end;
        }
        out
    }

    #[test]
    fn spliced_answers_are_the_encoded_message() {
        for rows in [1usize, 127, 128, 300, 1 << 16] {
            let full = answer(rows);
            let mut rest = full.clone();
            rest.rows = Bytes::new();
            let small = framed(&rest);
            for sizes in [&[usize::MAX][..], &[1], &[3, 1, 7]] {
                let mut resp = http::Response::new(body(cut(&small, sizes), true));
                resp.extensions_mut().insert(SplicedRows(full.rows.clone()));
                let (data, trailers) = drain(splice_response(resp).into_body()).unwrap();
                assert_eq!(data, framed(&full), "rows {rows}, pieces {sizes:?}");
                assert!(trailers);
            }
        }
        // Without the extension, or with no rows, the body is unchanged.
        let small = framed(&answer(0));
        let resp = http::Response::new(body(vec![Bytes::from(small.clone())], true));
        assert_eq!(drain(splice_response(resp).into_body()).unwrap().0, small);
        // An error answer (trailers only) passes.
        let mut resp = http::Response::new(body(vec![], true));
        resp.extensions_mut()
            .insert(SplicedRows(Bytes::from_static(b"abcd")));
        assert_eq!(
            drain(splice_response(resp).into_body()).unwrap(),
            (vec![], true)
        );
        // A compressed message cannot take the rows.
        let mut c = small.clone();
        c[0] = 1;
        let mut resp = http::Response::new(body(vec![Bytes::from(c)], true));
        resp.extensions_mut()
            .insert(SplicedRows(Bytes::from_static(b"abcd")));
        assert!(drain(splice_response(resp).into_body()).is_err());
    }

    fn strip(chunks: Vec<Bytes>) -> (Drained, Option<Vec<u8>>) {
        let resp = strip_response(http::Response::new(body(chunks, true)));
        let sink = resp.extensions().get::<RowChunks>().unwrap().clone();
        let out = drain(resp.into_body());
        let rows = sink.take().map(|v| v.concat());
        (out, rows)
    }

    #[test]
    fn stripped_answers_give_their_rows_aside() {
        for rows in [0usize, 1, 127, 128, 300, 1 << 16] {
            let full = answer(rows);
            let mut rest = full.clone();
            rest.rows = Bytes::new();
            let wire = framed(&full);
            for sizes in [&[usize::MAX][..], &[1], &[5, 2, 9, 1000]] {
                let (out, got) = strip(cut(&wire, sizes));
                let (data, trailers) = out.unwrap();
                assert!(trailers);
                assert_eq!(data, framed(&rest), "rows {rows}, pieces {sizes:?}");
                // proto3 does not encode an empty bytes field.
                let expect = (rows > 0).then(|| full.rows.to_vec());
                assert_eq!(got, expect, "rows {rows}, pieces {sizes:?}");
            }
        }
        // Rows after the other fields, and twice (the last counts), are found the same way.
        let mut m = answer(0).encode_to_vec();
        m.extend_from_slice(&[0x0a, 2, 9, 9, 0x0a, 3, 1, 2, 3]);
        let mut wire = vec![0u8];
        wire.extend_from_slice(&(m.len() as u32).to_be_bytes());
        wire.extend_from_slice(&m);
        let (out, got) = strip(cut(&wire, &[4]));
        assert_eq!(got, Some(vec![1, 2, 3]));
        assert_eq!(out.unwrap().0, framed(&answer(0)));
        // Empty length-delimited fields, last in the message (an empty sub-message), and an
        // empty rows field.
        let m = [0x0a, 0, 0x18, 5, 0x2a, 0];
        let mut wire = vec![0u8, 0, 0, 0, m.len() as u8];
        wire.extend_from_slice(&m);
        for sizes in [&[usize::MAX][..], &[1]] {
            let (out, got) = strip(cut(&wire, sizes));
            assert_eq!(out.unwrap().0, [0, 0, 0, 0, 4, 0x18, 5, 0x2a, 0]);
            assert_eq!(got, Some(vec![]));
        }
        // A compressed message passes whole, with no rows taken.
        let mut c = framed(&answer(10));
        c[0] = 1;
        let (out, got) = strip(cut(&c, &[3]));
        assert_eq!(out.unwrap().0, c);
        assert_eq!(got, None);
    }

    fn push_request(n: usize) -> PushRequest {
        PushRequest {
            table: "emb".into(),
            ids: Bytes::from(vec![7u8; 8 * n]),
            grads: Bytes::from((0..n * 16).map(|i| i as u8).collect::<Vec<u8>>()),
            dtype: 0,
            request_id: Some(crate::net::proto::RequestId { client: 3, seq: 9 }),
            pulled_version: Some(4),
            continued: true,
            ..Default::default()
        }
    }

    #[test]
    fn pushes_carry_their_gradients_past_the_message() {
        let full = push_request(1000);
        let mut rest = full.clone();
        rest.grads = Bytes::new();
        for sizes in [&[usize::MAX][..], &[1], &[7, 300]] {
            // Client: the gradients go in front of the other fields; the message is the same.
            let (data, _) = drain(splice(
                body(cut(&framed(&rest), sizes), false),
                GRADS_KEY,
                full.grads.clone(),
            ))
            .unwrap();
            assert_eq!(PushRequest::decode(&data[PREFIX..]).unwrap(), full);
            assert_eq!(data.len(), framed(&full).len());
            // Server: they are taken out again, whatever the order of the fields.
            for wire in [data, framed(&full)] {
                let mut req = http::Request::new(body(cut(&wire, sizes), false));
                *req.uri_mut() = http::Uri::from_static(PUSH_PATH);
                let req = strip_push(req, 1 << 20);
                let sink = req.extensions().get::<RowChunks>().unwrap().clone();
                let (small, _) = drain(req.into_body()).unwrap();
                assert_eq!(PushRequest::decode(&small[PREFIX..]).unwrap(), rest);
                assert_eq!(sink.take().unwrap().concat(), full.grads.to_vec());
            }
        }
        // A message over the server's limit is refused as tonic refuses it.
        let mut req = http::Request::new(body(vec![Bytes::from(framed(&full))], false));
        *req.uri_mut() = http::Uri::from_static(PUSH_PATH);
        let err = drain(strip_push(req, 1000).into_body()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange);
        // Other methods pass unchanged.
        let mut req = http::Request::new(body(vec![Bytes::from(framed(&full))], false));
        *req.uri_mut() = http::Uri::from_static(PULL_PATH);
        let req = strip_push(req, 10);
        assert!(req.extensions().get::<RowChunks>().is_none());
        assert_eq!(drain(req.into_body()).unwrap().0, framed(&full));
    }

    #[test]
    fn malformed_answers_are_errors() {
        let wire = framed(&answer(100));
        // Cut short: the body ends inside the message.
        let (out, _) = strip(vec![Bytes::copy_from_slice(&wire[..50])]);
        assert!(out.unwrap_err().message().contains("ends inside"));
        // A field longer than the message.
        let bad = [0u8, 0, 0, 0, 3, 0x0a, 9, 1];
        let (out, _) = strip(vec![Bytes::copy_from_slice(&bad)]);
        assert!(out.unwrap_err().message().contains("longer than"));
        // A group (wire type 3).
        let bad = [0u8, 0, 0, 0, 2, 0x0b, 0];
        let (out, _) = strip(vec![Bytes::copy_from_slice(&bad)]);
        assert!(out.unwrap_err().message().contains("wire type 3"));
        // A message that ends inside a varint field.
        let bad = [0u8, 0, 0, 0, 2, 0x10, 0x80];
        let (out, _) = strip(vec![Bytes::copy_from_slice(&bad)]);
        assert!(out.is_err());
    }
}
