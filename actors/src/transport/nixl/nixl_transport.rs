//! [`NixlTransport`] as a [`Transport`]: the trait's calls mapped onto NIXL (see the table in
//! the module documentation of `nixl`).

use kvhandoff_protocol::{AgentName, RegionDesc};
use nixl_sys::XferOp;

use super::{
    backend_error, poller, AddrRange, Completion, Descriptor, HostBuffer, NixlTransport,
    Notification, PeerState, Registered, Transport, TransportError,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

impl Transport for NixlTransport {
    type Region = HostBuffer;

    fn agent_name(&self) -> &AgentName {
        &self.name
    }

    /// Registers one allocation (NIXL: `register_memory`). A buffer may back several
    /// [`kvhandoff_protocol::RegionDesc`]s; register it once.
    ///
    /// # Errors
    /// [`TransportError::AlreadyRegistered`] when the buffer (or memory overlapping it) is
    /// registered already, [`TransportError::TooManyRegions`], or a NIXL refusal
    /// ([`TransportError::Backend`]).
    fn register_region(&mut self, region: &HostBuffer) -> Result<AddrRange, TransportError> {
        let range = region.range();
        let end = range
            .end()
            .ok_or(TransportError::BadRegionLen { len: range.len })?;
        if let Some((&base, _)) = self.regions.range(..end).next_back().filter(|(_, r)| {
            r.buffer
                .range()
                .end()
                .is_some_and(|other_end| other_end > range.base)
        }) {
            return Err(TransportError::AlreadyRegistered { base });
        }
        if self.regions.len() >= self.config.max_regions {
            return Err(TransportError::TooManyRegions {
                limit: self.config.max_regions,
            });
        }
        let handle = self
            .agent
            .register_memory(region, Some(&self.reg_args.0))
            .map_err(|e| backend_error("register_memory", e))?;
        self.regions.insert(
            range.base,
            Registered {
                handle: Some(handle),
                buffer: region.clone(),
            },
        );
        Ok(range)
    }

    /// Reads this agent's own host memory (its registered [`HostBuffer`]s) for the integrity
    /// digests: P digests what it is about to write, D what landed once NIXL reported it.
    ///
    /// # Errors
    /// [`TransportError::LocalOutOfRange`] when `[addr, addr + len)` is not inside one
    /// registered buffer.
    fn read_local(&self, addr: u64, len: u64, out: &mut Vec<u8>) -> Result<(), TransportError> {
        let out_of_range = TransportError::LocalOutOfRange {
            index: 0,
            addr,
            len,
        };
        let Some((&base, reg)) = self.regions.range(..=addr).next_back() else {
            return Err(out_of_range);
        };
        let offset = addr - base;
        let inside = offset
            .checked_add(len)
            .is_some_and(|end| end <= reg.buffer.len());
        let Ok(len) = usize::try_from(len) else {
            return Err(out_of_range);
        };
        if !inside || reg.handle.is_none() {
            return Err(out_of_range);
        }
        let start = out.len();
        out.resize(start + len, 0);
        reg.buffer.read(offset, &mut out[start..])
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.agent
            .get_local_md()
            .map_err(|e| backend_error("get_local_md", e))
    }

    fn load_remote(
        &mut self,
        peer: &PeerAddr,
        agent: &AgentName,
        metadata: &[u8],
    ) -> Result<(), TransportError> {
        let conflict = || TransportError::LoadConflict {
            peer: peer.clone(),
            agent: agent.clone(),
        };
        let refresh = match self.peers.get(peer) {
            Some(PeerState::Loaded(loaded)) if loaded != agent => return Err(conflict()),
            Some(PeerState::Loaded(_)) => true,
            _ => false,
        };
        if self.agents.get(agent).is_some_and(|p| p != peer) {
            return Err(conflict());
        }
        if !refresh && self.agents.len() >= self.config.max_peers {
            return Err(TransportError::TooManyPeers {
                limit: self.config.max_peers,
            });
        }
        if metadata.is_empty() {
            return Err(TransportError::BadMetadata {
                why: "empty metadata",
            });
        }
        let found = self.agent.load_remote_md(metadata).map_err(|err| {
            tracing::debug!(%peer, %err, "NIXL refused remote metadata");
            TransportError::BadMetadata {
                why: "NIXL load_remote_md refused it",
            }
        })?;
        if found != agent.as_str() {
            // Undo the load, unless it refreshed an agent this transport uses for another peer
            // or one whose transfers are still draining.
            if !self.agents.keys().any(|a| a.as_str() == found)
                && !self.draining.iter().any(|a| a.as_str() == found)
            {
                if let Err(err) = self.agent.invalidate_remote_md(&found) {
                    tracing::debug!(%found, %err, "could not unload mismatched metadata");
                }
            }
            return Err(match AgentName::new(found.as_str()) {
                Ok(found) => TransportError::MetadataMismatch {
                    expected: agent.clone(),
                    found,
                },
                Err(_) => TransportError::BadMetadata {
                    why: "metadata names an invalid agent name",
                },
            });
        }
        // Loaded again: a deferred invalidation of this agent no longer applies.
        self.draining.remove(agent);
        self.tombstones.retain(|p| p != peer);
        // The peer's regions may have changed: its prepared list (if any) is stale.
        self.peer_blocks.remove(peer);
        self.peers
            .insert(peer.clone(), PeerState::Loaded(agent.clone()));
        self.agents.insert(agent.clone(), peer.clone());
        Ok(())
    }

    fn invalidate_remote(&mut self, peer: &PeerAddr) {
        self.peer_blocks.remove(peer);
        let Some(PeerState::Loaded(agent)) = self.peers.get(peer).cloned() else {
            self.remember_invalidated(peer);
            return;
        };
        // Settle the peer's finished requests. One still in progress cannot be stopped (NIXL
        // keeps moving its bytes after a release or an invalidation: `tcp_in_progress_semantics`
        // in tests/nixl_transport.rs), so it is not reported failed: it stays pending and is
        // reported with its real end, and the remote's metadata stays loaded until then
        // (`get_xfer_status` must not see a request whose remote metadata is gone).
        let seqs: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, x)| &x.peer == peer)
            .map(|(&seq, _)| seq)
            .collect();
        let mut in_progress = 0;
        for seq in seqs {
            match self.in_flight.get(&seq).and_then(|x| self.status(x)) {
                Some(result) => self.finish(seq, result),
                None => in_progress += 1,
            }
        }
        self.poller_pending();
        if in_progress > 0 {
            tracing::debug!(%peer, %agent, in_progress, "invalidation waits for transfers NIXL cannot stop");
            self.draining.insert(agent.clone());
        } else if let Err(err) = self.agent.invalidate_remote_md(agent.as_str()) {
            tracing::debug!(%peer, %agent, %err, "NIXL invalidate_remote_md failed");
        }
        self.agents.remove(&agent);
        self.remember_invalidated(peer);
    }

    fn post_write(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(XferOp::Write, write, peer, descriptors, notification)
    }

    fn post_read(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        self.post(XferOp::Read, write, peer, descriptors, notification)
    }

    /// Gives up on a pending transfer if NIXL has finished it (its real outcome is reported);
    /// refuses while it is in progress, because releasing a NIXL request does not stop its
    /// bytes (see the module documentation).
    ///
    /// # Errors
    /// [`TransportError::UnknownWrite`], or [`TransportError::AbandonRefused`] while the
    /// transfer is in progress.
    fn abandon_write(&mut self, write: WriteId) -> Result<(), TransportError> {
        if self.done.iter().any(|c| c.write == write) {
            return Ok(());
        }
        let Some(&seq) = self.by_write.get(&write) else {
            return Err(TransportError::UnknownWrite { write });
        };
        match self.in_flight.get(&seq).and_then(|x| self.status(x)) {
            None => Err(TransportError::AbandonRefused { write }),
            Some(result) => {
                self.finish(seq, result);
                self.poller_pending();
                Ok(())
            }
        }
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>) {
        let finished: Vec<(u64, Result<(), TransportError>)> = self
            .in_flight
            .iter()
            .filter_map(|(&seq, x)| self.status(x).map(|result| (seq, result)))
            .collect();
        for (seq, result) in finished {
            self.finish(seq, result);
        }
        if !self.draining.is_empty() {
            self.finish_draining();
        }
        if !self.done.is_empty() {
            // A finished write is followed by the peer's reply (P: D's release; D reading:
            // the holder's answer).
            self.poller_activity();
            out.extend(self.done.drain(..));
            self.poller_pending();
        }
    }

    /// # Errors
    /// As the trait; a remote that NIXL reports as failing (`NIXL_ERR_REMOTE_DISCONNECT`
    /// reaches the C API as a generic backend error) is [`TransportError::PeerUnreachable`].
    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError> {
        if bytes.len() > self.config.max_notification_len {
            return Err(TransportError::NotificationTooLarge {
                len: bytes.len(),
                limit: self.config.max_notification_len,
            });
        }
        let agent = self.loaded_agent(peer)?;
        self.agent
            .send_notification(agent.as_str(), &bytes, None)
            .map_err(|err| {
                tracing::debug!(%peer, %agent, %err, "NIXL send_notification failed");
                TransportError::PeerUnreachable { agent }
            })?;
        // A message sent usually has an answer coming (a Register its write, a write's
        // notice its release).
        self.poller_activity();
        Ok(())
    }

    /// Appends the received notifications, in arrival order per sender (NIXL groups them by
    /// sender, and the order across senders is not kept): first those the arrival poller
    /// fetched already, then NIXL's newer ones.
    fn poll_notifications(&mut self, out: &mut Vec<Notification>) {
        let mut raw = Vec::new();
        match &self.poller {
            Some(poller) => poller.collect(&self.agent, &mut self.notifications.0, &mut raw),
            None => poller::fetch(&self.agent, &mut self.notifications.0, &mut raw),
        }
        if raw.is_empty() {
            return;
        }
        // One message often brings the next (a handshake's replies, a write after a Register).
        self.poller_activity();
        for (sender, bytes) in raw {
            let Ok(from) = AgentName::new(sender.as_str()) else {
                tracing::warn!(%sender, "notification from an invalid agent name dropped");
                continue;
            };
            let peer = self.agents.get(&from).cloned();
            out.push(Notification { from, peer, bytes });
        }
    }

    fn max_notification_len(&self) -> usize {
        self.config.max_notification_len
    }

    /// Starts the arrival poller's thread (when [`NixlConfig::poller`](super::NixlConfig::poller) is set), which calls
    /// `hook` while an arrival is likely; see [`PollerConfig`](super::PollerConfig).
    fn set_arrival_hook(&mut self, hook: crate::transport::ArrivalHook) {
        if let Some(poller) = &mut self.poller {
            poller.set_hook(hook);
        }
    }

    fn set_expecting(&mut self, expecting: bool) {
        if let Some(poller) = &self.poller {
            poller.set_expecting(expecting);
        }
    }

    /// Prepares one block-granular list for the table (NIXL: `prepare_xfer_dlist`, under the
    /// initiator name `""` for `None`, the peer's agent name otherwise), replacing any older one.
    ///
    /// # Errors
    /// As the trait; a table with no blocks, an inconsistent block layout or more than
    /// `MAX_PREPARED_BLOCKS` (2^24) blocks is a [`TransportError::Backend`].
    fn prepare_blocks(
        &mut self,
        peer: Option<&PeerAddr>,
        regions: &[RegionDesc],
    ) -> Result<(), TransportError> {
        self.prepare_table(peer, regions)
    }
}
