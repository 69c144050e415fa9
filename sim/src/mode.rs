//! Which transfer modes a seeded world runs, and the coverage marks each mode must hit.

use serde::Serialize;

/// The transfer modes of a seeded world's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every request by push (the world's original shape; its seeds replay unchanged).
    #[default]
    Push,
    /// Every request by pull: P exports, D reads.
    Pull,
    /// Push or pull per request, and some requests go on to a bidirectional second turn.
    Mixed,
    /// Push or pull per request, and most requests go on to a second turn in which P reads the
    /// first turn's KV back from D.
    Bidir,
}

impl Mode {
    /// Whether some requests are pushed.
    pub fn pushes(self) -> bool {
        matches!(self, Mode::Push | Mode::Mixed | Mode::Bidir)
    }

    /// Whether some requests are read (pull, or a second turn).
    pub fn reads(self) -> bool {
        matches!(self, Mode::Pull | Mode::Mixed | Mode::Bidir)
    }

    /// The share of requests pulled in their first turn.
    pub(crate) fn pull_share(self) -> f64 {
        match self {
            Mode::Push => 0.0,
            Mode::Pull => 1.0,
            Mode::Mixed | Mode::Bidir => 0.5,
        }
    }

    /// The share of requests that go on to a bidirectional second turn.
    pub(crate) fn second_turn_share(self) -> f64 {
        match self {
            Mode::Push | Mode::Pull => 0.0,
            Mode::Mixed => 0.3,
            Mode::Bidir => 0.7,
        }
    }

    /// The marks a sweep of this mode must hit.
    pub fn required_marks(self) -> Vec<&'static str> {
        let mut marks = Vec::new();
        if self.pushes() {
            marks.extend_from_slice(crate::COVERAGE_MARKS);
        }
        if self.reads() {
            marks.extend_from_slice(READ_MARKS);
        }
        if !self.pushes() {
            // A pull-only world has no second turns either.
            marks.retain(|m| !SECOND_TURN_MARKS.contains(m));
        }
        marks
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "push" => Ok(Mode::Push),
            "pull" => Ok(Mode::Pull),
            "mixed" => Ok(Mode::Mixed),
            "bidir" => Ok(Mode::Bidir),
            other => Err(format!("unknown mode {other:?} (push, pull, mixed, bidir)")),
        }
    }
}

/// The read path's coverage marks.
pub const READ_MARKS: &[&str] = &[
    "pull_read_completed",
    "pull_read_after_lease_renewal",
    "turn2_read_declined_near_expiry",
    "d_ttl_renewed_by_p",
    "read_racing_ttl_expiry",
    "load_failure_recompute",
];

/// Read marks only a second turn can hit.
const SECOND_TURN_MARKS: &[&str] = &["turn2_read_declined_near_expiry", "d_ttl_renewed_by_p"];
