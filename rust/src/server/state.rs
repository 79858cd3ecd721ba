//! What a store server keeps besides the store: the answers of recent writes (so a retried
//! request applies once), the workers' clocks, and the per-table stale-gradient policies with
//! their staleness statistics.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::{invalid, storage, Result};
use crate::net::proto::StalePolicy;

/// How many answered request ids a server remembers. A client retries within its timeout, so
/// this only has to outlast the retries of the requests in flight.
pub const DEDUP_CAPACITY: usize = 1 << 20;

type Slot<T> = Arc<Mutex<Option<T>>>;
type Key = (u64, u64);

/// The remembered answers, and their ids oldest first.
struct Answers<T> {
    map: HashMap<Key, Slot<T>>,
    order: VecDeque<Key>,
}

/// The answers of recent writes by request id.
pub struct Dedup<T> {
    inner: Mutex<Answers<T>>,
    capacity: usize,
}

impl<T: Clone> Dedup<T> {
    /// Remembers up to `capacity` answers.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Answers {
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
            capacity,
        }
    }

    /// Of the last `n` request ids remembered, those answered (oldest first).
    pub fn recent(&self, n: usize) -> Vec<(u64, u64)> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let skip = g.order.len().saturating_sub(n);
        g.order
            .iter()
            .skip(skip)
            .filter(|k| {
                g.map
                    .get(k)
                    .is_some_and(|s| s.lock().map(|a| a.is_some()).unwrap_or(false))
            })
            .copied()
            .collect()
    }

    /// The remembered answer of `id`, if it was answered.
    pub fn answered(&self, id: (u64, u64)) -> Option<T> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let slot = g.map.get(&id)?;
        let a = slot.lock().unwrap_or_else(|e| e.into_inner());
        a.clone()
    }

    /// Remembers `answer` for `id`, as if this server had applied it (the rows it applied came
    /// from another server); an id already known keeps its own.
    pub fn remember(&self, id: (u64, u64), answer: T) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Answers { map, order } = &mut *g;
        if map.contains_key(&id) {
            return;
        }
        map.insert(id, Arc::new(Mutex::new(Some(answer))));
        order.push_back(id);
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// Runs `apply` once per id: a retry that arrives while the first attempt runs waits for it
    /// and gets its answer; one that arrives later gets the remembered answer. A failed attempt
    /// is not remembered (it changed nothing), so a retry runs again. `None` (no id) always runs.
    pub fn once<E>(
        &self,
        id: Option<(u64, u64)>,
        apply: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let Some(key) = id else {
            return apply();
        };
        let slot = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let Answers { map, order } = &mut *g;
            match map.get(&key) {
                Some(s) => Arc::clone(s),
                None => {
                    let s: Slot<T> = Arc::new(Mutex::new(None));
                    map.insert(key, Arc::clone(&s));
                    order.push_back(key);
                    while order.len() > self.capacity {
                        if let Some(old) = order.pop_front() {
                            map.remove(&old);
                        }
                    }
                    s
                }
            }
        };
        let mut answer = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = &*answer {
            return Ok(a.clone());
        }
        let a = apply()?;
        *answer = Some(a.clone());
        Ok(a)
    }
}

/// The most workers one job's clocks can count.
pub const MAX_WORKERS: u32 = 1 << 16;

/// Training clocks of the workers of one job.
pub struct Clocks {
    tx: watch::Sender<Vec<u64>>,
}

impl Default for Clocks {
    fn default() -> Self {
        Self {
            tx: watch::channel(Vec::new()).0,
        }
    }
}

impl Clocks {
    /// Sets worker `w`'s clock (clocks only move forward); the first call fixes the number of
    /// workers until every clock is reset by a call with a different count at clock 0.
    pub fn advance(&self, w: u32, n: u32, clock: u64) -> Result<()> {
        if n > MAX_WORKERS {
            return Err(invalid(format!(
                "num_workers must be at most {MAX_WORKERS}, got {n}"
            )));
        }
        if n == 0 || w >= n {
            return Err(invalid(format!(
                "worker {w} is not in 0..num_workers = 0..{n}"
            )));
        }
        let mut err = None;
        self.tx.send_modify(|c| {
            if c.len() != n as usize {
                if c.is_empty() || c.iter().all(|&x| x == 0) || clock == 0 {
                    *c = vec![0; n as usize];
                } else {
                    err = Some(invalid(format!(
                        "this server's job has {} workers, worker {w} says {n}",
                        c.len()
                    )));
                    return;
                }
            }
            let x = &mut c[w as usize];
            *x = (*x).max(clock);
        });
        err.map_or(Ok(()), Err)
    }

    /// The clocks now.
    pub fn get(&self) -> Vec<u64> {
        self.tx.borrow().clone()
    }

