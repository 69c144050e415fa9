//! The one shape every machine has: D's request, P's request and a peer.

use super::effects::Outbox;
use super::types::Time;
use super::Config;

/// A sans-IO machine: a state enum of per-state structs whose one transition consumes the
/// state, and one timer. The endpoint keeps each kind in a [`Machines`](super::tables::Machines)
/// table, which re-arms a machine's timer from [`Machine::next_timer`] after every transition.
pub(crate) trait Machine: Sized {
    /// What a transition reads besides the state: the time, the config, this rank.
    type Ctx<'a>;
    /// What the machine reacts to (its timer included, as a `Timeout` input).
    type Input;
    /// What a transition gives back: the successor state, or the record of a machine that
    /// ended, with anything its owner must act on.
    type Next;

    /// The one transition.
    fn handle(self, ctx: &Self::Ctx<'_>, input: Self::Input, fx: &mut Outbox) -> Self::Next;

    /// When the machine next needs its `Timeout` input.
    fn next_timer(&self, config: &Config) -> Time;
}
