//! The host executor: one request of a [`PairPlan`] run end to end on host memory, then
//! checked byte for byte.
//!
//! [`Handoff::prepare`] draws both sides' block ids (shuffled, non-contiguous), plans the
//! request, allocates one arena per rank and space (KV tensors laid end to end; staging), fills
//! P's blocks with the reference KV in P's geometry (junk in padding tokens and everywhere
//! else) and D's memory with junk, and remembers every KV arena. [`Handoff::run`] runs P's
//! staging jobs with `kvhandoff-kernels`, then every transfer of the request in **one**
//! [`Wire::write_all`] call, then D's staging jobs and D's tail zeroing. [`Handoff::verify`]
//! then demands that every D block of the request equal the reference in D's own geometry (its
//! layout, block size, heads and layer window) for the tokens that move, that the tail past the
//! last token be zero, and that every other byte of D's memory and all of P's be as it was.

use std::ops::Range;

use kvhandoff_kernels::KernelError;
use kvhandoff_protocol::hetero::{
    plan_request, BlockFormat, HeteroError, ModelGroup, PairPlan, RequestInput, RequestPlan,
    SideMemory, SideName, SideSpec, Space,
};
use kvhandoff_protocol::BlockIds;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use super::wire::{Arena, Piece, Transfer, Wire, WireError};
use crate::pattern::{junk, reference_row, Part};

mod pull;
mod stage;
pub mod verify;

pub use pull::{PullLink, ReadPiece};

/// What one request looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RequestShape {
    /// Prompt tokens.
    pub tokens: u64,
    /// Tokens D already holds (a whole number of D's logical blocks, below `tokens`): D lists
    /// only the rest, and P's list is end-trimmed to it.
    pub cached_tokens: u64,
    /// Seed of the block ids and the junk.
    pub seed: u64,
}

/// Why a handoff could not run (as opposed to running and delivering wrong bytes, which
/// [`Handoff::verify`] reports).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// The request's shape is unusable.
    #[error("request shape: {0}")]
    Shape(String),
    /// The planner refused the request.
    #[error("{0}")]
    Plan(#[from] HeteroError),
    /// A kernel refused a staging job.
    #[error("{side} staging job {job}: {source}")]
    Kernel {
        /// Whose job.
        side: SideName,
        /// Its index.
        job: usize,
        /// The kernel's reason.
        #[source]
        source: KernelError,
    },
    /// A staging job's result does not have the shape its plan says.
    #[error("{side} staging job {job}: {why}")]
    Stage {
        /// Whose job.
        side: SideName,
        /// Its index.
        job: usize,
        /// What differs.
        why: String,
    },
    /// An address of the plan is outside its arena.
    #[error("{what} is outside arena {arena} ({len} bytes): {start}..{end}")]
    OutOfBounds {
        /// What the address is for.
        what: &'static str,
        /// The arena's name.
        arena: String,
        /// Its length.
        len: usize,
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
    },
    /// Two pieces of the request write the same destination bytes (a head written twice).
    #[error("arena {arena}: destination bytes {first:?} and {second:?} overlap")]
    Overlap {
        /// The destination arena.
        arena: String,
        /// One range.
        first: Range<u64>,
        /// The range that overlaps it.
        second: Range<u64>,
    },
    /// The wire failed.
    #[error("wire: {0}")]
    Wire(#[from] WireError),
}

/// What one run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RunStats {
    /// Bytes the wire moved.
    pub bytes: u64,
    /// Pieces (descriptors) it posted.
    pub descriptors: usize,
    /// Transfers (one per link and pair of spaces).
    pub transfers: usize,
    /// P's staging jobs.
    pub prefill_jobs: usize,
    /// D's staging jobs.
    pub decode_jobs: usize,
    /// Staging bytes used, both sides.
    pub staging_bytes: u64,
    /// Bytes D zeroed.
    pub zeroed_bytes: u64,
}

