//! The walk over a request's links that emits P's staging jobs, the wire's pieces and what
//! D's staging receives; then D's jobs and D's tail zeroing.

use std::collections::BTreeMap;
use std::ops::Range;

use super::super::rows::{copy_rows, BlockRun, Merger};
use super::super::transforms::{BlockFormat, StageOp};
use super::super::{HeteroError, PairPlan, RankLayout};
use super::{
    DecodeJob, GroupSpan, PrefillJob, RankMemory, RequestInput, Space, Transfer, ZeroRange,
};
use crate::geometry::RegionKind;

/// The kernel blocks of `region` holding the logical ids `ids`, from `first_token`.
fn native_run(
    pair: &PairPlan,
    rank: &RankLayout,
    memory: &RankMemory,
    region: usize,
    ids: &[u32],
    first_token: u64,
) -> BlockRun {
    let r = &rank.regions[region];
    let tensor = &rank.tensors[r.tensor];
    let base = memory.tensor_bases[r.tensor];
    let kbpl = u64::from(tensor.blocks_per_logical);
    let mut addrs = Vec::with_capacity(ids.len() * kbpl as usize);
    for &id in ids {
        for k in 0..kbpl {
            addrs.push(base + (u64::from(id) * kbpl + k) * tensor.block_len);
        }
    }
    BlockRun {
        addrs,
        first_token,
        format: BlockFormat {
            tokens: rank.kernel_block(),
            heads: rank.block_heads(),
            layout: rank.layout(),
        },
        row: pair.model.row_bytes(),
    }
}

/// Staging space handed out in order, per rank.
struct StagingAlloc {
    used: Vec<u64>,
}

impl StagingAlloc {
    fn take(
        &mut self,
        rank: usize,
        base: u64,
        blocks: u64,
        first_token: u64,
        format: BlockFormat,
        row: u64,
    ) -> Result<BlockRun, HeteroError> {
        let overflow = HeteroError::Overflow {
            what: "staging space",
        };
        let len = format
            .block_bytes(row)
            .and_then(|b| b.checked_mul(blocks))
            .ok_or(overflow.clone())?;
        let at = self.used[rank];
        let end = at.checked_add(len).ok_or(overflow.clone())?;
        base.checked_add(end).ok_or(overflow.clone())?;
        self.used[rank] = end;
        BlockRun::contiguous(base + at, blocks, first_token, format, row).ok_or(overflow)
    }
}

/// What D's staging received for one region: (D-local heads, the staging area, D's blocks,
/// the first token that moves), per writer.
type Landed = Vec<(Range<u32>, BlockRun, BlockRun, u64)>;

/// What a finished walk produced.
pub(super) struct Walked {
    pub prefill_jobs: Vec<PrefillJob>,
    pub transfers: Vec<Transfer>,
    pub decode_jobs: Vec<DecodeJob>,
    pub prefill_staging: Vec<u64>,
    pub decode_staging: Vec<u64>,
}

pub(super) struct Walk<'a> {
    pair: &'a PairPlan,
    input: &'a RequestInput<'a>,
    groups: &'a [Option<GroupSpan>],
    p_staging: StagingAlloc,
    d_staging: StagingAlloc,
    prefill_jobs: Vec<PrefillJob>,
    mergers: BTreeMap<(usize, Space, Space), Merger>,
    landed: BTreeMap<(usize, u32, RegionKind), Landed>,
}

