//! The simulated transport: a [`Transport`] that the shell's own [`TransportDriver`] drives,
//! as the actix `TransportActor` drives NIXL. The driver plans each write into descriptors,
//! encodes every message, and turns what comes back into endpoint inputs (a refused post is
//! `WriteFailed(PostFailed)`, a send to an invalidated peer is `PeerLost`, a failed transfer is
//! `WriteFailed(TransferFailed)`, bytes that do not decode are `Malformed`); so the simulator
//! runs the shell's logic, not a copy of it.
//!
//! The transport itself only records: the posts (mapped back from descriptors to block pairs),
//! sends and abandons the driver asked for, which the world then carries out with its NIXL
//! model (`nixl.rs`) and network (`world/net.rs`); and it hands back the completions and
//! notifications the world delivered. It refuses what NIXL refuses: a post or a send to a peer
//! it has not loaded, or has invalidated since. A notification from an agent it never loaded
//! has no peer (the driver counts and drops it).

use std::collections::{BTreeMap, BTreeSet};

use kvhandoff_protocol::driver::{
    connected_input, handshake_step, HandshakeStep, PeerInfo, TransportDriver, TransportOp,
};
use kvhandoff_protocol::machine::{ConnectFailure, NetEvent, WriteOrder};
use kvhandoff_protocol::transport::{
    AddrRange, Completion, Descriptor, Notification, Transport, TransportError,
};
use kvhandoff_protocol::{
    compatibility_hash, wire, AgentName, BlockIds, Incarnation, KvGeometry, KvLayout, Message,
    ModelIdentity, RegionDesc,
};
use kvhandoff_protocol::{PeerAddr, WriteId};

use crate::world::NodeId;

/// The geometry every simulated rank has: [`LAYERS`] layers, so two regions (keys, values) of
/// 8-byte blocks per layer. The simulator's ledger tracks blocks by id; addresses only need to
/// map back (and a layer-wise part's layers to the slice of each block's bytes it carries).
fn geometry() -> KvGeometry {
    KvGeometry::dense(LAYERS, 1, 8, 1, 1, KvLayout::Nhd)
}

/// Layers of every simulated rank.
pub(crate) const LAYERS: u32 = 4;

/// The bytes of a simulated block that layers `first .. first + count` of `of` stand for.
pub(crate) fn layer_slice(first: u32, count: u32, of: u32) -> std::ops::Range<usize> {
    let per = crate::ledger::BLOCK_BYTES / of.max(1) as usize;
    first as usize * per..(first + count) as usize * per
}

/// The address of block 0 of `region` of `node`.
fn region_base(node: NodeId, region: usize) -> u64 {
    ((node as u64 + 1) << 40) | ((region as u64) << 32)
}

/// The region of `node` an address lies in (see [`region_base`]).
fn region_of(node: NodeId, addr: u64) -> usize {
    (addr.wrapping_sub((node as u64 + 1) << 40) >> 32) as usize
}

/// What a simulated rank tells its peers in a handshake.
pub(crate) fn peer_info(
    node: NodeId,
    addr: &PeerAddr,
    incarnation: Incarnation,
    inc: u32,
    blocks: u32,
) -> PeerInfo {
    let geometry = geometry();
    let specs = geometry.regions().expect("the simulated geometry is valid");
    let regions = specs
        .iter()
        .enumerate()
        .map(|(r, spec)| RegionDesc {
            base: region_base(node, r),
            len: u64::from(blocks) * spec.block_len,
            num_blocks: blocks,
            block_len: spec.block_len,
        })
        .collect();
    let model = ModelIdentity {
        model: "sim".into(),
        dtype: "int8".into(),
        cache_dtype: "int8".into(),
    };
    PeerInfo {
        peer: addr.clone(),
        agent: agent_name(addr, inc),
        metadata: (node as u64).to_le_bytes().to_vec(),
        regions,
        compat: compatibility_hash(&model, &geometry),
        geometry,
        incarnation,
        routed: false,
    }
}

/// The agent of `addr`'s incarnation `inc` (a restarted process is another agent).
pub(crate) fn agent_name(addr: &PeerAddr, inc: u32) -> AgentName {
    AgentName::new(format!("{}-r{}-i{inc}", addr.engine, addr.rank)).expect("valid agent name")
}

/// A rank's shell: the driver over its simulated transport.
pub(crate) type Shell = TransportDriver<SimTransport>;

