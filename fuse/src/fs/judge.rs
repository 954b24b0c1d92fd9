//! Judging a close: whether the flush of a file being written is its opener's, and whether that
//! opener is running, exiting cleanly, or dying (see [`CkptFs::flush`](super::CkptFs)). The
//! kernel tells no FUSE filesystem why a descriptor is closed; `/proc` tells how the closing
//! thread stands, and what it cannot tell is judged as a death: a file whose writer may have
//! died is given up, never committed truncated.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fuser::Errno;

use super::DraftFile;
use starckpt_client::sync::LockExt;

impl DraftFile {
    /// Whether a flush of this file by thread `tid` is its opener's, and how that thread
    /// stands: None when not told within [`JUDGE_WAIT`].
    ///
    /// Judged off the FUSE thread: reading `/proc/<pid>/stat` blocks while that process is in
    /// the middle of an exec, and an exec closing close-on-exec descriptors is what sends some
    /// flushes; the read ends only once the flush is answered. Untold in time is such an exec,
    /// which is not the end of the file. A verdict that comes later still marks the file killed
    /// when it should, and release waits for it ([`Self::judged`]).
    ///
    /// While its flush is unanswered the thread cannot be gone; once answered, it may be (a
    /// killed thread other than its process's first leaves no `/proc` entry behind). A thread
    /// not found is judged as its opener ([`verdict`]): the file is given up rather than maybe
    /// committed truncated, unless only the opener wrote to it and is still running (then the
    /// thread closed the file and ended on its own).
    pub(super) fn judge(self: &Arc<Self>, opener: u32, tid: u32) -> Option<(bool, Requester)> {
        *self.judging.0.lock_unpoisoned() += 1;
        let (sender, told) = std::sync::mpsc::sync_channel(1);
        let judged = Arc::clone(self);
        let judge = move || {
            let (by_opener, requester) = verdict(tid, opener, judged.written_only_by(opener));
            if requester == Requester::Died && (by_opener || judged.written_by(tid)) {
                judged.killed.store(true, Ordering::Relaxed);
            }
            *judged.judging.0.lock_unpoisoned() -= 1;
            judged.judging.1.notify_all();
            let _ = sender.send((by_opener, requester));
        };
        if let Err(e) = std::thread::Builder::new().name("fuse-judge".into()).spawn(judge) {
            // Whether its writer died cannot be told: never commit what may be a truncated file.
            tracing::error!(job = %self.job, path = %self.path(), "cannot judge a close ({e}): the file is given up");
            self.killed.store(true, Ordering::Relaxed);
            *self.judging.0.lock_unpoisoned() -= 1;
            return Some((true, Requester::Died));
        }
        told.recv_timeout(JUDGE_WAIT).ok()
    }

    /// Notes that thread `tid` wrote to this file: its process dying with the file open gives the
    /// file up ([`Self::judge`]), as its opener's would. A shell's `{ prog; } > f` opens the file
    /// in the shell and writes it in `prog`, which may be killed mid-write while the shell closes
    /// the file as usual.
    pub(super) fn wrote_from(&self, tid: u32) {
        let mut writers = self.writers.lock_unpoisoned();
        if writers.last_tid == Some(tid) {
            return;
        }
        writers.last_tid = Some(tid);
        match tgid_of(tid) {
            Some(tgid) if writers.processes.contains(&tgid) => {}
            Some(tgid) if writers.processes.len() < MAX_WRITERS => writers.processes.push(tgid),
            // Too many to keep, or one that cannot be told: any death gives the file up.
            _ => writers.any = true,
        }
    }

    /// Whether no process but `opener` wrote to this file (as far as can be told).
    fn written_only_by(&self, opener: u32) -> bool {
        let writers = self.writers.lock_unpoisoned();
        !writers.any && writers.processes.iter().all(|&p| p == opener)
    }

    /// Whether the process of thread `tid` wrote to this file (or whether it did cannot be told).
    fn written_by(&self, tid: u32) -> bool {
        let writers = self.writers.lock_unpoisoned();
        writers.any || tgid_of(tid).is_none_or(|tgid| writers.processes.contains(&tgid))
    }

    /// Waits for every judgment of this file still under way ([`Self::judge`]); one that takes
    /// past [`JUDGED_WAIT`] gives the file up (whether its writer died cannot be told).
    pub(super) fn judged(&self) {
        let (count, done) = &self.judging;
        let pending = count.lock_unpoisoned();
        let (pending, waited) =
            done.wait_timeout_while(pending, JUDGED_WAIT, |n| *n > 0).unwrap_or_else(|p| p.into_inner());
        if waited.timed_out() && *pending > 0 {
            tracing::error!(job = %self.job, path = %self.path(), "a close was never judged: the file is given up");
            self.killed.store(true, Ordering::Relaxed);
        }
    }
}

/// How the thread behind a request stands, as far as its writes are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Requester {
    /// Running: its close is a close.
    Running,
    /// Exiting with status 0 (returned from main, `exit(0)`): the kernel closes what it left
    /// open (`python export.py > f` never closes its stdout), and its writes are complete.
    ExitedCleanly,
    /// Exiting otherwise (killed, a failure status), or not to be told (gone, or its exit status
    /// hidden from this process): its descriptors are closed for it, which says nothing about
    /// its writes being complete.
    Died,
}

