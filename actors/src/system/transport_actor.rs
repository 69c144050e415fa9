//! `TransportActor`: the only caller of one rank's transport.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient};
use kvhandoff_protocol::driver::TransportDriver;

use super::messages::{Expecting, Feed, LoadPeer, QueryTransportStats, TransportOps};
use crate::transport::{Transport, TransportError};
use kvhandoff_protocol::driver::PeerInfo;

/// Owns the transport (through a [`TransportDriver`], where every translation lives): performs
/// the rank's operations, polls on a tick and when the transport says something arrived (or,
/// for a transport that cannot tell, such as NIXL, may have: its poller thread calls the same
/// hook on a µs cadence while an arrival is likely, and the tick is only the fallback).
pub struct TransportActor<T: Transport> {
    driver: TransportDriver<T>,
    rank: Recipient<Feed>,
    poll_interval: Duration,
    /// A [`PollNow`] from the arrival hook is in the mailbox.
    arrival_poll_queued: Arc<AtomicBool>,
}

impl<T: Transport> TransportActor<T> {
    pub(crate) fn new(
        transport: T,
        own: PeerInfo,
        rank: Recipient<Feed>,
        poll_interval: Duration,
        route: Option<kvhandoff_protocol::driver::SharedRoute>,
        integrity_digest: bool,
    ) -> Self {
        let mut driver = TransportDriver::new(transport, own);
        driver.set_observer(Box::new(crate::metrics::TransferClock::new()));
        if let Some(route) = route {
            driver.set_route(route);
        }
        if integrity_digest {
            driver.set_integrity(kvhandoff_kernels::digest::digest);
        }
        TransportActor {
            driver,
            rank,
            poll_interval,
            arrival_poll_queued: Arc::new(AtomicBool::new(false)),
        }
    }

    fn poll(&mut self) {
        let mut feed = Vec::new();
        self.driver.poll(&mut feed);
        if !feed.is_empty() {
            self.rank.do_send(Feed(feed));
        }
    }
}

impl<T: Transport + Unpin + 'static> Actor for TransportActor<T> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // A transport that can tell when a notification arrives gets the transport actor polling at
        // once rather than on its next tick; the flag keeps one poll request in the mailbox.
        let actor = ctx.address().downgrade();
        let queued = Arc::clone(&self.arrival_poll_queued);
        self.driver
            .transport_mut()
            .set_arrival_hook(Arc::new(move || {
                if !queued.swap(true, Ordering::AcqRel) {
                    if let Some(actor) = actor.upgrade() {
                        actor.do_send(PollNow);
                    }
                }
            }));
        self.driver.prepare_own();
        ctx.run_interval(self.poll_interval, |act, _| act.poll());
    }
}

impl<T: Transport + Unpin + 'static> Handler<TransportOps> for TransportActor<T> {
    type Result = ();

    fn handle(&mut self, ops: TransportOps, _: &mut Context<Self>) {
        let mut feed = Vec::new();
        for op in ops.0 {
            self.driver.perform(op, &mut feed);
        }
        if !feed.is_empty() {
            self.rank.do_send(Feed(feed));
        }
        // A transport may land small writes within the post; report them without waiting.
        self.poll();
    }
}

/// The transport said a notification arrived: poll now.
#[derive(Message, Debug)]
#[rtype(result = "()")]
struct PollNow;

impl<T: Transport + Unpin + 'static> Handler<PollNow> for TransportActor<T> {
    type Result = ();

    fn handle(&mut self, _: PollNow, _: &mut Context<Self>) {
        self.arrival_poll_queued.store(false, Ordering::Release);
        self.poll();
    }
}

impl<T: Transport + Unpin + 'static> Handler<Expecting> for TransportActor<T> {
    type Result = ();

    fn handle(&mut self, Expecting(expecting): Expecting, _: &mut Context<Self>) {
        self.driver.transport_mut().set_expecting(expecting);
    }
}

impl<T: Transport + Unpin + 'static> Handler<LoadPeer> for TransportActor<T> {
    type Result = Result<(), TransportError>;

    fn handle(&mut self, LoadPeer(info): LoadPeer, _: &mut Context<Self>) -> Self::Result {
        // A reload replaces an older incarnation.
        self.driver.load_peer(info)
    }
}

impl<T: Transport + Unpin + 'static> Handler<QueryTransportStats> for TransportActor<T> {
    type Result = actix::MessageResult<QueryTransportStats>;

    fn handle(&mut self, _: QueryTransportStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.driver.stats())
    }
}
