//! Snapshot part files (Arrow IPC). Written by a helper; see the task description.
