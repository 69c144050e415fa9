//! Scheduler-driven stepping for the ordering fuzz and the exhaustive check: every enabled
//! choice is listed, and [`World::apply`] performs one. Due times are ignored; time moves only
//! when a timer is fired.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::world::{Ev, NodeId, World, WorldConfig};

/// One scheduler choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Action {
    /// Perform queued event `seq` (deliver a message, land or report a write, answer a
    /// handshake, start or abort a request, restart a node).
    Run(u64),
    /// Lose message `seq`.
    Drop(u64),
    /// Deliver message `seq` and keep a copy queued.
    Dup(u64),
    /// Fail write `seq` in flight (it may have landed in part).
    Fail(u64),
    /// Advance the clock to `node`'s next timer and fire it.
    Timer(NodeId),
    /// Crash `node` (it restarts through a queued event).
    Crash(NodeId),
}

/// Kinds of choice, for callers that pick a kind first and an index second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`Action::Run`] of a message delivery.
    Deliver,
    /// [`Action::Drop`].
    Drop,
    /// [`Action::Dup`].
    Dup,
    /// [`Action::Run`] of a write landing or report.
    Complete,
    /// [`Action::Fail`].
    Fail,
    /// [`Action::Run`] of anything else (engine, handshake, restart).
    Other,
    /// [`Action::Timer`].
    Timer,
    /// [`Action::Crash`].
    Crash,
}

impl World {
    /// Every choice enabled now, in a deterministic order.
    pub fn actions(&self) -> Vec<Action> {
        let mut out = Vec::new();
        for (&seq, (_, ev)) in &self.queue {
            out.push(Action::Run(seq));
            match ev {
                Ev::Deliver(msg) => {
                    out.push(Action::Drop(seq));
                    if self.cfg.dup_control || crate::world::is_notification(&msg.message) {
                        out.push(Action::Dup(seq));
                    }
                }
                Ev::Land { .. } => out.push(Action::Fail(seq)),
                _ => {}
            }
        }
        for node in 0..self.nodes.len() {
            if self.nodes[node]
                .endpoint()
                .and_then(|e| e.poll_timeout())
                .is_some()
            {
                out.push(Action::Timer(node));
            }
        }
        if self.crashes_left > 0 {
            for node in 0..self.nodes.len() {
                if self.alive(node) {
                    out.push(Action::Crash(node));
                }
            }
        }
        out
    }

    /// The enabled choices of one kind.
    pub fn actions_of(&self, kind: Kind) -> Vec<Action> {
        self.actions()
            .into_iter()
            .filter(|a| match (a, kind) {
                (Action::Run(s), Kind::Deliver) => matches!(self.queue[s].1, Ev::Deliver(_)),
                (Action::Run(s), Kind::Complete) => {
                    matches!(self.queue[s].1, Ev::Land { .. } | Ev::Report { .. })
                }
                (Action::Run(s), Kind::Other) => !matches!(
                    self.queue[s].1,
                    Ev::Deliver(_) | Ev::Land { .. } | Ev::Report { .. }
                ),
                (Action::Drop(_), Kind::Drop)
                | (Action::Dup(_), Kind::Dup)
                | (Action::Fail(_), Kind::Fail)
                | (Action::Timer(_), Kind::Timer)
                | (Action::Crash(_), Kind::Crash) => true,
                _ => false,
            })
            .collect()
    }