impl<'a> Walk<'a> {
    pub(super) fn new(
        pair: &'a PairPlan,
        input: &'a RequestInput<'a>,
        groups: &'a [Option<GroupSpan>],
    ) -> Walk<'a> {
        Walk {
            pair,
            input,
            groups,
            p_staging: StagingAlloc {
                used: vec![0; pair.prefill.ranks.len()],
            },
            d_staging: StagingAlloc {
                used: vec![0; pair.decode.ranks.len()],
            },
            prefill_jobs: Vec::new(),
            mergers: BTreeMap::new(),
            landed: BTreeMap::new(),
        }
    }

    /// P's jobs, the transfers, D's jobs and each side's staging bytes per rank.
    pub(super) fn finish(mut self) -> Walked {
        let decode_jobs = self.decode_jobs();
        let transfers = std::mem::take(&mut self.mergers)
            .into_iter()
            .filter(|(_, m)| !m.pieces.is_empty())
            .map(|((link, src_space, dst_space), m)| Transfer {
                link,
                src_space,
                dst_space,
                bytes: m.bytes,
                pieces: m.pieces,
            })
            .collect();
        Walked {
            prefill_jobs: self.prefill_jobs,
            transfers,
            decode_jobs,
            prefill_staging: self.p_staging.used,
            decode_staging: self.d_staging.used,
        }
    }

    pub(super) fn link(&mut self, li: usize) -> Result<(), HeteroError> {
        let pair = self.pair;
        let link = &pair.links[li];
        let (p, d) = (
            &pair.prefill.ranks[link.prefill],
            &pair.decode.ranks[link.decode],
        );
        let (pm, dm) = (
            &self.input.prefill_memory.ranks[link.prefill],
            &self.input.decode_memory.ranks[link.decode],
        );
        let row = pair.model.row_bytes();
        let missing = HeteroError::Inconsistent {
            what: "a link names a region its rank does not hold",
        };
        for layer in link.layers.clone() {
            let g = pair.model.group_of(layer);
            let Some(span) = &self.groups[g] else {
                continue;
            };
            if !pair.model.groups[g].is_attention() {
                let Some(state) = &link.state else { continue };
                let (Some(pr), Some(dr)) = (
                    p.region(layer, RegionKind::State),
                    d.region(layer, RegionKind::State),
                ) else {
                    return Err(missing);
                };
                let slot = |rank: &RankLayout, mem: &RankMemory, r: usize, id: u32| {
                    let t = rank.regions[r].tensor;
                    mem.tensor_bases[t] + u64::from(id) * rank.tensors[t].block_len
                };
                let ps = slot(p, pm, pr, span.prefill[0]);
                let ds = slot(d, dm, dr, span.decode[0]);
                let m = self.mergers.entry((li, Space::Kv, Space::Kv)).or_default();
                m.cut();
                for bytes in [&state.conv, &state.ssm] {
                    let len = bytes.prefill.end - bytes.prefill.start;
                    m.push(ps + bytes.prefill.start, ds + bytes.decode.start, len)?;
                }
                continue;
            }
            let Some(heads) = &link.heads else { continue };
            let kinds: &[RegionKind] = if pair.model.mla {
                &[RegionKind::Latent]
            } else {
                &[RegionKind::Key, RegionKind::Value]
            };
            for &kind in kinds {
                let (Some(pr), Some(dr)) = (p.region(layer, kind), d.region(layer, kind)) else {
                    return Err(missing.clone());
                };
                let p_run = native_run(pair, p, pm, pr, &span.prefill, span.prefill_first_token);
                let d_run = native_run(pair, d, dm, dr, &span.decode, span.decode_first_token);
                let start = span.tokens.start;
                let (src, src_head, src_space) = match &pair.pipeline.prefill_stage {
                    Some(stage) => {
                        let k = u64::from(p_run.format.tokens);
                        let skip = ((start - p_run.first_token) / k) as usize;
                        let input = BlockRun {
                            addrs: p_run.addrs[skip..].to_vec(),
                            first_token: p_run.first_token + skip as u64 * k,
                            ..p_run
                        };
                        let (first, blocks) = stage.ops.iter().fold(
                            (input.first_token, input.addrs.len() as u64),
                            |(f, b), op| op.span(f, b),
                        );
                        let output = self.p_staging.take(
                            link.prefill,
                            pm.staging_base,
                            blocks,
                            first,
                            stage.output,
                            row,
                        )?;
                        self.prefill_jobs.push(PrefillJob {
                            link: li,
                            rank: link.prefill,
                            layer,
                            kind,
                            input,
                            heads: heads.prefill_local.clone(),
                            ops: stage.ops.clone(),
                            output: output.clone(),
                        });
                        (output, 0, Space::Staging)
                    }
                    None => (p_run, heads.prefill_local.start, Space::Kv),
                };
                let (dst, dst_head, dst_space) = match &pair.pipeline.decode_stage {
                    Some(stage) => {
                        let k = u64::from(stage.input.tokens);
                        let first = start / k * k;
                        let end = src.end_token().min(d_run.end_token());
                        let blocks = (end - first).div_ceil(k);
                        let area = self.d_staging.take(
                            link.decode,
                            dm.staging_base,
                            blocks,
                            first,
                            stage.input,
                            row,
                        )?;
                        self.landed
                            .entry((link.decode, layer, kind))
                            .or_default()
                            .push((heads.decode_local.clone(), area.clone(), d_run, start));
                        (area, 0, Space::Staging)
                    }
                    None => (d_run, heads.decode_local.start, Space::Kv),
                };
                let tokens = start..src.end_token().min(dst.end_token());
                let m = self.mergers.entry((li, src_space, dst_space)).or_default();
                // A piece never spans two regions (two registrations).
                m.cut();
                copy_rows(
                    &src,
                    src_head,
                    &dst,
                    dst_head,
                    tokens,
                    pair.pipeline.link_heads,
                    m,
                )?;
            }
        }
        Ok(())
    }

    fn decode_jobs(&mut self) -> Vec<DecodeJob> {
        let Some(stage) = &self.pair.pipeline.decode_stage else {
            return Vec::new();
        };
        let gather = stage.ops.contains(&StageOp::GatherHeads);
        let mut jobs = Vec::new();
        for ((rank, layer, kind), mut landed) in std::mem::take(&mut self.landed) {
            landed.sort_by_key(|(heads, ..)| heads.start);
            let job = |sources: Vec<BlockRun>, heads: Range<u32>, output: &BlockRun, start| {
                let end = sources
                    .iter()
                    .map(BlockRun::end_token)
                    .min()
                    .unwrap_or(start)
                    .min(output.end_token());
                DecodeJob {
                    rank,
                    layer,
                    kind,
                    sources,
                    ops: stage.ops.clone(),
                    tokens: start..end.max(start),
                    heads,
                    output: output.clone(),
                }
            };
            if gather {
                let Some((_, _, output, start)) = landed.first() else {
                    continue;
                };
                let heads =
                    landed.first().map_or(0, |l| l.0.start)..landed.last().map_or(0, |l| l.0.end);
                let sources = landed.iter().map(|l| l.1.clone()).collect();
                jobs.push(job(sources, heads, output, *start));
            } else {
                for (heads, area, output, start) in &landed {
                    jobs.push(job(vec![area.clone()], heads.clone(), output, *start));
                }
            }
        }
        jobs
    }
}

/// The tail of D's last logical block in every attention region: tokens `n..` of it.
pub(super) fn zero_ranges(
    pair: &PairPlan,
    input: &RequestInput<'_>,
    groups: &[Option<GroupSpan>],
) -> Result<Vec<ZeroRange>, HeteroError> {
    let n = input.tokens;
    let mut out = Vec::new();
    for (di, d) in pair.decode.ranks.iter().enumerate() {
        let dm = &input.decode_memory.ranks[di];
        for (r, region) in d.regions.iter().enumerate() {
            if !pair.model.groups[region.group].is_attention() {
                continue;
            }
            let Some(span) = &groups[region.group] else {
                continue;
            };
            let run = native_run(pair, d, dm, r, &span.decode, span.decode_first_token);
            if run.end_token() <= n {
                continue;
            }
            let mut m = Merger::default();
            let heads = run.format.heads;
            copy_rows(&run, 0, &run, 0, n..run.end_token(), heads, &mut m)?;
            out.extend(m.pieces.into_iter().map(|p| ZeroRange {
                rank: di,
                addr: p.dst,
                len: p.len,
            }));
        }
    }
    Ok(out)
}
