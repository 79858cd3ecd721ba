//! Where snapshots live: a local directory, or a prefix in an object store (`s3://bucket/prefix`,
//! through Apache Arrow's `object_store` crate).
//!
//! Snapshot files are written and read as local files (the readers map them). A remote
//! destination is written through a local *staging* directory: the snapshot is written there
//! exactly as into a local one, then every file is uploaded (multipart above [`PART_BYTES`]),
//! `manifest.json` last, so a prefix without its manifest is no snapshot, as a directory without
//! one is not. A remote snapshot is read by downloading it, and the parents its chain names,
//! into a staging directory laid out as the bucket is ([`stage`]); the readers then check every
//! file's size and CRC-32 as for a local snapshot. Decision record 0061 gives the reasons.
//!
//! Credentials and the endpoint come from the standard environment: `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`), `AWS_REGION` or `AWS_DEFAULT_REGION`,
//! `AWS_ENDPOINT_URL` for an S3-compatible server and `AWS_ALLOW_HTTP=true` for a plain-http one.
//! Requests time out (`AWS_CONNECT_TIMEOUT`, default 5 s; `AWS_TIMEOUT`, default 120 s) and are
//! retried a bounded number of times. `PSTORE_STAGING_DIR` names where staging directories go
//! (default: the system's temporary directory).

use std::future::Future;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig, WriteMultipart};

use super::{Manifest, MANIFEST};
use crate::error::{corrupt, invalid, storage, Error, Result};

/// The file a cluster snapshot's directory holds (see `client/cluster.rs`).
pub const CLUSTER_MANIFEST: &str = "cluster.json";
/// Files larger than this are uploaded in parts of this size (S3's parts are 5 MiB at least).
pub const PART_BYTES: usize = 16 << 20;
/// Uploads or downloads of one snapshot in flight at once.
const CONCURRENCY: usize = 4;
/// Attempts of a failing request after the first.
const MAX_RETRIES: usize = 3;
/// Time after a request's first attempt past which it is not retried.
const RETRY_TIMEOUT: Duration = Duration::from_secs(30);

/// A snapshot location as written: a local path or an object-store URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uri {
    /// A local directory (a plain path, or `file://PATH`).
    Local(PathBuf),
    /// `s3://bucket/key`: `key` has no leading or trailing `/` and no empty, `.` or `..`
    /// segment.
    S3 {
        /// The bucket.
        bucket: String,
        /// The prefix inside the bucket.
        key: String,
    },
}

/// Parses a location string without touching the network or the environment.
pub fn parse(location: &str) -> Result<Uri> {
    if location.is_empty() {
        return Err(invalid(
            "a snapshot location is empty: give a directory or s3://BUCKET/PREFIX",
        ));
    }
    if let Some(p) = location.strip_prefix("file://") {
        if p.is_empty() {
            return Err(invalid(format!(
                "snapshot location {location:?} names no directory"
            )));
        }
        return Ok(Uri::Local(PathBuf::from(p)));
    }
    let Some((scheme, rest)) = location.split_once("://") else {
        return Ok(Uri::Local(PathBuf::from(location)));
    };
    if scheme != "s3" {
        return Err(invalid(format!(
            "snapshot location {location:?}: scheme {scheme}:// is not supported; give a \
             directory, file://DIR or s3://BUCKET/PREFIX"
        )));
    }
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !bucket.starts_with(['-', '.'])
        && !bucket.ends_with(['-', '.']);
    if !bucket_ok {
        return Err(invalid(format!(
            "snapshot location {location:?}: {bucket:?} is not a bucket name (3 to 63 lower-case \
             letters, digits, '-' and '.')"
        )));
    }
    let key = key.trim_end_matches('/');
    if key.is_empty() {
        return Err(invalid(format!(
            "snapshot location {location:?} names a bucket but no prefix: give \
             s3://{bucket}/PREFIX"
        )));
    }
    if key
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == ".." || s.contains(['\\', '\0']))
    {
        return Err(invalid(format!(
            "snapshot location {location:?}: the prefix {key:?} has an empty, '.' or '..' \
             segment"
        )));
    }
    Ok(Uri::S3 {
        bucket: bucket.to_string(),
        key: key.to_string(),
    })
}

