//! Replica groups as a client sees them: each position of the server list is a group of
//! members (the first the initial primary). Calls go to the member believed primary, with the
//! group epoch the client knows; on "not primary", "stale epoch" or an unreachable primary the
//! client asks every member for its role and epoch, routes to the primary of the highest epoch
//! and retries the same request (the same request id: exactly once). docs/CLUSTER.md, Failover.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::net::proto::p_store_client::PStoreClient;
use crate::net::proto::StatusRequest;
use crate::server::fence::EPOCH_KEY;

/// How the error of a group without a reachable primary begins (after `failover_timeout`).
pub(super) const NO_PRIMARY: &str = "no primary in the replica group";

/// One member of a group.
pub(super) struct Member {
    pub name: String,
    pub stub: super::Stub,
    pub channel: Channel,
}

/// A list position: its members and which one is primary.
pub(super) struct Group {
    pub members: Vec<Member>,
    /// The member believed primary.
    current: AtomicUsize,
    /// The group epoch last seen (0: none yet; not sent).
    epoch: AtomicU64,
    /// The member reads go to with `read_from="follower"` (none: the primary).
    reader: AtomicUsize,
}

/// What one member said of itself.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub role: String,
    pub epoch: u64,
    pub lag_entries: Option<u64>,
    pub lag_seconds: Option<f64>,
}

impl Group {
    pub fn new(members: Vec<Member>) -> Self {
        Self {
            members,
            current: AtomicUsize::new(0),
            epoch: AtomicU64::new(0),
            reader: AtomicUsize::new(usize::MAX),
        }
    }

    /// The member a call goes to: the primary, or for a read with followers preferred, a
    /// follower when one is known.
    pub fn pick(&self, read: bool) -> usize {
        if read {
            let r = self.reader.load(Ordering::Relaxed);
            if r < self.members.len() {
                return r;
            }
        }
        self.current
            .load(Ordering::Relaxed)
            .min(self.members.len() - 1)
    }

    /// The epoch to send (0: none).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// The member believed primary.
    pub fn primary(&self) -> &Member {
        &self.members[self.pick(false)]
    }

    /// Puts the known epoch on a request.
    pub fn stamp<T>(&self, r: &mut tonic::Request<T>) {
        let e = self.epoch();
        if e > 0 {
            if let Ok(v) = e.to_string().parse() {
                r.metadata_mut().insert(EPOCH_KEY, v);
            }
        }
    }

    /// Whether `s` from member `k` means: look for the primary again.
    pub fn fails_over(&self, s: &Status) -> bool {
        if self.members.len() < 2 {
            return false;
        }
        let kind = s
            .metadata()
            .get(crate::net::ERROR_KIND)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        match s.code() {
            Code::FailedPrecondition => matches!(kind, "not_primary" | "stale_epoch"),
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => true,
            _ => false,
        }
    }

