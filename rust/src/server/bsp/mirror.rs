//! A job's state in a replica group: the records a primary hands to its followers through the
//! replication log, in the order it kept them on its own disk, and a follower's copy of them.
//!
//! A durable primary keeps its job in `bsp/` (`job.json` and one log per pending step, see
//! `Persist`); every change it makes there is also a record of the next log entry: a job header
//! (`job.json` as written, `reset` when a job started), a tagged push counted in a pending step
//! (the bytes appended to the step's log, at its index in that log), a prune of the logs of
//! applied steps, or "no job". A resync sends the whole state (`Clear`, the header, every
//! pending step's pushes). A follower writes the same files the same way (atomic header, fsync
//! with `sync` durability) before it acks, and never runs the job: promoted, it loads the job
//! from them as a restarted primary does (`Steps::take_over`).
//!
//! Applying a record twice changes nothing: a header replaces the one held (a `reset` of the
//! job held already prunes nothing), a push whose index the step's log has already is skipped,
//! a prune is idempotent. So the entries after a resync's position, which carry records its
//! state holds already, are harmless.

use std::collections::BTreeMap;
use std::io::Write;

use super::{io_err, Persist, Saved};
use crate::error::{corrupt, Result};

/// One change of a job's state as it replicates.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Record {
    /// `job.json` as the primary wrote it; `reset`: a job started (its nonce is new).
    Header { reset: bool, saved: Vec<u8> },
    /// A tagged push counted in step `step`: the bytes of its record in the step's log, the
    /// `index`-th record there.
    Push {
        step: u64,
        index: u64,
        body: Vec<u8>,
    },
    /// The logs of steps <= `applied` are deleted.
    Prune { applied: u64 },
    /// No job: everything is deleted.
    Clear,
}

const HEADER: u8 = 1;
const PUSH: u8 = 2;
const PRUNE: u8 = 3;
const CLEAR: u8 = 4;

impl Record {
    /// The record as it goes into a log entry: a kind byte and its body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Record::Header { reset, saved } => {
                let mut b = Vec::with_capacity(2 + saved.len());
                b.push(HEADER);
                b.push(u8::from(*reset));
                b.extend_from_slice(saved);
                b
            }
            Record::Push { step, index, body } => {
                let mut b = Vec::with_capacity(17 + body.len());
                b.push(PUSH);
                b.extend_from_slice(&step.to_le_bytes());
                b.extend_from_slice(&index.to_le_bytes());
                b.extend_from_slice(body);
                b
            }
            Record::Prune { applied } => {
                let mut b = vec![PRUNE];
                b.extend_from_slice(&applied.to_le_bytes());
                b
            }
            Record::Clear => vec![CLEAR],
        }
    }

    /// A record of a log entry; an error names what is wrong with it.
    pub(crate) fn decode(b: &[u8]) -> Result<Self> {
        let bad = |what: &str| corrupt(format!("a job record of the primary: {what}"));
        let u64_at = |at: usize| -> Result<u64> {
            b.get(at..at + 8)
                .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
                .ok_or_else(|| bad(&format!("{} bytes, too short", b.len())))
        };
        match b.first().copied() {
            Some(HEADER) => {
                let reset = match b.get(1) {
                    Some(0) => false,
                    Some(1) => true,
                    _ => return Err(bad("a header without its reset flag")),
                };
                let saved = b[2..].to_vec();
                serde_json::from_slice::<Saved>(&saved)
                    .map_err(|e| bad(&format!("its job header: {e}")))?;
                Ok(Record::Header { reset, saved })
            }
            Some(PUSH) => {
                let (step, index) = (u64_at(1)?, u64_at(9)?);
                let body = b[17..].to_vec();
                if super::split_log(&body).len() != 1 {
                    return Err(bad(&format!("the push {index} of step {step} is torn")));
                }
                Ok(Record::Push { step, index, body })
            }
            Some(PRUNE) if b.len() == 9 => Ok(Record::Prune {
                applied: u64_at(1)?,
            }),
            Some(CLEAR) if b.len() == 1 => Ok(Record::Clear),
            Some(k) => Err(bad(&format!("kind {k}, {} bytes", b.len()))),
            None => Err(bad("empty")),
        }
    }
}