/// The processes that wrote to a file.
#[derive(Default)]
pub(super) struct Writers {
    /// Thread groups, at most [`MAX_WRITERS`].
    processes: Vec<u32>,
    /// The thread of the last write, whose process is known already.
    last_tid: Option<u32>,
    /// More processes than kept, or one whose group could not be read: every process counts.
    any: bool,
}

/// Most writing processes a file keeps apart; past it any death gives the file up.
const MAX_WRITERS: usize = 64;

/// How long a flush waits to learn how its requester stands ([`DraftFile::judge`]).
const JUDGE_WAIT: Duration = Duration::from_millis(250);
/// How long a release waits for a judgment still under way before giving the file up.
const JUDGED_WAIT: Duration = Duration::from_secs(10);

/// [`Requester`] of thread `tid`. Blocks while that thread's process is in the middle of an
/// exec (see [`DraftFile::judge`]): never called on a FUSE thread.
fn requester(tid: u32) -> Requester {
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{tid}/stat")) else { return Requester::Died };
    // After the parenthesised command name: state is field 3, flags field 9, exit_code field 52.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else { return Requester::Died };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok());
    let Some(flags) = field(9) else { return Requester::Died };
    if flags & PF_EXITING == 0 {
        return Requester::Running;
    }
    // The kernel shows a thread's exit code only to who may ptrace it, and 0 (a clean exit, as
    // read) to anyone else. Who may is the kernel's call (uids, capabilities, dumpable, LSMs):
    // ask it the same question through a file it guards alike. `cwd` is still there, as the
    // descriptors are closed before the working directory is let go.
    let shown = std::fs::read_link(format!("/proc/{tid}/cwd")).is_ok();
    match field(52) {
        Some(0) if shown => Requester::ExitedCleanly,
        _ => Requester::Died,
    }
}

/// The process (thread group) of thread `pid`, which opens a file for writing (FUSE names the
/// thread). A process this one cannot see (another pid namespace, `/proc` mounted with
/// `hidepid`) is refused: whether it finished its file or died writing it could never be told.
pub(super) fn opener_of(pid: u32) -> Result<u32, Errno> {
    tgid_of(pid).ok_or_else(|| {
        tracing::error!(
            pid,
            "a write open by a process not in this mount's /proc is refused: its close could not be judged"
        );
        Errno::EACCES
    })
}

fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:")).and_then(|tgid| tgid.trim().parse().ok())
}

/// Whether thread `tid` belongs to process `opener`, and how it stands. A thread not found is
/// judged as the opener's: dead, unless `only_opener_wrote` and the opener is running (a killed
/// thread's process is exiting: its signal kills every thread).
fn verdict(tid: u32, opener: u32, only_opener_wrote: bool) -> (bool, Requester) {
    match tgid_of(tid) {
        Some(tgid) => (tgid == opener, requester(tid)),
        None if only_opener_wrote && requester(opener) == Requester::Running => (true, Requester::Running),
        None => (true, Requester::Died),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id of a thread that has exited and left `/proc`. A join returns when the kernel
    /// clears the thread's id, before it is reaped: until then `/proc/<tid>` still shows it,
    /// exiting with status 0 (a busy machine saw that).
    fn gone_thread() -> u32 {
        // SAFETY: gettid(2) cannot fail.
        let tid = std::thread::spawn(|| unsafe { libc::gettid() } as u32).join().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::path::Path::new(&format!("/proc/{tid}")).exists() {
            assert!(std::time::Instant::now() < deadline, "thread {tid} still in /proc after 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        tid
    }

    #[test]
    fn a_running_thread_is_judged_by_its_process() {
        let me = std::process::id();
        assert_eq!(verdict(me, me, true), (true, Requester::Running));
        assert_eq!(verdict(me, me + 1, true), (false, Requester::Running));
        let (sender, told) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            // SAFETY: gettid(2) cannot fail.
            sender.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = stopped.recv();
        });
        let tid = told.recv().unwrap();
        assert_eq!(verdict(tid, me, true), (true, Requester::Running), "a thread is judged as its process");
        stop.send(()).unwrap();
        other.join().unwrap();
    }

    #[test]
    fn a_thread_gone_from_proc_is_judged_by_who_wrote_and_how_its_opener_stands() {
        let tid = gone_thread();
        let me = std::process::id();
        // Another process wrote to the file too: the gone thread may have been its, killed.
        assert_eq!(verdict(tid, me, false), (true, Requester::Died));
        assert_eq!(verdict(tid, 1, false), (true, Requester::Died), "whose it was cannot be told");
        // Only the opener wrote, and it runs: the thread ended on its own.
        assert_eq!(verdict(tid, me, true), (true, Requester::Running));
        // Only the opener wrote, and it is gone too.
        assert_eq!(verdict(tid, gone_thread(), true), (true, Requester::Died));
    }

    #[test]
    fn write_opens_by_processes_not_in_proc_are_refused() {
        assert_eq!(opener_of(std::process::id()), Ok(std::process::id()));
        // FUSE reports pid 0 for a process outside the mount's pid namespace.
        assert_eq!(opener_of(0), Err(Errno::EACCES));
        assert_eq!(opener_of(gone_thread()), Err(Errno::EACCES));
    }
}