    /// A read from the follower `k` failed: read from the primary until the next refresh.
    pub fn reader_failed(&self, k: usize) {
        let _ = self
            .reader
            .compare_exchange(k, usize::MAX, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Asks every member for its role and epoch (each at most `wait`); routes to the primary
    /// of the highest epoch (and reads to the follower of least lag with `followers`).
    /// Returns what each said, or the error.
    pub async fn refresh(
        &self,
        token: Option<&str>,
        wait: Duration,
        followers: bool,
    ) -> Vec<std::result::Result<Seen, String>> {
        let asks = self.members.iter().map(|m| async move {
            let mut req = tonic::Request::new(StatusRequest {});
            req.set_timeout(wait);
            if let Some(t) = token {
                if let Ok(v) = format!("Bearer {t}").parse() {
                    req.metadata_mut().insert("authorization", v);
                }
            }
            let mut c = m.stub.clone();
            match tokio::time::timeout(wait, c.status(req)).await {
                Err(_) => Err(format!(
                    "{}: no answer within {:.1} s",
                    m.name,
                    wait.as_secs_f64()
                )),
                Ok(Err(s)) => Err(format!("{}: {}", m.name, s.message())),
                Ok(Ok(r)) => {
                    let v: serde_json::Value =
                        serde_json::from_str(&r.into_inner().replication_json)
                            .unwrap_or(serde_json::Value::Null);
                    Ok(Seen {
                        role: v["role"].as_str().unwrap_or("primary").to_string(),
                        epoch: v["epoch"].as_u64().unwrap_or(0),
                        lag_entries: v["lag_entries"].as_u64(),
                        lag_seconds: v["lag_seconds"].as_f64(),
                    })
                }
            }
        });
        let seen = futures::future::join_all(asks).await;
        let best = seen
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.as_ref().ok().map(|s| (k, s)))
            .filter(|(_, s)| s.role == "primary")
            .max_by_key(|(_, s)| s.epoch);
        if let Some((k, s)) = best {
            self.current.store(k, Ordering::Relaxed);
            self.epoch.fetch_max(s.epoch, Ordering::Relaxed);
        }
        if followers {
            let r = seen
                .iter()
                .enumerate()
                .filter_map(|(k, s)| s.as_ref().ok().map(|s| (k, s)))
                .filter(|(_, s)| s.role == "follower" && s.lag_seconds.is_some())
                .min_by_key(|(_, s)| s.lag_entries.unwrap_or(u64::MAX))
                .map_or(usize::MAX, |(k, _)| k);
            self.reader.store(r, Ordering::Relaxed);
        }
        seen
    }

    /// [`refresh`](Self::refresh) until a primary answers or `deadline` passes; the error
    /// names what each member said.
    pub async fn find_primary(
        &self,
        token: Option<&str>,
        deadline: Instant,
        followers: bool,
    ) -> std::result::Result<(), String> {
        let mut delay = Duration::from_millis(50);
        loop {
            let seen = self.refresh(token, Duration::from_secs(1), followers).await;
            if seen
                .iter()
                .any(|s| s.as_ref().is_ok_and(|s| s.role == "primary"))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let said: Vec<String> = seen
                    .into_iter()
                    .zip(&self.members)
                    .map(|(s, m)| match s {
                        Ok(s) => format!("{} is {} of epoch {}", m.name, s.role, s.epoch),
                        Err(e) => e,
                    })
                    .collect();
                return Err(format!(
                    "{NO_PRIMARY} [{}]: {}",
                    self.members
                        .iter()
                        .map(|m| m.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    said.join("; ")
                ));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }
}

/// What a promotion answered.
#[derive(Debug, Clone)]
pub struct Promoted {
    /// The new group epoch.
    pub epoch: u64,
    /// The old primary's replication id.
    pub from_replication_id: u64,
    /// The last entry of the old primary's log the new primary holds.
    pub from_lsn: u64,
    /// Seconds until the new primary accepts its first write.
    pub writes_in_seconds: f64,
}

/// Makes the follower at `addr` the primary of its replica group (the `Promote` call).
/// `expected_primary` (when not empty) must be the primary it follows; `force` promotes one
/// that was never caught up.
pub fn promote(
    addr: &str,
    token: Option<&str>,
    expected_primary: &str,
    force: bool,
    timeout: Duration,
) -> crate::error::Result<Promoted> {
    use crate::error::{invalid, Error};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Internal(format!("starting a runtime: {e}")))?;
    let ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| invalid(format!("server address {addr:?}: {e}")))?
        .connect_timeout(timeout)
        .timeout(timeout);
    rt.block_on(async {
        let remote = |s: Status| crate::net::error_of(&s, addr);
        let ch = ep.connect().await.map_err(|e| Error::Remote {
            server: addr.to_string(),
            code: Code::Unavailable as i32,
            message: format!("cannot reach {addr}: {e}"),
        })?;
        let mut req = tonic::Request::new(crate::net::proto::PromoteRequest {
            expected_primary: expected_primary.to_string(),
            force,
        });
        if let Some(t) = token {
            if let Ok(v) = format!("Bearer {t}").parse() {
                req.metadata_mut().insert("authorization", v);
            }
        }
        let r = PStoreClient::new(ch)
            .promote(req)
            .await
            .map_err(remote)?
            .into_inner();
        Ok(Promoted {
            epoch: r.epoch,
            from_replication_id: r.from_replication_id,
            from_lsn: r.from_lsn,
            writes_in_seconds: r.writes_in_seconds,
        })
    })
}
