//! Human and JSON output helpers.

use std::time::Duration;

use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressStyle};

pub struct Output {
    pub json: bool,
}

impl Output {
    pub fn json(&self, value: serde_json::Value) {
        say!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
    }
}

/// Writes one line of command output to stdout ([`say!`]). Where the reader has gone (a closed
/// pipe) the process exits at once with status 141, what SIGPIPE would have given it: Rust
/// ignores that signal, so the write fails instead, and `println!` would panic.
pub fn line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(args).and_then(|()| stdout.write_all(b"\n")) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        drop(stdout);
        eprintln!("error: writing to stdout: {error}");
        std::process::exit(1);
    }
}

/// Bytes per second as a human string.
pub fn rate(bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!("{}/s", HumanBytes((bytes as f64 / secs) as u64))
}

pub fn bytes(n: u64) -> String {
    HumanBytes(n).to_string()
}

/// "3 minutes ago" for a Unix-milliseconds timestamp.
pub fn age(unix_ms: u64) -> String {
    if unix_ms == 0 {
        return "-".into();
    }
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    format!("{} ago", HumanDuration(Duration::from_millis(now.saturating_sub(unix_ms))))
}

/// Progress bars are drawn only for transfers over this size (and only on a terminal).
pub const PROGRESS_MIN_BYTES: u64 = 8 << 20;

pub fn progress_bar(total: u64, verb: &str) -> ProgressBar {
    if total < PROGRESS_MIN_BYTES {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let template = format!("{verb} {{bar:40}} {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}");
    bar.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar
}

/// Moves `bar` to `position()` ten times a second until the returned guard is dropped.
pub fn follow(bar: &ProgressBar, position: impl Fn() -> u64 + Send + 'static) -> Follow {
    let bar = bar.clone();
    Follow(tokio::spawn(async move {
        loop {
            bar.set_position(position());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }))
}

/// Stops the progress task when dropped.
pub struct Follow(tokio::task::JoinHandle<()>);

impl Drop for Follow {
    fn drop(&mut self) {
        self.0.abort();
    }
}
