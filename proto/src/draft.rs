//! Drafts: checkpoints a mount is writing in place (`fuse/src/fs/journal.rs`), recorded at the
//! control plane by the mount that holds them so that they outlive the mount's process. A draft
//! is known by its job, its name (the directory or file under the job) and its writer (one
//! mount); its record is the closed files and the directories, as a part's manifest.

use crate::model::{ModelError, RelPath, field};

/// Longest writer name (`host:mountpoint` by default).
pub const MAX_WRITER_BYTES: usize = 256;
/// Most drafts one job may have recorded at once, over all writers.
pub const MAX_DRAFTS_PER_JOB: u64 = 1024;
/// Most drafts one writer may have recorded at once, over all jobs (so one listing fits a message).
pub const MAX_DRAFTS_PER_WRITER: u64 = 1024;

/// A draft's name: a relative path under its job.
pub fn validate_name(name: &str) -> Result<(), ModelError> {
    RelPath::try_from(name).map(|_| ()).map_err(|e| field("name", e.to_string()))
}

/// A writer's name: 1 to [`MAX_WRITER_BYTES`] bytes of printable text.
pub fn validate_writer(writer: &str) -> Result<(), ModelError> {
    if writer.is_empty() || writer.len() > MAX_WRITER_BYTES {
        return Err(field("writer", format!("must be 1 to {MAX_WRITER_BYTES} bytes, not {}", writer.len())));
    }
    if writer.chars().any(char::is_control) {
        return Err(field("writer", format!("{:?} holds control characters", writer.escape_debug().to_string())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_writers_are_checked() {
        assert!(validate_name("global_step5").is_ok());
        assert!(validate_name("a/b").is_ok());
        for bad in ["", "/abs", "../up", "a/../b", "nul\0"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        assert!(validate_writer("host-1:/ckpt").is_ok());
        assert!(validate_writer("").is_err());
        assert!(validate_writer("line\nbreak").is_err());
        assert!(validate_writer(&"w".repeat(MAX_WRITER_BYTES)).is_ok());
        assert!(validate_writer(&"w".repeat(MAX_WRITER_BYTES + 1)).is_err());
    }
}
