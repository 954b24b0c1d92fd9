//! Drafts: checkpoints a mount is writing in place (`fuse/src/fs/journal.rs`), recorded at the
//! control plane by the mount that holds them so that they outlive the mount's process. A draft
//! is known by its job, its name (the directory or file under the job) and its writer (one
//! mount); its record is the closed files and the directories, as a part's manifest.
//!
//! Job files are what a mount writes directly in a job's directory that is no checkpoint: a
//! file whose name has no step number (Lightning's `last.ckpt`, a model saved at the top of the
//! output directory, DeepSpeed's `latest`). Each is one file, known by its job and name, replaced
//! whole by a put and kept until dropped.

use crate::model::{Manifest, ModelError, RelPath, field};

/// Longest writer name (`host:mountpoint` by default).
pub const MAX_WRITER_BYTES: usize = 256;
/// Most drafts one job may have recorded at once, over all writers.
pub const MAX_DRAFTS_PER_JOB: u64 = 1024;
/// Most drafts one writer may have recorded at once, over all jobs (so one listing fits a message).
pub const MAX_DRAFTS_PER_WRITER: u64 = 1024;

/// Most job files one job may have.
pub const MAX_JOB_FILES_PER_JOB: u64 = 1024;

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

/// A job file's name (one path component) and its manifest: exactly that one file.
pub fn validate_job_file(name: &str, manifest: &Manifest) -> Result<(), ModelError> {
    validate_job_file_name(name)?;
    match manifest.files.as_slice() {
        [file] if file.path.as_str() == name && manifest.directories.is_empty() => Ok(()),
        _ => Err(field(
            "manifest",
            format!(
                "a job file's manifest holds exactly the file {name:?}, not {} files and {} directories",
                manifest.files.len(),
                manifest.directories.len()
            ),
        )),
    }
}

/// A job file's name: one path component.
pub fn validate_job_file_name(name: &str) -> Result<(), ModelError> {
    validate_name(name)?;
    if name.contains('/') {
        return Err(field("name", format!("{name:?}: a job file is directly in its job's directory")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FileEntry;

    #[test]
    fn job_files_hold_one_file_of_their_name() {
        let file = |path: &str| FileEntry {
            path: RelPath::try_from(path).unwrap(),
            size_bytes: 0,
            mode: 0o644,
            chunks: Vec::new(),
        };
        let manifest = |files: Vec<FileEntry>| Manifest { files, ..Default::default() };
        assert!(validate_job_file("last.ckpt", &manifest(vec![file("last.ckpt")])).is_ok());
        assert!(validate_job_file("last.ckpt", &manifest(vec![file("other")])).is_err());
        assert!(validate_job_file("last.ckpt", &manifest(vec![])).is_err());
        assert!(validate_job_file("last.ckpt", &manifest(vec![file("last.ckpt"), file("x")])).is_err());
        assert!(validate_job_file("a/b", &manifest(vec![file("a/b")])).is_err());
        assert!(validate_job_file_name("..").is_err());
    }

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
