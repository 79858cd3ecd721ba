//! Checking an LMDB data file against its own meta pages before it is mapped: LMDB maps the
//! whole file and trusts its meta page, so a file cut short (a copy that stopped, a full disk
//! under a copy tool) would otherwise kill the process with SIGBUS on the first read past its
//! end, and a file cut to 0 bytes would be taken for a new environment.
//!
//! The layout read here (LMDB's `mdb.c`, 64-bit builds): pages 0 and 1 are meta pages. A page
//! starts with a 16-byte header (page number u64, pad u16, flags u16, lower/upper u16s); a meta
//! page's body, at byte 16, is `magic u32, version u32, address u64, mapsize u64`, two database
//! records of 48 bytes (free pages, main: `pad u32, flags u16, depth u16, branch, leaf,
//! overflow, entries, root` as u64s; the free database's `pad` is the page size), then
//! `last_pg u64` (the last page in use) and `txnid u64`. LMDB uses the meta page with the larger
//! `txnid`; every page up to its `last_pg` must be in the file.

use std::io::Read;
use std::path::Path;

use crate::error::{corrupt, storage, Result};

const MAGIC: u32 = 0xBEEF_C0DE;
/// `MDB_DATA_VERSION` of the LMDB heed builds (999 in LMDB's development builds).
const VERSIONS: [u32; 2] = [1, 999];
const P_META: u16 = 0x08;
const META_AT: usize = 16;
const DB_BYTES: usize = 48;
/// No root page (an empty database).
const NO_PAGE: u64 = u64::MAX;

