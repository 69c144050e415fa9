//! The exhaustive check as the command line runs it: every scope searched to its bound, and a
//! report that says how far each got.

use serde::Serialize;

use crate::{exhaustive, explore, Mutation, WorldConfig};

/// One scope of the exhaustive check: requests, crashes and the depth bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExhaustiveScope {
    /// Requests in the small world.
    pub requests: usize,
    /// Most crashes.
    pub crashes: u32,
    /// Depth bound (choices per path).
    pub depth: usize,
    /// Distinct states visited.
    pub states: usize,
    /// States cut at the depth bound: their successors were not explored.
    pub cut: usize,
    /// The search stopped at [`EXHAUSTIVE_MAX_STATES`].
    pub capped: bool,
    /// Every reachable state was visited (`cut` is 0, not capped, no violation). A scope that
    /// is not complete checked every state within `depth` choices, and no further.
    pub complete: bool,
    /// Wall-clock seconds the scope took.
    pub seconds: f64,
}

/// The exhaustive check over the CI scopes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExhaustiveReport {
    /// States over all scopes.
    pub states: usize,
    /// Every scope complete: every reachable state visited (see [`ExhaustiveScope::complete`]).
    pub complete: bool,
    /// A scope stopped at its cap on states (its depth bound was not searched through).
    pub capped: bool,
    /// Violations, each with the choice path that reaches it.
    pub violations: Vec<String>,
    /// The deliberate bug the run had, if any.
    pub mutation: Option<String>,
    /// Each scope.
    pub scopes: Vec<ExhaustiveScope>,
}

/// The scopes CI checks exhaustively: (requests, crashes, depth bound). One request with a crash,
/// and two requests, each searched through every state within its depth bound, well under
/// [`EXHAUSTIVE_MAX_STATES`]. Neither is complete: heartbeats and deadlines keep every path
/// going, so states are cut at the bound (each scope reports how many).
pub const EXHAUSTIVE_SCOPES: &[(usize, u32, usize)] = &[(1, 1, 11), (2, 0, 9)];

/// Cap on distinct states per scope (a search that reaches it reports `capped`: it did not
/// search its whole depth bound).
pub const EXHAUSTIVE_MAX_STATES: usize = 400_000;

/// Runs the exhaustive check over [`EXHAUSTIVE_SCOPES`] with an optional deliberate bug, each
/// scope on a thread of its own.
pub fn run_exhaustive(mutation: Option<Mutation>) -> ExhaustiveReport {
    let run = |&(requests, crashes, depth): &(usize, u32, usize)| {
        let cfg = WorldConfig::small(requests, crashes, mutation);
        let started = std::time::Instant::now();
        let result = exhaustive(&cfg, depth, EXHAUSTIVE_MAX_STATES);
        (result, started.elapsed().as_secs_f64())
    };
    let results: Vec<(explore::Exhaustive, f64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = EXHAUSTIVE_SCOPES
            .iter()
            .map(|s| scope.spawn(move || run(s)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("exhaustive thread panicked"))
            .collect()
    });
    let mut report = ExhaustiveReport {
        states: 0,
        complete: true,
        capped: false,
        violations: Vec::new(),
        mutation: mutation.map(|m| m.name().to_string()),
        scopes: Vec::new(),
    };
    for (&(requests, crashes, depth), (result, seconds)) in EXHAUSTIVE_SCOPES.iter().zip(results) {
        report.states += result.states;
        report.complete &= result.complete;
        report.capped |= result.capped;
        if let Some((v, path)) = &result.violation {
            report
                .violations
                .push(format!("{} (path {path:?})", v.message));
        }
        report.scopes.push(ExhaustiveScope {
            requests,
            crashes,
            depth,
            states: result.states,
            cut: result.cut,
            capped: result.capped,
            complete: result.complete,
            seconds,
        });
    }
    report
}