/// Whether `s` is written as a URI with a scheme (`file://` included).
pub fn is_uri(s: &str) -> bool {
    s.contains("://")
}

/// The parent prefix of `key` ("" at the bucket's top).
fn key_parent(key: &str) -> &str {
    key.rsplit_once('/').map_or("", |(p, _)| p)
}

fn join_key(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// The key `rel` names, relative to the prefix holding the snapshot `child` (a manifest's parent
/// path: a sibling's name or a `../`-relative path, as [`relative_key`] writes them).
pub fn resolve_key(bucket: &str, child: &str, rel: &str) -> Result<String> {
    if let Some(rest) = rel.strip_prefix("s3://") {
        return match parse(rel)? {
            Uri::S3 { bucket: b, key } if b == bucket => Ok(key),
            _ => Err(invalid(format!(
                "s3://{bucket}/{child}: its parent {rel:?} is in another bucket ({rest})"
            ))),
        };
    }
    if rel.starts_with('/') || is_uri(rel) {
        return Err(invalid(format!(
            "s3://{bucket}/{child}: its parent is {rel:?}, not in the bucket"
        )));
    }
    let mut segs: Vec<&str> = key_parent(child)
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    for s in rel.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                if segs.pop().is_none() {
                    return Err(corrupt(format!(
                        "s3://{bucket}/{child}: its parent path {rel:?} leaves the bucket"
                    )));
                }
            }
            s => segs.push(s),
        }
    }
    if segs.is_empty() {
        return Err(corrupt(format!(
            "s3://{bucket}/{child}: its parent path {rel:?} names the bucket itself"
        )));
    }
    Ok(segs.join("/"))
}

/// How the snapshot `child` names `parent` (both keys of one bucket): the parent's name when
/// they share a prefix, else a `../`-relative path, so a bucket copied elsewhere still reads.
pub fn relative_key(child: &str, parent: &str) -> String {
    let a: Vec<&str> = key_parent(child)
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let b: Vec<&str> = parent.split('/').collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut out: Vec<&str> = vec![".."; a.len() - common];
    out.extend_from_slice(&b[common..]);
    out.join("/")
}

/// A location that is opened: a local directory or a prefix of an object store.
#[derive(Debug, Clone)]
pub enum Location {
    /// A local directory.
    Local(PathBuf),
    /// A prefix of an object store.
    Remote(Remote),
}

/// A prefix in an S3 bucket with the client that reaches it.
#[derive(Debug, Clone)]
pub struct Remote {
    bucket: String,
    key: String,
    store: Arc<AmazonS3>,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Remote(r) => write!(f, "{}", r.uri()),
        }
    }
}

impl Location {
    /// Opens `location` (a directory, `file://DIR` or `s3://BUCKET/PREFIX`); an `s3://` one
    /// gets a client configured from the environment (see the module documentation).
    pub fn open(location: &str) -> Result<Location> {
        match parse(location)? {
            Uri::Local(p) => Ok(Location::Local(p)),
            Uri::S3 { bucket, key } => Ok(Location::Remote(Remote::open(&bucket, &key)?)),
        }
    }

    /// `name` inside this location.
    pub fn join(&self, name: &str) -> Location {
        match self {
            Location::Local(p) => Location::Local(p.join(name)),
            Location::Remote(r) => Location::Remote(r.at(join_key(&r.key, name))),
        }
    }

    /// The location holding this one.
    pub fn parent(&self) -> Option<Location> {
        match self {
            Location::Local(p) => p.parent().map(|p| {
                Location::Local(if p.as_os_str().is_empty() {
                    ".".into()
                } else {
                    p.into()
                })
            }),
            Location::Remote(r) => {
                let k = key_parent(&r.key);
                (!k.is_empty()).then(|| Location::Remote(r.at(k.to_string())))
            }
        }
    }