/// What a follower's copy holds, read from its files once and kept up with its writes.
#[derive(Debug, Default)]
pub(super) struct Mirror {
    /// The held job's nonce (0: none).
    nonce: u64,
    /// Its applied steps.
    applied: u64,
    /// The records in each pending step's log.
    counts: BTreeMap<u64, u64>,
}

impl Mirror {
    /// What the files of `p` hold.
    pub(super) fn read(p: &Persist) -> Result<Self> {
        let mut m = Mirror::default();
        let f = p.dir.join("job.json");
        match std::fs::read(&f) {
            Ok(b) => {
                let s: Saved = serde_json::from_slice(&b)
                    .map_err(|e| corrupt(format!("{}: {e}", f.display())))?;
                m.nonce = s.nonce;
                m.applied = s.applied;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&f, e)),
        }
        for step in p.steps()? {
            let n = p.read_raw(step)?.len() as u64;
            m.counts.insert(step, n);
        }
        Ok(m)
    }

    /// Keeps one record of the primary in the files of `p`.
    pub(super) fn install(&mut self, p: &Persist, r: Record) -> Result<()> {
        match r {
            Record::Header { reset, saved } => {
                let s: Saved = serde_json::from_slice(&saved)
                    .map_err(|e| corrupt(format!("a job header of the primary: {e}")))?;
                if reset && s.nonce != self.nonce {
                    p.prune(0, true)?;
                    self.counts.clear();
                    self.applied = 0;
                }
                p.write_header(&saved)?;
                if s.nonce != self.nonce {
                    self.applied = s.applied;
                } else {
                    self.applied = self.applied.max(s.applied);
                }
                self.nonce = s.nonce;
            }
            Record::Push { step, index, body } => {
                if step <= self.applied {
                    return Ok(());
                }
                let have = self.counts.get(&step).copied().unwrap_or(0);
                if index < have {
                    return Ok(());
                }
                if index > have {
                    return Err(corrupt(format!(
                        "the primary's push {index} of step {step} arrived after {have} of that \
                         step's pushes: a record is missing"
                    )));
                }
                p.append(step, &body)?;
                self.counts.insert(step, have + 1);
            }
            Record::Prune { applied } => {
                p.prune(applied, false)?;
                self.counts = self.counts.split_off(&(applied + 1));
                self.applied = self.applied.max(applied);
            }
            Record::Clear => {
                p.prune(0, true)?;
                let f = p.dir.join("job.json");
                match std::fs::remove_file(&f) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(&f, e)),
                }
                if p.sync {
                    std::fs::File::open(&p.dir)
                        .and_then(|d| d.sync_all())
                        .map_err(|e| io_err(&p.dir, e))?;
                }
                *self = Mirror::default();
            }
        }
        Ok(())
    }
}

impl Persist {
    /// Appends one record (as [`super::encode_log`] made it) to a step's log.
    pub(super) fn append(&self, step: u64, rec: &[u8]) -> Result<()> {
        let f = self.step_log(step);
        let write = || -> std::io::Result<()> {
            let mut h = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&f)?;
            h.write_all(rec)?;
            if self.sync {
                h.sync_data()?;
            }
            Ok(())
        };
        write().map_err(|e| io_err(&f, e))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{JobOptions, Steps};
    use super::*;
    use crate::durable::{CommitEntry, CommitSink, Durability};
    use crate::store::{DurableConfig, Store, StoreConfig, Table};
    use crate::table::SparseTableConfig;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[test]
    fn records_decode_to_what_was_encoded_and_bad_bytes_are_refused() {
        let saved = br#"{"id":"j","lease_s":10.0,"continue_on_loss":false,"mean":true,"clocks":[1,0],"lost":[false,false],"applied":0,"applying":null,"nonce":7}"#.to_vec();
        let body = super::super::encode_log(
            &super::super::LogHead {
                rid: Some((3, 4)),
                table: "t".into(),
                dim: 2,
            },
            &[5],
            &[1.0, 2.0],
        );
        for r in [
            Record::Header {
                reset: true,
                saved: saved.clone(),
            },
            Record::Push {
                step: 2,
                index: 9,
                body: body.clone(),
            },
            Record::Prune { applied: 4 },
            Record::Clear,
        ] {
            assert_eq!(Record::decode(&r.encode()).unwrap(), r);
        }
        let torn = Record::Push {
            step: 2,
            index: 0,
            body: body[..body.len() - 1].to_vec(),
        }
        .encode();
        for bad in [vec![], vec![9], vec![PRUNE, 1], torn, vec![HEADER, 1, b'{']] {
            let e = Record::decode(&bad).unwrap_err().to_string();
            assert!(e.contains("job record"), "{e}");
        }
    }

