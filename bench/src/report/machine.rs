//! What the report says about where and when it ran: cores, CPU, memory, kernel, NIXL, the
//! build, the commit and the date. Each part is read where Linux keeps it; what cannot be read
//! is left out (`None`), never guessed.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The machine and build a report ran on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineInfo {
    /// Cores this process may use (`std::thread::available_parallelism`).
    pub cores: usize,
    /// The CPU's model name (`/proc/cpuinfo`).
    pub cpu: Option<String>,
    /// Memory, GiB (`/proc/meminfo`'s `MemTotal`).
    pub memory_gib: Option<f64>,
    /// The kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: Option<String>,
    /// NIXL as this build and environment have it.
    pub nixl: String,
    /// `release` or `debug`.
    pub build: String,
    /// The cargo features of `kvhandoff-bench` compiled in (`nixl`, `cuda`).
    pub features: Vec<String>,
    /// The commit checked out, short, with `+ uncommitted changes` when the tree differs
    /// (`git`; `None` outside a repository).
    pub commit: Option<String>,
    /// When the run started, UTC (`YYYY-MM-DD HH:MM UTC`).
    pub date_utc: String,
}

impl MachineInfo {
    /// Reads what it can of this machine, build and checkout.
    pub fn detect() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let cpu = read("/proc/cpuinfo").and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        let memory_gib = read("/proc/meminfo").and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
                .map(|kib| kib / (1024.0 * 1024.0))
        });
        let mut features = Vec::new();
        if cfg!(feature = "nixl") {
            features.push("nixl".to_string());
        }
        if cfg!(feature = "cuda") {
            features.push("cuda".to_string());
        }
        MachineInfo {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            memory_gib,
            kernel: read("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()),
            nixl: nixl_description(std::env::var("NIXL_HOME").ok().as_deref()),
            build: if cfg!(debug_assertions) {
                "debug".into()
            } else {
                "release".into()
            },
            features,
            commit: git_commit(),
            date_utc: utc_date(SystemTime::now()),
        }
    }

    /// One markdown paragraph: the machine, the build, the commit and the date.
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("{} cores", self.cores)];
        if let Some(cpu) = &self.cpu {
            parts.push(cpu.clone());
        }
        if let Some(gib) = self.memory_gib {
            parts.push(format!("{gib:.0} GiB"));
        }
        if let Some(kernel) = &self.kernel {
            parts.push(format!("Linux {kernel}"));
        }
        let features = if self.features.is_empty() {
            "no optional features".to_string()
        } else {
            format!("features {}", self.features.join(", "))
        };
        format!(
            "**Machine:** {}. **NIXL:** {}. **Build:** {} ({features}), commit {}. **Date:** {}.",
            parts.join(", "),
            self.nixl,
            self.build,
            self.commit
                .as_deref()
                .map_or("unknown".to_string(), |c| format!("`{c}`")),
            self.date_utc
        )
    }
}

/// NIXL's description: not compiled in, or the wheel's version from `NIXL_HOME`'s folder name
/// (`…/nixl-cu12-1.5.1`, as `scripts/nixl-env.sh` sets it).
pub(super) fn nixl_description(nixl_home: Option<&str>) -> String {
    if !cfg!(feature = "nixl") {
        return "not in this build (no `nixl` feature)".into();
    }
    let version = nixl_home
        .and_then(|home| home.trim_end_matches('/').rsplit('/').next())
        .and_then(|name| name.strip_prefix("nixl-cu12-"))
        .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.'));
    match version {
        Some(v) => format!("nixl-cu12 {v} (from `NIXL_HOME`), UCX over loopback"),
        None => "version unknown (`NIXL_HOME` not set by `scripts/nixl-env.sh`)".into(),
    }
}

fn git_commit() -> Option<String> {
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = run(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty())?;
    let dirty =
        run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some(if dirty {
        format!("{commit} + uncommitted changes")
    } else {
        commit
    })
}

/// `time` as `YYYY-MM-DD HH:MM UTC`.
pub(super) fn utc_date(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    let (hour, minute) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02} UTC")
}
