//! Integration tests of the Rust core through its public API (no Python).

use std::collections::HashMap;
use std::sync::Arc;

use pstore::hash::mix64;
use pstore::{
    Initializer, OptimizerConfig, OptimizerKind, SparseTable, SparseTableConfig, Store, StoreConfig,
};

fn store(num_shards: usize, threads: usize) -> Store {
    Store::new(StoreConfig {
        num_shards,
        threads,
        ..StoreConfig::default()
    })
    .unwrap()
}

fn sgd(lr: f64) -> OptimizerConfig {
    OptimizerConfig {
        lr,
        ..OptimizerConfig::default()
    }
}

fn adam() -> OptimizerConfig {
    OptimizerConfig {
        lr: 0.01,
        kind: OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        clip_value: Some(0.5),
        clip_norm: Some(1.0),
    }
}

/// A sparse table "t" of `dim` floats with [`adam`] in `s`.
fn adam_table(s: &Store, dim: usize, initializer: Initializer, seed: u64) -> Arc<SparseTable> {
    let config = SparseTableConfig {
        dim,
        optimizer: adam(),
        initializer,
        seed,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    };
    s.create_sparse_table("t", config).unwrap()
}

/// A deterministic batch: ids with duplicates from a small space, and gradients.
fn batch(step: u64, n: usize, dim: usize) -> (Vec<u64>, Vec<f32>) {
    let ids: Vec<u64> = (0..n as u64)
        .map(|i| mix64(step * 1_000_003 + i) % 3_000)
        .collect();
    let grads: Vec<f32> = (0..n * dim)
        .map(|i| ((mix64(step ^ (i as u64) << 20) % 2001) as f32 - 1000.0) / 1000.0)
        .collect();
    (ids, grads)
}