/// A new shell for `node`'s incarnation `inc`.
pub(crate) fn shell(node: NodeId, info: PeerInfo) -> Shell {
    let transport = SimTransport {
        agent: info.agent.clone(),
        node,
        block_len: info.regions[0].block_len,
        peers: BTreeMap::new(),
        agents: BTreeMap::new(),
        calls: Vec::new(),
        completions: Vec::new(),
        notifications: Vec::new(),
        refuse_next_post: false,
        dead_agents: BTreeSet::new(),
    };
    TransportDriver::new(transport, info)
}

/// What the driver asked the transport to do, for the world to carry out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// A write: (local block, remote block) pairs, and the notification to send after it.
    Post {
        write: WriteId,
        to: PeerAddr,
        pairs: Vec<(u32, u32)>,
        notification: Option<Vec<u8>>,
    },
    /// A read: (local block, remote block) pairs, the data flowing from the peer.
    PostRead {
        read: WriteId,
        from: PeerAddr,
        pairs: Vec<(u32, u32)>,
    },
    /// A control message.
    Send { to: PeerAddr, bytes: Vec<u8> },
    /// Stop a write (the world's NIXL lets it go on, as the real one does).
    Abandon(WriteId),
}

/// A loaded peer: its node, and whether it was invalidated since.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SimPeer {
    node: NodeId,
    agent: AgentName,
    loaded: bool,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct SimTransport {
    agent: AgentName,
    node: NodeId,
    block_len: u64,
    peers: BTreeMap<PeerAddr, SimPeer>,
    agents: BTreeMap<AgentName, PeerAddr>,
    pub(crate) calls: Vec<Call>,
    pub(crate) completions: Vec<Completion>,
    pub(crate) notifications: Vec<Notification>,
    /// The world's fault: refuse the next post.
    pub(crate) refuse_next_post: bool,
    /// Agents whose process died: posts and sends to them fail at once, as NIXL's do
    /// (`write_to_dropped_peer_fails_typed`).
    dead_agents: BTreeSet<AgentName>,
}

impl SimTransport {
    /// The peers as this transport sees them (for the exhaustive check's state identity).
    pub(crate) fn view(&self) -> String {
        format!("{:?} {:?}", self.peers, self.dead_agents)
    }

    /// The process behind `agent` died.
    pub(crate) fn agent_died(&mut self, agent: AgentName) {
        self.dead_agents.insert(agent);
    }

    fn loaded(&self, peer: &PeerAddr) -> Result<&SimPeer, TransportError> {
        const _: () = assert!(crate::nixl::measured::POST_WITHOUT_METADATA_IS_REFUSED);
        match self.peers.get(peer) {
            Some(p) if p.loaded && self.dead_agents.contains(&p.agent) => {
                Err(TransportError::PeerUnreachable {
                    agent: p.agent.clone(),
                })
            }
            Some(p) if p.loaded => Ok(p),
            Some(_) => Err(TransportError::PeerInvalidated { peer: peer.clone() }),
            None => Err(TransportError::UnknownPeer { peer: peer.clone() }),
        }
    }

    /// The (local block, remote block) pairs `descriptors` cover between this node and `peer`.
    fn block_pairs(&self, peer: NodeId, descriptors: &[Descriptor]) -> Vec<(u32, u32)> {
        let mut pairs = Vec::new();
        // Every region carries the same blocks: the first region's descriptors say which (a
        // layer-wise part holds only its layers' regions).
        let Some(first) = descriptors
            .iter()
            .map(|d| region_of(self.node, d.local_addr))
            .min()
        else {
            return pairs;
        };
        for d in descriptors {
            if region_of(self.node, d.local_addr) != first {
                continue;
            }
            let (Some(local), Some(remote)) = (
                self.block_at(self.node, first, d.local_addr),
                self.block_at(peer, first, d.remote_addr),
            ) else {
                continue;
            };
            let blocks = u32::try_from(d.len / self.block_len).unwrap_or(0);
            pairs.extend((0..blocks).map(|k| (local + k, remote + k)));
        }
        pairs
    }

    /// The block of `region` of `node` at `addr`, if the address is in that region.
    fn block_at(&self, node: NodeId, region: usize, addr: u64) -> Option<u32> {
        let base = region_base(node, region);
        let offset = addr.checked_sub(base)?;
        if offset >= 1 << 32 {
            return None;
        }
        u32::try_from(offset / self.block_len).ok()
    }
}

impl Transport for SimTransport {
    type Region = RegionDesc;

    fn agent_name(&self) -> &AgentName {
        &self.agent
    }

    fn register_region(&mut self, region: &RegionDesc) -> Result<AddrRange, TransportError> {
        Ok(AddrRange {
            base: region.base,
            len: region.len,
        })
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        Ok((self.node as u64).to_le_bytes().to_vec())
    }

