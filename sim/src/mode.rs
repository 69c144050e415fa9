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

    /// The share of requests that are multi-rank (several P ranks per D rank, or the reverse)
    /// unless the options say otherwise ([`crate::SimOptions::multi_source`]). `mixed`, the
    /// command line's default, `pull` (issue 23: multi-rank pulls) and `bidir` (issue 23,
    /// item 4: second turns read back across a multi-rank pair) have them by default: `push`
    /// replays the worlds (and the regression seeds) as they were found.
    pub fn multi_source_share(self) -> f64 {
        match self {
            Mode::Mixed | Mode::Pull | Mode::Bidir => 0.1,
            Mode::Push => 0.0,
        }
    }

    /// The marks of multi-rank requests in this mode, when it has any: pushed ones where it
    /// pushes, pulled ones (heterogeneous reads) where it pulls first turns.
    pub fn multi_rank_marks(self) -> Vec<&'static str> {
        let mut marks = Vec::new();
        if self.pushes() {
            marks.extend_from_slice(MULTI_SOURCE_MARKS);
        }
        if self.pull_share() > 0.0 {
            marks.extend_from_slice(HETERO_READ_MARKS);
        }
        marks
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
        if self.multi_source_share() > 0.0 {
            marks.extend(self.multi_rank_marks());
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
    "decline_refused_while_reading",
];

/// Read marks only a second turn can hit.
const SECOND_TURN_MARKS: &[&str] = &["turn2_read_declined_near_expiry", "d_ttl_renewed_by_p"];

/// The marks of multi-rank requests (required where the mode has them by default; reported
/// whenever hit): `multi_source_ready` (a D rank fed by several P ranks got every pair's
/// write), `multi_source_partial_failure` (one pair's sub-request was ready and another failed:
/// the request failed, and the shared blocks went back only after every pair handed them
/// back), `multi_source_sibling_aborted` (a failure aborted a live sibling, which then cancelled
/// at its own peer rank), `multi_target_partial_failure` (a P rank writing to several D ranks
/// kept its sources until every pair ended, one having delivered and another not),
/// `multi_source_fenced_early` (the session told the engine once that a request fenced by a P
/// rank's death failed), `multi_source_sub_refused` (the endpoint refused one pair's sub-request
/// after a sibling had started: the session failed the request at once and handed it back when
/// the sibling had), `multi_source_failed_after_a_write` (a request failed on a D rank after a
/// pair's write had landed in its blocks: the engine heard `Failed`, never `Ready`). All of them
/// are decided by the session the engine's connector runs (`kvhandoff_protocol::session`).
pub const MULTI_SOURCE_MARKS: &[&str] = &[
    "multi_source_ready",
    "multi_source_partial_failure",
    "multi_source_sibling_aborted",
    "multi_target_partial_failure",
    "multi_source_fenced_early",
    "multi_source_sub_refused",
    "multi_source_failed_after_a_write",
];

/// The marks of multi-rank pulls (heterogeneous reads; required where the mode pulls and has
/// multi-rank requests, reported whenever hit): `hetero_read` (a D rank reading from two or
/// more P ranks was `Loaded`: every part's read landed its slice of every block),
/// `hetero_read_sibling_aborted` (a failed part aborted a live sibling part of the same read
/// or export), `hetero_read_replica_holder` (a P rank no D rank reads from, a replica, ended its
/// export at once, unread: `FullPrefixHit`, `NeverGranted`). Each decided by the session's
/// fan-ins of side `Reader`/`Holder`.
pub const HETERO_READ_MARKS: &[&str] = &[
    "hetero_read",
    "hetero_read_sibling_aborted",
    "hetero_read_replica_holder",
];

/// The marks of second turns read back across a multi-rank pair (issue 23, item 4; required
/// where the mode has second turns and multi-rank requests and the options read turns back
/// across ranks, [`crate::SimOptions::multi_rank_turns`]; reported whenever hit):
/// `hetero_turn2_read_back` (a P rank that read its next turn back from two or more D ranks
/// ended `Loaded`, every part's slice of every block landed and judged byte for byte against
/// what D held), `hetero_turn2_read_back_part_failed` (such a read back had a part fail: the
/// whole read failed, typed by its first failed part and the engine's policy, and every D
/// rank's kept blocks came back), `hetero_turn2_declined` (a P rank that recomputes its next
/// turn declined it at every D rank it is linked to, and a D rank's part ended
/// `Released(Declined)`, its blocks back before its TTL). Each decided by the session's fan-ins
/// of side `Reader` (P, `next_turn_allocated` with turn links) and `Holder` (D,
/// `keep_for_next_turn`), and its multi-rank decline (`decline_export` with turn links).
pub const HETERO_TURN_MARKS: &[&str] = &[
    "hetero_turn2_read_back",
    "hetero_turn2_read_back_part_failed",
    "hetero_turn2_declined",
];

/// The marks of siblings declining a multi-rank pull (required where multi-rank requests are
/// pulled and [`crate::SimOptions::multi_rank_turns`] is on; reported whenever hit):
/// `hetero_sibling_decline_sent` (a sibling of a D rank's multi-rank read declined the export
/// once the read had ended: one decline per P rank the rank reads from, each changing nothing),
/// `hetero_decline_refused_while_reading` (it declined while any part of the read was live: the
/// session refused the whole decline, `ImportInProgress`, and no P rank heard of it). Decided by
/// the session's multi-rank decline (`protocol/src/session/fan_declines.rs`).
pub const HETERO_DECLINE_MARKS: &[&str] = &[
    "hetero_sibling_decline_sent",
    "hetero_decline_refused_while_reading",
];