/// One request of a pair, ready to run: its plan, its block ids and every arena.
#[derive(Debug, Clone)]
pub struct Handoff {
    /// The pair.
    pub pair: PairPlan,
    /// The request's shape.
    pub shape: RequestShape,
    /// P's logical block ids per cache group.
    pub prefill_blocks: BlockIds,
    /// D's logical block ids per cache group (its uncached suffix).
    pub decode_blocks: BlockIds,
    /// Where P's tensors are (in its KV arenas).
    pub prefill_memory: SideMemory,
    /// Where D's tensors are.
    pub decode_memory: SideMemory,
    /// The request's plan.
    pub plan: RequestPlan,
    /// Every arena: for P rank `i`, KV at `2i` and staging at `2i + 1`; then D's the same way
    /// (see [`Handoff::arena`]).
    pub arenas: Vec<Arena>,
    /// Every KV arena as it was before the run (P's, then D's), for [`Handoff::verify`].
    pub(crate) before: Vec<Vec<u8>>,
    /// Threads each kernel may use.
    pub threads: usize,
}

/// Logical block ids for one side: per group, the blocks a side holds for the request, drawn
/// from one shuffled pool (so groups sharing tensors never collide), plus the pool size.
fn draw_ids(
    pair: &PairPlan,
    spec: &SideSpec,
    shape: &RequestShape,
    decode: bool,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> (BlockIds, u32) {
    let lb = spec.logical_block();
    let blocks = shape.tokens.div_ceil(lb);
    let cached = if decode { shape.cached_tokens / lb } else { 0 };
    let counts: Vec<u64> = pair
        .model
        .groups
        .iter()
        .map(|g| match g {
            ModelGroup::Mamba { .. } => 1,
            ModelGroup::Full | ModelGroup::SlidingWindow { .. } => blocks - cached,
        })
        .collect();
    let total: u64 = counts.iter().sum();
    let pool = (2 * total + 3) as u32;
    let mut order: Vec<u32> = (0..pool).collect();
    order.shuffle(rng);
    let mut next = order.into_iter();
    let groups = counts
        .iter()
        .map(|&n| next.by_ref().take(n as usize).collect())
        .collect();
    (BlockIds { groups }, pool)
}

fn slice<'a>(
    arena: &'a Arena,
    what: &'static str,
    start: u64,
    len: u64,
) -> Result<&'a [u8], HandoffError> {
    let end = start.saturating_add(len);
    usize::try_from(start)
        .ok()
        .zip(usize::try_from(end).ok())
        .and_then(|(s, e)| arena.bytes.get(s..e))
        .ok_or_else(|| HandoffError::OutOfBounds {
            what,
            arena: arena.name.clone(),
            len: arena.bytes.len(),
            start,
            end,
        })
}

fn slice_mut<'a>(
    arena: &'a mut Arena,
    what: &'static str,
    start: u64,
    len: u64,
) -> Result<&'a mut [u8], HandoffError> {
    let end = start.saturating_add(len);
    let bad = HandoffError::OutOfBounds {
        what,
        arena: arena.name.clone(),
        len: arena.bytes.len(),
        start,
        end,
    };
    usize::try_from(start)
        .ok()
        .zip(usize::try_from(end).ok())
        .and_then(|(s, e)| arena.bytes.get_mut(s..e))
        .ok_or(bad)
}

impl Handoff {
    /// Checks that `shape` suits `pair`: tokens within the limit, a cached prefix of whole D
    /// logical blocks below the token count.
    ///
    /// # Errors
    /// [`HandoffError::Shape`] or [`HandoffError::Plan`] saying which.
    pub fn check_shape(pair: &PairPlan, shape: &RequestShape) -> Result<(), HandoffError> {
        let d_logical = pair.decode.spec.logical_block();
        if shape.tokens == 0 || shape.cached_tokens >= shape.tokens {
            return Err(HandoffError::Shape(format!(
                "{} cached of {} tokens: a request needs tokens, and D must lack some",
                shape.cached_tokens, shape.tokens
            )));
        }
        if shape.cached_tokens % d_logical != 0 {
            return Err(HandoffError::Shape(format!(
                "{} cached tokens are not a whole number of D's {d_logical}-token logical blocks",
                shape.cached_tokens
            )));
        }
        if shape.tokens > kvhandoff_protocol::hetero::MAX_REQUEST_TOKENS {
            return Err(HeteroError::TooManyTokens {
                tokens: shape.tokens,
                limit: kvhandoff_protocol::hetero::MAX_REQUEST_TOKENS,
            }
            .into());
        }
        Ok(())
    }