    /// Waits until every clock is at least `target`.
    pub async fn wait_min(&self, target: u64) {
        let mut rx = self.tx.subscribe();
        // The sender lives as long as the server, so the wait ends only when the clocks do.
        let _ = rx
            .wait_for(|c| !c.is_empty() && c.iter().min().copied().unwrap_or(0) >= target)
            .await;
    }
}

/// A table's stale-gradient policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Policy {
    /// `"apply"`, `"drop"` or `"scale"`.
    #[serde(with = "policy_name")]
    pub policy: StalePolicy,
    /// Under `drop`, pushes staler than this are dropped (0: no limit).
    pub max_staleness: u64,
}

mod policy_name {
    use super::StalePolicy;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &StalePolicy, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&p.as_str_name().to_ascii_lowercase())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<StalePolicy, D::Error> {
        let s = String::deserialize(d)?;
        StalePolicy::from_str_name(&s.to_ascii_uppercase())
            .ok_or_else(|| serde::de::Error::custom(format!("unknown stale policy {s:?}")))
    }
}

/// Staleness seen by one table's pushes on this server.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Staleness {
    /// Pushes that carried the seq of their pull.
    pub pushes: u64,
    /// Sum of their staleness.
    pub total: u64,
    /// The largest staleness seen.
    pub max: u64,
    /// Pushes dropped by the `drop` policy.
    pub dropped: u64,
    /// Pushes whose learning rate the `scale` policy lowered.
    pub scaled: u64,
    /// Pushes per staleness bucket (bounds in [`super::versions::BUCKET_BOUNDS`], the last
    /// bucket above them).
    pub histogram: [u64; super::versions::BUCKETS],
}

/// What a push does given its staleness.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Apply it, the learning rate scaled by this factor.
    Apply(f64),
    /// Drop it.
    Drop,
}

/// The policies and statistics of all tables, the policies kept in a JSON file next to the
/// store's replica so a restarted server keeps them.
pub struct Policies {
    map: Mutex<BTreeMap<String, (Policy, Staleness)>>,
    file: Option<PathBuf>,
}

