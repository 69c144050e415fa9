//! One request between a planned pair: which tokens of each cache group move (sliding-window
//! clipping, the prefix-cache end trim), the staging passes, the wire's pieces per link, and
//! the tail D zeroes.
//!
//! Block lists are *logical* ids, one list per cache group, in token order and tail-aligned:
//! the last id holds the request's last token. D lists only its uncached suffix, so a list
//! shorter than the request's blocks means D holds the first tokens already (a prefix hit),
//! and P's list is end-trimmed to the blocks that hold the tokens D lacks. A sliding-window
//! group keeps only its last `⌈window / logical block⌉ + 1` blocks on each side; the tokens
//! both sides keep move. A mamba group moves its last slot (the state after the prompt).

mod walk;

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Serialize;

use super::rows::{BlockRun, Piece};
use super::transforms::StageOp;
use super::{
    HeteroError, ModelGroup, PairPlan, SideLayout, SideName, Tensor, MAX_POOL_BLOCKS,
    MAX_REQUEST_TOKENS,
};
use crate::geometry::RegionKind;
use crate::message::BlockIds;
use walk::{zero_ranges, Walk};

/// Where one rank's memory is: the base address of each of its tensors (in
/// [`RankLayout::tensors`](super::RankLayout::tensors) order) and of its staging buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct RankMemory {
    /// Base address of each tensor.
    pub tensor_bases: Vec<u64>,
    /// Base address of the rank's staging buffer (as large as [`RequestPlan`] asks).
    pub staging_base: u64,
}

/// Where one side's memory is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct SideMemory {
    /// Logical blocks in the side's pool (every tensor holds this many logical blocks).
    pub pool_blocks: u32,
    /// Each rank's memory, in [`SideLayout::ranks`] order.
    pub ranks: Vec<RankMemory>,
}

/// Bytes of a tensor holding `pool_blocks` logical blocks.
pub fn tensor_len(tensor: &Tensor, pool_blocks: u32) -> Option<u64> {
    u64::from(pool_blocks)
        .checked_mul(u64::from(tensor.blocks_per_logical))?
        .checked_mul(tensor.block_len)
}

impl SideMemory {
    /// Every rank's tensors laid end to end from address 0, staging at address 0 of a
    /// separate space (what the host executor allocates: one arena per rank and space).
    ///
    /// # Errors
    /// [`HeteroError::Memory`] for a pool of zero or above [`MAX_POOL_BLOCKS`],
    /// [`HeteroError::Overflow`] when a rank's tensors do not fit in 64 bits.
    pub fn packed(side: &SideLayout, pool_blocks: u32) -> Result<SideMemory, HeteroError> {
        check_pool(side.side, pool_blocks)?;
        let mut ranks = Vec::with_capacity(side.ranks.len());
        for rank in &side.ranks {
            let mut at = 0u64;
            let mut tensor_bases = Vec::with_capacity(rank.tensors.len());
            for tensor in &rank.tensors {
                tensor_bases.push(at);
                at = tensor_len(tensor, pool_blocks)
                    .and_then(|len| at.checked_add(len))
                    .ok_or(HeteroError::Overflow {
                        what: "rank memory",
                    })?;
            }
            ranks.push(RankMemory {
                tensor_bases,
                staging_base: 0,
            });
        }
        Ok(SideMemory { pool_blocks, ranks })
    }
}

/// One request between the pair's engines.
#[derive(Debug, Clone, Copy)]
pub struct RequestInput<'a> {
    /// Tokens of the prompt P prefilled.
    pub tokens: u64,
    /// P's logical block ids per cache group (tail-aligned; the planner end-trims and clips).
    pub prefill_blocks: &'a BlockIds,
    /// D's logical block ids per cache group: its uncached suffix (tail-aligned).
    pub decode_blocks: &'a BlockIds,
    /// P's memory.
    pub prefill_memory: &'a SideMemory,
    /// D's memory.
    pub decode_memory: &'a SideMemory,
}

