//! Layer-wise writes in the driver: one write of the endpoint, posted as several parts (one
//! transfer each, each with its own [`WritePartDone`] notification), reported to the endpoint
//! as one end.
//!
//! The request's descriptors are planned once, at the first part, and sorted by the layer of
//! the local region they read; each part posts the descriptors of its layers. A part's
//! notification certifies only that part's bytes (NIXL delivers a transfer's notification after
//! that transfer's data, and promises nothing across transfers), so D counts the parts rather
//! than trusting the last one.
//!
//! The end of a layer-wise write is reported once every posted part has ended and either its
//! last part was posted or it was abandoned: never while a part may still read P's blocks or
//! land in D's. It is `WriteCompleted` only if every layer was posted and landed.

use std::collections::{BTreeMap, BTreeSet};

use super::integrity::Integrity;
use crate::integrity::DigestLayout;
use crate::machine::NetEvent;
use crate::planner::Descriptor;
use crate::transport::{Transport, TransportError};
use crate::{
    wire, BlockIds, Epoch, Message, PairingKey, PeerAddr, WriteFailure, WriteId, WritePartDone,
};

/// The integrity state and this rank's memory, when digests are on: each part carries the
/// digests of its layers of the write's local blocks.
pub(super) type PartDigests<'a, 'b> = Option<(&'a mut Integrity, &'a DigestLayout<'b>)>;

/// Transport ids of parts: above the endpoint's write ids, below its read ids.
const FIRST_PART_ID: u64 = 1 << 62;

/// One layer-wise write in flight.
#[derive(Debug)]
struct Stream {
    to: PeerAddr,
    key: PairingKey,
    epoch: Epoch,
    prefill_rank: u32,
    /// This rank's blocks the write reads (for the parts' integrity digests).
    local: BlockIds,
    /// The write's descriptors, by layer.
    by_layer: Vec<Vec<Descriptor>>,
    /// Layers `0 .. posted` are posted.
    posted: u32,
    /// Parts still in flight.
    pending: BTreeSet<WriteId>,
    /// The first way a part failed, if one did.
    failure: Option<WriteFailure>,
    /// The endpoint gave up on the write: no more parts.
    abandoned: bool,
}

impl Stream {
    fn layers(&self) -> u32 {
        self.by_layer.len() as u32
    }

    /// The end to report, once nothing of the write can move any more.
    fn end(&self, write: WriteId) -> Option<NetEvent> {
        let complete = self.posted == self.layers();
        let over = complete || self.failure.is_some() || self.abandoned;
        if !self.pending.is_empty() || !over {
            return None;
        }
        Some(match self.failure {
            None if complete => NetEvent::WriteCompleted { write },
            None => NetEvent::WriteFailed {
                write,
                failure: WriteFailure::TransferFailed,
            },
            Some(failure) => NetEvent::WriteFailed { write, failure },
        })
    }
}

/// The layer-wise writes of one driver.
#[derive(Debug, Default)]
pub(super) struct Streams {
    streams: BTreeMap<WriteId, Stream>,
    /// Part id → its write.
    parts: BTreeMap<WriteId, WriteId>,
    next_part: u64,
    scratch: Vec<Descriptor>,
}

/// What a new layer-wise write needs besides its descriptors.
pub(super) struct StreamStart<'a> {
    pub write: WriteId,
    pub to: &'a PeerAddr,
    pub notification: &'a Message,
    /// Layers to post at once.
    pub posted: u32,
    /// This rank's blocks the write reads.
    pub local: &'a BlockIds,
}

impl Streams {
    /// Whether `id` is a part's transport id.
    pub(super) fn owns_part(&self, id: WriteId) -> bool {
        self.parts.contains_key(&id)
    }

    /// Starts a layer-wise write whose descriptors, by layer, are `by_layer`, and posts its
    /// first layers. `None`, or the end to report if nothing could be posted.
    pub(super) fn start<T: Transport>(
        &mut self,
        transport: &mut T,
        start: StreamStart<'_>,
        by_layer: Vec<Vec<Descriptor>>,
        digests: PartDigests<'_, '_>,
    ) -> Option<NetEvent> {
        let Message::WriteDone(done) = start.notification else {
            tracing::warn!(write = %start.write, "layer-wise write without a WriteDone to split");
            return Some(NetEvent::WriteFailed {
                write: start.write,
                failure: WriteFailure::PostFailed,
            });
        };
        let stream = Stream {
            to: start.to.clone(),
            key: done.key.clone(),
            epoch: done.epoch,
            prefill_rank: done.prefill_rank,
            local: start.local.clone(),
            by_layer,
            posted: 0,
            pending: BTreeSet::new(),
            failure: None,
            abandoned: false,
        };
        self.streams.insert(start.write, stream);
        self.extend(transport, start.write, start.posted, digests)
    }

