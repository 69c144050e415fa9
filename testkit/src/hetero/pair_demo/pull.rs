//! Pull in the heterogeneous demo: P's ranks export, the router hands P's answer to D's ranks,
//! each D rank reads every link into it (its route places the pieces), and once every read
//! landed D runs the transforms of the pair on its side ([`Handoff::land_pulled_link`], then
//! its own jobs).
//!
//! Where the pieces go: in one process D's engine knows P's memory and files each link's
//! pieces ahead; across processes (and over side channels in one) P's route names the slot's
//! KV buffer in its grant (`ReadGrant::memory`), and D's route places the pieces there when the
//! grant comes.

use kvhandoff::KvTransferParams;
use kvhandoff_protocol::driver::RouteRequest;
use kvhandoff_protocol::hetero::{PairPlan, SideName, Space};
use kvhandoff_protocol::planner::Descriptor;
use kvhandoff_protocol::{MemorySpan, PairingKey};

use super::flight::{lock, region, Placing, Rank, Shared};
use crate::hetero::handoff::{Handoff, PullLink, ReadPiece};

/// How long D keeps a turn's blocks for the next turn's read-back.
pub(super) const KEEP_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// What P's ranks are called with for a pull.
pub(super) fn prefill_params() -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        transfer_mode: Some("pull".into()),
        ..KvTransferParams::default()
    }
}

/// What the router hands D's ranks: P's answer (`from_p`: the first P rank's, as vLLM's proxy
/// takes one), turned into the decode leg's; or, where no P rank runs in this process, the
/// same parameters from the shared plan.
pub(super) fn decode_params(
    from_p: Option<&KvTransferParams>,
    h: &Handoff,
    pair: &PairPlan,
    remote: Option<std::net::SocketAddr>,
) -> KvTransferParams {
    let mut params = from_p.cloned().unwrap_or_else(|| KvTransferParams {
        remote_engine_id: Some(super::PREFILL.into()),
        tp_size: Some(pair.prefill.spec.tp),
        transfer_mode: Some("pull".into()),
        remote_block_ids: Some(h.prefill_blocks.groups.clone()),
        remote_num_tokens: Some(h.shape.tokens),
        ..KvTransferParams::default()
    });
    params.do_remote_prefill = true;
    params.do_remote_decode = false;
    if let Some(addr) = remote {
        params.remote_host = Some(addr.ip().to_string());
        params.remote_port = Some(addr.port());
    }
    params
}

/// Files request `key`'s reads with the routes of the ranks held here: each D rank the pieces
/// of every link into it (ahead, or a planner for when P's grant names its memory); each P
/// rank, when placing at post time, the slot's KV buffer for every link it serves.
pub(super) fn file_reads(
    h: &Handoff,
    shared: &Shared,
    pair: &PairPlan,
    ranks: &[Rank],
    slot: usize,
    key: &PairingKey,
    placing: Placing,
) -> Result<(), String> {
    for rank in ranks {
        match rank.side {
            SideName::Decode => {
                for pulled in h.pull_links_into(rank.index) {
                    let link = &pair.links[pulled.link];
                    let p_id = pair.prefill.ranks[link.prefill].geometry.rank_index();
                    let pair_key = key.for_pair(p_id, rank.id).map_err(|e| e.to_string())?;
                    match placing {
                        Placing::Ahead => {
                            let p = find(ranks, SideName::Prefill, link.prefill)?;
                            let descriptors =
                                read_descriptors(&pulled, rank, slot, p.base(slot, 0)?)?;
                            rank.route
                                .file(
                                    pair_key,
                                    h.decode_blocks.clone(),
                                    h.prefill_blocks.clone(),
                                    descriptors,
                                    None,
                                )
                                .map_err(|e| e.to_string())?;
                        }
                        Placing::AtPost => {
                            let planner = read_planner(shared, pulled, rank, slot)?;
                            rank.route
                                .file_planner(pair_key, h.decode_blocks.clone(), planner)
                                .map_err(|e| e.to_string())?;
                        }
                    }
                }
            }
            SideName::Prefill if placing == Placing::AtPost => {
                let span = MemorySpan {
                    addr: rank.base(slot, 0)?,
                    len: rank
                        .kv
                        .region_len(region(slot, 0))
                        .map_err(|e| e.to_string())?,
                };
                for link in pair.links.iter().filter(|l| l.prefill == rank.index) {
                    let d_id = pair.decode.ranks[link.decode].geometry.rank_index();
                    let pair_key = key.for_pair(rank.id, d_id).map_err(|e| e.to_string())?;
                    rank.route
                        .file_memory(pair_key, vec![span])
                        .map_err(|e| e.to_string())?;
                }
            }
            SideName::Prefill => {}
        }
    }
    Ok(())
}

