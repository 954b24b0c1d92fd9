//! Fault points: named places on the put, commit, GC and repair paths where a test makes a
//! process fail the operation in hand or die on the spot. The crash matrix
//! (`cli/tests/crash_matrix.rs`) starts processes with `FAILPOINTS` set to strike them.
//!
//! Compiled in only with the `testing` feature, which only test builds turn on (the CLI's
//! dev-dependencies): in every other build [`point`] is an inlined `Ok(())` and `FAILPOINTS` is
//! ignored.
//!
//! `FAILPOINTS` is `name=actions;name=actions`, with the `fail` crate's action syntax: `return`
//! makes the point fail with an injected I/O error, `return(crash)` SIGKILLs the process where it
//! stands (no unwinding, no flushing: what a power cut does to the process), and counts and
//! sequences select which hit strikes (`2*off->1*return(crash)`: the third).

/// Every fault point, by path. Tests iterate this list; a point missing here is never struck.
pub const POINTS: &[&str] = &[
    // Client, per chunk copy: before it is sent to its target.
    "client.put",
    // Client: every copy durable, before committing the part; after the commit is answered.
    "client.commit",
    "client.commit.reply",
    // Target, storing a copy: before the temp file is written; written and synced, before its
    // rename; renamed, before the directory sync; durable, before the put is acknowledged.
    "target.store.write",
    // Target: before a placed write (a chunk written straight from a same-host client's staging
    // memory), after `target.store.write`.
    "target.store.write_placed",
    "target.store.rename",
    // Target: every device write hangs for ever (a device that stopped completing), set at start.
    "target.io.hang",
    "target.store.sync_dir",
    "target.put.ack",
    // Target: before each GC unlink; before a bad copy found by scrub or read repair is removed.
    "target.delete.unlink",
    "target.remove_bad",
    // Client, restore: the manifest in hand and the destination locked, before any chunk is read.
    "client.restore.begin",
    // Client, restore: the unfinished tree's root made, before its directories and files.
    "client.restore.tree",
    // Client, restore --force over a tree: the atomic exchange answers as on a file system
    // without it; the old tree moved aside, before the new one is renamed into place; moving the
    // old one back after that failed.
    "client.restore.exchange",
    "client.restore.into_place",
    "client.restore.move_back",
    // Control plane: after recording a begun checkpoint, before answering; before and inside the
    // commit's transaction; committed, before answering.
    "control.begin.reply",
    "control.commit.record",
    "control.commit.txn",
    "control.commit.reply",
    // Control plane: a heartbeat arrived, before it is written (`delay`: a database that is slow
    // to take writes).
    "control.heartbeat.record",
    // Control plane GC: live set marked, before sweeping; before each batch of deletes.
    "control.gc.mark",
    "control.gc.delete",
    // Control plane re-replication: before each new copy is sent.
    "control.repair.copy",
];

/// Configures the points named in `FAILPOINTS`. A malformed entry is an error (a test that
/// asked for a fault must not silently run without it).
#[cfg(feature = "testing")]
pub fn setup() -> Result<(), String> {
    let Ok(spec) = std::env::var("FAILPOINTS") else { return Ok(()) };
    for entry in spec.split(';').filter(|e| !e.trim().is_empty()) {
        let (name, actions) =
            entry.split_once('=').ok_or_else(|| format!("FAILPOINTS entry {entry:?} is not name=actions"))?;
        let name = name.trim();
        if !POINTS.contains(&name) {
            return Err(format!("FAILPOINTS names unknown fault point {name:?}"));
        }
        fail::cfg(name, actions.trim()).map_err(|e| format!("FAILPOINTS entry {entry:?}: {e}"))?;
    }
    Ok(())
}

/// Without the `testing` feature there are no points to configure.
#[cfg(not(feature = "testing"))]
pub fn setup() -> Result<(), String> {
    Ok(())
}

/// A fault point. Returns the injected error when the point is set to `return`; never returns
/// when it is set to `return(crash)`.
#[cfg(feature = "testing")]
pub fn point(name: &'static str) -> std::io::Result<()> {
    debug_assert!(POINTS.contains(&name), "fault point {name} is not listed in POINTS");
    fail::fail_point!(name, |arg: Option<String>| {
        if arg.as_deref() == Some("crash") {
            eprintln!("fault point {name}: crashing");
            // SAFETY: kill(2) on our own pid with a valid signal number.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            // Not reached: SIGKILL cannot be caught.
            std::process::abort();
        }
        Err(std::io::Error::other(format!("fault point {name}: injected error")))
    });
    Ok(())
}

/// Without the `testing` feature every point passes.
#[cfg(not(feature = "testing"))]
#[inline(always)]
pub fn point(_name: &'static str) -> std::io::Result<()> {
    Ok(())
}

/// A fault point that delays: set to `return(MS)`, it waits MS milliseconds without holding up
/// the other tasks of the runtime (the `fail` crate's `sleep` blocks the thread it runs on).
#[cfg(feature = "testing")]
pub async fn delay(name: &'static str) {
    debug_assert!(POINTS.contains(&name), "fault point {name} is not listed in POINTS");
    let Some(arg) = fail::eval(name, |arg| arg) else { return };
    match arg.as_deref().map(str::parse::<u64>) {
        Some(Ok(millis)) => tokio::time::sleep(std::time::Duration::from_millis(millis)).await,
        _ => eprintln!("fault point {name}: set it to return(MS), not {arg:?}; not delayed"),
    }
}

/// Without the `testing` feature there is no delay.
#[cfg(not(feature = "testing"))]
#[inline(always)]
pub async fn delay(_name: &'static str) {}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;

    #[test]
    fn a_point_set_to_return_fails_with_an_injected_error() {
        assert!(point("client.put").is_ok());
        fail::cfg("client.put", "1*return").unwrap();
        let error = point("client.put").unwrap_err();
        assert!(error.to_string().contains("fault point client.put: injected error"), "{error}");
        assert!(point("client.put").is_ok(), "the count of one is spent");
        fail::remove("client.put");
    }

    #[tokio::test(start_paused = true)]
    async fn a_delay_point_waits_as_long_as_it_is_told() {
        let started = tokio::time::Instant::now();
        delay("control.heartbeat.record").await;
        assert_eq!(started.elapsed(), std::time::Duration::ZERO, "unset, it does not wait");
        fail::cfg("control.heartbeat.record", "1*return(1500)").unwrap();
        delay("control.heartbeat.record").await;
        assert_eq!(started.elapsed(), std::time::Duration::from_millis(1500));
        fail::remove("control.heartbeat.record");
    }
}