#[test]
fn training_is_bitwise_identical_across_shards_and_threads() {
    let dim = 8;
    let mut results = Vec::new();
    for (shards, threads) in [(1, 1), (3, 2), (64, 2), (257, 1)] {
        let s = store(shards, threads);
        let truncated = Initializer::TruncatedNormal {
            mean: 0.0,
            std: 0.1,
        };
        let t = adam_table(&s, dim, truncated, 11);
        for step in 0..20 {
            let (ids, grads) = batch(step, 5_000, dim);
            t.push(&ids, &grads).unwrap();
        }
        let probe: Vec<u64> = (0..3_000).collect();
        results.push(t.pull(&probe).unwrap());
    }
    for r in &results[1..] {
        assert!(r
            .iter()
            .zip(&results[0])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

/// A push of distinct ids takes the path without a sort; the same gradients split into two
/// halves under duplicated ids take the sorting path. Halving is exact, so the rows and counters
/// must agree bit for bit (Adam: a step count per row, clipping).
#[test]
fn distinct_and_duplicated_pushes_update_alike() {
    let dim = 5;
    let tables: Vec<_> = (0..2)
        .map(|_| {
            let s = store(4, 2);
            let normal = Initializer::Normal {
                mean: 0.0,
                std: 0.1,
            };
            let t = adam_table(&s, dim, normal, 3);
            (s, t)
        })
        .collect();
    for step in 0..4u64 {
        // 4,000 distinct ids (about 1,000 per shard), half of them new at each step.
        let ids: Vec<u64> = (0..4_000u64).map(|i| i + step * 2_000).collect();
        let (_, grads) = batch(step, ids.len(), dim);
        tables[0].1.push(&ids, &grads).unwrap();
        let twice: Vec<u64> = ids.iter().chain(&ids).copied().collect();
        let halves: Vec<f32> = grads.iter().chain(&grads).map(|g| g / 2.0).collect();
        tables[1].1.push(&twice, &halves).unwrap();
    }
    let probe: Vec<u64> = (0..12_000).collect();
    let (a, b) = (
        tables[0].1.pull(&probe).unwrap(),
        tables[1].1.pull(&probe).unwrap(),
    );
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    let stats = |t: &SparseTable| {
        let s = t.stats();
        (s.rows, s.rows_updated, s.rows_created)
    };
    assert_eq!(stats(&tables[0].1), stats(&tables[1].1));
}

#[test]
fn sgd_table_matches_a_hashmap_model() {
    let dim = 3;
    let s = store(5, 2);
    let t = s
        .create_sparse_table(
            "m",
            SparseTableConfig {
                dim,
                optimizer: sgd(0.5),
                initializer: Initializer::Constant(1.0),
                seed: 0,
                lifecycle: Default::default(),
                refuse_nonfinite: false,
            },
        )
        .unwrap();
    let mut model: HashMap<u64, Vec<f64>> = HashMap::new();
    for step in 0..300u64 {
        let (ids, grads) = batch(step, 1 + (step as usize * 37) % 400, dim);
        match step % 4 {
            0 | 1 => {
                t.push(&ids, &grads).unwrap();
                let mut sums: HashMap<u64, Vec<f64>> = HashMap::new();
                for (i, id) in ids.iter().enumerate() {
                    let acc = sums.entry(*id).or_insert_with(|| vec![0.0; dim]);
                    for k in 0..dim {
                        acc[k] += grads[i * dim + k] as f64;
                    }
                }
                for (id, g) in sums {
                    let w = model.entry(id).or_insert_with(|| vec![1.0; dim]);
                    for k in 0..dim {
                        w[k] = (w[k] as f32 as f64 - 0.5 * g[k]) as f32 as f64;
                    }
                }
            }
            2 => {
                let got = t.pull(&ids).unwrap();
                for (i, id) in ids.iter().enumerate() {
                    let w = model.entry(*id).or_insert_with(|| vec![1.0; dim]);
                    for k in 0..dim {
                        assert_eq!(got[i * dim + k], w[k] as f32, "id {id}");
                    }
                }
            }
            _ => {
                let gone = t.remove(&ids[..ids.len() / 3]).unwrap();
                let mut want = 0;
                for id in &ids[..ids.len() / 3] {
                    want += model.remove(id).is_some() as usize;
                }
                assert_eq!(gone, want);
            }
        }
        assert_eq!(t.len(), model.len());
    }
}

#[test]
fn concurrent_sgd_pushes_sum_up() {
    let dim = 4;
    let s = store(16, 2);
    let t = s
        .create_sparse_table(
            "c",
            SparseTableConfig {
                dim,
                optimizer: sgd(1.0),
                initializer: Initializer::Zeros,
                seed: 0,
                lifecycle: Default::default(),
                refuse_nonfinite: false,
            },
        )
        .unwrap();
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let t = Arc::clone(&t);
            std::thread::spawn(move || {
                for step in 0..50 {
                    let ids: Vec<u64> = (0..3_000u64).map(|i| (i * 7 + w + step) % 500).collect();
                    let grads = vec![0.25f32; ids.len() * dim];
                    if step % 2 == 0 {
                        t.push(&ids, &grads).unwrap();
                    } else {
                        t.push_async(ids, grads).unwrap();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    s.flush().unwrap();
    // Every id in 0..500 receives the same number of gradients: 4 workers x 50 steps x 6 each.
    let rows = t.pull(&(0..500).collect::<Vec<_>>()).unwrap();
    assert!(
        rows.iter().all(|&v| v == -(4.0 * 50.0 * 6.0 * 0.25)),
        "{:?}",
        &rows[..8]
    );
    assert_eq!(t.stats().pushes, 200);
}

#[test]
fn async_pushes_apply_in_order() {
    let dim = 2;
    let s = store(4, 2);
    let cfg = SparseTableConfig {
        dim,
        optimizer: adam(),
        initializer: Initializer::Zeros,
        seed: 0,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    };
    let a = s.create_sparse_table("a", cfg.clone()).unwrap();
    let b = s.create_sparse_table("b", cfg).unwrap();
    let mut handles = Vec::new();
    for step in 0..40 {
        let (ids, grads) = batch(step, 300, dim);
        b.push(&ids, &grads).unwrap();
        handles.push(a.push_async(ids, grads).unwrap());
    }
    s.flush().unwrap();
    assert!(handles.iter().all(|h| h.is_done()));
    let probe: Vec<u64> = (0..3_000).collect();
    assert_eq!(a.pull(&probe).unwrap(), b.pull(&probe).unwrap());
}

#[test]
fn rejected_push_changes_nothing() {
    let s = store(8, 2);
    let t = s
        .create_sparse_table(
            "r",
            SparseTableConfig {
                dim: 2,
                optimizer: sgd(0.1),
                initializer: Initializer::Zeros,
                seed: 0,
                lifecycle: Default::default(),
                refuse_nonfinite: false,
            },
        )
        .unwrap();
    let ids: Vec<u64> = (0..5_000).collect();
    let mut grads = vec![1.0f32; 10_000];
    grads[9_999] = f32::NAN;
    assert!(matches!(
        t.push(&ids, &grads),
        Err(pstore::Error::NonFinite(_))
    ));
    assert!(matches!(
        t.push(&ids, &grads[..9_998]),
        Err(pstore::Error::Shape(_))
    ));
    assert!(t.push_async(ids.clone(), grads).is_err());
    assert_eq!(t.len(), 0);
    assert_eq!(t.stats().pushes, 0);
}

#[test]
fn names_and_configs_are_checked() {
    let s = store(2, 1);
    let cfg = SparseTableConfig {
        dim: 0,
        optimizer: sgd(0.1),
        initializer: Initializer::Zeros,
        seed: 0,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    };
    assert!(matches!(
        s.create_sparse_table("x", cfg.clone()),
        Err(pstore::Error::InvalidArgument(_))
    ));
    let ok = SparseTableConfig { dim: 4096, ..cfg };
    s.create_sparse_table("x", ok.clone()).unwrap();
    assert!(matches!(
        s.create_sparse_table("x", ok.clone()),
        Err(pstore::Error::TableExists(_))
    ));
    assert!(matches!(s.table("y"), Err(pstore::Error::UnknownTable(_))));
    assert!(s.create_sparse_table("", ok).is_err());
    assert_eq!(s.tables(), vec!["x".to_string()]);
}

#[test]
fn dropped_tables_refuse_their_handles() {
    let s = store(2, 1);
    let cfg = SparseTableConfig {
        dim: 2,
        optimizer: sgd(0.1),
        initializer: Initializer::Zeros,
        seed: 0,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    };
    let t = s.create_sparse_table("d", cfg.clone()).unwrap();
    t.pull(&[1]).unwrap();
    s.drop_table("d").unwrap();
    assert!(matches!(t.pull(&[1]), Err(pstore::Error::UnknownTable(_))));
    assert!(t.push(&[1], &[1.0, 1.0]).is_err());
    let again = s.create_sparse_table("d", cfg).unwrap();
    assert_eq!(again.len(), 0);
    assert!(matches!(
        s.drop_table("nope"),
        Err(pstore::Error::UnknownTable(_))
    ));
}