/// One meta page, as far as the check needs it.
struct Meta {
    psize: u64,
    last_pg: u64,
    txnid: u64,
    roots: [u64; 2],
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

/// The meta page at the start of `page`, or what is wrong with it.
fn meta_of(page: &[u8]) -> std::result::Result<Meta, String> {
    let m = META_AT;
    if page.len() < m + 8 + 16 + 2 * DB_BYTES + 16 {
        return Err("too short for a meta page".into());
    }
    if u16_at(page, 10) & P_META == 0 {
        return Err("not a meta page".into());
    }
    if u32_at(page, m) != MAGIC {
        return Err("no LMDB magic number".into());
    }
    let version = u32_at(page, m + 4);
    if !VERSIONS.contains(&version) {
        return Err(format!("LMDB data version {version}, not 1"));
    }
    let dbs = m + 24;
    let after = dbs + 2 * DB_BYTES;
    Ok(Meta {
        psize: u64::from(u32_at(page, dbs)),
        last_pg: u64_at(page, after),
        txnid: u64_at(page, after + 8),
        roots: [
            u64_at(page, dbs + DB_BYTES - 8),
            u64_at(page, dbs + 2 * DB_BYTES - 8),
        ],
    })
}

/// Checks the LMDB data file `dir/data.mdb`, if there is one, against its own meta pages: both
/// must be LMDB meta pages, and every page up to the newer one's last page in use (and its
/// databases' roots) must be in the file. A file of 0 bytes is refused too (LMDB would take it
/// for a new environment). A missing file passes (the caller decides whether that is a new
/// store). `what` names the kind of file in errors ("store", "artifact").
pub fn check_data_file(dir: &Path, what: &str) -> Result<()> {
    let path = dir.join("data.mdb");
    let mut f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(storage(format!("opening {}: {e}", path.display()))),
    };
    let len = f
        .metadata()
        .map_err(|e| storage(format!("reading {}: {e}", path.display())))?
        .len();
    let bad = |why: String| {
        corrupt(format!(
            "{} is damaged: {why}; the {what} cannot be opened (restore it from a snapshot or \
             a copy)",
            path.display()
        ))
    };
    if len == 0 {
        return Err(bad("the file is empty (0 bytes)".into()));
    }
    // The first meta page tells the page size; the second starts one page later.
    let mut head = vec![0u8; 4096.min(len as usize)];
    f.read_exact(&mut head)
        .map_err(|e| storage(format!("reading {}: {e}", path.display())))?;
    let first = meta_of(&head).map_err(|w| bad(format!("its first page: {w}")))?;
    let psize = first.psize;
    if !(512..=65536).contains(&psize) || !psize.is_power_of_two() {
        return Err(bad(format!("a page size of {psize} bytes")));
    }
    if len < 2 * psize {
        return Err(bad(format!(
            "{len} bytes hold less than its two meta pages of {psize} bytes"
        )));
    }
    let mut second = vec![0u8; 256];
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(psize))
        .and_then(|_| f.read_exact(&mut second))
        .map_err(|e| storage(format!("reading {}: {e}", path.display())))?;
    let second = meta_of(&second).map_err(|w| bad(format!("its second page: {w}")))?;
    let used = if second.txnid > first.txnid {
        &second
    } else {
        &first
    };
    let pages = len / psize;
    if used.last_pg >= pages {
        return Err(bad(format!(
            "its meta page says pages 0 to {} are in use, {} bytes of {psize}-byte pages, but \
             the file has {len} bytes (cut short?)",
            used.last_pg,
            (used.last_pg + 1).saturating_mul(psize)
        )));
    }
    for root in used.roots {
        if root != NO_PAGE && root > used.last_pg {
            return Err(bad(format!(
                "a database root at page {root}, past the last page in use {}",
                used.last_pg
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A meta page of `psize` bytes at txnid `txnid` whose last page in use is `last_pg`.
    fn meta_page(psize: u32, last_pg: u64, txnid: u64) -> Vec<u8> {
        let mut p = vec![0u8; psize as usize];
        p[10..12].copy_from_slice(&P_META.to_le_bytes());
        p[16..20].copy_from_slice(&MAGIC.to_le_bytes());
        p[20..24].copy_from_slice(&1u32.to_le_bytes());
        p[40..44].copy_from_slice(&psize.to_le_bytes());
        // Roots: free database empty, main database at page 2.
        p[40 + 40..40 + 48].copy_from_slice(&NO_PAGE.to_le_bytes());
        p[40 + 88..40 + 96].copy_from_slice(&2u64.to_le_bytes());
        p[136..144].copy_from_slice(&last_pg.to_le_bytes());
        p[144..152].copy_from_slice(&txnid.to_le_bytes());
        p
    }

    fn file(dir: &Path, metas: [(u64, u64); 2], pages: usize) {
        let mut bytes = meta_page(4096, metas[0].0, metas[0].1);
        bytes.extend(meta_page(4096, metas[1].0, metas[1].1));
        bytes.resize(pages * 4096, 0);
        std::fs::write(dir.join("data.mdb"), bytes).unwrap();
    }

    #[test]
    fn the_newer_meta_page_must_fit_in_the_file() {
        let dir = std::env::temp_dir().join(format!("pstore-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            check_data_file(&dir, "store").is_ok(),
            "a missing file passes"
        );
        file(&dir, [(9, 4), (5, 3)], 10);
        assert!(check_data_file(&dir, "store").is_ok());
        // The newer meta page (txnid 4) needs pages 0..=9: one short.
        file(&dir, [(9, 4), (5, 3)], 9);
        let e = check_data_file(&dir, "store").unwrap_err().to_string();
        assert!(e.contains("data.mdb") && e.contains("cut short"), "{e}");
        // The older one may name more pages than the file has; it is not used.
        file(&dir, [(5, 4), (20, 3)], 6);
        assert!(check_data_file(&dir, "store").is_ok());
        file(&dir, [(5, 3), (20, 4)], 6);
        assert!(check_data_file(&dir, "store").is_err());
        // Empty, one page, a damaged second meta page.
        std::fs::write(dir.join("data.mdb"), b"").unwrap();
        let e = check_data_file(&dir, "store").unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        std::fs::write(dir.join("data.mdb"), meta_page(4096, 1, 1)).unwrap();
        assert!(check_data_file(&dir, "store").is_err());
        let mut bytes = meta_page(4096, 1, 1);
        bytes.extend(vec![0u8; 4096]);
        std::fs::write(dir.join("data.mdb"), bytes).unwrap();
        let e = check_data_file(&dir, "store").unwrap_err().to_string();
        assert!(e.contains("second page"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