    fn load_remote(
        &mut self,
        peer: &PeerAddr,
        agent: &AgentName,
        metadata: &[u8],
    ) -> Result<(), TransportError> {
        let bytes: [u8; 8] = metadata
            .try_into()
            .map_err(|_| TransportError::BadMetadata {
                why: "not a node id",
            })?;
        let node = u64::from_le_bytes(bytes) as NodeId;
        // Agents are never forgotten: a notification maps to its peer as it would have when it
        // arrived (a stalled process's transport may poll what queued before its rank's
        // timers run, and before a newer incarnation of the peer is loaded).
        self.agents.insert(agent.clone(), peer.clone());
        self.peers.insert(
            peer.clone(),
            SimPeer {
                node,
                agent: agent.clone(),
                loaded: true,
            },
        );
        Ok(())
    }

    fn invalidate_remote(&mut self, peer: &PeerAddr) {
        if let Some(p) = self.peers.get_mut(peer) {
            p.loaded = false;
        }
    }

    fn post_write(
        &mut self,
        write: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        let target = self.loaded(peer)?.node;
        if std::mem::take(&mut self.refuse_next_post) {
            return Err(TransportError::PostFailed {
                reason: "simulated refusal".into(),
            });
        }
        let pairs = self.block_pairs(target, descriptors);
        self.calls.push(Call::Post {
            write,
            to: peer.clone(),
            pairs,
            notification,
        });
        Ok(())
    }

    fn post_read(
        &mut self,
        read: WriteId,
        peer: &PeerAddr,
        descriptors: &[Descriptor],
        _notification: Option<Vec<u8>>,
    ) -> Result<(), TransportError> {
        let holder = self.loaded(peer)?.node;
        if std::mem::take(&mut self.refuse_next_post) {
            return Err(TransportError::PostFailed {
                reason: "simulated refusal".into(),
            });
        }
        let pairs = self.block_pairs(holder, descriptors);
        self.calls.push(Call::PostRead {
            read,
            from: peer.clone(),
            pairs,
        });
        Ok(())
    }

    fn abandon_write(&mut self, write: WriteId) -> Result<(), TransportError> {
        self.calls.push(Call::Abandon(write));
        Ok(())
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.completions);
    }

    fn send_notification(&mut self, peer: &PeerAddr, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.loaded(peer)?;
        self.calls.push(Call::Send {
            to: peer.clone(),
            bytes,
        });
        Ok(())
    }

    fn poll_notifications(&mut self, out: &mut Vec<Notification>) {
        for mut note in self.notifications.drain(..) {
            note.peer = self.agents.get(&note.from).cloned();
            out.push(note);
        }
    }

    fn max_notification_len(&self) -> usize {
        1 << 20
    }
}

impl crate::world::World {
    /// What `node`'s rank tells its peers in a handshake, as it is now.
    pub(crate) fn info_of(&self, node: NodeId) -> PeerInfo {
        let n = &self.nodes[node];
        peer_info(
            node,
            &n.addr,
            crate::world::incarnation_of(node, n.incarnation),
            n.incarnation,
            self.cfg.pool_blocks,
        )
    }

    /// Runs one of the endpoint's transport outputs through `node`'s shell, carries out what
    /// the shell asked the transport for, and feeds back what the shell made of it.
    pub(crate) fn shell_op(&mut self, node: NodeId, op: TransportOp) {
        let mut feed = Vec::new();
        let post = matches!(
            op,
            TransportOp::PostWrite(_) | TransportOp::PostRead(_) | TransportOp::ExtendWrite { .. }
        );
        let read_order = match &op {
            TransportOp::PostRead(order) => Some((**order).clone()),
            TransportOp::PostWrite(_)
            | TransportOp::ExtendWrite { .. }
            | TransportOp::Send { .. }
            | TransportOp::Abandon(_)
            | TransportOp::Invalidate(_) => None,
        };
        // NIXL may refuse a post outright (`post_xfer_req` failing): the transport says so
        // and the shell makes it `WriteFailed(PostFailed)`.
        let refuse = post && self.chance(self.rates.post_fail);
        if let TransportOp::PostWrite(order) = &op {
            // Every post the endpoint asked for reaches the shell (S8's accounting).
            self.nodes[node].posts_seen += 1;
            self.check_lease_at_post(node, order);
        }
        if read_order.is_some() {
            self.nodes[node].reads_seen += 1;
        }
        let Some(shell) = self.nodes[node].shell.as_mut() else {
            return;
        };
        shell.transport_mut().refuse_next_post = refuse;
        shell.perform(op, &mut feed);
        let calls = std::mem::take(&mut shell.transport_mut().calls);
        for call in calls {
            match call {
                Call::Post {
                    write,
                    to,
                    pairs,
                    notification,
                } => self.carry_post(node, write, to, pairs, notification),
                Call::PostRead { read, from, pairs } => match read_order.clone() {
                    Some(order) if order.read == read && order.from == from => {
                        self.post_read(node, order, pairs);
                    }
                    _ => self.violate(format!("node {node}: read {read} posted without its order")),
                },
                Call::Send { to, bytes } => match wire::decode(&bytes) {
                    Ok(message) => self.send(node, &to, message),
                    Err(error) => self.violate(format!("node {node} sent bad bytes: {error}")),
                },
                Call::Abandon(write) => self.abandon_write(node, write),
            }
        }
        for input in feed {
            match &input {
                NetEvent::PeerLost { .. } => self.mark("shell_send_refused"),
                NetEvent::WriteFailed { .. } => self.mark("shell_post_refused"),
                _ => {}
            }
            self.feed(node, input);
        }
    }

