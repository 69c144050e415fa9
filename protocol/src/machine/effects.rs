//! What a request machine's transition can do besides changing state: emit outputs and count
//! drops. Every machine gets one `Effects` per transition.

use std::collections::VecDeque;

use crate::Message;

use super::types::{Counters, DropReason, Output};
use crate::PeerAddr;

/// The side effects of one transition.
pub(crate) struct Effects<'a> {
    pub(crate) out: &'a mut VecDeque<Output>,
    pub(crate) counters: &'a mut Counters,
}

impl Effects<'_> {
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
