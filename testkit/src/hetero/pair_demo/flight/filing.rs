//! Filing a request with the ranks' routes: where each link's pieces go in the two ranks'
//! registered memory (ahead, in one process; or at post time, from the buffers D's registration
//! names), the link's staging work, and withdrawing what a request that ended left filed.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvhandoff::route::{Planner, Staging};
use kvhandoff::KvCache;
use kvhandoff_protocol::driver::RouteRequest;
use kvhandoff_protocol::hetero::{PairPlan, SideName, Space};
use kvhandoff_protocol::planner::Descriptor;
use kvhandoff_protocol::{MemorySpan, PairingKey, RequestId};

use super::super::HeteroFault;
use super::{lock, region, Rank, Shared};
use crate::hetero::handoff::Handoff;

/// Drops what request `r`'s links left filed with the routes of the ranks held here (P: a
/// sub-request that ended without its write; D: the memory its registration named).
pub(super) fn withdraw(r: usize, pair: &PairPlan, ranks: &[Rank]) {
    let Ok(request) = RequestId::new(format!("req-{r}")) else {
        return;
    };
    let key = PairingKey::from_request_id(&request);
    for link in &pair.links {
        let p = pair.prefill.ranks[link.prefill].geometry.rank_index();
        let d = pair.decode.ranks[link.decode].geometry.rank_index();
        let Ok(pair_key) = key.for_pair(p, d) else {
            continue;
        };
        for rank in ranks.iter().filter(|r| {
            (r.side == SideName::Prefill && r.index == link.prefill)
                || (r.side == SideName::Decode && r.index == link.decode)
        }) {
            rank.route.withdraw(&pair_key);
        }
    }
}

/// The staging work of `link` in request `shared`: P's jobs of the link, and their output
/// blocks into P's registered staging memory, region `staging` of `kv`; `None` for a link
/// with no P job.
fn staging_of(
    h: &Handoff,
    shared: &Shared,
    link: usize,
    kv: &KvCache,
    staging: usize,
) -> Option<Staging> {
    if !h.plan.prefill_jobs.iter().any(|job| job.link == link) {
        return None;
    }
    let shared = Arc::clone(shared);
    let kv = kv.clone();
    Some(Box::new(move || {
        let mut h = lock(&shared)?;
        let written = h
            .run_prefill_jobs_of_link(link)
            .map_err(|e| e.to_string())?;
        let rank = h.pair.links[link].prefill;
        let arena = &h.arenas[h.arena(SideName::Prefill, rank, Space::Staging)].bytes;
        for (addr, len) in written {
            let bytes = usize::try_from(addr)
                .ok()
                .and_then(|a| arena.get(a..a.checked_add(usize::try_from(len).ok()?)?))
                .ok_or_else(|| format!("staging block {addr}+{len} outside the arena"))?;
            kv.write(staging, addr, bytes).map_err(|e| e.to_string())?;
        }
        Ok(())
    }))
}

