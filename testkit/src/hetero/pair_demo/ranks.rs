//! Each rank of a run as its engine sets it up: the memory it allocates per slot, its engine id
//! and geometry, its transport agent's name, and where its side channel listens.

use kvhandoff::{KvRegion, SideChannel};
use kvhandoff_actors::system::agent_name;
use kvhandoff_protocol::hetero::{PairPlan, SideName, Space};
use kvhandoff_protocol::{AgentName, EngineId, ModelIdentity};

use super::{Prepared, DECODE, PREFILL};
use crate::demo::DemoError;
use crate::hetero::handoff::Handoff;

/// Per rank (side, index): the lengths of its KV and staging memory, the largest any request
/// needs (a pulled request's D staging holds the mirrors of P's blocks too).
pub(super) fn region_lens(
    pair: &PairPlan,
    handoffs: &[Handoff],
    pulled: &[bool],
) -> Vec<((SideName, usize), [u64; 2])> {
    let mut out = Vec::new();
    for (side, layout) in [
        (SideName::Prefill, &pair.prefill),
        (SideName::Decode, &pair.decode),
    ] {
        for index in 0..layout.ranks.len() {
            let mut lens = [1u64, 1u64];
            for (h, &pull) in handoffs.iter().zip(pulled) {
                for (slot, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
                    let len = match (pull, side, space) {
                        (true, SideName::Decode, Space::Staging) => h.pull_staging_len(index),
                        _ => h.arenas[h.arena(side, index, space)].bytes.len() as u64,
                    };
                    lens[slot] = lens[slot].max(len);
                }
            }
            out.push(((side, index), lens));
        }
    }
    out
}

/// Every rank's engine id and geometry, in [`region_lens`] order.
pub(super) fn ranks_of(
    run: &Prepared,
) -> impl Iterator<Item = Result<(EngineId, &kvhandoff_protocol::KvGeometry), DemoError>> {
    run.lens.iter().map(|&((side, index), _)| {
        let (engine, layout) = match side {
            SideName::Prefill => (PREFILL, &run.pair.prefill),
            SideName::Decode => (DECODE, &run.pair.decode),
        };
        let engine = EngineId::new(engine).map_err(|e| DemoError::Options(e.to_string()))?;
        Ok((engine, &layout.ranks[index].geometry))
    })
}

/// The transport agents' names the builder gives the ranks, in [`region_lens`] order.
pub(super) fn agent_names(run: &Prepared) -> Result<Vec<AgentName>, DemoError> {
    ranks_of(run)
        .map(|rank| {
            let (engine, geometry) = rank?;
            agent_name(&engine, geometry.rank_index())
                .map_err(|e| DemoError::Options(e.to_string()))
        })
        .collect()
}

/// A rank's TCP side channel on `listen`: P's takes the handshakes of D's engine, which dials
/// it first.
pub(super) fn side_channel(
    side: SideName,
    listen: std::net::SocketAddr,
) -> Result<SideChannel, DemoError> {
    let mut config = kvhandoff::SideChannelConfig::new(listen);
    if side == SideName::Prefill {
        let decode = EngineId::new(DECODE).map_err(|e| DemoError::Options(e.to_string()))?;
        config.accept = kvhandoff::AcceptPolicy::Known([decode].into());
    }
    Ok(SideChannel::Tcp(config))
}

/// Where a rank listens: its engine's base port + its rank index (vLLM's convention).
pub(super) fn rank_port(
    base: std::net::SocketAddr,
    geometry: &kvhandoff_protocol::KvGeometry,
) -> Result<std::net::SocketAddr, DemoError> {
    let port = u32::from(base.port()) + geometry.rank_index();
    let port = u16::try_from(port)
        .map_err(|_| DemoError::Options(format!("rank port {port} is past 65535")))?;
    Ok(std::net::SocketAddr::new(base.ip(), port))
}

/// A rank's memory, allocated by its engine: per slot of the window, a zeroed KV buffer and a
/// zeroed staging buffer of `lens` bytes (region `2 × slot` and `2 × slot + 1`).
pub(super) fn slot_memory(lens: [u64; 2], window: usize) -> Result<Vec<KvRegion>, DemoError> {
    lens.repeat(window)
        .into_iter()
        .map(|len| {
            let len = usize::try_from(len)
                .map_err(|_| DemoError::Options(format!("a {len}-byte buffer is too large")))?;
            Ok(KvRegion::zeroed(len))
        })
        .collect()
}

pub(super) fn model_identity(pair: &PairPlan) -> ModelIdentity {
    ModelIdentity {
        model: format!("kvhandoff-catalog-{}", pair.model.name),
        dtype: "bfloat16".into(),
        cache_dtype: format!("{}-byte", pair.model.dtype_bytes),
    }
}
