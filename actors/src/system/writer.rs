//! `WriterActor`: the only caller of one rank's transport.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, Handler, Message, Recipient};
use kvhandoff_protocol::planner::{PlanInput, Planner};
use kvhandoff_protocol::{wire, Message as WireMessage, RegionSpec, WriteFailure};

use super::rank::Feed;
use super::PeerInfo;
use crate::machine::{Input, WriteOrder};
use crate::transport::{Completion, Descriptor, Notification, Transport, TransportError};
use crate::{PeerAddr, WriteId};

/// One thing the rank actor asks the writer to do.
#[derive(Debug)]
pub enum WriterOp {
    /// Encode and send a control message as a notification.
    Send {
        /// The peer.
        to: PeerAddr,
        /// The message.
        message: WireMessage,
    },
    /// Plan and post a write.
    Post(Box<WriteOrder>),
    /// Make sure a write never lands.
    Abandon(WriteId),
    /// Cut a dead peer off.
    Invalidate(PeerAddr),
}

/// A batch of [`WriterOp`]s, in order.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct WriterOps(pub Vec<WriterOp>);

/// Loads a peer into the transport (from the link actor, during a handshake).
#[derive(Message, Debug)]
#[rtype(result = "Result<(), TransportError>")]
pub struct LoadPeer(pub PeerInfo);

/// Asks for the writer's counters.
#[derive(Message)]
#[rtype(result = "WriterStats")]
pub struct QueryWriterStats;

/// What the writer did, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Writes posted.
    pub posted: u64,
    /// Descriptors posted, over all writes.
    pub descriptors: u64,
    /// Bytes posted, over all writes.
    pub bytes: u64,
    /// Writes that failed to plan or post.
    pub post_failures: u64,
    /// Notifications that could not be sent.
    pub send_failures: u64,
    /// Notifications from agents the transport does not know.
    pub unknown_senders: u64,
}

/// Owns the transport; plans, posts, sends and polls.
pub struct WriterActor<T: Transport> {
    transport: T,
    own: PeerInfo,
    specs: Vec<RegionSpec>,
    peers: BTreeMap<PeerAddr, PeerInfo>,
    rank: Recipient<Feed>,
    poll_interval: Duration,
    planner: Planner,
    descriptors: Vec<Descriptor>,
    completions: Vec<Completion>,
    notifications: Vec<Notification>,
    stats: WriterStats,
    /// A [`PollNow`] from the arrival hook is in the mailbox.
    arrival_poll_queued: Arc<AtomicBool>,
}

impl<T: Transport> WriterActor<T> {
    pub(crate) fn new(
        transport: T,
        own: PeerInfo,
        rank: Recipient<Feed>,
        poll_interval: Duration,
    ) -> Self {
        // The rank's own geometry was validated before its regions were registered.
        let specs = own.geometry.regions().unwrap_or_default();
        WriterActor {
            transport,
            own,
            specs,
            peers: BTreeMap::new(),
            rank,
            poll_interval,
            planner: Planner::new(),
            descriptors: Vec::new(),
            completions: Vec::new(),
            notifications: Vec::new(),
            stats: WriterStats::default(),
            arrival_poll_queued: Arc::new(AtomicBool::new(false)),
        }
    }

    fn post(&mut self, order: &WriteOrder) -> Option<Input> {
        let failed = |write| {
            Some(Input::WriteFailed {
                write,
                failure: WriteFailure::PostFailed,
            })
        };
        let Some(peer) = self.peers.get(&order.to) else {
            tracing::warn!(peer = %order.to, write = %order.write, "write to an unloaded peer");
            self.stats.post_failures += 1;
            return failed(order.write);
        };
        let input = PlanInput::new(
            &self.own.regions,
            &peer.regions,
            &self.specs,
            &order.local,
            &order.remote,
            self.own.geometry.kernel_blocks_per_logical,
        );
        let summary = match self.planner.plan_into(&input, &mut self.descriptors) {
            Ok(summary) => summary,
            Err(error) => {
                tracing::warn!(key = %order.key, epoch = %order.epoch, %error, "write plan failed");
                self.stats.post_failures += 1;
                return failed(order.write);
            }
        };
        let notification = wire::encode(&order.notification);
        match self.transport.post_write(
            order.write,
            &order.to,
            &self.descriptors,
            Some(notification),
        ) {
            Ok(()) => {
                self.stats.posted += 1;
                self.stats.descriptors += summary.descriptors as u64;
                self.stats.bytes += summary.bytes;
                None
            }
            Err(error) => {
                tracing::warn!(key = %order.key, epoch = %order.epoch, %error, "write post failed");
                self.stats.post_failures += 1;
                failed(order.write)
            }
        }
    }

