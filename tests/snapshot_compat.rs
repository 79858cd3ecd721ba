//! Snapshots written by an earlier pstore still restore: `tests/fixtures/snapshot-handwritten/`
//! holds a full snapshot and an increment on it written by pstore's own Arrow IPC writer (before
//! snapshot files were written with arrow-ipc's `FileWriter`; see
//! docs/decisions/0028-snapshot-writer-measured-against-arrow-ipc.md). The store they were taken of is rebuilt here by the same
//! steps, and the restore must equal it.

use std::path::{Path, PathBuf};

use pstore::{
    DenseTableConfig, Initializer, OptimizerConfig, OptimizerKind, SparseTableConfig, Store,
    StoreConfig,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/snapshot-handwritten")
}

fn config() -> StoreConfig {
    StoreConfig {
        num_shards: 4,
        threads: 2,
        ..StoreConfig::default()
    }
}

const IDS: u64 = 300;

/// The store of the fixtures: `steps` 1 is its state at the full snapshot, 2 at the increment.
fn build(steps: usize) -> Store {
    let store = Store::new(config()).unwrap();
    let adagrad = OptimizerConfig {
        lr: 0.05,
        kind: OptimizerKind::Adagrad {
            initial_accumulator_value: 0.1,
            eps: 1e-10,
            weight_decay: 0.0,
        },
        clip_value: None,
        clip_norm: None,
    };
    let emb = store
        .create_sparse_table(
            "emb",
            SparseTableConfig {
                dim: 8,
                optimizer: adagrad,
                initializer: Initializer::Normal {
                    mean: 0.0,
                    std: 0.1,
                },
                seed: 11,
                lifecycle: Default::default(),
                refuse_nonfinite: false,
            },
        )
        .unwrap();
    let bias = store
        .create_dense_table(
            "bias",
            DenseTableConfig {
                shape: vec![3],
                optimizer: adagrad,
                initializer: Initializer::Zeros,
                seed: 1,
            },
        )
        .unwrap();
    let ids: Vec<u64> = (0..IDS).collect();
    let grads: Vec<f32> = (0..IDS as usize * 8)
        .map(|i| (i % 17) as f32 - 8.0)
        .collect();
    emb.push(&ids, &grads).unwrap();
    bias.push(&[1.0, -2.0, 0.5]).unwrap();
    if steps >= 2 {
        emb.push(&ids[..50], &grads[..50 * 8]).unwrap();
        emb.remove(&[7, 8, 9]).unwrap();
        bias.push(&[0.5, 0.5, 0.5]).unwrap();
    }
    store
}

fn same(a: &Store, b: &Store) {
    let (ea, eb) = (a.sparse("emb").unwrap(), b.sparse("emb").unwrap());
    let ids: Vec<u64> = (0..IDS).collect();
    assert_eq!(ea.contains(&ids).unwrap(), eb.contains(&ids).unwrap());
    let held: Vec<u64> = ids
        .iter()
        .copied()
        .filter(|&id| ea.contains(&[id]).unwrap()[0])
        .collect();
    assert_eq!(ea.pull(&held).unwrap(), eb.pull(&held).unwrap());
    assert_eq!(ea.stats().seq, eb.stats().seq);
    let (da, db) = (a.table("bias").unwrap(), b.table("bias").unwrap());
    assert_eq!(da.handle().lr(), db.handle().lr());
    match (da, db) {
        (pstore::Table::Dense(x), pstore::Table::Dense(y)) => assert_eq!(x.words(), y.words()),
        _ => panic!("bias is dense"),
    }
}

#[test]
fn snapshots_of_the_hand_written_arrow_writer_restore() {
    let full = Store::restore(&fixtures().join("full"), config(), None).unwrap();
    same(&full, &build(1));
    let inc = Store::restore(&fixtures().join("inc"), config(), None).unwrap();
    same(&inc, &build(2));
    assert!(!inc.sparse("emb").unwrap().contains(&[7]).unwrap()[0]);
}

/// Writes the fixtures (run once, with the writer whose files they keep):
/// `cargo test --test snapshot_compat -- --ignored write_fixtures`.
#[test]
#[ignore]
fn write_fixtures() {
    let dir = fixtures();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = build(1);
    store.snapshot(&dir.join("full"), false).unwrap();
    let emb = store.sparse("emb").unwrap();
    let bias = match store.table("bias").unwrap() {
        pstore::Table::Dense(d) => d,
        _ => unreachable!(),
    };
    let ids: Vec<u64> = (0..IDS).collect();
    let grads: Vec<f32> = (0..IDS as usize * 8)
        .map(|i| (i % 17) as f32 - 8.0)
        .collect();
    emb.push(&ids[..50], &grads[..50 * 8]).unwrap();
    emb.remove(&[7, 8, 9]).unwrap();
    bias.push(&[0.5, 0.5, 0.5]).unwrap();
    store.snapshot(&dir.join("inc"), true).unwrap();
}