fn find(ranks: &[Rank], side: SideName, index: usize) -> Result<&Rank, String> {
    ranks
        .iter()
        .find(|r| r.side == side && r.index == index)
        .ok_or_else(|| format!("no {side} rank {index}"))
}

/// The descriptors of one pulled link on D rank `d`: D's slot memory local, P's KV (at
/// `p_kv`) remote.
fn read_descriptors(
    pulled: &PullLink,
    d: &Rank,
    slot: usize,
    p_kv: u64,
) -> Result<Vec<Descriptor>, String> {
    let own = [d.base(slot, 0)?, d.base(slot, 1)?];
    Ok(piece_descriptors(&pulled.pieces, own, p_kv))
}

/// A pulled link's pieces as descriptors: into D's slot memory (`own`: its KV, then its
/// staging base), from P's KV at `p_kv`.
fn piece_descriptors(pieces: &[ReadPiece], own: [u64; 2], p_kv: u64) -> Vec<Descriptor> {
    pieces
        .iter()
        .map(|piece| Descriptor {
            local_addr: own[usize::from(piece.dst_space == Space::Staging)] + piece.dst,
            remote_addr: p_kv + piece.src,
            len: piece.len,
        })
        .collect()
}

/// The planner of one pulled link on D rank `d`: once P's grant named its KV buffer, and
/// granted the blocks this request's plan was made for, the link's pieces in it.
fn read_planner(
    shared: &Shared,
    pulled: PullLink,
    d: &Rank,
    slot: usize,
) -> Result<kvhandoff::route::Planner, String> {
    let own = [d.base(slot, 0)?, d.base(slot, 1)?];
    let shared = std::sync::Arc::clone(shared);
    Ok(Box::new(move |request: &RouteRequest<'_>| {
        let [kv, ..] = request.remote_memory else {
            return Err("P's grant names no buffer to read the request from".into());
        };
        {
            let h = lock(&shared)?;
            if request.remote != &h.prefill_blocks {
                return Err("P granted other blocks than this request's plan".into());
            }
        }
        Ok(piece_descriptors(&pulled.pieces, own, kv.addr))
    }))
}

/// D's half of a pulled request on the D ranks held here, before D's own jobs: every link's
/// mirror read back from the slot's staging memory, and P's jobs of the link run over it.
pub(super) fn land(h: &mut Handoff, ranks: &[Rank], slot: usize) -> Result<(), String> {
    for rank in ranks.iter().filter(|r| r.side == SideName::Decode) {
        for pulled in h.pull_links_into(rank.index) {
            let mut mirror =
                vec![0u8; usize::try_from(pulled.mirror_len).map_err(|e| e.to_string())?];
            if !mirror.is_empty() {
                rank.kv
                    .read(region(slot, 1), pulled.mirror_at, &mut mirror)
                    .map_err(|e| format!("D rank {}: {e}", rank.id))?;
            }
            h.land_pulled_link(&pulled, &mirror)
                .map_err(|e| format!("D rank {}: {e}", rank.id))?;
        }
    }
    Ok(())
}