    /// Posts layers up to `to` of `write` (what is posted already is skipped). The end to
    /// report, if the write is over.
    pub(super) fn extend<T: Transport>(
        &mut self,
        transport: &mut T,
        write: WriteId,
        to: u32,
        digests: PartDigests<'_, '_>,
    ) -> Option<NetEvent> {
        let Some(stream) = self.streams.get_mut(&write) else {
            // Ended already (a part failed and the end was reported): nothing to post.
            tracing::debug!(%write, "part of a layer-wise write that ended");
            return None;
        };
        let to = to.min(stream.layers());
        if to > stream.posted && stream.failure.is_none() && !stream.abandoned {
            let from = stream.posted;
            self.scratch.clear();
            for layer in &stream.by_layer[from as usize..to as usize] {
                self.scratch.extend_from_slice(layer);
            }
            let part = WriteId(FIRST_PART_ID + self.next_part);
            self.next_part += 1;
            // Just before the part's post, as for a whole write (see `super::integrity`).
            let part_digests = match digests {
                Some((integrity, layout)) => {
                    integrity.digests(&*transport, layout, &stream.local, from..to)
                }
                None => Ok(Vec::new()),
            };
            let note = part_digests.map(|digests| {
                Message::WritePartDone(WritePartDone {
                    key: stream.key.clone(),
                    epoch: stream.epoch,
                    prefill_rank: stream.prefill_rank,
                    first: from,
                    count: to - from,
                    of: stream.layers(),
                    digests,
                })
            });
            let posted = match note {
                Err(error) => Err(TransportError::Backend {
                    reason: format!("integrity digests: {error}"),
                }),
                // Layers with no bytes for D: their notification alone says they are done.
                Ok(note) if self.scratch.is_empty() => {
                    transport.send_notification(&stream.to, wire::encode(&note))
                }
                Ok(note) => transport
                    .post_write(part, &stream.to, &self.scratch, Some(wire::encode(&note)))
                    .map(|()| {
                        stream.pending.insert(part);
                        self.parts.insert(part, write);
                    }),
            };
            match posted {
                Ok(()) => stream.posted = to,
                Err(error) => {
                    tracing::warn!(key = %stream.key, epoch = %stream.epoch, %error, "write part not posted");
                    stream.failure.get_or_insert(WriteFailure::PostFailed);
                }
            }
        }
        self.end_if_over(write)
    }

    /// Gives up on `write`: no more parts; the parts in flight are abandoned where the
    /// transport can stop them. The end to report, if nothing is in flight.
    pub(super) fn abandon<T: Transport>(
        &mut self,
        transport: &mut T,
        write: WriteId,
    ) -> Option<Option<NetEvent>> {
        let stream = self.streams.get_mut(&write)?;
        stream.abandoned = true;
        let pending: Vec<WriteId> = stream.pending.iter().copied().collect();
        for part in pending {
            match transport.abandon_write(part) {
                Ok(()) => {}
                Err(TransportError::UnknownWrite { .. }) => {
                    stream.pending.remove(&part);
                    self.parts.remove(&part);
                    stream.failure.get_or_insert(WriteFailure::TransferFailed);
                }
                // NIXL cannot stop a posted transfer: its end still comes.
                Err(error) => tracing::debug!(%part, %error, "abandon of a part refused"),
            }
        }
        Some(self.end_if_over(write))
    }

    /// A part ended (`ok`: it landed). The end to report, if the write is over.
    pub(super) fn part_ended(&mut self, part: WriteId, ok: bool) -> Option<NetEvent> {
        let write = self.parts.remove(&part)?;
        let stream = self.streams.get_mut(&write)?;
        stream.pending.remove(&part);
        if !ok {
            stream.failure.get_or_insert(WriteFailure::TransferFailed);
        }
        self.end_if_over(write)
    }

    fn end_if_over(&mut self, write: WriteId) -> Option<NetEvent> {
        let end = self.streams.get(&write)?.end(write)?;
        self.streams.remove(&write);
        Some(end)
    }
}