    /// A post the shell planned: back to the write order the world's NIXL carries out.
    fn carry_post(
        &mut self,
        node: NodeId,
        write: WriteId,
        to: PeerAddr,
        pairs: Vec<(u32, u32)>,
        notification: Option<Vec<u8>>,
    ) {
        let decoded = notification.as_deref().map(wire::decode);
        let (key, epoch, layers) = match &decoded {
            Some(Ok(Message::WriteDone(done))) => (done.key.clone(), done.epoch, None),
            Some(Ok(Message::WritePartDone(part))) => (
                part.key.clone(),
                part.epoch,
                Some(layer_slice(part.first, part.count, part.of)),
            ),
            _ => {
                self.violate(format!("node {node}: write {write} without its WriteDone"));
                return;
            }
        };
        let Some(Ok(notification)) = decoded else {
            unreachable!("decoded above");
        };
        let (local, remote): (Vec<u32>, Vec<u32>) = pairs.into_iter().unzip();
        let order = WriteOrder {
            write,
            to,
            key,
            epoch,
            local: BlockIds::single_group(local),
            remote: BlockIds::single_group(remote),
            notification,
            stream: None,
            remote_memory: Vec::new(),
        };
        self.post_write(node, order, layers);
    }

    /// Hands `node`'s shell what its transport reports (a write's end, a notification) and
    /// feeds the endpoint what the shell made of it.
    pub(crate) fn shell_poll(&mut self, node: NodeId) {
        let mut feed = Vec::new();
        if let Some(shell) = self.nodes[node].shell.as_mut() {
            shell.poll(&mut feed);
        }
        for input in feed {
            self.feed(node, input);
        }
    }

    /// A write of `node` ended: its transport reports it, the shell translates it.
    pub(crate) fn shell_completion(&mut self, node: NodeId, write: WriteId, failed: bool) {
        let Some(shell) = self.nodes[node].shell.as_mut() else {
            return;
        };
        let result = if failed {
            Err(TransportError::TransferFailed {
                reason: "simulated".into(),
            })
        } else {
            Ok(())
        };
        shell
            .transport_mut()
            .completions
            .push(Completion { write, result });
        self.shell_poll(node);
    }

    /// A notification from `from`'s incarnation `from_inc` reached `node`'s transport.
    pub(crate) fn shell_notification(
        &mut self,
        node: NodeId,
        from: NodeId,
        from_inc: u32,
        message: &Message,
    ) {
        let agent = agent_name(&self.nodes[from].addr, from_inc);
        let Some(shell) = self.nodes[node].shell.as_mut() else {
            return;
        };
        shell.transport_mut().notifications.push(Notification {
            from: agent,
            peer: None,
            bytes: wire::encode(message),
        });
        self.shell_poll(node);
    }

    /// A handshake completed at `node` with `peer`: the shell loads the peer (unless it repeats
    /// the incarnation the endpoint is connected to) and the endpoint hears of it.
    pub(crate) fn shell_handshake(&mut self, node: NodeId, peer: NodeId) {
        let info = self.info_of(peer);
        let Some(endpoint) = self.nodes[node].endpoint() else {
            return;
        };
        let input = match handshake_step(endpoint, &info) {
            HandshakeStep::Repeat(input) => input,
            HandshakeStep::Load => {
                let Some(shell) = self.nodes[node].shell.as_mut() else {
                    return;
                };
                let loaded = shell
                    .load_peer(info.clone())
                    .map_err(|e| ConnectFailure::Refused(e.to_string()));
                connected_input(&info, &loaded)
            }
        };
        self.feed(node, input);
    }
}
