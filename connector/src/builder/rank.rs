//! [`EngineRank`]: a rank once started — its connector, its KV memory, the runtime it may own,
//! and the peer book it can still add to. Kept apart from the builder because this is what the
//! engine holds for the rank's whole life, while the builder is gone after one call.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvhandoff_actors::system::{blocking, AddPeerAddress};
use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::{EngineId, PeerAddr};

use super::StartError;
use crate::route::PlannedRoute;
use crate::{ConnectorIdentity, KvCache, KvConnector, Runtime};

/// How long [`EngineRank::add_peer`] waits for the rank's link.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// A started engine rank: its [`KvConnector`] (also reached through `Deref`), the engine's
/// access to its KV memory ([`KvCache`]), and, when it was started with
/// [`RankBuilder::start`](crate::RankBuilder::start), the runtime it owns (shut down when this
/// is dropped, after the connector).
pub struct EngineRank {
    // Field order is drop order: the connector before the runtime it talks to.
    pub(super) connector: KvConnector,
    pub(super) kv: KvCache,
    pub(super) route: Option<Arc<PlannedRoute>>,
    pub(super) info: PeerInfo,
    pub(super) runtime: Option<Runtime>,
}

impl std::fmt::Debug for EngineRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineRank")
            .field("identity", self.connector.identity())
            .field("kv", &self.kv)
            .field("routed", &self.route.is_some())
            .field("owns_runtime", &self.runtime.is_some())
            .finish()
    }
}

impl EngineRank {
    /// The rank's connector.
    pub fn connector(&self) -> &KvConnector {
        &self.connector
    }

    /// The rank's connector, to call its hooks.
    pub fn connector_mut(&mut self) -> &mut KvConnector {
        &mut self.connector
    }

    /// The engine's access to the rank's KV memory (clone it to keep it on another thread).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Where the rank's TCP side channel listens (the bound address: port 0 resolved); `None`
    /// in process.
    pub fn side_channel(&self) -> Option<SocketAddr> {
        self.connector.rank().side_channel
    }

    /// The identity the rank's answers advertise.
    pub fn identity(&self) -> &ConnectorIdentity {
        self.connector.identity()
    }

    /// The route of a rank of a heterogeneous pair
    /// ([`RankBuilder::pairing`](crate::RankBuilder::pairing)): P's engine files each link's
    /// descriptors and staging work with it before `request_finished`.
    pub fn route(&self) -> Option<&Arc<PlannedRoute>> {
        self.route.as_ref()
    }

    /// The handshake payload this rank hands its peers: its address, agent name and metadata,
    /// its regions as registered (where the engine's memory sits in the transport's address
    /// space), geometry, compatibility hash and incarnation. For diagnostics and tests (a test
    /// that replays the rank's handshake sends this).
    pub fn peer_info(&self) -> &PeerInfo {
        &self.info
    }

    /// Tells the rank where `engine`'s rank of this rank's index listens (TCP), and so to take
    /// `engine`'s handshakes. Blocks for the rank's answer (a few seconds at most). For a peer
    /// rank of another index (a heterogeneous pair), see [`add_peer_rank`](Self::add_peer_rank).
    ///
    /// # Errors
    /// [`StartError::Peer`] if the rank's book of addresses is full or it did not answer.
    pub fn add_peer(&self, engine: &EngineId, addr: SocketAddr) -> Result<(), StartError> {
        let peer = PeerAddr::new(engine.clone(), self.info.peer.rank);
        self.add_peer_rank(&peer, addr)
    }

    /// Tells the rank where `peer`'s side channel listens (TCP; each rank of an engine has its
    /// own), and so to take its engine's handshakes. Blocks for the rank's answer (a few seconds
    /// at most).
    ///
    /// # Errors
    /// [`StartError::Peer`] if the rank's book of addresses is full or it did not answer.
    pub fn add_peer_rank(&self, peer: &PeerAddr, addr: SocketAddr) -> Result<(), StartError> {
        let added = blocking::ask(
            &self.connector.rank().link,
            AddPeerAddress {
                peer: peer.clone(),
                addr,
            },
            PEER_TIMEOUT,
        );
        match added {
            Some(Ok(())) => Ok(()),
            _ => Err(StartError::Peer {
                engine: peer.engine.clone(),
            }),
        }
    }

    /// Takes the rank apart: its connector, its cache, and the runtime it owns (if it was
    /// started with [`RankBuilder::start`](crate::RankBuilder::start); keep it alive while the
    /// connector is used).
    pub fn into_parts(self) -> (KvConnector, KvCache, Option<Runtime>) {
        (self.connector, self.kv, self.runtime)
    }

    /// Stops the rank: drops the connector and, if the rank owns its runtime, shuts it down
    /// (which releases the engine's memory). For a graceful end, call
    /// [`KvConnector::shutdown`] first and poll until [`KvConnector::has_pending_work`] is
    /// false.
    pub fn shutdown(self) {
        let (connector, _kv, runtime) = self.into_parts();
        drop(connector);
        if let Some(runtime) = runtime {
            runtime.shutdown();
        }
    }
}

impl std::ops::Deref for EngineRank {
    type Target = KvConnector;

    fn deref(&self) -> &KvConnector {
        &self.connector
    }
}

impl std::ops::DerefMut for EngineRank {
    fn deref_mut(&mut self) -> &mut KvConnector {
        &mut self.connector
    }
}

/// A compile-time check that a rank and its cache can move to the engine's threads.
#[allow(dead_code)]
fn assert_send() {
    fn send<T: Send>() {}
    fn sync<T: Send + Sync>() {}
    send::<EngineRank>();
    sync::<KvCache>();
}
