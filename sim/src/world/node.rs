//! One engine rank of the world: its process's session (and through it its endpoint), its
//! shell, its pool, and what the checker remembers of its incarnations.

use kvhandoff_protocol::machine::{Endpoint, Time};
use kvhandoff_protocol::session::{ConnectorIdentity, ConnectorSettings, Session};
use kvhandoff_protocol::{EngineId, PeerAddr};

use super::{NodeId, Stall, WorldConfig};
use crate::ledger::Pool;

/// The incarnation id `node`'s process number `inc` sends in its handshakes.
pub(crate) fn incarnation_of(node: NodeId, inc: u32) -> kvhandoff_protocol::Incarnation {
    kvhandoff_protocol::Incarnation(((node as u128) << 64) | u128::from(inc))
}

/// One engine rank.
#[derive(Debug)]
pub(crate) struct Node {
    pub addr: PeerAddr,
    /// The rank's session, which owns its endpoint (`None` while crashed): the engine model
    /// calls it as an engine calls its connector.
    pub session: Option<Session>,
    /// The shell's transport driver over the simulated transport (`None` while crashed).
    pub shell: Option<crate::transport::Shell>,
    pub incarnation: u32,
    pub pool: Pool,
    /// `writes_posted` of earlier incarnations' counters plus this one's posts seen.
    pub posts_seen: u64,
    /// Reads this incarnation's endpoint asked its shell to post.
    pub reads_seen: u64,
    /// The stall the process is in, if it is stopped.
    pub stall: Option<Stall>,
    /// Stalls that ended, (from, until): the node's own deadlines could not run then.
    pub stalled_spans: Vec<(Time, Time)>,
    /// Siblings this incarnation's session aborted, as last seen.
    pub siblings_aborted: u64,
}

impl Node {
    /// The running incarnation's endpoint.
    pub fn endpoint(&self) -> Option<&Endpoint> {
        self.session.as_ref().map(Session::endpoint)
    }
}

/// A new incarnation of the rank at `addr`: its endpoint under `cfg`'s machine config, inside
/// the session an engine's connector would drive, which reports every endpoint event to the
/// checker too ([`SessionOutput::Observed`]).
pub(crate) fn new_session(addr: &PeerAddr, cfg: &WorldConfig) -> Session {
    let mut endpoint = Endpoint::new(addr.engine.clone(), addr.rank, cfg.machine.clone())
        .expect("valid machine config");
    endpoint.set_mutation(cfg.mutation);
    let identity = ConnectorIdentity::in_process(addr.engine.clone(), addr.rank, 1);
    let settings = ConnectorSettings {
        lease_duration: cfg.machine.lease_duration,
        read_span: kvhandoff_protocol::machine::read_span(&cfg.machine),
        block_tokens: Some(crate::engine::BLOCK_TOKENS),
        layers: Some(crate::transport::LAYERS),
        // One layer a part (the most partial states), and prompts of one block as one part
        // (the threshold's path).
        layerwise_parts: crate::transport::LAYERS,
        layerwise_min_tokens: 2 * u64::from(crate::engine::BLOCK_TOKENS),
        ..ConnectorSettings::default()
    };
    let mut session = Session::new(endpoint, identity, settings);
    session.set_mutation(cfg.mutation);
    session.observe_endpoint_events(true);
    // One clock for the whole world: every engine's offset is known and zero, so a reader
    // converts a holder's `remote_blocks_expiry_time` exactly (the actix shell learns each
    // from its side channel's handshake).
    for engine in engine_names(cfg) {
        session.clock_measured(engine, 0);
    }
    session
}

/// The world's engines: P's and each D's.
fn engine_names(cfg: &WorldConfig) -> impl Iterator<Item = EngineId> {
    std::iter::once("prefill-0".to_string())
        .chain((0..cfg.decode_engines).map(|d| format!("decode-{d}")))
        .map(|name| EngineId::new(name).expect("valid engine id"))
}
