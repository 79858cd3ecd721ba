//! Snapshots: full and incremental copies of a store's tables as Arrow IPC files plus a manifest.

pub mod files;

/// The snapshot an increment builds on.
#[derive(Debug, Clone, PartialEq)]
pub struct Parent {
    /// The parent's id.
    pub id: String,
}
