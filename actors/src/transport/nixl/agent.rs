//! [`NixlTransport`]'s own methods: creating the agent and its UCX backend, the peer table,
//! and posting and settling NIXL requests.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use kvhandoff_protocol::AgentName;
use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, NotificationMap, OptArgs, XferDescList, XferOp,
    XferStatus,
};

use super::{
    backend_error, nixl_runtime_available, poller, Completion, Descriptor, InFlight, NixlConfig,
    NixlTransport, PeerState, TransportError, Unshared, BACKEND,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

impl NixlTransport {
    /// Creates the agent `name` with a UCX backend.
    ///
    /// # Errors
    /// [`TransportError::Backend`] when the NIXL runtime cannot be loaded (see
    /// [`nixl_runtime_available`]), the UCX plugin is missing (`NIXL_PLUGIN_DIR`), or NIXL
    /// refuses to create the agent or the backend (e.g. `UCX_TLS` naming only shared-memory
    /// transports, which this machine kind refuses).
    pub fn new(name: AgentName, config: NixlConfig) -> Result<Self, TransportError> {
        nixl_runtime_available()?;
        let agent_config = AgentConfig {
            enable_prog_thread: config.progress_thread,
            pthr_delay_us: config.pthr_delay_us,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name.as_str(), &agent_config)
            .map_err(|e| backend_error("create agent", e))?;
        let plugins = agent
            .get_available_plugins()
            .map_err(|e| backend_error("list plugins", e))?;
        let plugins: Vec<String> = plugins
            .iter()
            .filter_map(Result::ok)
            .map(str::to_owned)
            .collect();
        if !plugins.iter().any(|p| p == BACKEND) {
            return Err(TransportError::Backend {
                reason: format!(
                    "NIXL plugin {BACKEND} not found (plugins: {plugins:?}); set \
                     NIXL_PLUGIN_DIR to the nixl-cu12 wheel's .nixl_cu12.mesonpy.libs/plugins \
                     (`source scripts/nixl-env.sh`); NIXL_PLUGIN_DIR={:?}",
                    std::env::var("NIXL_PLUGIN_DIR").ok()
                ),
            });
        }
        let (_mems, params) = agent
            .get_plugin_params(BACKEND)
            .map_err(|e| backend_error("UCX plugin parameters", e))?;
        let backend = agent
            .create_backend(BACKEND, &params)
            .map_err(|e| backend_error("create UCX backend (is UCX_TLS restricted?)", e))?;
        let with_backend = || -> Result<OptArgs, TransportError> {
            let mut args = OptArgs::new().map_err(|e| backend_error("opt args", e))?;
            args.add_backend(&backend)
                .map_err(|e| backend_error("opt args: add backend", e))?;
            Ok(args)
        };
        let reg_args = with_backend()?;
        let xfer_args = with_backend()?;
        let notifications =
            NotificationMap::new().map_err(|e| backend_error("notification map", e))?;
        let arrival_poller = config
            .poller
            .clone()
            .map(|poller| poller::Poller::new(poller, agent.clone()));
        Ok(Self {
            name,
            config,
            in_flight: BTreeMap::new(),
            by_write: HashMap::new(),
            next_seq: 0,
            done: VecDeque::new(),
            peers: HashMap::new(),
            agents: HashMap::new(),
            tombstones: VecDeque::new(),
            draining: BTreeSet::new(),
            notifications: Unshared(notifications),
            reg_args: Unshared(reg_args),
            xfer_args: Unshared(xfer_args),
            local_blocks: None,
            peer_blocks: HashMap::new(),
            prepared_posts: 0,
            dynamic_posts: 0,
            poller: arrival_poller,
            _backend: backend,
            agent,
            regions: BTreeMap::new(),
        })
    }

    /// The configuration the transport was created with.
    pub fn config(&self) -> &NixlConfig {
        &self.config
    }

    /// Transfers posted and not yet reported.
    pub fn pending(&self) -> usize {
        self.in_flight.len() + self.done.len()
    }

    /// The registered buffer holding `[addr, addr + len)`, if any.
    fn local_region(&self, addr: u64, len: u64) -> Option<u64> {
        self.regions
            .range(..=addr)
            .next_back()
            .filter(|(_, r)| r.buffer.range().contains(addr, len))
            .map(|(&base, _)| base)
    }

    fn is_pending(&self, write: WriteId) -> bool {
        self.by_write.contains_key(&write) || self.done.iter().any(|c| c.write == write)
    }

    /// Whether NIXL still holds metadata for `agent` (it drops it itself after a disconnect).
    fn nixl_knows(&self, agent: &AgentName) -> bool {
        self.agent.check_remote_metadata(agent.as_str(), None)
    }

    pub(super) fn loaded_agent(&self, peer: &PeerAddr) -> Result<AgentName, TransportError> {
        match self.peers.get(peer) {
            None => Err(TransportError::UnknownPeer { peer: peer.clone() }),
            Some(PeerState::Invalidated) => {
                Err(TransportError::PeerInvalidated { peer: peer.clone() })
            }
            Some(PeerState::Loaded(agent)) => Ok(agent.clone()),
        }
    }

    pub(super) fn remember_invalidated(&mut self, peer: &PeerAddr) {
        self.peers.insert(peer.clone(), PeerState::Invalidated);
        self.tombstones.retain(|p| p != peer);
        self.tombstones.push_back(peer.clone());
        while self.tombstones.len() > self.config.max_peers {
            if let Some(old) = self.tombstones.pop_front() {
                if self.peers.get(&old) == Some(&PeerState::Invalidated) {
                    self.peers.remove(&old);
                }
            }
        }
    }

    /// Why `create_xfer_req` failed, after every local check passed.
    fn diagnose_create(
        &self,
        agent: &AgentName,
        descriptors: &[Descriptor],
        err: NixlError,
    ) -> TransportError {
        if !self.nixl_knows(agent) {
            return TransportError::PeerUnreachable {
                agent: agent.clone(),
            };
        }
        for (index, d) in descriptors.iter().enumerate() {
            let mut one = match XferDescList::new(MemType::Dram) {
                Ok(list) => list,
                Err(e) => return backend_error("descriptor list", e),
            };
            one.add_desc(d.remote_addr as usize, d.len as usize, 0);
            if !self.agent.check_remote_metadata(agent.as_str(), Some(&one)) {
                return TransportError::RemoteOutOfRange {
                    index,
                    addr: d.remote_addr,
                    len: d.len,
                };
            }
        }
        TransportError::PostFailed {
            reason: format!("NIXL create_xfer_req: {err}"),
        }
    }

    pub(super) fn post(
        &mut self,
        op: XferOp,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        let config = &self.config;
        if let Some(n) = &notification {
            if n.len() > config.max_notification_len {
                return Err(TransportError::NotificationTooLarge {
                    len: n.len(),
                    limit: config.max_notification_len,
                });
            }
        }
        if descriptors.is_empty() {
            return Err(TransportError::NoDescriptors);
        }
        if descriptors.len() > config.max_descriptors {
            return Err(TransportError::TooManyDescriptors {
                count: descriptors.len(),
                limit: config.max_descriptors,
            });
        }
        if self.is_pending(write) {
            return Err(TransportError::DuplicateWrite { write });
        }
        if self.pending() >= config.max_in_flight {
            return Err(TransportError::TooManyInFlight {
                limit: config.max_in_flight,
            });
        }
        let agent = self.loaded_agent(peer)?;
        // Validate, collecting block indices while every descriptor is one prepared block.
        let prepared = self.local_blocks.as_ref().zip(self.peer_blocks.get(peer));
        let mut local_idx = Vec::new();
        let mut remote_idx = Vec::new();
        let mut by_index = prepared.is_some();
        for (index, d) in descriptors.iter().enumerate() {
            if d.len == 0 {
                return Err(TransportError::EmptyDescriptor { index });
            }
            // Inside a registered buffer, so the address and length fit a `usize`.
            if self.local_region(d.local_addr, d.len).is_none() {
                return Err(TransportError::LocalOutOfRange {
                    index,
                    addr: d.local_addr,
                    len: d.len,
                });
            }
            let remote_fits = usize::try_from(d.remote_addr)
                .ok()
                .is_some_and(|addr| addr.checked_add(d.len as usize).is_some());
            if !remote_fits {
                return Err(TransportError::RemoteOutOfRange {
                    index,
                    addr: d.remote_addr,
                    len: d.len,
                });
            }
            if let (true, Some((local, remote))) = (by_index, prepared) {
                match (
                    local.index(d.local_addr, d.len),
                    remote.index(d.remote_addr, d.len),
                ) {
                    (Some(l), Some(r)) => {
                        local_idx.push(l);
                        remote_idx.push(r);
                    }
                    _ => by_index = false,
                }
            }
        }
        let args = &mut self.xfer_args.0;
        match &notification {
            Some(bytes) => {
                args.set_has_notification(true)
                    .map_err(|e| backend_error("opt args: notification flag", e))?;
                args.set_notification_message(bytes)
                    .map_err(|e| backend_error("opt args: notification", e))?;
            }
            None => args
                .set_has_notification(false)
                .map_err(|e| backend_error("opt args: notification flag", e))?,
        }
        let args = &self.xfer_args.0;
        let prepared_req = match prepared.filter(|_| by_index) {
            Some((local, remote)) => self
                .agent
                .make_xfer_req(
                    op,
                    local.handle(),
                    &local_idx,
                    remote.handle(),
                    &remote_idx,
                    Some(args),
                )
                .map_err(|err| {
                    // E.g. a list gone stale after the peer re-registered (nixl#2051).
                    tracing::debug!(%peer, %err, "NIXL make_xfer_req failed; posting dynamically");
                })
                .ok(),
            None => None,
        };
        let via_prepared = prepared_req.is_some();
        let req = match prepared_req {
            Some(req) => req,
            None => {
                let mut local = XferDescList::new(MemType::Dram)
                    .map_err(|e| backend_error("local descriptor list", e))?;
                let mut remote = XferDescList::new(MemType::Dram)
                    .map_err(|e| backend_error("remote descriptor list", e))?;
                for d in descriptors {
                    local.add_desc(d.local_addr as usize, d.len as usize, 0);
                    remote.add_desc(d.remote_addr as usize, d.len as usize, 0);
                }
                self.agent
                    .create_xfer_req(op, &local, &remote, agent.as_str(), Some(args))
                    .map_err(|e| self.diagnose_create(&agent, descriptors, e))?
            }
        };
        let in_progress = match self.agent.post_xfer_req(&req, None) {
            Ok(in_progress) => in_progress,
            Err(err) => {
                drop(req);
                return Err(if self.nixl_knows(&agent) {
                    TransportError::PostFailed {
                        reason: format!("NIXL post_xfer_req: {err}"),
                    }
                } else {
                    TransportError::PeerUnreachable { agent }
                });
            }
        };
        self.poller_activity();
        if via_prepared {
            self.prepared_posts += 1;
        } else {
            self.dynamic_posts += 1;
        }
        if in_progress {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.by_write.insert(write, seq);
            self.in_flight.insert(
                seq,
                InFlight {
                    write,
                    peer: peer.clone(),
                    agent,
                    req,
                },
            );
        } else {
            // Done within the post (data and notification); reported by the next poll.
            drop(req);
            self.done.push_back(Completion {
                write,
                result: Ok(()),
            });
        }
        self.poller_pending();
        Ok(())
    }

    /// Tells the poller something happened that a reply or a completion may follow.
    pub(super) fn poller_activity(&self) {
        if let Some(poller) = &self.poller {
            poller.activity();
        }
    }

    /// Tells the poller how many transfers are pending.
    pub(super) fn poller_pending(&self) {
        if let Some(poller) = &self.poller {
            poller.set_pending(self.pending());
        }
    }

    /// The outcome of a pending request, `None` while it is in progress.
    pub(super) fn status(&self, x: &InFlight) -> Option<Result<(), TransportError>> {
        match self.agent.get_xfer_status(&x.req) {
            Ok(XferStatus::InProgress) => None,
            Ok(XferStatus::Success) => Some(Ok(())),
            Err(err) if !self.nixl_knows(&x.agent) => {
                tracing::debug!(write = %x.write, %err, "transfer failed, remote disconnected");
                Some(Err(TransportError::PeerUnreachable {
                    agent: x.agent.clone(),
                }))
            }
            Err(err) => Some(Err(TransportError::TransferFailed {
                reason: format!("NIXL get_xfer_status: {err}"),
            })),
        }
    }

    /// Invalidates the metadata of every draining agent whose last transfer has ended.
    pub(super) fn finish_draining(&mut self) {
        let done: Vec<AgentName> = self
            .draining
            .iter()
            .filter(|agent| !self.in_flight.values().any(|x| &x.agent == *agent))
            .cloned()
            .collect();
        for agent in done {
            self.draining.remove(&agent);
            if let Err(err) = self.agent.invalidate_remote_md(agent.as_str()) {
                tracing::debug!(%agent, %err, "NIXL invalidate_remote_md failed");
            }
        }
    }

    /// Removes a pending request (releasing it) and queues its completion.
    pub(super) fn finish(&mut self, seq: u64, result: Result<(), TransportError>) {
        if let Some(x) = self.in_flight.remove(&seq) {
            self.by_write.remove(&x.write);
            self.done.push_back(Completion {
                write: x.write,
                result,
            });
        }
    }
}