    /// Performs one choice; a choice that is not enabled does nothing.
    pub fn apply(&mut self, action: Action) {
        self.step_decode_events.clear();
        match action {
            Action::Run(seq) => {
                if let Some((_, ev)) = self.unschedule(seq) {
                    self.run_event(ev);
                }
            }
            Action::Drop(seq) => {
                if let Some((_, Ev::Deliver(msg))) = self.queue.get(&seq).cloned() {
                    self.unschedule(seq);
                    self.record(format!("net drop {}", crate::world::describe(&msg)));
                }
            }
            Action::Dup(seq) => {
                if let Some((_, Ev::Deliver(msg))) = self.queue.get(&seq).cloned() {
                    self.schedule(std::time::Duration::ZERO, Ev::Deliver(msg.clone()));
                    self.unschedule(seq);
                    self.run_event(Ev::Deliver(msg));
                }
            }
            Action::Fail(seq) => {
                if let Some((_, Ev::Land { write })) = self.queue.get(&seq).cloned() {
                    self.unschedule(seq);
                    self.land(write, true);
                    self.check_step();
                }
            }
            Action::Timer(node) => {
                let due = self.nodes[node].endpoint().and_then(|e| e.poll_timeout());
                if let Some(t) = due {
                    self.end_writes_before(t);
                    self.lose_messages_before(t);
                    self.now = self.now.max(t);
                    self.fire_timer(node);
                }
            }
            Action::Crash(node) => {
                if self.crashes_left > 0 && self.alive(node) {
                    self.crashes_left -= 1;
                    self.crash(node);
                    self.check_step();
                }
            }
        }
    }

    /// The fabric ends every write within `max_write_life` (see `nixl.rs`): before time moves
    /// to `t`, every write still in flight whose life ends earlier lands then (its `Land` event
    /// runs; the explorer chose no failure for it).
    fn end_writes_before(&mut self, t: kvhandoff_protocol::machine::Time) {
        let life = self.cfg.machine.max_write_life;
        loop {
            let due = self
                .writes
                .iter()
                .filter(|(seq, w)| {
                    w.in_flight() && w.posted + life <= t && self.queue.contains_key(seq)
                })
                .map(|(seq, w)| (w.posted + life, *seq))
                .min();
            let Some((end, seq)) = due else {
                return;
            };
            self.now = self.now.max(end);
            if let Some((_, ev)) = self.unschedule(seq) {
                self.run_event(ev);
            }
        }
    }

    /// Control messages arrive within `max_message_delay` or never (see `world/net.rs`): before
    /// time moves to `t`, every message still travelling whose bound ends by then is lost.
    fn lose_messages_before(&mut self, t: kvhandoff_protocol::machine::Time) {
        let bound = self.cfg.machine.max_message_delay;
        let late: Vec<u64> = self
            .queue
            .iter()
            .filter(|(_, (at, ev))| matches!(ev, Ev::Deliver(_)) && *at + bound <= t)
            .map(|(&seq, _)| seq)
            .collect();
        for seq in late {
            if let Some((_, Ev::Deliver(msg))) = self.unschedule(seq) {
                let line = format!("net lost past its bound {}", crate::world::describe(&msg));
                self.record(line);
            }
        }
    }

    /// A hash of everything that determines the future (not of sequence numbers, due times or
    /// the trace), so that orderings reaching the same state meet.
    pub fn state_hash(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.now.hash(&mut h);
        self.crashes_left.hash(&mut h);
        for node in &self.nodes {
            node.incarnation.hash(&mut h);
            node.pool.hash(&mut h);
            // Streamed into the hasher: the endpoint's text is most of a state's, and building
            // it as a string first costs as much again.
            let _ = write!(HashWriter(&mut h), "{:?}", node.endpoint());
            node.shell
                .as_ref()
                .map(|s| s.transport().view())
                .hash(&mut h);
        }
        let mut events: Vec<String> = self
            .queue
            .values()
            .map(|(at, ev)| match ev {
                // A transfer by what it is, not by its sequence number (which depends on the
                // order of the path that reached the state).
                Ev::Land { write } => format!("Land {:?}", self.writes.get(write)),
                Ev::Report { write, failure } => {
                    format!("Report {failure:?} {:?}", self.writes.get(write))
                }
                // When a message left decides when it is lost (`lose_messages_before`).
                Ev::Deliver(_) => format!("{at:?} {ev:?}"),
                other => format!("{other:?}"),
            })
            .collect();
        events.sort();
        events.hash(&mut h);
        let writes: BTreeSet<String> = self.writes.values().map(|w| format!("{w:?}")).collect();
        writes.hash(&mut h);
        self.requests.hash(&mut h);
        // What decides whether a message is lost with its connection, where a write lands, and
        // how the ledger judges a hand-back or a `Ready` (S8, `NeverExposed`).
        self.conns.hash(&mut h);
        self.views.hash(&mut h);
        self.known.hash(&mut h);
        self.registers_sent.hash(&mut h);
        self.landed.hash(&mut h);
        self.landed_pairs.hash(&mut h);
        let _ = write!(HashWriter(&mut h), "{:?}", self.alloc_waiters);
        h.finish()
    }
}