/// Which memory of a rank an address is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Space {
    /// The rank's registered KV tensors.
    Kv,
    /// The rank's staging buffer.
    Staging,
}

/// Every piece one link moves from one space of its P rank to one space of its D rank (one
/// NIXL transfer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Transfer {
    /// Index of the link in [`PairPlan::links`].
    pub link: usize,
    /// The P rank's space the pieces read.
    pub src_space: Space,
    /// The D rank's space the pieces write.
    pub dst_space: Space,
    /// The pieces, merged where contiguous on both sides (each one NIXL descriptor).
    pub pieces: Vec<Piece>,
    /// Bytes moved.
    pub bytes: u64,
}

/// The tokens of one cache group that move, and the blocks that hold them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupSpan {
    /// The tokens that move (for a mamba group, the whole prompt: its state).
    pub tokens: Range<u64>,
    /// P's logical ids used (end-trimmed / clipped; one slot for mamba).
    pub prefill: Vec<u32>,
    /// Token of the first of P's used blocks.
    pub prefill_first_token: u64,
    /// D's logical ids written (clipped; one slot for mamba).
    pub decode: Vec<u32>,
    /// Token of the first of D's written blocks.
    pub decode_first_token: u64,
}

/// P's staging pass for one link and one region: `input` (P's blocks) through `ops` into
/// `output` (P's staging, which the wire reads).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefillJob {
    /// The link.
    pub link: usize,
    /// The P rank.
    pub rank: usize,
    /// Global layer.
    pub layer: u32,
    /// Part of the layer.
    pub kind: RegionKind,
    /// P's kernel blocks from the one holding the first token that moves.
    pub input: BlockRun,
    /// The link's heads in P's block (what [`StageOp::SliceHeads`] keeps).
    pub heads: Range<u32>,
    /// The ops.
    pub ops: Vec<StageOp>,
    /// The staging blocks it fills (contiguous; span from [`StageOp::span`]).
    pub output: BlockRun,
}

/// D's staging pass for one region: its writers' staging (`sources`, in head order) through
/// `ops`, then the rows of `tokens` into heads `heads` of D's blocks `output`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecodeJob {
    /// The D rank.
    pub rank: usize,
    /// Global layer.
    pub layer: u32,
    /// Part of the layer.
    pub kind: RegionKind,
    /// Staging areas the wire filled, one per writer in head order (one without a gather).
    pub sources: Vec<BlockRun>,
    /// The ops.
    pub ops: Vec<StageOp>,
    /// Tokens whose rows are copied into D's blocks (rows before are left as they were).
    pub tokens: Range<u64>,
    /// D's block heads the result covers.
    pub heads: Range<u32>,
    /// D's blocks.
    pub output: BlockRun,
}

/// Bytes D zeroes after the write (the tail of its last logical block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ZeroRange {
    /// The D rank.
    pub rank: usize,
    /// Address in its KV space.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// Everything one request does, in order: P's jobs, the transfers (one wire call), D's jobs,
/// D's zeroing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestPlan {
    /// Tokens of the request.
    pub tokens: u64,
    /// Per cache group, what moves (none: D lists no block of it).
    pub groups: Vec<Option<GroupSpan>>,
    /// P's staging passes.
    pub prefill_jobs: Vec<PrefillJob>,
    /// The wire's transfers.
    pub transfers: Vec<Transfer>,
    /// D's staging passes.
    pub decode_jobs: Vec<DecodeJob>,
    /// D's tail zeroing.
    pub zero: Vec<ZeroRange>,
    /// Staging bytes each P rank needs.
    pub prefill_staging: Vec<u64>,
    /// Staging bytes each D rank needs.
    pub decode_staging: Vec<u64>,
}

impl RequestPlan {
    /// Bytes the wire moves.
    pub fn bytes(&self) -> u64 {
        self.transfers.iter().map(|t| t.bytes).sum()
    }