    /// Collects the entries of a store's commit log.
    struct Sink(Mutex<Vec<CommitEntry>>);

    impl CommitSink for Sink {
        fn wanted(&self) -> bool {
            true
        }
        fn committed(&self, entry: CommitEntry) {
            self.0.lock().unwrap().push(entry);
        }
        fn skipped(&self, _lsn: u64) {}
    }

    fn durable(dir: &std::path::Path) -> Arc<Store> {
        let mut d = DurableConfig::new(dir);
        d.durability = Durability::Sync;
        Arc::new(Store::open(StoreConfig::default(), d).unwrap())
    }

    fn config() -> SparseTableConfig {
        SparseTableConfig {
            dim: 2,
            optimizer: crate::OptimizerConfig {
                lr: 0.5,
                kind: crate::OptimizerKind::Sgd {
                    momentum: 0.0,
                    weight_decay: 0.0,
                    nesterov: false,
                },
                ..Default::default()
            },
            initializer: crate::init::Initializer::Zeros,
            seed: 1,
            lifecycle: Default::default(),
            refuse_nonfinite: false,
        }
    }

    fn opts() -> JobOptions {
        JobOptions {
            lease: Duration::from_secs(10),
            continue_on_loss: false,
            mean: false,
        }
    }

    #[test]
    fn a_follower_mirror_of_the_records_loads_the_job_with_its_pending_pushes_once() {
        let root = std::env::temp_dir().join(format!("pstore-jobmirror-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let primary = durable(&root.join("a"));
        let sink = Arc::new(Sink(Mutex::new(Vec::new())));
        let f = primary.flusher().unwrap();
        f.set_commit_sink(Some(Arc::clone(&sink) as Arc<dyn CommitSink>));
        let cfg = config();
        primary.create_sparse_table("t", cfg.clone()).unwrap();
        let steps = Steps::load(&primary, false).unwrap();
        steps.advance("j", 0, 2, 0, opts()).unwrap();
        steps.advance("j", 1, 2, 0, opts()).unwrap();
        steps
            .add("j", 0, Some((1, 1)), 1, "t", 2, &[5], &[1.0, 1.0])
            .unwrap();
        steps
            .add(
                "j",
                1,
                Some((2, 1)),
                1,
                "t",
                2,
                &[5, 6],
                &[2.0, 2.0, 3.0, 3.0],
            )
            .unwrap();
        steps.advance("j", 0, 2, 1, opts()).unwrap();
        f.flush().unwrap();
        let records: Vec<Vec<u8>> = sink
            .0
            .lock()
            .unwrap()
            .iter()
            .flat_map(|e| e.job.clone())
            .collect();
        assert!(records.len() >= 4, "{}", records.len());

        // The follower keeps them, twice over (an entry applied again changes nothing), and
        // runs nothing.
        let follower = durable(&root.join("b"));
        follower.create_sparse_table("t", cfg).unwrap();
        let fs = Steps::load(&follower, true).unwrap();
        fs.follow();
        fs.install(&records).unwrap();
        fs.install(&records).unwrap();
        assert_eq!(fs.view().job, "");
        assert!(fs.advance("j", 1, 2, 1, opts()).is_err());
        // A record missing in the middle is an error, not a silent gap.
        let gap = Record::Push {
            step: 1,
            index: 5,
            body: super::super::encode_log(
                &super::super::LogHead {
                    rid: None,
                    table: "t".into(),
                    dim: 2,
                },
                &[1],
                &[1.0, 1.0],
            ),
        };
        assert!(fs.install(&[gap.encode()]).is_err());
        // The whole state of the primary, as a resync sends it, gives the same files.
        let again = durable(&root.join("c"));
        again.create_sparse_table("t", config()).unwrap();
        let gs = Steps::load(&again, true).unwrap();
        gs.install(&steps.records().unwrap()).unwrap();

        for (store, s) in [(&follower, &fs), (&again, &gs)] {
            s.take_over(store).unwrap();
            let v = s.view();
            assert_eq!(
                (v.job.as_str(), v.clocks.clone(), v.applied),
                ("j", vec![1, 0], 0)
            );
            // A retried push is counted once; the step applies the sum of the two.
            s.add(
                "j",
                1,
                Some((2, 1)),
                1,
                "t",
                2,
                &[5, 6],
                &[2.0, 2.0, 3.0, 3.0],
            )
            .unwrap();
            s.advance("j", 1, 2, 1, opts()).unwrap();
            s.apply_ready(store).unwrap();
            assert_eq!(s.view().applied, 1);
            let Table::Sparse(t) = store.table("t").unwrap() else {
                panic!("sparse")
            };
            // SGD from zeros, lr 0.5: each row is -0.5 times the sum of its gradients, once.
            assert_eq!(t.pull(&[5, 6]).unwrap(), vec![-1.5, -1.5, -1.5, -1.5]);
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_promoted_follower_finishes_a_step_only_on_the_tables_that_lack_its_request_id() {
        let root = std::env::temp_dir().join(format!("pstore-jobmarker-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = durable(&root);
        for name in ["t", "u"] {
            store.create_sparse_table(name, config()).unwrap();
        }
        let steps = Steps::load(&store, true).unwrap();
        steps.follow();
        let nonce = 77;
        // The old primary was applying step 1 (its marker) of both tables' pushes.
        let saved = serde_json::to_vec(&Saved {
            id: "j".into(),
            lease_s: 10.0,
            continue_on_loss: false,
            mean: false,
            clocks: vec![1, 1],
            lost: vec![false, false],
            applied: 0,
            applying: Some((1, BTreeMap::new())),
            nonce,
        })
        .unwrap();
        let push = |table: &str, g: f32, rid: (u64, u64), index: u64| Record::Push {
            step: 1,
            index,
            body: super::super::encode_log(
                &super::super::LogHead {
                    rid: Some(rid),
                    table: table.into(),
                    dim: 2,
                },
                &[1],
                &[g, g],
            ),
        };
        let records = [
            Record::Header { reset: true, saved },
            push("t", 1.0, (5, 1), 0),
            push("u", 2.0, (6, 1), 1),
        ];
        let records: Vec<Vec<u8>> = records.iter().map(Record::encode).collect();
        steps.install(&records).unwrap();
        // Its apply reached table t (the rows with the step's request id), not u.
        let Table::Sparse(t) = store.table("t").unwrap() else {
            panic!("sparse")
        };
        t.push_validated_as(&[1], &[1.0, 1.0], 1.0, Some((nonce, 1)))
            .unwrap();
        steps.take_over(&store).unwrap();
        assert_eq!(steps.view().applied, 1);
        let Table::Sparse(u) = store.table("u").unwrap() else {
            panic!("sparse")
        };
        // SGD from zeros, lr 0.5: t once (not twice), u once.
        assert_eq!(t.pull(&[1]).unwrap(), vec![-0.5, -0.5]);
        assert_eq!(u.pull(&[1]).unwrap(), vec![-1.0, -1.0]);
        // Loaded again (a restart of the promoted server): nothing applied again.
        drop(steps);
        let again = Steps::load(&store, false).unwrap();
        assert_eq!(again.view().applied, 1);
        assert_eq!(t.pull(&[1]).unwrap(), vec![-0.5, -0.5]);
        assert_eq!(u.pull(&[1]).unwrap(), vec![-1.0, -1.0]);
        let _ = std::fs::remove_dir_all(&root);
    }
}