    /// Plans `shape` on `pair` and builds every arena (see the module documentation).
    ///
    /// # Errors
    /// [`HandoffError::Shape`] for a cached prefix that is not a whole number of D's logical
    /// blocks below the token count, [`HandoffError::Plan`] when the planner refuses.
    pub fn prepare(pair: PairPlan, shape: RequestShape) -> Result<Handoff, HandoffError> {
        Self::check_shape(&pair, &shape)?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(shape.seed);
        let (prefill_blocks, p_pool) = draw_ids(&pair, &pair.prefill.spec, &shape, false, &mut rng);
        let (decode_blocks, d_pool) = draw_ids(&pair, &pair.decode.spec, &shape, true, &mut rng);
        let prefill_memory = SideMemory::packed(&pair.prefill, p_pool)?;
        let decode_memory = SideMemory::packed(&pair.decode, d_pool)?;
        let plan = plan_request(
            &pair,
            &RequestInput {
                tokens: shape.tokens,
                prefill_blocks: &prefill_blocks,
                decode_blocks: &decode_blocks,
                prefill_memory: &prefill_memory,
                decode_memory: &decode_memory,
            },
        )?;
        let mut arenas = Vec::new();
        for (side, memory, staging, name) in [
            (&pair.prefill, &prefill_memory, &plan.prefill_staging, "P"),
            (&pair.decode, &decode_memory, &plan.decode_staging, "D"),
        ] {
            for (i, rank) in side.ranks.iter().enumerate() {
                let kv_len: u64 = rank
                    .tensors
                    .iter()
                    .filter_map(|t| kvhandoff_protocol::hetero::tensor_len(t, memory.pool_blocks))
                    .sum();
                for (space, len) in [("kv", kv_len), ("staging", staging[i].max(64))] {
                    let index = arenas.len();
                    let mut bytes = vec![0u8; len as usize];
                    junk(shape.seed, index, &mut bytes);
                    arenas.push(Arena {
                        name: format!("{name} {} {space}", rank.rank),
                        bytes,
                    });
                }
            }
        }
        let mut handoff = Handoff {
            pair,
            shape,
            prefill_blocks,
            decode_blocks,
            prefill_memory,
            decode_memory,
            plan,
            arenas,
            before: Vec::new(),
            threads: 1,
        };
        handoff.fill_prefill();
        handoff.before = handoff
            .kv_arenas()
            .map(|i| handoff.arenas[i].bytes.clone())
            .collect();
        Ok(handoff)
    }

    /// The index in [`Handoff::arenas`] of a rank's KV or staging arena.
    pub fn arena(&self, side: SideName, rank: usize, space: Space) -> usize {
        let base = match side {
            SideName::Prefill => 0,
            SideName::Decode => 2 * self.pair.prefill.ranks.len(),
        };
        base + 2 * rank + usize::from(space == Space::Staging)
    }

    /// The indices of every KV arena, P's then D's.
    pub fn kv_arenas(&self) -> impl Iterator<Item = usize> {
        let ranks = self.pair.prefill.ranks.len() + self.pair.decode.ranks.len();
        (0..ranks).map(|i| 2 * i)
    }

