//! How a report run shows its progress: a bar (`indicatif`) on a terminal, one line per step
//! otherwise (a log, CI), nothing in tests.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What the report runner tells about its steps.
pub trait Progress {
    /// Step `index` (from 1) of `total`, `name`, starts.
    fn start(&mut self, index: usize, total: usize, name: &str);
    /// The step that started last ended: `note` says what it did (or why it was skipped).
    fn end(&mut self, name: &str, seconds: f64, note: &str);
    /// The run is over (whether or not every step ran).
    fn finish(&mut self);
}

/// Progress on stderr: an `indicatif` bar with a spinner and the elapsed time when stderr is a
/// terminal, plain `[i/n] step ...` lines otherwise.
pub struct StderrProgress {
    bar: Option<ProgressBar>,
}

impl StderrProgress {
    /// A bar if stderr is a terminal, plain lines if not.
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        StderrProgress { bar }
    }
}

impl Default for StderrProgress {
    fn default() -> Self {
        StderrProgress::new()
    }
}

impl Progress for StderrProgress {
    fn start(&mut self, index: usize, total: usize, name: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total as u64);
                bar.set_position(index.saturating_sub(1) as u64);
                bar.set_message(name.to_string());
            }
            None => eprintln!("[{index}/{total}] {name} ..."),
        }
    }

    fn end(&mut self, name: &str, seconds: f64, note: &str) {
        let line = format!("  {name}: {note} ({seconds:.1} s)");
        match &self.bar {
            Some(bar) => {
                bar.println(line);
                bar.inc(1);
            }
            None => eprintln!("{line}"),
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// No progress at all (tests, `--json` callers that want a quiet stderr).
#[derive(Debug, Default, Clone, Copy)]
pub struct Silent;

impl Progress for Silent {
    fn start(&mut self, _: usize, _: usize, _: &str) {}
    fn end(&mut self, _: &str, _: f64, _: &str) {}
    fn finish(&mut self) {}
}