/// Feeds formatted text straight into a hasher.
struct HashWriter<'a>(&'a mut DefaultHasher);

impl std::fmt::Write for HashWriter<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

/// What an exhaustive run saw.
#[derive(Debug, Clone, Default)]
pub struct Exhaustive {
    /// The depth bound: the most choices on a path.
    pub depth: usize,
    /// Distinct states visited (by [`World::state_hash`]).
    pub states: usize,
    /// States cut at the depth bound: reached no earlier than the bound, with choices left that
    /// the search did not take. Their successors, and whatever only they lead to, were not
    /// explored.
    pub cut: usize,
    /// The search stopped at `max_states` distinct states.
    pub capped: bool,
    /// Every reachable state was visited: no state was cut at the bound, the search was not
    /// capped and found no violation (the states visited are closed under every choice).
    pub complete: bool,
    /// The first violation, with the path of choices that reaches it.
    pub violation: Option<(crate::Violation, Vec<Action>)>,
}

/// Depth-first search over every choice sequence of a small world, up to `max_depth` choices
/// and `max_states` distinct states, with a visited set over [`World::state_hash`]. Worlds are
/// not cloneable (the machines are not), so each state is rebuilt by replaying its path.
///
/// A state is expanded at the smallest depth the search reaches it: one first reached at the
/// bound and later by a shorter path is expanded then, so that every state within `max_depth`
/// choices of the start is visited (unless capped) and `cut` counts exactly the states whose
/// choices the bound left untaken.
pub fn exhaustive(cfg: &WorldConfig, max_depth: usize, max_states: usize) -> Exhaustive {
    let mut result = Exhaustive {
        depth: max_depth,
        ..Exhaustive::default()
    };
    // The smallest depth each state was reached at, and the states cut at the bound.
    let mut shallowest: HashMap<u64, usize> = HashMap::new();
    let mut cut: HashSet<u64> = HashSet::new();
    let mut stack: Vec<Vec<Action>> = vec![Vec::new()];
    while let Some(path) = stack.pop() {
        let mut world = World::new(cfg.clone(), 0);
        for &a in &path {
            world.apply(a);
        }
        if let Some(v) = world.violations().first() {
            result.violation = Some((v.clone(), path));
            break;
        }
        let hash = world.state_hash();
        let depth = path.len();
        match shallowest.get(&hash) {
            Some(&seen) if seen <= depth => continue,
            Some(_) => {}
            None => {
                if shallowest.len() >= max_states {
                    result.capped = true;
                    break;
                }
            }
        }
        shallowest.insert(hash, depth);
        let actions = world.actions();
        if depth >= max_depth {
            if !actions.is_empty() {
                cut.insert(hash);
            }
            continue;
        }
        // Reached again within the bound: expanded now.
        cut.remove(&hash);
        for a in actions.into_iter().rev() {
            let mut next = path.clone();
            next.push(a);
            stack.push(next);
        }
    }
    result.states = shallowest.len();
    result.cut = cut.len();
    result.complete = result.violation.is_none() && !result.capped && result.cut == 0;
    result
}