    /// The snapshot a manifest in this location names as its parent by `rel`.
    pub fn resolve(&self, rel: &str) -> Result<Location> {
        match self {
            Location::Local(p) => Ok(Location::Local(super::resolve(p, rel))),
            Location::Remote(r) => Ok(Location::Remote(r.at(resolve_key(&r.bucket, &r.key, rel)?))),
        }
    }

    /// How this location's manifest names `parent`.
    pub fn relative(&self, parent: &Location) -> Result<String> {
        match (self, parent) {
            (Location::Local(c), Location::Local(p)) => Ok(super::relative_to(c, p)),
            (Location::Remote(c), Location::Remote(p)) if c.bucket == p.bucket => {
                Ok(relative_key(&c.key, &p.key))
            }
            _ => Err(invalid(format!(
                "{self} cannot build on {parent}: an increment is written into the store (or \
                 bucket) of the snapshot it builds on; take a full snapshot there first"
            ))),
        }
    }

    /// The bytes of file `name` in this location, or None when there is none.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self {
            Location::Local(p) => {
                let path = p.join(name);
                match std::fs::read(&path) {
                    Ok(b) => Ok(Some(b)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(storage(format!("reading {}: {e}", path.display()))),
                }
            }
            Location::Remote(r) => r.get(name),
        }
    }

    /// Whether this location holds anything: a local path that exists, a prefix with objects.
    pub fn exists(&self) -> Result<bool> {
        match self {
            Location::Local(p) => Ok(p.exists()),
            Location::Remote(r) => r.any(),
        }
    }

    /// Writes file `name` whole: a local one through a temporary file and a rename, then
    /// fsynced with its directory; a remote one with one put (objects appear whole).
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        match self {
            Location::Local(dir) => {
                let path = dir.join(name);
                let tmp = dir.join(format!(".{name}.tmp-{}", super::new_id()));
                let r = (|| {
                    let mut f = std::fs::File::create(&tmp)?;
                    f.write_all(bytes)?;
                    f.sync_all()?;
                    std::fs::rename(&tmp, &path)
                })();
                if let Err(e) = r {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(storage(format!("writing {}: {e}", path.display())));
                }
                super::fsync_dir(dir)
            }
            Location::Remote(r) => r.put(name, bytes.to_vec()),
        }
    }

    /// Creates a local directory with its parents (a prefix needs no creating).
    pub fn create_dir_all(&self) -> Result<()> {
        match self {
            Location::Local(p) => std::fs::create_dir_all(p)
                .map_err(|e| storage(format!("creating {}: {e}", p.display()))),
            Location::Remote(_) => Ok(()),
        }
    }
}

fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("pstore-objstore")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| storage(format!("starting the object-store runtime: {e}")))
}

/// Runs `f` on the object-store runtime and waits for it; callable from any thread, also a
/// blocking thread of another runtime (a server's request handler).
fn block<T: Send + 'static>(f: impl Future<Output = Result<T>> + Send + 'static) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime()?.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv()
        .map_err(|_| Error::Internal("an object-store task ended without an answer".into()))?
}

fn env_set(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}

/// Whether the environment `get` reads gives the S3 client credentials of its own (keys, a
/// web-identity token, a container endpoint) or asks for unsigned requests.
fn has_credentials(get: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| get(k).is_some_and(|v| !v.is_empty());
    set("AWS_ACCESS_KEY_ID")
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || get("AWS_SKIP_SIGNATURE").is_some_and(|v| v == "true" || v == "1")
}

/// A clear error for a failed request on `uri`.
fn remote_error(uri: &str, what: &str, e: object_store::Error) -> Error {
    let text = e.to_string();
    let hint = if text.contains("NoSuchBucket") {
        "the bucket does not exist: "
    } else if text.contains("InvalidAccessKeyId")
        || text.contains("SignatureDoesNotMatch")
        || text.contains("AccessDenied")
        || text.contains("403 Forbidden")
    {
        "the credentials were refused (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY): "
    } else if text.contains("error sending request")
        || text.contains("connect")
        || text.contains("timed out")
    {
        "the endpoint could not be reached (AWS_ENDPOINT_URL, AWS_ALLOW_HTTP): "
    } else {
        ""
    };
    match e {
        object_store::Error::NotFound { .. } if hint.is_empty() => {
            invalid(format!("{uri}: {what}: no such object"))
        }
        _ => storage(format!("{uri}: {what} failed: {hint}{}", short(&text))),
    }
}

