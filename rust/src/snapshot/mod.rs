//! Snapshots: full and incremental copies of a store's tables as Arrow IPC files plus a manifest.

pub mod files;
