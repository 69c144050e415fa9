//! Small types shared by the machines, the transports and the actix shells.

use std::fmt;

use crate::EngineId;

/// One rank of a remote engine: the unit that has a NIXL agent, a region table and a liveness.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerAddr {
    /// The engine.
    pub engine: EngineId,
    /// The engine's TP rank.
    pub rank: u32,
}

impl PeerAddr {
    /// The address of `rank` of `engine`.
    pub fn new(engine: EngineId, rank: u32) -> Self {
        Self { engine, rank }
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine, self.rank)
    }
}

impl fmt::Debug for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerAddr({self})")
    }
}

/// Names one posted write (all descriptors of one request's transfer to one peer rank). Unique
/// per endpoint for its whole life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteId(pub u64);

impl fmt::Display for WriteId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}