    /// Pieces (NIXL descriptors) the wire posts.
    pub fn descriptors(&self) -> usize {
        self.transfers.iter().map(|t| t.pieces.len()).sum()
    }

    /// Pieces and bytes of one link.
    pub fn link_totals(&self, link: usize) -> (usize, u64) {
        self.transfers
            .iter()
            .filter(|t| t.link == link)
            .fold((0, 0), |(n, b), t| (n + t.pieces.len(), b + t.bytes))
    }
}

fn check_pool(side: SideName, pool_blocks: u32) -> Result<(), HeteroError> {
    if pool_blocks == 0 || pool_blocks > MAX_POOL_BLOCKS {
        return Err(HeteroError::Memory {
            side,
            why: format!("a pool of {pool_blocks} blocks is not in 1..={MAX_POOL_BLOCKS}"),
        });
    }
    Ok(())
}

fn check_memory(side: &SideLayout, memory: &SideMemory) -> Result<(), HeteroError> {
    let name = side.side;
    check_pool(name, memory.pool_blocks)?;
    if memory.ranks.len() != side.ranks.len() {
        return Err(HeteroError::Memory {
            side: name,
            why: format!(
                "{} ranks described, the side has {}",
                memory.ranks.len(),
                side.ranks.len()
            ),
        });
    }
    for (rank, mem) in side.ranks.iter().zip(&memory.ranks) {
        if mem.tensor_bases.len() != rank.tensors.len() {
            return Err(HeteroError::Memory {
                side: name,
                why: format!(
                    "rank {} lists {} tensor bases, it registers {} tensors",
                    rank.rank,
                    mem.tensor_bases.len(),
                    rank.tensors.len()
                ),
            });
        }
        for (tensor, &base) in rank.tensors.iter().zip(&mem.tensor_bases) {
            tensor_len(tensor, memory.pool_blocks)
                .and_then(|len| base.checked_add(len))
                .ok_or(HeteroError::Overflow {
                    what: "a tensor's end address",
                })?;
        }
    }
    Ok(())
}

fn check_ids(
    pair: &PairPlan,
    side: SideName,
    ids: &BlockIds,
    pool: u32,
) -> Result<(), HeteroError> {
    let model = &pair.model;
    if ids.groups.len() != model.groups.len() {
        return Err(HeteroError::GroupCount {
            side,
            given: ids.groups.len(),
            expected: model.groups.len(),
        });
    }
    // The group that last used each id in each family of tensors (attention groups share one
    // family when the model shares tensors).
    let mut seen: BTreeMap<(usize, u32), usize> = BTreeMap::new();
    for (g, list) in ids.groups.iter().enumerate() {
        let family = if model.shared_tensors && model.groups[g].is_attention() {
            usize::MAX
        } else {
            g
        };
        for &block in list {
            if block >= pool {
                return Err(HeteroError::BlockOutOfRange {
                    side,
                    group: g,
                    block,
                    pool,
                });
            }
            if let Some(first) = seen.insert((family, block), g) {
                return Err(HeteroError::DuplicateBlock {
                    side,
                    block,
                    first,
                    second: g,
                });
            }
        }
    }
    Ok(())
}

