//! Posting: a transfer order planned into descriptor lists (by the equal-geometry [`Planner`]
//! or the rank's [`TransferRoute`]) and handed to the transport; a failure to plan or post is
//! the order's `WriteFailed(PostFailed)` (or the read's refusal), never a panic.
//!
//! [`Planner`]: crate::planner::Planner
//! [`TransferRoute`]: super::TransferRoute

use super::integrity::digest_layout;
use super::{streams, RouteDirection, RouteRequest, TransportDriver};
use crate::machine::{NetEvent, ReadOrder, StreamedLayers, WriteOrder};
use crate::planner::PlanInput;
use crate::transport::{Descriptor, Transport, TransportError};
use crate::{wire, PeerAddr, WriteFailure, WriteId};

impl<T: Transport> TransportDriver<T> {
    /// Plans a layer-wise write once, sorts its descriptors by layer, and posts its first
    /// layers (see `streams`).
    pub(super) fn post_stream(
        &mut self,
        order: &WriteOrder,
        stream: StreamedLayers,
    ) -> Option<NetEvent> {
        let failed = Some(NetEvent::WriteFailed {
            write: order.write,
            failure: WriteFailure::PostFailed,
        });
        let Some(summary) = self.plan(&Transfer::write(order)) else {
            return failed;
        };
        let Some(by_layer) = self.by_layer(stream.layers) else {
            tracing::warn!(key = %order.key, layers = stream.layers, "layer-wise write does not match this rank's layers");
            self.stats.post_failures += 1;
            return failed;
        };
        self.stats.posted += 1;
        self.stats.descriptors += summary.0 as u64;
        self.stats.bytes += summary.1;
        let start = streams::StreamStart {
            write: order.write,
            to: &order.to,
            notification: &order.notification,
            posted: stream.posted,
            local: &order.local,
        };
        // The whole layer-wise write is one transfer: its post is its first layers' post.
        self.observe(|o| o.posting());
        let layout = digest_layout(&self.own, &self.specs);
        let digests = self.integrity.as_mut().map(|i| (i, &layout));
        let end = self
            .streams
            .start(&mut self.transport, start, by_layer, digests);
        // An end straight from the start is a post that failed: nothing to time.
        if end.is_none() {
            let write = order.write;
            self.observe(|o| o.posted(write, summary.0, summary.1));
        }
        end
    }

    /// The planned descriptors by the layer of the local region each reads, if every one lies
    /// in one region and the rank has `layers` layers.
    fn by_layer(&self, layers: u32) -> Option<Vec<Vec<Descriptor>>> {
        let own_layers = self.specs.iter().map(|s| s.layer + 1).max()?;
        if own_layers != layers {
            return None;
        }
        let mut regions: Vec<(u64, u64, u32)> = self
            .own
            .regions
            .iter()
            .zip(&self.specs)
            .map(|(r, s)| (r.base, r.base.saturating_add(r.len), s.layer))
            .collect();
        regions.sort_unstable();
        let mut out = vec![Vec::new(); layers as usize];
        for d in &self.descriptors {
            let at = regions
                .partition_point(|r| r.0 <= d.local_addr)
                .checked_sub(1)?;
            let (_, end, layer) = regions[at];
            if d.local_addr.saturating_add(d.len) > end {
                return None;
            }
            out[layer as usize].push(*d);
        }
        Some(out)
    }

    pub(super) fn post(&mut self, order: &mut WriteOrder) -> Option<NetEvent> {
        if let Some(integrity) = self.integrity.as_mut() {
            let layout = digest_layout(&self.own, &self.specs);
            if let Err(error) = integrity.fill_write(&self.transport, &layout, order) {
                tracing::warn!(key = %order.key, %error, "integrity digests not computed; write not posted");
                self.stats.post_failures += 1;
                return Some(NetEvent::WriteFailed {
                    write: order.write,
                    failure: WriteFailure::PostFailed,
                });
            }
        }
        let transfer = Transfer::write(order);
        let notification = wire::encode(&order.notification);
        self.plan_and_post(&transfer, |transport, descriptors| {
            transport.post_write(order.write, &order.to, descriptors, Some(notification))
        })
    }

