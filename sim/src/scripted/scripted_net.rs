//! The scripted world's network: the test's filter over every message, the held queue the test
//! delivers from in any order, and the answers to handshakes.

use kvhandoff_protocol::machine::{ConnectFailure, NetEvent};
use kvhandoff_protocol::PeerAddr;

use super::{Envelope, Harness, Rule};

impl Harness {
    /// Routes every new message through `filter` (replacing any previous one). The filter may
    /// also rewrite the message.
    pub fn set_filter(&mut self, filter: impl FnMut(&mut Envelope) -> Rule + 'static) {
        self.filter = Some(Box::new(filter));
    }

    /// Back to plain in-order delivery.
    pub fn clear_filter(&mut self) {
        self.filter = None;
    }

    /// Holds every new message.
    pub fn hold_all(&mut self) {
        self.set_filter(|_| Rule::Hold);
    }

    /// Delivers the oldest held message; returns it.
    pub fn deliver_held_next(&mut self) -> Option<Envelope> {
        let env = self.held.pop_front()?;
        self.deliver(env.clone());
        self.run_until_quiet();
        Some(env)
    }

    /// Delivers the oldest held message matching `pred` (overtaking older ones).
    pub fn deliver_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> Option<Envelope> {
        let at = self.held.iter().position(pred)?;
        let env = self.held.remove(at).expect("position is valid");
        self.deliver(env.clone());
        self.run_until_quiet();
        Some(env)
    }

    /// Delivers every held message, oldest first (including those held meanwhile).
    pub fn deliver_all_held(&mut self) {
        while self.deliver_held_next().is_some() {}
    }

    /// Drops every held message matching `pred`; returns how many.
    pub fn drop_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let (gone, kept): (Vec<_>, Vec<_>) = self.held.drain(..).partition(|e| pred(e));
        self.held = kept.into();
        let n = gone.len();
        self.dropped.extend(gone);
        n
    }

    /// Copies every held message matching `pred` to the end of the held queue.
    pub fn duplicate_held_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let copies: Vec<Envelope> = self.held.iter().filter(|e| pred(e)).cloned().collect();
        let n = copies.len();
        self.held.extend(copies);
        n
    }

    /// Answers every held handshake with success.
    pub fn complete_connects(&mut self) {
        for (from, to) in std::mem::take(&mut self.pending_connects) {
            self.connect_pair(&from, &to);
        }
        self.run_until_quiet();
    }

    /// Answers every held handshake with failure.
    pub fn fail_connects(&mut self, reason: ConnectFailure) {
        for (from, to) in std::mem::take(&mut self.pending_connects) {
            self.feed(
                &from,
                NetEvent::PeerConnectFailed {
                    peer: to,
                    reason: reason.clone(),
                },
            );
        }
        self.run_until_quiet();
    }

    /// Connects `a` and `b` (both get `PeerConnected`), as a handshake `a` started.
    pub fn connect(&mut self, a: &PeerAddr, b: &PeerAddr) {
        self.connect_pair(a, b);
        self.run_until_quiet();
    }

    pub(super) fn enqueue(&mut self, mut env: Envelope) {
        let rule = match self.filter.as_mut() {
            Some(filter) => filter(&mut env),
            None => Rule::Deliver,
        };
        match rule {
            Rule::Deliver => self.net.push_back(env),
            Rule::Hold => self.held.push_back(env),
            Rule::Drop => self.dropped.push(env),
            Rule::Duplicate => {
                self.net.push_back(env.clone());
                self.net.push_back(env);
            }
        }
    }

    pub(super) fn deliver(&mut self, env: Envelope) {
        if !self.nodes.get(&env.to).is_some_and(|n| n.alive) {
            self.lost.push(env);
            return;
        }
        let input = NetEvent::Received {
            from: env.from,
            message: env.message,
        };
        self.feed(&env.to, input);
    }

    pub(super) fn connect_pair(&mut self, a: &PeerAddr, b: &PeerAddr) {
        self.unloaded.remove(&(a.clone(), b.clone()));
        self.unloaded.remove(&(b.clone(), a.clone()));
        let (inc_a, inc_b) = (self.node(a).incarnation, self.node(b).incarnation);
        self.known.insert((a.clone(), b.clone()), inc_b);
        self.known.insert((b.clone(), a.clone()), inc_a);
        // The accepting side learns first, so it already knows the peer when its first message
        // arrives.
        let incarnation_of = |w: &Self, x: &PeerAddr| {
            kvhandoff_protocol::Incarnation(u128::from(w.node(x).incarnation))
        };
        let (of_a, of_b) = (incarnation_of(self, a), incarnation_of(self, b));
        self.feed(
            b,
            NetEvent::PeerConnected {
                peer: a.clone(),
                incarnation: of_a,
            },
        );
        self.feed(
            a,
            NetEvent::PeerConnected {
                peer: b.clone(),
                incarnation: of_b,
            },
        );
    }
}