/// An S3 error answer's code and message (`NoSuchBucket: The specified bucket does not exist`)
/// instead of its whole XML body; other errors as they are.
fn short(text: &str) -> String {
    let tag = |t: &str| -> Option<&str> {
        let open = format!("<{t}>");
        let from = text.find(&open)? + open.len();
        let to = text[from..].find(&format!("</{t}>"))? + from;
        Some(&text[from..to])
    };
    match (tag("Code"), tag("Message")) {
        (Some(code), Some(msg)) => {
            let status = text
                .find("status code: ")
                .map(|i| &text[i + 13..])
                .and_then(|t| t.split(':').next())
                .unwrap_or("");
            format!("{code}: {msg} ({status})")
        }
        _ => text.to_string(),
    }
}

impl Remote {
    fn open(bucket: &str, key: &str) -> Result<Remote> {
        let uri = format!("s3://{bucket}/{key}");
        // Without credentials in the environment the client would ask an instance-metadata
        // service off this machine; a store says what it needs instead.
        if !has_credentials(|k| std::env::var(k).ok()) {
            return Err(invalid(format!(
                "{uri}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
                 AWS_ENDPOINT_URL for an S3-compatible server)"
            )));
        }
        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        if !env_set("AWS_CONNECT_TIMEOUT") {
            b = b.with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                "5s",
            );
        }
        if !env_set("AWS_TIMEOUT") {
            b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), "120s");
        }
        let store = b
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: MAX_RETRIES,
                retry_timeout: RETRY_TIMEOUT,
            })
            .build()
            .map_err(|e| invalid(format!("{uri}: the S3 client's settings: {e}")))?;
        Ok(Remote {
            bucket: bucket.to_string(),
            key: key.to_string(),
            store: Arc::new(store),
        })
    }

    fn at(&self, key: String) -> Remote {
        Remote {
            bucket: self.bucket.clone(),
            key,
            store: Arc::clone(&self.store),
        }
    }

    /// `s3://bucket/key`.
    pub fn uri(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }

    fn object(&self, name: &str) -> ObjectPath {
        ObjectPath::from(join_key(&self.key, name))
    }

    /// Whether any object lies under the prefix.
    fn any(&self) -> Result<bool> {
        let (store, prefix, uri) = (
            Arc::clone(&self.store),
            ObjectPath::from(self.key.as_str()),
            self.uri(),
        );
        block(async move {
            match store.list(Some(&prefix)).next().await {
                None => Ok(false),
                Some(Ok(_)) => Ok(true),
                Some(Err(e)) => Err(remote_error(&uri, "listing", e)),
            }
        })
    }

    fn get(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let (store, path, uri) = (Arc::clone(&self.store), self.object(name), self.uri());
        let what = format!("reading {name}");
        block(async move {
            match store.get(&path).await {
                Ok(r) => match r.bytes().await {
                    Ok(b) => Ok(Some(b.to_vec())),
                    Err(e) => Err(remote_error(&uri, &what, e)),
                },
                Err(object_store::Error::NotFound { .. }) => {
                    // A missing bucket answers NotFound too: tell it apart.
                    match store.list(None).next().await {
                        Some(Err(e)) => Err(remote_error(&uri, &what, e)),
                        _ => Ok(None),
                    }
                }
                Err(e) => Err(remote_error(&uri, &what, e)),
            }
        })
    }

    fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let (store, path, uri) = (Arc::clone(&self.store), self.object(name), self.uri());
        let what = format!("writing {name}");
        block(async move {
            store
                .put(&path, bytes.into())
                .await
                .map(|_| ())
                .map_err(|e| remote_error(&uri, &what, e))
        })
    }

    /// Uploads every file under the local directory `dir` to this prefix, `manifest.json`
    /// last; on a failure deletes what it uploaded. Returns the bytes uploaded.
    pub fn upload_dir(&self, dir: &Path) -> Result<u64> {
        let mut files = Vec::new();
        list_files(dir, "", &mut files)?;
        let (last, rest): (Vec<String>, Vec<String>) =
            files.into_iter().partition(|f| f == MANIFEST);
        if last.is_empty() {
            return Err(Error::Internal(format!(
                "{}: a staged snapshot without its manifest",
                dir.display()
            )));
        }
        let (store, key, uri, dir) = (
            Arc::clone(&self.store),
            self.key.clone(),
            self.uri(),
            dir.to_path_buf(),
        );
        block(async move {
            let uploads = futures::stream::iter(rest.clone())
                .map(|name| upload(&store, &key, &uri, &dir, name))
                .buffer_unordered(CONCURRENCY)
                .try_fold(0u64, |a, b| async move { Ok(a + b) })
                .await;
            let r = match uploads {
                Ok(n) => upload(&store, &key, &uri, &dir, MANIFEST.to_string())
                    .await
                    .map(|m| n + m),
                Err(e) => Err(e),
            };
            if r.is_err() {
                // Best effort: the manifest was not written, so what is left is no snapshot.
                for name in rest.iter().chain(last.iter()) {
                    let _ = store.delete(&ObjectPath::from(join_key(&key, name))).await;
                }
            }
            r
        })
    }

    /// Downloads every object under the prefix into `dest` (created); returns the bytes.
    fn download(&self, dest: &Path) -> Result<u64> {
        let (store, key, uri, dest) = (
            Arc::clone(&self.store),
            self.key.clone(),
            self.uri(),
            dest.to_path_buf(),
        );
        block(async move {
            let prefix = ObjectPath::from(key.as_str());
            let metas: Vec<_> = store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|e| remote_error(&uri, "listing", e))?;
            futures::stream::iter(metas)
                .map(|m| {
                    let (store, uri, dest, prefix) = (&store, &uri, &dest, &prefix);
                    async move {
                        let rel: Vec<String> = match m.location.prefix_match(prefix) {
                            Some(parts) => parts.map(|p| p.as_ref().to_string()).collect(),
                            None => return Ok(0),
                        };
                        if rel.is_empty() || rel.iter().any(|s| s == ".." || s == ".") {
                            return Ok(0);
                        }
                        let path = rel.iter().fold(dest.clone(), |p, s| p.join(s));
                        let what = format!("reading {}", rel.join("/"));
                        let r = store
                            .get(&m.location)
                            .await
                            .map_err(|e| remote_error(uri, &what, e))?;
                        if let Some(parent) = path.parent() {
                            std::fs::create_dir_all(parent).map_err(|e| {
                                storage(format!("creating {}: {e}", parent.display()))
                            })?;
                        }
                        let mut f = std::fs::File::create(&path)
                            .map_err(|e| storage(format!("creating {}: {e}", path.display())))?;
                        let mut stream = r.into_stream();
                        let mut n = 0u64;
                        while let Some(chunk) = stream.next().await {
                            let chunk = chunk.map_err(|e| remote_error(uri, &what, e))?;
                            f.write_all(&chunk)
                                .map_err(|e| storage(format!("writing {}: {e}", path.display())))?;
                            n += chunk.len() as u64;
                        }
                        Ok::<u64, Error>(n)
                    }
                })
                .buffer_unordered(CONCURRENCY)
                .try_fold(0u64, |a, b| async move { Ok(a + b) })
                .await
        })
    }
}