    pub(super) fn post_read(&mut self, order: &ReadOrder) -> Option<NetEvent> {
        let transfer = Transfer {
            id: order.read,
            direction: RouteDirection::Read,
            peer: &order.from,
            key: &order.key,
            epoch: order.epoch,
            local: &order.local,
            remote: &order.remote,
            remote_memory: &order.remote_memory,
        };
        self.plan_and_post(&transfer, |transport, descriptors| {
            transport.post_read(order.read, &order.from, descriptors, None)
        })
    }

    /// Plans `transfer`'s descriptors and posts them with `post`; a transfer that cannot be
    /// planned or posted is `WriteFailed(PostFailed)` under its id (reads and writes alike).
    fn plan_and_post(
        &mut self,
        transfer: &Transfer<'_>,
        post: impl FnOnce(&mut T, &[Descriptor]) -> Result<(), TransportError>,
    ) -> Option<NetEvent> {
        let failed = Some(NetEvent::WriteFailed {
            write: transfer.id,
            failure: WriteFailure::PostFailed,
        });
        let Some(summary) = self.plan(transfer) else {
            return failed;
        };
        self.observe(|o| o.posting());
        match post(&mut self.transport, &self.descriptors) {
            Ok(()) => {
                let id = transfer.id;
                self.observe(|o| o.posted(id, summary.0, summary.1));
                self.stats.posted += 1;
                self.stats.descriptors += summary.0 as u64;
                self.stats.bytes += summary.1;
                None
            }
            Err(error) => {
                tracing::warn!(key = %transfer.key, epoch = %transfer.epoch, %error, "transfer post failed");
                self.stats.post_failures += 1;
                failed
            }
        }
    }

    /// Plans `transfer`'s descriptors into `self.descriptors`: their count and bytes, or `None`
    /// (counted) when it cannot be planned: the caller reports `WriteFailed(PostFailed)`.
    fn plan(&mut self, transfer: &Transfer<'_>) -> Option<(usize, u64)> {
        let Some(peer) = self.peers.get(transfer.peer) else {
            tracing::warn!(peer = %transfer.peer, id = %transfer.id, "transfer with an unloaded peer");
            self.stats.post_failures += 1;
            return None;
        };
        let summary = match &self.route {
            Some(route) => {
                self.descriptors.clear();
                let request = RouteRequest {
                    direction: transfer.direction,
                    peer,
                    key: transfer.key,
                    epoch: transfer.epoch,
                    local: transfer.local,
                    remote: transfer.remote,
                    remote_memory: transfer.remote_memory,
                };
                match route.descriptors(&request, &mut self.descriptors) {
                    Ok(()) => (
                        self.descriptors.len(),
                        self.descriptors.iter().map(|d| d.len).sum::<u64>(),
                    ),
                    Err(error) => {
                        self.descriptors.clear();
                        tracing::warn!(key = %transfer.key, epoch = %transfer.epoch, %error, "transfer route refused");
                        self.stats.post_failures += 1;
                        return None;
                    }
                }
            }
            None => {
                let input = PlanInput::new(
                    &self.own.regions,
                    &peer.regions,
                    &self.specs,
                    transfer.local,
                    transfer.remote,
                    self.own.geometry.kernel_blocks_per_logical,
                );
                match self.planner.plan_into(&input, &mut self.descriptors) {
                    Ok(summary) => (summary.descriptors, summary.bytes),
                    Err(error) => {
                        tracing::warn!(key = %transfer.key, epoch = %transfer.epoch, %error, "transfer plan failed");
                        self.stats.post_failures += 1;
                        return None;
                    }
                }
            }
        };
        Some(summary)
    }
}

/// What a write and a read have in common for planning and posting.
struct Transfer<'a> {
    id: WriteId,
    direction: RouteDirection,
    peer: &'a PeerAddr,
    key: &'a crate::PairingKey,
    epoch: crate::Epoch,
    local: &'a crate::BlockIds,
    remote: &'a crate::BlockIds,
    remote_memory: &'a [crate::MemorySpan],
}

impl<'a> Transfer<'a> {
    /// The transfer of write order `order`.
    fn write(order: &'a WriteOrder) -> Self {
        Transfer {
            id: order.write,
            direction: RouteDirection::Write,
            peer: &order.to,
            key: &order.key,
            epoch: order.epoch,
            local: &order.local,
            remote: &order.remote,
            remote_memory: &order.remote_memory,
        }
    }
}