/// The span of group `g`, or `None` when D lists no block of it.
fn group_span(
    pair: &PairPlan,
    g: usize,
    n: u64,
    p_list: &[u32],
    d_list: &[u32],
) -> Result<Option<GroupSpan>, HeteroError> {
    if d_list.is_empty() {
        return Ok(None);
    }
    let window = match pair.model.groups[g] {
        ModelGroup::Full => None,
        ModelGroup::SlidingWindow { window_tokens } => Some(u64::from(window_tokens)),
        ModelGroup::Mamba { .. } => {
            let (Some(&p), Some(&d)) = (p_list.last(), d_list.last()) else {
                return Err(HeteroError::NotCovered {
                    group: g,
                    needed_from: 0,
                    covered_from: n,
                });
            };
            return Ok(Some(GroupSpan {
                tokens: 0..n,
                prefill: vec![p],
                prefill_first_token: 0,
                decode: vec![d],
                decode_first_token: 0,
            }));
        }
    };
    let (lp, ld) = (
        pair.prefill.spec.logical_block(),
        pair.decode.spec.logical_block(),
    );
    let (nb_p, nb_d) = (n.div_ceil(lp), n.div_ceil(ld));
    for (side, len, max) in [
        (SideName::Prefill, p_list.len(), nb_p),
        (SideName::Decode, d_list.len(), nb_d),
    ] {
        if len as u64 > max {
            return Err(HeteroError::ListTooLong {
                side,
                group: g,
                len,
                max,
            });
        }
    }
    let keep = |len: usize, block: u64| match window {
        Some(w) => (len as u64).min(w.div_ceil(block) + 1),
        None => len as u64,
    };
    let (keep_p, keep_d) = (keep(p_list.len(), lp), keep(d_list.len(), ld));
    let p_first = (nb_p - keep_p) * lp;
    let d_first = (nb_d - keep_d) * ld;
    let needed_from = match window {
        Some(w) => d_first.max(n.saturating_sub(w)),
        None => d_first,
    };
    if p_first > needed_from {
        return Err(HeteroError::NotCovered {
            group: g,
            needed_from,
            covered_from: p_first,
        });
    }
    let start = d_first.max(p_first);
    let p_used_first = start / lp;
    let p_skip = (p_used_first - (nb_p - keep_p)) as usize;
    let p_from = p_list.len() - keep_p as usize + p_skip;
    Ok(Some(GroupSpan {
        tokens: start..n,
        prefill: p_list[p_from..].to_vec(),
        prefill_first_token: p_used_first * lp,
        decode: d_list[d_list.len() - keep_d as usize..].to_vec(),
        decode_first_token: d_first,
    }))
}

/// Plans one request between the pair's engines: see the module documentation.
///
/// # Errors
/// A [`HeteroError`] for a request that cannot be planned (token count, block lists, memory);
/// nothing is planned then.
pub fn plan_request(pair: &PairPlan, input: &RequestInput<'_>) -> Result<RequestPlan, HeteroError> {
    let n = input.tokens;
    if n == 0 {
        return Err(HeteroError::NoTokens);
    }
    if n > MAX_REQUEST_TOKENS {
        return Err(HeteroError::TooManyTokens {
            tokens: n,
            limit: MAX_REQUEST_TOKENS,
        });
    }
    check_memory(&pair.prefill, input.prefill_memory)?;
    check_memory(&pair.decode, input.decode_memory)?;
    check_ids(
        pair,
        SideName::Prefill,
        input.prefill_blocks,
        input.prefill_memory.pool_blocks,
    )?;
    check_ids(
        pair,
        SideName::Decode,
        input.decode_blocks,
        input.decode_memory.pool_blocks,
    )?;
    let mut groups = Vec::with_capacity(pair.model.groups.len());
    for g in 0..pair.model.groups.len() {
        groups.push(group_span(
            pair,
            g,
            n,
            &input.prefill_blocks.groups[g],
            &input.decode_blocks.groups[g],
        )?);
    }
    let mut walk = Walk::new(pair, input, &groups);
    for li in 0..pair.links.len() {
        walk.link(li)?;
    }
    let walked = walk.finish();
    let zero = zero_ranges(pair, input, &groups)?;
    Ok(RequestPlan {
        tokens: n,
        groups,
        prefill_jobs: walked.prefill_jobs,
        transfers: walked.transfers,
        decode_jobs: walked.decode_jobs,
        zero,
        prefill_staging: walked.prefill_staging,
        decode_staging: walked.decode_staging,
    })
}

#[cfg(test)]
mod tests;