impl Policies {
    /// Loads the policies file of a durable server (none: in memory).
    pub fn load(file: Option<PathBuf>) -> Result<Self> {
        let mut map = BTreeMap::new();
        if let Some(f) = &file {
            match std::fs::read(f) {
                Ok(b) => {
                    let saved: BTreeMap<String, Policy> = serde_json::from_slice(&b)
                        .map_err(|e| crate::error::corrupt(format!("{}: {e}", f.display())))?;
                    for (k, p) in saved {
                        map.insert(k, (p, Staleness::default()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(storage(format!("{}: {e}", f.display()))),
            }
        }
        Ok(Self {
            map: Mutex::new(map),
            file,
        })
    }

    fn save(&self, map: &BTreeMap<String, (Policy, Staleness)>) -> Result<()> {
        let Some(f) = &self.file else { return Ok(()) };
        let saved: BTreeMap<&String, Policy> = map.iter().map(|(k, (p, _))| (k, *p)).collect();
        let tmp = f.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(&saved).expect("policies serialize");
        std::fs::write(&tmp, body)
            .and_then(|_| std::fs::rename(&tmp, f))
            .map_err(|e| storage(format!("{}: {e}", f.display())))
    }

    /// Sets a table's policy.
    pub fn set(&self, table: &str, p: Policy) -> Result<()> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let before = m.get(table).map(|x| x.0);
        m.entry(table.to_string()).or_default().0 = p;
        if before != Some(p) {
            self.save(&m)?;
        }
        Ok(())
    }

    /// Forgets a dropped table.
    pub fn remove(&self, table: &str) -> Result<()> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if m.remove(table).is_some() {
            self.save(&m)?;
        }
        Ok(())
    }

    /// A table's policy.
    pub fn get(&self, table: &str) -> Policy {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.get(table).map(|x| x.0).unwrap_or_default()
    }

    /// A table's staleness statistics.
    pub fn stats(&self, table: &str) -> Staleness {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.get(table).map(|x| x.1).unwrap_or_default()
    }

    /// Decides what a push of the given staleness does (before it is applied).
    pub fn decide(&self, table: &str, staleness: Option<u64>) -> Decision {
        let Some(s) = staleness else {
            return Decision::Apply(1.0);
        };
        let p = self.get(table);
        match p.policy {
            StalePolicy::Apply => Decision::Apply(1.0),
            StalePolicy::Drop if p.max_staleness > 0 && s > p.max_staleness => Decision::Drop,
            StalePolicy::Drop => Decision::Apply(1.0),
            StalePolicy::Scale if s >= 1 => Decision::Apply(1.0 / s as f64),
            StalePolicy::Scale => Decision::Apply(1.0),
        }
    }

    /// Counts a push once it was applied or dropped.
    pub fn record(&self, table: &str, staleness: Option<u64>, d: Decision) {
        let Some(s) = staleness else { return };
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut m.entry(table.to_string()).or_default().1;
        st.pushes += 1;
        st.total += s;
        st.max = st.max.max(s);
        st.histogram[super::versions::bucket_of(s)] += 1;
        match d {
            Decision::Drop => st.dropped += 1,
            Decision::Apply(x) if x < 1.0 => st.scaled += 1,
            Decision::Apply(_) => {}
        }
    }

    /// Every table's statistics.
    pub fn all_stats(&self) -> Vec<(String, Staleness)> {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().map(|(k, (_, s))| (k.clone(), *s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn remembered_ids_are_answered_and_recent_lists_answered_ones() {
        let d: Dedup<u32> = Dedup::new(3);
        d.once(Some((1, 1)), || Ok::<_, ()>(10)).unwrap();
        d.remember((9, 9), 99);
        // A remembered id is answered, its work never runs.
        assert_eq!(d.once(Some((9, 9)), || Ok::<_, ()>(0)).unwrap(), 99);
        // An id already known keeps its own answer.
        d.remember((1, 1), 5);
        assert_eq!(d.once(Some((1, 1)), || Ok::<_, ()>(0)).unwrap(), 10);
        // A failed attempt is not listed.
        let _ = d.once(Some((2, 2)), || Err::<u32, ()>(()));
        assert_eq!(d.recent(10), vec![(1, 1), (9, 9)]);
        // The last n ids remembered, those answered among them.
        assert_eq!(d.recent(2), vec![(9, 9)]);
    }

    #[test]
    fn a_request_id_applies_once_and_failures_are_retried() {
        let d: Dedup<u32> = Dedup::new(4);
        let n = AtomicU32::new(0);
        let run = || -> std::result::Result<u32, ()> { Ok(n.fetch_add(1, Ordering::SeqCst)) };
        assert_eq!(d.once(Some((1, 1)), run), Ok(0));
        assert_eq!(d.once(Some((1, 1)), run), Ok(0));
        assert_eq!(d.once(Some((1, 2)), run), Ok(1));
        assert_eq!(d.once(None, run), Ok(2));
        assert_eq!(d.once(None, run), Ok(3));
        assert_eq!(d.once(Some((2, 1)), || Err::<u32, _>("full")), Err("full"));
        assert_eq!(d.once(Some((2, 1)), run), Ok(4));
        // Forgotten after `capacity` newer ids.
        for s in 10..20 {
            d.once(Some((3, s)), run).unwrap();
        }
        assert_ne!(d.once(Some((1, 1)), run), Ok(0));
    }

    #[test]
    fn policies_decide_by_staleness() {
        let p = Policies::load(None).unwrap();
        assert_eq!(p.decide("t", Some(9)), Decision::Apply(1.0));
        p.set(
            "t",
            Policy {
                policy: StalePolicy::Drop,
                max_staleness: 3,
            },
        )
        .unwrap();
        assert_eq!(p.decide("t", Some(3)), Decision::Apply(1.0));
        assert_eq!(p.decide("t", Some(4)), Decision::Drop);
        assert_eq!(p.decide("t", None), Decision::Apply(1.0));
        p.set(
            "t",
            Policy {
                policy: StalePolicy::Scale,
                max_staleness: 0,
            },
        )
        .unwrap();
        assert_eq!(p.decide("t", Some(0)), Decision::Apply(1.0));
        assert_eq!(p.decide("t", Some(4)), Decision::Apply(0.25));
        p.record("t", Some(4), Decision::Apply(0.25));
        p.record("t", Some(2), Decision::Drop);
        let s = p.stats("t");
        assert_eq!(
            (s.pushes, s.total, s.max, s.dropped, s.scaled),
            (2, 6, 4, 1, 1)
        );
        assert_eq!(s.histogram, [0, 0, 1, 1, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn policies_survive_a_restart() {
        let dir = std::env::temp_dir().join(format!("pstore-pol-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("policies.json");
        let p = Policies::load(Some(f.clone())).unwrap();
        let want = Policy {
            policy: StalePolicy::Scale,
            max_staleness: 7,
        };
        p.set("emb", want).unwrap();
        assert_eq!(Policies::load(Some(f.clone())).unwrap().get("emb"), want);
        std::fs::write(&f, b"{broken").unwrap();
        assert!(Policies::load(Some(f)).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn clocks_wait_for_the_slowest() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let c = Arc::new(Clocks::default());
            c.advance(0, 2, 1).unwrap();
            assert!(c.advance(2, 2, 1).is_err());
            let c2 = Arc::clone(&c);
            let waiter = tokio::spawn(async move { c2.wait_min(1).await });
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished());
            c.advance(1, 2, 1).unwrap();
            tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(c.get(), vec![1, 1]);
            assert!(c.advance(0, 3, 2).is_err());
            assert!(c.advance(0, u32::MAX, 0).is_err());
        });
    }
}
