//! What a transition can do besides changing state: queue outputs and count drops, in the
//! endpoint's one [`Outbox`].

use std::collections::VecDeque;

use crate::Message;

use super::types::{Counters, DropReason, Output};
use crate::PeerAddr;

/// The endpoint's outputs, in order, and its counters: every transition of every machine
/// writes here and nowhere else.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    pub(crate) out: VecDeque<Output>,
    pub(crate) counters: Counters,
}

impl Outbox {
    pub(crate) fn send(&mut self, to: &PeerAddr, message: Message) {
        self.out.push_back(Output::Send {
            to: to.clone(),
            message,
        });
    }

    pub(crate) fn emit(&mut self, output: Output) {
        self.out.push_back(output);
    }

    pub(crate) fn drop_input(&mut self, reason: DropReason) {
        self.counters.drop(reason);
    }
}

/// The result of a transition: the machine lives on, or it ended with a terminal record.
#[derive(Debug)]
pub(crate) enum Step<Live, Ended> {
    Live(Live),
    Ended(Ended),
}
