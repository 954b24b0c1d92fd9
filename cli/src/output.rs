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

/// `text` with its control characters escaped (`\n`, `\u{1b}`): a path in a checkpoint
/// may hold any, and printed raw an escape sequence would drive the terminal of whoever lists it.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let escaped = text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() });
    std::borrow::Cow::Owned(escaped.collect())
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

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(super::printable("model/w.pt"), "model/w.pt");
        assert_eq!(super::printable("a\u{1b}]52;x\u{7}b\nc é"), "a\\u{1b}]52;x\\u{7}b\\nc é");
    }
}
