//! A follower's own log of the entries it acknowledged (docs/decisions/0126).
//!
//! A follower appends each batch of entries it receives to one file in its store directory and
//! syncs it (`fdatasync`) before it applies them and acks: a sequential write, where committing
//! the rows to LMDB rewrites every page they fall on. The rows reach LMDB at a checkpoint (about
//! once a second, and when the follower stops or is promoted), after which the file is emptied.
//! A follower that crashed finds the file on its next start and applies it again, in order, on
//! top of what LMDB holds ([`super::repl::settle_follow_log`]): entries carry whole rows, and
//! LMDB holds at least the state the file starts from, so the result is the state after its
//! last entry.
//!
//! A record is `magic (4) | length (u32 LE) | CRC-32 of the payload (u32 LE) | payload`, the
//! payload a `ReplicateMessage` as the primary sent it. A torn or damaged record ends the file:
//! it and what follows were never synced, so never acknowledged.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use prost::Message;

use crate::error::{storage, Result};
use crate::net::proto::ReplicateMessage;

const MAGIC: &[u8; 4] = b"PSFL";
const HEAD: usize = 12;
/// The file's name in the store directory.
pub const FILE_NAME: &str = "follower.log";

/// The log file of a follower's store directory.
pub fn path_in(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// An open, appendable follower log.
pub struct FollowLog {
    file: File,
    path: PathBuf,
    bytes: u64,
    /// When the file was last emptied (or opened).
    since: Instant,
    buf: Vec<u8>,
}

fn io_error(path: &Path, what: &str, e: std::io::Error) -> crate::error::Error {
    storage(format!("{what} the follower's log {}: {e}", path.display()))
}

impl FollowLog {
    /// Opens the log of `dir` empty (its earlier content was settled before).
    pub fn create(dir: &Path) -> Result<Self> {
        let path = path_in(dir);
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| io_error(&path, "creating", e))?;
        Ok(Self {
            file,
            path,
            bytes: 0,
            since: Instant::now(),
            buf: Vec::new(),
        })
    }

    /// Bytes of records in the file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How long ago the file was last emptied.
    pub fn age(&self) -> std::time::Duration {
        self.since.elapsed()
    }

    /// Appends `msgs` and syncs the file: when this returns they survive a crash.
    pub fn append(&mut self, msgs: &[ReplicateMessage]) -> Result<()> {
        self.buf.clear();
        for m in msgs {
            let at = self.buf.len();
            self.buf.extend_from_slice(MAGIC);
            self.buf.extend_from_slice(&[0; 8]);
            m.encode(&mut self.buf)
                .map_err(|e| storage(format!("encoding an entry for the follower's log: {e}")))?;
            let payload = &self.buf[at + HEAD..];
            let len = u32::try_from(payload.len())
                .map_err(|_| storage("an entry of over 4 GiB for the follower's log"))?;
            let crc = crc32fast::hash(payload);
            self.buf[at + 4..at + 8].copy_from_slice(&len.to_le_bytes());
            self.buf[at + 8..at + 12].copy_from_slice(&crc.to_le_bytes());
        }
        let r = self
            .file
            .write_all(&self.buf)
            .and_then(|()| self.file.sync_data());
        if let Err(e) = r {
            // What was written in part is cut off again; the caller fails this batch.
            let _ = self.file.set_len(self.bytes);
            let _ = self.file.seek(SeekFrom::Start(self.bytes));
            return Err(io_error(&self.path, "writing", e));
        }
        self.bytes += self.buf.len() as u64;
        if self.buf.capacity() > 64 << 20 {
            self.buf = Vec::new();
        }
        Ok(())
    }

    /// Empties the file (its entries are in LMDB now).
    pub fn reset(&mut self) -> Result<()> {
        if self.bytes > 0 {
            self.file
                .set_len(0)
                .and_then(|()| self.file.seek(SeekFrom::Start(0)).map(|_| ()))
                .and_then(|()| self.file.sync_all())
                .map_err(|e| io_error(&self.path, "emptying", e))?;
            self.bytes = 0;
        }
        self.since = Instant::now();
        Ok(())
    }

    /// Removes the file (the follower stops: its entries are in LMDB).
    pub fn remove(self) -> Result<()> {
        drop(self.file);
        std::fs::remove_file(&self.path).map_err(|e| io_error(&self.path, "removing", e))
    }
}

/// The entries of the log file at `path`, in order, up to the first torn or damaged record,
/// and the bytes after it that were dropped.
pub fn read(path: &Path) -> Result<(Vec<ReplicateMessage>, u64)> {
    let mut data = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(|e| io_error(path, "reading", e))?;
    let mut out = Vec::new();
    let mut at = 0usize;
    while data.len() - at >= HEAD && &data[at..at + 4] == MAGIC {
        let len = u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap_or_default()) as usize;
        let crc = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap_or_default());
        let Some(payload) = data.get(at + HEAD..at + HEAD + len) else {
            break;
        };
        if crc32fast::hash(payload) != crc {
            break;
        }
        let Ok(m) = ReplicateMessage::decode(payload) else {
            break;
        };
        out.push(m);
        at += HEAD + len;
    }
    Ok((out, (data.len() - at) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::proto::ReplicatedTable;

    fn entry(lsn: u64, n: usize) -> ReplicateMessage {
        ReplicateMessage {
            replication_id: 7,
            lsn,
            tables: vec![ReplicatedTable {
                name: "t".into(),
                ids: vec![lsn as u8; 8 * n].into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn entries_read_back_in_order_and_a_torn_or_damaged_tail_ends_the_log() {
        let dir = std::env::temp_dir().join(format!("pstore-follow-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut log = FollowLog::create(&dir).unwrap();
        log.append(&[entry(1, 3), entry(2, 5)]).unwrap();
        log.append(&[entry(3, 1)]).unwrap();
        let p = path_in(&dir);
        let (got, dropped) = read(&p).unwrap();
        assert_eq!(got, vec![entry(1, 3), entry(2, 5), entry(3, 1)]);
        assert_eq!(dropped, 0);
        let full = std::fs::read(&p).unwrap();
        assert_eq!(full.len() as u64, log.bytes());
        // Torn inside the last record: the first two stand.
        std::fs::write(&p, &full[..full.len() - 3]).unwrap();
        let (got, dropped) = read(&p).unwrap();
        assert_eq!(got, vec![entry(1, 3), entry(2, 5)]);
        assert!(dropped > 0);
        // A flipped bit in the second record's payload: only the first stands.
        let mut bad = full.clone();
        let second = HEAD + entry(1, 3).encoded_len();
        bad[second + HEAD + 2] ^= 4;
        std::fs::write(&p, &bad).unwrap();
        assert_eq!(read(&p).unwrap().0, vec![entry(1, 3)]);
        // Emptied, the file reads as no entry, and appends start again at its beginning.
        std::fs::write(&p, &full).unwrap();
        log.reset().unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
        log.append(&[entry(9, 2)]).unwrap();
        assert_eq!(read(&p).unwrap().0, vec![entry(9, 2)]);
        log.remove().unwrap();
        assert!(!p.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
