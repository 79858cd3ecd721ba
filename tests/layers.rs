//! The core's layers point one way: tables know nothing of durability, storage, snapshots or
//! the store; durability and snapshots know nothing of the store or of what serves it. This test
//! reads the sources and fails on any path into a higher layer (`crate::<module>`, alone or in a
//! `crate::{...}` group).

use std::path::{Path, PathBuf};

/// The modules of the table layer, and those above it that it must not name.
const TABLE_LAYER: &[&str] = &[
    "table",
    "shard.rs",
    "optimizer",
    "init.rs",
    "hash.rs",
    "buffer.rs",
    "executor.rs",
];
const ABOVE_TABLES: &[&str] = &[
    "durable", "storage", "snapshot", "store", "server", "client", "net", "python", "serving",
];

/// The modules of the durability and snapshot layer, and those above it.
const DURABLE_LAYER: &[&str] = &["durable", "storage", "snapshot"];
const ABOVE_DURABLE: &[&str] = &["store", "server", "client", "net", "python", "serving"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("rust/src")
}

/// Every `.rs` file under `rel` (a file or a folder of `rust/src`).
fn files(rel: &str) -> Vec<PathBuf> {
    let root = src().join(rel);
    assert!(
        root.exists(),
        "{} is gone: update this test's layers",
        root.display()
    );
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        if p.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out
}

/// The first segment of every path that starts at `crate::` in `text`.
fn crate_modules(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c, d::{e}}`: the first segment of each top-level item.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(first_segment(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(first_segment(&item));
        } else {
            out.push(first_segment(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn first_segment(s: &str) -> String {
    s.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

fn check(layer: &[&str], above: &[&str]) -> Vec<String> {
    let mut bad = Vec::new();
    for rel in layer {
        for f in files(rel) {
            let text = std::fs::read_to_string(&f).unwrap();
            for m in crate_modules(&text) {
                if above.contains(&m.as_str()) {
                    bad.push(format!("{} names crate::{m}", f.display()));
                }
            }
        }
    }
    bad
}

#[test]
fn the_table_layer_names_no_higher_layer() {
    assert!(
        files("table").len() > 3,
        "the table sources are where this test looks"
    );
    let bad = check(TABLE_LAYER, ABOVE_TABLES);
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn durability_and_snapshots_name_no_store() {
    assert!(!files("durable").is_empty() && !files("snapshot").is_empty());
    let bad = check(DURABLE_LAYER, ABOVE_DURABLE);
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_scan_sees_grouped_and_plain_paths() {
    let m = crate_modules(
        "use crate::{error::Result, store::{Store, X}};\nlet s = crate::snapshot::f();",
    );
    assert_eq!(m, ["error", "store", "snapshot"]);
}
