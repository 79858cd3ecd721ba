//! Serving artifacts in Rust: export from a snapshot chain, lookups, increments applied in order.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use pstore::serving::{export, Artifact, Dtype, Fallback};
use pstore::{Initializer, OptimizerConfig, SparseTableConfig, Store, StoreConfig};

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("pstore-serving-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config(dim: usize) -> SparseTableConfig {
    SparseTableConfig {
        dim,
        optimizer: OptimizerConfig {
            lr: 1.0,
            ..OptimizerConfig::default()
        },
        initializer: Initializer::Uniform {
            low: -1.0,
            high: 1.0,
        },
        seed: 9,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    }
}

#[test]
fn export_then_increments_match_the_store() {
    let d = Dir::new("chain");
    let store = Store::new(StoreConfig::default()).unwrap();
    let t = store.create_sparse_table("emb", config(5)).unwrap();
    let ids: Vec<u64> = (0..3000u64).map(|i| i * 7919 + (i << 50)).collect();
    t.push(&ids, &vec![0.25; ids.len() * 5]).unwrap();
    store.snapshot(&d.0.join("s0"), false).unwrap();
    t.push(&ids[..100], &vec![1.0; 500]).unwrap();
    t.remove(&ids[2900..]).unwrap();
    store.snapshot(&d.0.join("s1"), true).unwrap();

    let out = d.0.join("model");
    let done = AtomicU64::new(0);
    let ex = export(&d.0.join("s0"), &out, None, Dtype::Float32, &done).unwrap();
    assert_eq!(ex.state.tables[0].rows, 3000);
    let a = Artifact::open(&out, true).unwrap();
    // Before the increment: the rows of s0.
    let mut rows = vec![0.0; 3 * 5];
    let probe = [ids[0], ids[2950], 12345];
    let (found, g0) = a
        .lookup("emb", &probe, &Fallback::Zeros, &mut rows, None)
        .unwrap();
    assert_eq!(found, 2);
    assert_eq!(&rows[10..], &[0.0; 5]);

    let applied = a.apply(&d.0.join("s1")).unwrap().unwrap();
    assert_eq!(applied.deleted, 100);
    assert!(a.apply(&d.0.join("s1")).unwrap().is_none(), "applied twice");
    let mut got = vec![0.0; ids.len() * 5];
    let mut mask = vec![false; ids.len()];
    let (found, g1) = a
        .lookup("emb", &ids, &Fallback::Initial, &mut got, Some(&mut mask))
        .unwrap();
    assert!(g1 > g0);
    assert_eq!(found, 2900);
    assert!(mask[..2900].iter().all(|&m| m) && mask[2900..].iter().all(|&m| !m));
    let live = t.pull(&ids[..2900]).unwrap();
    assert_eq!(&got[..2900 * 5], &live[..]);
    // Removed ids get the initial value, as a training pull of a new id would.
    assert_eq!(&got[2900 * 5..], &config(5).initial_rows(&ids[2900..])[..]);
}

#[test]
fn an_increment_out_of_order_changes_nothing() {
    let d = Dir::new("order");
    let store = Store::new(StoreConfig::default()).unwrap();
    let t = store.create_sparse_table("emb", config(2)).unwrap();
    t.push(&[1, 2, 3], &[1.0; 6]).unwrap();
    store.snapshot(&d.0.join("s0"), false).unwrap();
    t.push(&[1], &[1.0; 2]).unwrap();
    store.snapshot(&d.0.join("s1"), true).unwrap();
    t.push(&[2], &[1.0; 2]).unwrap();
    store.snapshot(&d.0.join("s2"), true).unwrap();
    let out = d.0.join("model");
    export(&d.0.join("s0"), &out, None, Dtype::Int8, &AtomicU64::new(0)).unwrap();
    let a = Artifact::open(&out, true).unwrap();
    let before = a.state().unwrap();
    let e = a.apply(&d.0.join("s2")).unwrap_err();
    assert!(
        e.to_string().contains("apply the snapshots in order"),
        "{e}"
    );
    assert_eq!(a.state().unwrap(), before);
    let todo = a.pending(&d.0).unwrap();
    assert_eq!(todo.len(), 2);
    assert_eq!(a.follow(&d.0).unwrap().len(), 2);
    assert!(a.pending(&d.0).unwrap().is_empty());
    // int8 rows are within half a step of the store's.
    let mut rows = vec![0.0; 6];
    a.lookup("emb", &[1, 2, 3], &Fallback::Zeros, &mut rows, None)
        .unwrap();
    let live = t.pull(&[1, 2, 3]).unwrap();
    for (r, l) in rows.chunks(2).zip(live.chunks(2)) {
        let step = l.iter().fold(0.0f32, |m, w| m.max(w.abs())) / 127.0;
        for (x, y) in r.iter().zip(l) {
            assert!((x - y).abs() <= step * 0.5 + 1e-6, "{x} vs {y}");
        }
    }
}
