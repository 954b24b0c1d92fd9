//! Directory views: a committed checkpoint's manifest as a tree, and the step-number rule.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use starckpt_client::CheckpointManifest;

/// One entry of a directory of a committed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Child {
    Dir,
    /// Index into the manifest's files.
    File(usize),
}

/// A committed checkpoint's files and directories, indexed by directory ("" is its root).
pub struct StepTree {
    pub manifest: Arc<CheckpointManifest>,
    pub dirs: HashMap<String, BTreeMap<String, Child>>,
}

impl StepTree {
    pub fn new(manifest: CheckpointManifest) -> StepTree {
        let mut dirs: HashMap<String, BTreeMap<String, Child>> = HashMap::new();
        dirs.entry(String::new()).or_default();
        let add_dirs = |dirs: &mut HashMap<String, BTreeMap<String, Child>>, path: &str| {
            // Every ancestor directory of `path` exists and names its child directory.
            let mut parent = String::new();
            for component in path.split('/') {
                let full = join(&parent, component);
                dirs.entry(parent.clone()).or_default().entry(component.to_owned()).or_insert(Child::Dir);
                dirs.entry(full.clone()).or_default();
                parent = full;
            }
        };
        for directory in &manifest.directories {
            add_dirs(&mut dirs, directory.as_str());
        }
        for (index, file) in manifest.files.iter().enumerate() {
            let path = file.path.as_str();
            let (parent, name) = split(path);
            if !parent.is_empty() {
                add_dirs(&mut dirs, parent);
            }
            dirs.entry(parent.to_owned()).or_default().insert(name.to_owned(), Child::File(index));
        }
        StepTree { manifest: Arc::new(manifest), dirs }
    }

    pub fn child(&self, dir: &str, name: &str) -> Option<&Child> {
        self.dirs.get(dir)?.get(name)
    }
}

/// `parent/name`, or `name` at the root.
pub fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() { name.to_owned() } else { format!("{parent}/{name}") }
}

/// (parent, name) of a relative path.
pub fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((parent, name)) => (parent, name),
        None => ("", path),
    }
}

/// The step a name stands for: its last run of decimal digits (`step_100` → 100,
/// `step_100.pt` → 100, `000042` → 42), Lightning's version suffix aside (`ModelCheckpoint`
/// adds `-v1`, `-v2` when the name it wants exists: `last-v1.ckpt` has no step,
/// `epoch=0-step=5-v1.ckpt` has 5). None if it has no digits or they overflow.
pub fn step_of(name: &str) -> Option<u64> {
    let name = without_version(name);
    // By bytes: a digit is one byte, and the byte after a non-digit's last byte may start
    // nothing (`é5`: an index inside `é` is no character boundary).
    let bytes = name.as_bytes();
    let end = bytes.iter().rposition(u8::is_ascii_digit)? + 1;
    let start = bytes[..end].iter().rposition(|b| !b.is_ascii_digit()).map_or(0, |i| i + 1);
    name[start..end].parse().ok()
}

/// `name` up to a version suffix `-v<N>` at the end of its stem (before an extension without
/// digits), or all of it.
fn without_version(name: &str) -> &str {
    let stem_end = match name.rfind('.') {
        Some(dot) if dot > 0 && !name[dot..].bytes().any(|b| b.is_ascii_digit()) => dot,
        _ => name.len(),
    };
    let stem = &name[..stem_end];
    let digits = stem.bytes().rev().take_while(u8::is_ascii_digit).count();
    match stem[..stem.len() - digits].strip_suffix("-v") {
        Some(before) if digits > 0 => before,
        _ => name,
    }
}

/// Whether a file name in a job directory marks a file written to be renamed into place (a
/// hidden name, or a `.tmp`, `.temp`, `.part` or `~` suffix): such a one-file checkpoint is
/// committed by that rename, not by its close.
pub fn temporary(name: &str) -> bool {
    name.starts_with('.') || [".tmp", ".temp", ".part", "~"].iter().any(|suffix| name.ends_with(suffix))
}

/// A committed step's directory name: its decimal step.
pub fn step_name(step: u64) -> String {
    step.to_string()
}

/// The step a committed-step directory name denotes: plain decimal digits only, canonical.
pub fn parse_step_name(name: &str) -> Option<u64> {
    let step: u64 = name.parse().ok()?;
    (step_name(step) == name).then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_numbers_from_names() {
        assert_eq!(step_of("step_100"), Some(100));
        assert_eq!(step_of("step_100.pt"), Some(100));
        assert_eq!(step_of("ckpt-7.tmp"), Some(7));
        assert_eq!(step_of("000042"), Some(42));
        assert_eq!(step_of("weights"), None);
        // Lightning's version suffix is no step.
        assert_eq!(step_of("last-v1.ckpt"), None);
        assert_eq!(step_of("last-v12"), None);
        assert_eq!(step_of("epoch=0-step=5-v1.ckpt"), Some(5));
        assert_eq!(step_of("epoch=0-step=5.ckpt"), Some(5));
        assert_eq!(step_of("model.v2"), Some(2));
        assert!(temporary(".tmpab12cd") && temporary("model_5.pt.tmp") && temporary("x.part"));
        assert!(!temporary("model_5.pt") && !temporary("latest"));
        assert_eq!(step_of("99999999999999999999999"), None);
        assert_eq!(parse_step_name("100"), Some(100));
        assert_eq!(parse_step_name("0100"), None);
        assert_eq!(parse_step_name("step_1"), None);
        assert_eq!(split("a/b/c"), ("a/b", "c"));
        assert_eq!(split("c"), ("", "c"));
        assert_eq!(join("", "c"), "c");
    }
}