/// Files each link's pieces and staging work with its P rank's route, under the link's pair
/// key, as addresses in `slot` of the two ranks' registered memory. Every link of the plan is
/// filed, so that each sub-request's write is placed by its route or refused by it; a link with
/// no piece would be refused by the transport (`NoDescriptors`, as NIXL does) and fail its
/// request — the planner gives every link pieces when D lacks tokens (every runtime cell).
pub(super) fn file_routes(
    h: &Handoff,
    shared: &Shared,
    pair: &PairPlan,
    ranks: &[Rank],
    slot: usize,
    key: &PairingKey,
    fault: Option<HeteroFault>,
) -> Result<(), String> {
    let find = |side: SideName, index: usize| {
        ranks
            .iter()
            .find(|r| r.side == side && r.index == index)
            .ok_or_else(|| format!("no {side} rank {index}"))
    };
    let mut by_link: BTreeMap<usize, Vec<Descriptor>> = BTreeMap::new();
    for (l, link) in pair.links.iter().enumerate() {
        let (p, d) = (
            find(SideName::Prefill, link.prefill)?,
            find(SideName::Decode, link.decode)?,
        );
        let own = [p.base(slot, 0)?, p.base(slot, 1)?];
        let theirs = [d.base(slot, 0)?, d.base(slot, 1)?];
        by_link.insert(l, link_descriptors(h, l, own, theirs));
    }
    match fault {
        Some(HeteroFault::UnfiledLink) => {
            by_link.remove(&0);
        }
        Some(HeteroFault::ShiftedPiece) => {
            let row = pair.model.row_bytes();
            if let Some(d) = by_link.values_mut().find_map(|d| d.first_mut()) {
                d.remote_addr += row;
            }
        }
        Some(HeteroFault::DecodeAborts | HeteroFault::Unstaged) | None => {}
    }
    for (l, descriptors) in by_link {
        let link = &pair.links[l];
        let p = find(SideName::Prefill, link.prefill)?;
        let d = find(SideName::Decode, link.decode)?;
        let pair_key = key.for_pair(p.id, d.id).map_err(|e| e.to_string())?;
        let staging = match fault {
            Some(HeteroFault::Unstaged) => None,
            _ => staging_of(h, shared, l, &p.kv, region(slot, 1)),
        };
        p.route
            .file(
                pair_key,
                h.prefill_blocks.clone(),
                h.decode_blocks.clone(),
                descriptors,
                staging,
            )
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Files request `key`'s links with the routes of the ranks held here, for placement at post
/// time: each D rank names its slot's buffers (KV, then staging) for every link that writes to
/// it; each P rank files a planner per link that places the link's pieces in the buffers D's
/// registration names, once it checked that D registered the blocks this request's plan was
/// made for, and runs the link's staging right before.
pub(super) fn file_at_post(
    h: &Handoff,
    shared: &Shared,
    pair: &PairPlan,
    ranks: &[Rank],
    slot: usize,
    key: &PairingKey,
) -> Result<(), String> {
    for (l, link) in pair.links.iter().enumerate() {
        let p_id = pair.prefill.ranks[link.prefill].geometry.rank_index();
        let d_id = pair.decode.ranks[link.decode].geometry.rank_index();
        let pair_key = key.for_pair(p_id, d_id).map_err(|e| e.to_string())?;
        for rank in ranks {
            match rank.side {
                SideName::Decode if rank.index == link.decode => {
                    let mut spans = Vec::with_capacity(2);
                    for space in 0..2 {
                        let at = region(slot, space);
                        let span = MemorySpan {
                            addr: rank.base(slot, space)?,
                            len: rank.kv.region_len(at).map_err(|e| e.to_string())?,
                        };
                        spans.push(span);
                    }
                    rank.route
                        .file_memory(pair_key.clone(), spans)
                        .map_err(|e| e.to_string())?;
                }
                SideName::Prefill if rank.index == link.prefill => {
                    let planner = planner_of(h, shared, l, rank, slot)?;
                    rank.route
                        .file_planner(pair_key.clone(), h.prefill_blocks.clone(), planner)
                        .map_err(|e| e.to_string())?;
                }
                SideName::Decode | SideName::Prefill => {}
            }
        }
    }
    Ok(())
}

/// Link `l`'s writes as descriptors: from P's slot memory (`own`: its KV, then its staging
/// base) into D's (`theirs`, the same way).
fn link_descriptors(h: &Handoff, l: usize, own: [u64; 2], theirs: [u64; 2]) -> Vec<Descriptor> {
    let at = |space: Space| usize::from(space == Space::Staging);
    let mut out = Vec::new();
    for t in h.plan.transfers.iter().filter(|t| t.link == l) {
        let (src, dst) = (own[at(t.src_space)], theirs[at(t.dst_space)]);
        out.extend(t.pieces.iter().map(|piece| Descriptor {
            local_addr: src + piece.src,
            remote_addr: dst + piece.dst,
            len: piece.len,
        }));
    }
    out
}

/// The planner of link `l` of request `shared` on P rank `p` (see [`file_at_post`]).
fn planner_of(
    h: &Handoff,
    shared: &Shared,
    l: usize,
    p: &Rank,
    slot: usize,
) -> Result<Planner, String> {
    let own = [p.base(slot, 0)?, p.base(slot, 1)?];
    let staging = staging_of(h, shared, l, &p.kv, region(slot, 1));
    let shared = Arc::clone(shared);
    Ok(Box::new(move |request: &RouteRequest<'_>| {
        let [kv, staging_buffer, ..] = request.remote_memory else {
            return Err(format!(
                "D named {} buffers; the plan places pieces in its KV and its staging buffer",
                request.remote_memory.len()
            ));
        };
        let descriptors = {
            let h = lock(&shared)?;
            if request.remote != &h.decode_blocks {
                return Err("D registered other blocks than this request's plan".into());
            }
            link_descriptors(&h, l, own, [kv.addr, staging_buffer.addr])
        };
        // Released first: the staging work locks the request's arenas itself.
        if let Some(staging) = staging {
            staging().map_err(|why| format!("P's staging failed: {why}"))?;
        }
        Ok(descriptors)
    }))
}
