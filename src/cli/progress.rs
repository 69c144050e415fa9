//! Progress of a long sweep on stderr: an `indicatif` bar when stderr is a terminal, otherwise
//! a plain line every [`LINE_EVERY`] (logs and CI get a sign of life, short runs stay quiet).

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the plain lines come.
const LINE_EVERY: Duration = Duration::from_secs(10);

/// Counts the items of a sweep of known length; shared by the sweep's threads.
pub(crate) struct SweepProgress {
    what: &'static str,
    total: u64,
    done: AtomicU64,
    started: Instant,
    bar: Option<ProgressBar>,
    last_line: Mutex<Instant>,
}

impl SweepProgress {
    /// Progress over `total` items called `what` (`"seeds"`).
    pub(crate) fn new(what: &'static str, total: u64) -> SweepProgress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_message(what);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        SweepProgress {
            what,
            total,
            done: AtomicU64::new(0),
            started: now,
            bar,
            last_line: Mutex::new(now),
        }
    }

    /// One more item is done.
    pub(crate) fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(bar) = &self.bar {
            bar.inc(1);
            return;
        }
        let Ok(mut last) = self.last_line.try_lock() else {
            return;
        };
        if last.elapsed() >= LINE_EVERY {
            *last = Instant::now();
            eprintln!(
                "[{:.0} s] {done}/{} {}",
                self.started.elapsed().as_secs_f64(),
                self.total,
                self.what
            );
        }
    }

    /// The sweep ended: the bar goes away (the report follows).
    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