    /// Writes the reference KV into every P block of the request, in P's geometry.
    fn fill_prefill(&mut self) {
        let n = self.shape.tokens;
        let model = self.pair.model;
        let spec = self.pair.prefill.spec;
        let row = model.row_bytes() as usize;
        let mut buf = vec![0u8; row.max(1)];
        for (ri, rank) in self.pair.prefill.ranks.iter().enumerate() {
            let arena = self.arena(SideName::Prefill, ri, Space::Kv);
            let base_of = &self.prefill_memory.ranks[ri].tensor_bases;
            for region in &rank.regions {
                let tensor = &rank.tensors[region.tensor];
                let base = base_of[region.tensor];
                let list = &self.prefill_blocks.groups[region.group];
                let bytes = &mut self.arenas[arena].bytes;
                let Some(part) = Part::of(region.kind) else {
                    let Some(&slot) = list.last() else { continue };
                    let at = base + u64::from(slot) * tensor.block_len;
                    fill_state(&model, region.layer, &rank.state_heads, at, bytes);
                    continue;
                };
                let lb = spec.logical_block();
                let first = (n.div_ceil(lb) - list.len() as u64) * lb;
                let format = BlockFormat {
                    tokens: spec.block,
                    heads: rank.block_heads(),
                    layout: spec.layout,
                };
                for (j, &id) in list.iter().enumerate() {
                    for k in 0..u64::from(spec.kbpl) {
                        let block =
                            base + (u64::from(id) * u64::from(spec.kbpl) + k) * tensor.block_len;
                        let origin =
                            first + (j as u64 * u64::from(spec.kbpl) + k) * u64::from(spec.block);
                        for t in 0..u64::from(spec.block) {
                            if origin + t >= n {
                                break;
                            }
                            for h in 0..rank.block_heads() {
                                let global = rank.heads.start + h;
                                reference_row(region.layer, part, global, origin + t, &mut buf);
                                let at =
                                    (block + format.row_offset(t, h.into(), row as u64)) as usize;
                                bytes[at..at + row].copy_from_slice(&buf);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every transfer of the request, as the wire takes them (arena indices and offsets).
    pub fn wire_transfers(&self) -> Vec<Transfer> {
        self.plan
            .transfers
            .iter()
            .map(|t| {
                let link = &self.pair.links[t.link];
                Transfer {
                    src: self.arena(SideName::Prefill, link.prefill, t.src_space),
                    dst: self.arena(SideName::Decode, link.decode, t.dst_space),
                    pieces: t
                        .pieces
                        .iter()
                        .map(|p| Piece {
                            src_offset: p.src,
                            dst_offset: p.dst,
                            len: p.len,
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// Runs the request: P's staging jobs, one [`Wire::write_all`] with every transfer, D's
    /// staging jobs, D's tail zeroing.
    ///
    /// # Errors
    /// A [`HandoffError`] when a job, a range or the wire fails; the arenas may then hold
    /// anything.
    pub fn run(&mut self, wire: &mut dyn Wire) -> Result<RunStats, HandoffError> {
        self.run_prefill_jobs()?;
        let transfers = self.wire_transfers();
        check_no_overlap(&self.arenas, &transfers)?;
        wire.write_all(&mut self.arenas, &transfers)?;
        self.run_decode_side()
    }

    /// P's half before the wire: its staging jobs (the transforms the plan runs on P).
    ///
    /// # Errors
    /// A [`HandoffError`] when a job or a range fails.
    pub fn run_prefill_jobs(&mut self) -> Result<(), HandoffError> {
        let jobs = std::mem::take(&mut self.plan.prefill_jobs);
        let result = jobs
            .iter()
            .enumerate()
            .try_for_each(|(i, job)| self.prefill_job(i, job));
        self.plan.prefill_jobs = jobs;
        result
    }

    /// P's staging jobs of one link only (what P runs when that link's D rank registered),
    /// and where they wrote: `(staging offset, length)` per output block, in P's staging arena
    /// of the link's P rank.
    ///
    /// # Errors
    /// A [`HandoffError`] when a job or a range fails.
    pub fn run_prefill_jobs_of_link(
        &mut self,
        link: usize,
    ) -> Result<Vec<(u64, u64)>, HandoffError> {
        let jobs = std::mem::take(&mut self.plan.prefill_jobs);
        let mut written = Vec::new();
        let result = jobs
            .iter()
            .enumerate()
            .filter(|(_, job)| job.link == link)
            .try_for_each(|(i, job)| {
                self.prefill_job(i, job)?;
                let len = job.output.block_len();
                written.extend(job.output.addrs.iter().map(|&addr| (addr, len)));
                Ok(())
            });
        self.plan.prefill_jobs = jobs;
        result.map(|()| written)
    }

    /// D's half after the wire landed: its staging jobs and its tail zeroing; the run's stats.
    ///
    /// # Errors
    /// A [`HandoffError`] when a job or a range fails.
    pub fn run_decode_side(&mut self) -> Result<RunStats, HandoffError> {
        self.run_decode_side_of(None)
    }

    /// D's half for the D ranks (indices in the pair's D side) in `only`, or for every one:
    /// what a process that holds some of D's ranks runs.
    ///
    /// # Errors
    /// As [`Handoff::run_decode_side`].
    pub fn run_decode_side_of(&mut self, only: Option<&[usize]>) -> Result<RunStats, HandoffError> {
        let plan = self.plan.clone();
        let mine = |rank: usize| only.is_none_or(|ranks| ranks.contains(&rank));
        for (i, job) in plan.decode_jobs.iter().enumerate() {
            if mine(job.rank) {
                self.decode_job(i, job)?;
            }
        }
        let mut zeroed = 0;
        for z in plan.zero.iter().filter(|z| mine(z.rank)) {
            let arena = self.arena(SideName::Decode, z.rank, Space::Kv);
            slice_mut(&mut self.arenas[arena], "a tail to zero", z.addr, z.len)?.fill(0);
            zeroed += z.len;
        }
        Ok(RunStats {
            bytes: plan.bytes(),
            descriptors: plan.descriptors(),
            transfers: plan.transfers.len(),
            prefill_jobs: plan.prefill_jobs.len(),
            decode_jobs: plan.decode_jobs.len(),
            staging_bytes: plan
                .prefill_staging
                .iter()
                .chain(&plan.decode_staging)
                .sum(),
            zeroed_bytes: zeroed,
        })
    }

    /// Refuses a request whose pieces write any destination byte twice.
    ///
    /// # Errors
    /// [`HandoffError::Overlap`] naming the first two.
    pub fn check_no_overlap(&self) -> Result<(), HandoffError> {
        check_no_overlap(&self.arenas, &self.wire_transfers())
    }

    /// Checks every byte (see the module documentation).
    ///
    /// # Errors
    /// The first wrong byte, located and explained, with the count of wrong bytes.
    pub fn verify(&self) -> Result<(), verify::Mismatch> {
        verify::verify(self, None)
    }

    /// As [`Handoff::verify`], for the ranks in `only` (side, index in its side): what a
    /// process that holds those ranks can check.
    ///
    /// # Errors
    /// As [`Handoff::verify`].
    pub fn verify_ranks(&self, only: &[(SideName, usize)]) -> Result<(), verify::Mismatch> {
        verify::verify(self, Some(only))
    }
}

/// Refuses a request whose pieces write any destination byte twice.
fn check_no_overlap(arenas: &[Arena], transfers: &[Transfer]) -> Result<(), HandoffError> {
    let mut ranges: Vec<(usize, u64, u64)> = transfers
        .iter()
        .flat_map(|t| {
            t.pieces
                .iter()
                .map(move |p| (t.dst, p.dst_offset, p.dst_offset.saturating_add(p.len)))
        })
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            return Err(HandoffError::Overlap {
                arena: arenas
                    .get(w[0].0)
                    .map_or_else(String::new, |a| a.name.clone()),
                first: w[0].1..w[0].2,
                second: w[1].1..w[1].2,
            });
        }
    }
    Ok(())
}

/// Writes the reference state of `layer` for `heads` into the slot at `at`: every head's conv
/// state, then every head's SSM state.
fn fill_state(
    model: &kvhandoff_protocol::hetero::Model,
    layer: u32,
    heads: &Range<u32>,
    at: u64,
    bytes: &mut [u8],
) {
    let Some((_, conv, ssm)) = model.mamba() else {
        return;
    };
    let count = u64::from(heads.end - heads.start);
    for (j, h) in heads.clone().enumerate() {
        let c = (at + j as u64 * conv) as usize;
        reference_row(layer, Part::Conv, h, 0, &mut bytes[c..c + conv as usize]);
        let s = (at + count * conv + j as u64 * ssm) as usize;
        reference_row(layer, Part::Ssm, h, 0, &mut bytes[s..s + ssm as usize]);
    }
}