/// Relative names of the files under `dir`, `/`-separated.
fn list_files(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<()> {
    let rd =
        std::fs::read_dir(dir).map_err(|e| storage(format!("reading {}: {e}", dir.display())))?;
    for e in rd {
        let e = e.map_err(|e| storage(format!("reading {}: {e}", dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let r = join_key(rel, &name);
        let ft = e
            .file_type()
            .map_err(|err| storage(format!("reading {}: {err}", e.path().display())))?;
        if ft.is_dir() {
            list_files(&e.path(), &r, out)?;
        } else {
            out.push(r);
        }
    }
    Ok(())
}

/// Uploads `dir/name` to `key/name`: one put up to [`PART_BYTES`], a multipart upload above
/// (aborted on a failure, so no partial object is left).
async fn upload(
    store: &Arc<AmazonS3>,
    key: &str,
    uri: &str,
    dir: &Path,
    name: String,
) -> Result<u64> {
    let path = dir.join(&name);
    let object = ObjectPath::from(join_key(key, &name));
    let what = format!("uploading {name}");
    let mut f = std::fs::File::open(&path)
        .map_err(|e| storage(format!("reading {}: {e}", path.display())))?;
    let size = f
        .metadata()
        .map_err(|e| storage(format!("reading {}: {e}", path.display())))?
        .len();
    let read_chunk = |f: &mut std::fs::File, n: usize| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; n];
        f.read_exact(&mut buf)
            .map_err(|e| storage(format!("reading {}: {e}", path.display())))?;
        Ok(buf)
    };
    if size as usize <= PART_BYTES {
        let buf = read_chunk(&mut f, size as usize)?;
        store
            .put(&object, buf.into())
            .await
            .map_err(|e| remote_error(uri, &what, e))?;
        return Ok(size);
    }
    let upload = store
        .put_multipart(&object)
        .await
        .map_err(|e| remote_error(uri, &what, e))?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
    let mut left = size as usize;
    while left > 0 {
        let n = left.min(PART_BYTES);
        let buf = match read_chunk(&mut f, n) {
            Ok(b) => b,
            Err(e) => {
                let _ = w.abort().await;
                return Err(e);
            }
        };
        if let Err(e) = w.wait_for_capacity(2).await {
            let _ = w.abort().await;
            return Err(remote_error(uri, &what, e));
        }
        w.put(buf.into());
        left -= n;
    }
    w.finish().await.map_err(|e| remote_error(uri, &what, e))?;
    Ok(size)
}

/// A staging directory, removed with everything in it when dropped.
#[derive(Debug)]
pub struct StagingDir(PathBuf);

impl StagingDir {
    /// A new empty directory under `PSTORE_STAGING_DIR` or the system's temporary directory.
    pub fn new() -> Result<StagingDir> {
        let base = std::env::var_os("PSTORE_STAGING_DIR")
            .filter(|v| !v.is_empty())
            .map_or_else(std::env::temp_dir, PathBuf::from);
        let dir = base.join(format!("pstore-staging-{}", super::new_id()));
        std::fs::create_dir_all(&dir).map_err(|e| {
            storage(format!(
                "creating the staging directory {}: {e}",
                dir.display()
            ))
        })?;
        Ok(StagingDir(dir))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A snapshot made readable as a local directory: the directory itself for a local location,
/// a downloaded copy (removed when this is dropped) for a remote one.
#[derive(Debug)]
pub struct Staged {
    dir: PathBuf,
    /// The staging root and the URI prefix it mirrors (`s3://bucket/`).
    staging: Option<(StagingDir, String)>,
}

impl Staged {
    /// The local directory the readers use.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the snapshot was downloaded.
    pub fn is_staged(&self) -> bool {
        self.staging.is_some()
    }

    /// A local path of the staged copy written as the URI it came from.
    pub fn name(&self, p: &Path) -> String {
        let s = p.display().to_string();
        match &self.staging {
            Some((root, prefix)) => {
                let r = format!("{}/", root.path().display());
                s.strip_prefix(&r)
                    .map_or(s.clone(), |k| format!("{prefix}{k}"))
            }
            None => s,
        }
    }

    /// `e` with the staged copy's paths written as the URIs they came from.
    pub fn explain(&self, e: Error) -> Error {
        let Some((root, prefix)) = &self.staging else {
            return e;
        };
        let r = format!("{}/", root.path().display());
        let fix = |m: String| m.replace(&r, prefix);
        match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(fix(m)),
            Error::Storage(m) => Error::Storage(fix(m)),
            Error::Corrupt(m) => Error::Corrupt(fix(m)),
            Error::Internal(m) => Error::Internal(fix(m)),
            e => e,
        }
    }
}

/// Makes the snapshot (or cluster snapshot) at `location` readable as a local directory: the
/// entry every reader of a snapshot location goes through. A remote one is downloaded with the
/// parents its manifests name (every part's, for a cluster snapshot); nothing is checked here
/// beyond the manifests being there, the readers check every file as for a local snapshot.
pub fn stage(location: &str) -> Result<Staged> {
    let r = match Location::open(location)? {
        Location::Local(dir) => return Ok(Staged { dir, staging: None }),
        Location::Remote(r) => r,
    };
    let root = StagingDir::new()?;
    let local = |key: &str| {
        key.split('/')
            .fold(root.path().to_path_buf(), |p, s| p.join(s))
    };
    let dir = local(&r.key);
    r.download(&dir)?;
    let has = |n: &str| dir.join(n).is_file();
    if !has(MANIFEST) && !has(CLUSTER_MANIFEST) {
        return Err(invalid(format!(
            "{} is not a snapshot: it has no {MANIFEST} (nor {})",
            r.uri(),
            CLUSTER_MANIFEST
        )));
    }
    // The snapshots to follow: this one, or each part of a cluster snapshot.
    let mut todo: Vec<String> = Vec::new();
    if has(MANIFEST) {
        todo.push(r.key.clone());
    }
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            if e.path().join(MANIFEST).is_file() {
                todo.push(join_key(&r.key, &e.file_name().to_string_lossy()));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    while let Some(key) = todo.pop() {
        if !seen.insert(key.clone()) || seen.len() > 100_000 {
            continue;
        }
        let mpath = local(&key).join(MANIFEST);
        let Ok(bytes) = std::fs::read(&mpath) else {
            continue; // a missing parent: the chain reader names it
        };
        let Ok(m) = serde_json::from_slice::<Manifest>(&bytes) else {
            continue; // an unreadable manifest: the reader names it
        };
        let Some(p) = m.parent else { continue };
        let pkey = resolve_key(&r.bucket, &key, &p.path)?;
        let pdir = local(&pkey);
        if !pdir.join(MANIFEST).exists() {
            r.at(pkey.clone()).download(&pdir)?;
        }
        todo.push(pkey);
    }
    Ok(Staged {
        dir,
        staging: Some((root, format!("s3://{}/", r.bucket))),
    })
}

/// The manifests of the chain ending at the snapshot `location`, base first, with where each
/// lies; a remote chain is read manifest by manifest without downloading the files.
pub fn manifest_chain(location: &str) -> Result<Vec<(String, Manifest)>> {
    let loc = match Location::open(location)? {
        Location::Local(dir) => {
            return Ok(Manifest::chain(&dir)?
                .into_iter()
                .map(|(p, m)| (p.display().to_string(), m))
                .collect())
        }
        l => l,
    };
    let mut out: Vec<(String, Manifest)> = Vec::new();
    let mut at = loc;
    loop {
        let bytes = at.read(MANIFEST)?.ok_or_else(|| {
            let what = match out.last() {
                Some((child, _)) => format!(" (the parent of {child}, which the increment needs)"),
                None => String::new(),
            };
            invalid(format!(
                "{at} is not a snapshot: it has no {MANIFEST} (a snapshot without its manifest \
                 does not exist){what}"
            ))
        })?;
        let m = Manifest::from_bytes(&bytes, &format!("{at}/{MANIFEST}"))?;
        if let Some((child, cm)) = out.last() {
            let want = cm
                .parent
                .as_ref()
                .map(|p| p.id.as_str())
                .unwrap_or_default();
            if m.id != want {
                return Err(corrupt(format!(
                    "{child}: its parent should be snapshot {want}, but {at} holds snapshot {}",
                    m.id
                )));
            }
        }
        let parent = m.parent.clone();
        out.push((at.to_string(), m));
        if out.len() > 100_000 {
            return Err(corrupt(format!("{location}: the chain of parents loops")));
        }
        let Some(p) = parent else { break };
        at = at.resolve(&p.path)?;
    }
    out.reverse();
    if out[0].1.kind != "full" {
        return Err(corrupt(format!(
            "{}: the chain does not start with a full snapshot",
            out[0].0
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s3(bucket: &str, key: &str) -> Uri {
        Uri::S3 {
            bucket: bucket.into(),
            key: key.into(),
        }
    }

    #[test]
    fn parses_locations() {
        assert_eq!(
            parse("snaps/0001").unwrap(),
            Uri::Local("snaps/0001".into())
        );
        // An absolute path of this machine, made at run time.
        let abs = std::env::temp_dir().join("s");
        let abs_str = abs.display().to_string();
        assert_eq!(parse(&abs_str).unwrap(), Uri::Local(abs.clone()));
        assert_eq!(
            parse(&format!("file://{abs_str}")).unwrap(),
            Uri::Local(abs)
        );
        assert_eq!(parse("s3://my-bucket/a/b").unwrap(), s3("my-bucket", "a/b"));
        assert_eq!(
            parse("s3://my.bucket/a/b/").unwrap(),
            s3("my.bucket", "a/b")
        );
    }

    #[test]
    fn refuses_bad_locations() {
        for (bad, says) in [
            ("", "empty"),
            ("file://", "names no directory"),
            ("gs://bucket/a", "scheme gs://"),
            ("http://host/a", "scheme http://"),
            ("s3://bucket", "no prefix"),
            ("s3://bucket/", "no prefix"),
            ("s3:///a", "not a bucket name"),
            ("s3://Bucket/a", "not a bucket name"),
            ("s3://ab/a", "not a bucket name"),
            ("s3://-ab/a", "not a bucket name"),
            ("s3://bucket/a//b", "segment"),
            ("s3://bucket/a/../b", "segment"),
            ("s3://bucket/./b", "segment"),
        ] {
            match parse(bad) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(says), "{bad:?}: {m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn parent_paths_round_trip() {
        for (child, parent, rel) in [
            ("snaps/0002", "snaps/0001", "0001"),
            ("c2/server-0", "c1/server-0", "../c1/server-0"),
            ("a/b/c2/server-1", "a/b/c1/server-1", "../c1/server-1"),
            ("x/y/s", "z/s0", "../../z/s0"),
            ("s2", "s1", "s1"),
            ("s2", "deep/s1", "deep/s1"),
        ] {
            assert_eq!(relative_key(child, parent), rel, "{child} -> {parent}");
            assert_eq!(
                resolve_key("bkt", child, rel).unwrap(),
                parent,
                "{child} + {rel}"
            );
        }
        assert_eq!(resolve_key("bkt", "a/s2", "s3://bkt/q/s1").unwrap(), "q/s1");
        assert!(matches!(
            resolve_key("bkt", "a/s2", "s3://ccc/q/s1"),
            Err(Error::InvalidArgument(_))
        ));
        let local_parent = std::env::temp_dir().join("s1");
        assert!(matches!(
            resolve_key("bkt", "a/s2", &local_parent.display().to_string()),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            resolve_key("bkt", "a/s2", "../../s1"),
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(
            resolve_key("bkt", "a/s2", ".."),
            Err(Error::Corrupt(_))
        ));
    }

    #[test]
    fn s3_error_answers_are_shortened() {
        let body = "Generic S3 error: Error performing GET http://h/b in 9ms - Server returned \
                    non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?><Error>\
                    <Code>NoSuchBucket</Code><Message>The specified bucket does not exist\
                    </Message><RequestId>x</RequestId></Error>";
        assert_eq!(
            short(body),
            "NoSuchBucket: The specified bucket does not exist (404 Not Found)"
        );
        assert_eq!(
            short("HTTP error: error sending request"),
            "HTTP error: error sending request"
        );
    }

    #[test]
    fn credentials_come_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!has_credentials(env(&[])));
        assert!(!has_credentials(env(&[("AWS_ACCESS_KEY_ID", "")])));
        assert!(!has_credentials(env(&[("AWS_SKIP_SIGNATURE", "false")])));
        assert!(!has_credentials(env(&[("AWS_REGION", "us-east-1")])));
        assert!(has_credentials(env(&[("AWS_ACCESS_KEY_ID", "k")])));
        assert!(has_credentials(env(&[("AWS_SKIP_SIGNATURE", "true")])));
        assert!(has_credentials(env(&[(
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "/t"
        )])));
    }
}