    fn perform(&mut self, op: WriterOp, feed: &mut Vec<Input>) {
        match op {
            WriterOp::Send { to, message } => {
                let bytes = wire::encode(&message);
                if let Err(error) = self.transport.send_notification(&to, bytes) {
                    tracing::debug!(peer = %to, %error, "notification not sent");
                    self.stats.send_failures += 1;
                    if matches!(
                        error,
                        TransportError::PeerUnreachable { .. }
                            | TransportError::PeerInvalidated { .. }
                    ) {
                        feed.push(Input::PeerLost { peer: to });
                    }
                }
            }
            WriterOp::Post(order) => feed.extend(self.post(&order)),
            WriterOp::Abandon(write) => {
                // On refusal the write stays in flight and its completion still comes; the
                // endpoint invalidates the peer if it never does.
                if let Err(error) = self.transport.abandon_write(write) {
                    tracing::warn!(%write, %error, "abandon refused");
                }
            }
            WriterOp::Invalidate(peer) => {
                self.transport.invalidate_remote(&peer);
                self.peers.remove(&peer);
            }
        }
    }

    fn poll(&mut self) {
        let mut feed = Vec::new();
        self.transport.poll_completions(&mut self.completions);
        for completion in self.completions.drain(..) {
            feed.push(match completion.result {
                Ok(()) => Input::WriteCompleted {
                    write: completion.write,
                },
                Err(error) => {
                    tracing::debug!(write = %completion.write, %error, "write failed");
                    Input::WriteFailed {
                        write: completion.write,
                        failure: WriteFailure::TransferFailed,
                    }
                }
            });
        }
        self.transport.poll_notifications(&mut self.notifications);
        for note in self.notifications.drain(..) {
            let Some(from) = note.peer else {
                self.stats.unknown_senders += 1;
                continue;
            };
            feed.push(match wire::decode(&note.bytes) {
                Ok(message) => Input::Received { from, message },
                Err(error) => Input::Malformed {
                    from: Some(from),
                    error,
                },
            });
        }
        if !feed.is_empty() {
            self.rank.do_send(Feed(feed));
        }
    }
}

impl<T: Transport + Unpin + 'static> Actor for WriterActor<T> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // A transport that can tell when a notification arrives gets the writer polling at
        // once rather than on its next tick; the flag keeps one poll request in the mailbox.
        let writer = ctx.address().downgrade();
        let queued = Arc::clone(&self.arrival_poll_queued);
        self.transport.set_arrival_hook(Arc::new(move || {
            if !queued.swap(true, Ordering::AcqRel) {
                if let Some(writer) = writer.upgrade() {
                    writer.do_send(PollNow);
                }
            }
        }));
        // Prepared block lists are an optimisation: without them posts take the dynamic path.
        if let Err(error) = self.transport.prepare_blocks(None, &self.own.regions) {
            tracing::warn!(%error, "own region table not prepared; posting dynamically");
        }
        ctx.run_interval(self.poll_interval, |act, _| act.poll());
    }
}

impl<T: Transport + Unpin + 'static> Handler<WriterOps> for WriterActor<T> {
    type Result = ();

    fn handle(&mut self, ops: WriterOps, _: &mut Context<Self>) {
        let mut feed = Vec::new();
        for op in ops.0 {
            self.perform(op, &mut feed);
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

impl<T: Transport + Unpin + 'static> Handler<PollNow> for WriterActor<T> {
    type Result = ();

    fn handle(&mut self, _: PollNow, _: &mut Context<Self>) {
        self.arrival_poll_queued.store(false, Ordering::Release);
        self.poll();
    }
}

impl<T: Transport + Unpin + 'static> Handler<LoadPeer> for WriterActor<T> {
    type Result = Result<(), TransportError>;

    fn handle(&mut self, LoadPeer(info): LoadPeer, _: &mut Context<Self>) -> Self::Result {
        // A reload replaces an older incarnation.
        self.transport.invalidate_remote(&info.peer);
        self.transport
            .load_remote(&info.peer, &info.agent, &info.metadata)?;
        if let Err(error) = self
            .transport
            .prepare_blocks(Some(&info.peer), &info.regions)
        {
            tracing::warn!(peer = %info.peer, %error, "peer region table not prepared; posting dynamically");
        }
        self.peers.insert(info.peer.clone(), info);
        Ok(())
    }
}

impl<T: Transport + Unpin + 'static> Handler<QueryWriterStats> for WriterActor<T> {
    type Result = actix::MessageResult<QueryWriterStats>;

    fn handle(&mut self, _: QueryWriterStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.stats)
    }
}
