//! `kvhandoff plan`'s report: a pair's plan and one example request's plan (contiguous block
//! ids), per P rank its targets with their byte ranges, descriptor counts and transforms; or
//! why the pair cannot work.

use std::fmt::Write as _;
use std::ops::Range;

use kvhandoff_protocol::hetero::{
    model, plan_pair, plan_request, HeadLink, HeteroError, PairPlan, Piece, RankId, RequestInput,
    RequestPlan, SideMemory, SideName, SideSpec, Space, Stage, StateLink, StridedBytes, Transform,
};
use kvhandoff_protocol::BlockIds;
use serde::Serialize;

use super::handoff::{Handoff, HandoffError, RequestShape};
use super::vllm::vllm_verdict;
use super::wire::MemoryWire;

/// Why `kvhandoff plan` has no plan to show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanReportError {
    /// The model, a spec or the pair is impossible, or the example request cannot be planned.
    #[error("{0}")]
    Hetero(#[from] HeteroError),
    /// The example request's shape is unusable, or (with `--verify`) its run failed.
    #[error("{0}")]
    Handoff(#[from] HandoffError),
    /// The verification run delivered a wrong byte.
    #[error("verification failed: {0}")]
    Verify(String),
}

/// Where a link's heads lie in one kernel block of each side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeadBytes {
    /// In P's block.
    pub prefill: StridedBytes,
    /// In D's block.
    pub decode: StridedBytes,
}

/// One transfer of the example request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferReport {
    /// P's space read.
    pub src_space: Space,
    /// D's space written.
    pub dst_space: Space,
    /// Descriptors.
    pub descriptors: usize,
    /// Bytes.
    pub bytes: u64,
    /// The first pieces (addresses in each rank's space).
    pub first_pieces: Vec<Piece>,
}

/// One D rank a P rank writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetReport {
    /// The D rank.
    pub decode_rank: RankId,
    /// Global layers written.
    pub layers: Range<u32>,
    /// Attention heads written.
    pub heads: Option<HeadLink>,
    /// Where those heads lie in a kernel block of each side.
    pub head_bytes: Option<HeadBytes>,
    /// Mamba state written (per-slot byte ranges).
    pub state: Option<StateLink>,
    /// Descriptors of the example request.
    pub descriptors: usize,
    /// Bytes of the example request.
    pub bytes: u64,
    /// Its transfers.
    pub transfers: Vec<TransferReport>,
}

/// One P rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefillRankReport {
    /// The rank.
    pub rank: RankId,
    /// Global layers it holds.
    pub layers: Range<u32>,
    /// Global KV heads it holds.
    pub heads: Range<u32>,
    /// Global mamba state heads it holds.
    pub state_heads: Range<u32>,
    /// Regions, and distinct tensors it registers.
    pub regions: usize,
    /// Distinct tensors it registers (one registration each).
    pub registrations: usize,
    /// Whether it writes nothing (a replica another rank writes for).
    pub idle: bool,
    /// The D ranks it writes.
    pub targets: Vec<TargetReport>,
}

/// One D rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DecodeRankReport {
    /// The rank.
    pub rank: RankId,
    /// Global layers it holds.
    pub layers: Range<u32>,
    /// Global KV heads it holds.
    pub heads: Range<u32>,
    /// Global mamba state heads it holds.
    pub state_heads: Range<u32>,
    /// Distinct tensors it registers.
    pub registrations: usize,
    /// Writes it waits for (its completion count).
    pub writers: u32,
    /// Who they are.
    pub from: Vec<RankId>,
}

/// Totals of the example request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Bytes the wire moves.
    pub bytes: u64,
    /// Descriptors it posts.
    pub descriptors: usize,
    /// Staging bytes on P (all ranks).
    pub prefill_staging_bytes: u64,
    /// Staging bytes on D (all ranks).
    pub decode_staging_bytes: u64,
    /// P's staging jobs.
    pub prefill_jobs: usize,
    /// D's staging jobs.
    pub decode_jobs: usize,
    /// Bytes D zeroes (tails).
    pub zeroed_bytes: u64,
}

/// vLLM 0.33's verdict on the same pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VllmReport {
    /// `push`, `pull only` or `rejected`.
    pub verdict: &'static str,
    /// Why, or a note.
    pub reason: String,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanReport {
    /// Model name.
    pub model: &'static str,
    /// P's spec.
    pub prefill: String,
    /// D's spec.
    pub decode: String,
    /// The example request: `(tokens, cached_tokens)`.
    pub tokens: u64,
    /// Tokens D holds already in the example.
    pub cached_tokens: u64,
    /// Every transform, where it runs and why.
    pub transforms: Vec<Transform>,
    /// P's staging pass.
    pub prefill_stage: Option<Stage>,
    /// D's staging pass.
    pub decode_stage: Option<Stage>,
    /// Per P rank.
    pub prefill_ranks: Vec<PrefillRankReport>,
    /// Per D rank.
    pub decode_ranks: Vec<DecodeRankReport>,
    /// Totals.
    pub totals: Totals,
    /// vLLM 0.33 on the same pair.
    pub vllm: VllmReport,
    /// With `--verify`: whether a run with shuffled block ids delivered every byte right.
    pub verified: Option<bool>,
}

/// Contiguous ids for `tokens` (minus `cached` for D's attention groups), groups one after the
/// other.
fn contiguous_ids(pair: &PairPlan, spec: &SideSpec, tokens: u64, cached: u64) -> (BlockIds, u32) {
    let lb = spec.logical_block();
    let blocks = tokens.div_ceil(lb);
    let mut next = 0u32;
    let groups = pair
        .model
        .groups
        .iter()
        .map(|g| {
            let n = if g.is_attention() {
                blocks - cached / lb
            } else {
                1
            } as u32;
            let ids = (next..next + n).collect();
            next += n;
            ids
        })
        .collect();
    (BlockIds { groups }, next.max(1))
}

/// Plans `prefill` → `decode` for model `model_name` and an example request of `tokens`
/// (D holding `cached`), and with `verify` also runs it (shuffled ids) and checks every byte.
///
/// # Errors
/// [`PlanReportError`]: an unknown model, a bad spec, an impossible pair or request, a failed
/// verification.
pub fn plan_report(
    model_name: &str,
    prefill: &str,
    decode: &str,
    tokens: u64,
    cached: u64,
    verify: bool,
) -> Result<PlanReport, PlanReportError> {
    let m = model(model_name)?;
    let spec = |side, text: &str| {
        text.parse::<SideSpec>()
            .map_err(|source| HeteroError::Spec { side, source })
    };
    let (p, d) = (
        spec(SideName::Prefill, prefill)?,
        spec(SideName::Decode, decode)?,
    );
    let pair = plan_pair(m, p, d)?;
    let shape = RequestShape {
        tokens,
        cached_tokens: cached,
        seed: 1,
    };
    // The shape's own checks (cached prefix whole D blocks and below the tokens).
    let verified = if verify {
        let mut h = Handoff::prepare(pair.clone(), shape)?;
        h.run(&mut MemoryWire)?;
        h.verify()
            .map_err(|m| PlanReportError::Verify(m.to_string()))?;
        Some(true)
    } else {
        Handoff::check_shape(&pair, &shape)?;
        None
    };
    let (pb, p_pool) = contiguous_ids(&pair, &p, tokens, 0);
    let (db, d_pool) = contiguous_ids(&pair, &d, tokens, cached);
    let pm = SideMemory::packed(&pair.prefill, p_pool)?;
    let dm = SideMemory::packed(&pair.decode, d_pool)?;
    let plan = plan_request(
        &pair,
        &RequestInput {
            tokens,
            prefill_blocks: &pb,
            decode_blocks: &db,
            prefill_memory: &pm,
            decode_memory: &dm,
        },
    )?;
    let vllm = vllm_verdict(m, &p, &d);
    Ok(PlanReport {
        model: m.name,
        prefill: p.to_string(),
        decode: d.to_string(),
        tokens,
        cached_tokens: cached,
        transforms: pair.pipeline.transforms.clone(),
        prefill_stage: pair.pipeline.prefill_stage.clone(),
        decode_stage: pair.pipeline.decode_stage.clone(),
        prefill_ranks: prefill_ranks(&pair, &plan),
        decode_ranks: decode_ranks(&pair),
        totals: Totals {
            bytes: plan.bytes(),
            descriptors: plan.descriptors(),
            prefill_staging_bytes: plan.prefill_staging.iter().sum(),
            decode_staging_bytes: plan.decode_staging.iter().sum(),
            prefill_jobs: plan.prefill_jobs.len(),
            decode_jobs: plan.decode_jobs.len(),
            zeroed_bytes: plan.zero.iter().map(|z| z.len).sum(),
        },
        vllm: VllmReport {
            verdict: vllm.label(),
            reason: vllm.reason().to_string(),
        },
        verified,
    })
}

fn prefill_ranks(pair: &PairPlan, plan: &RequestPlan) -> Vec<PrefillRankReport> {
    let row = pair.model.row_bytes();
    pair.prefill
        .ranks
        .iter()
        .enumerate()
        .map(|(pi, p)| {
            let targets: Vec<TargetReport> = pair
                .links_from(pi)
                .map(|(li, link)| {
                    let d = &pair.decode.ranks[link.decode];
                    let native = |r: &kvhandoff_protocol::hetero::RankLayout| {
                        kvhandoff_protocol::hetero::BlockFormat {
                            tokens: r.kernel_block(),
                            heads: r.block_heads(),
                            layout: r.layout(),
                        }
                    };
                    let head_bytes = link.heads.as_ref().map(|h| HeadBytes {
                        prefill: native(p).head_bytes(h.prefill_local.clone(), row),
                        decode: native(d).head_bytes(h.decode_local.clone(), row),
                    });
                    let transfers: Vec<TransferReport> = plan
                        .transfers
                        .iter()
                        .filter(|t| t.link == li)
                        .map(|t| TransferReport {
                            src_space: t.src_space,
                            dst_space: t.dst_space,
                            descriptors: t.pieces.len(),
                            bytes: t.bytes,
                            first_pieces: t.pieces.iter().take(4).copied().collect(),
                        })
                        .collect();
                    let (descriptors, bytes) = plan.link_totals(li);
                    TargetReport {
                        decode_rank: d.rank,
                        layers: link.layers.clone(),
                        heads: link.heads.clone(),
                        head_bytes,
                        state: link.state.clone(),
                        descriptors,
                        bytes,
                        transfers,
                    }
                })
                .collect();
            PrefillRankReport {
                rank: p.rank,
                layers: p.layers.clone(),
                heads: p.heads.clone(),
                state_heads: p.state_heads.clone(),
                regions: p.regions.len(),
                registrations: p.tensors.len(),
                idle: targets.is_empty(),
                targets,
            }
        })
        .collect()
}

fn decode_ranks(pair: &PairPlan) -> Vec<DecodeRankReport> {
    pair.decode
        .ranks
        .iter()
        .enumerate()
        .map(|(di, d)| DecodeRankReport {
            rank: d.rank,
            layers: d.layers.clone(),
            heads: d.heads.clone(),
            state_heads: d.state_heads.clone(),
            registrations: d.tensors.len(),
            writers: pair.completions[di],
            from: pair
                .links_into(di)
                .map(|(_, l)| pair.prefill.ranks[l.prefill].rank)
                .collect(),
        })
        .collect()
}

fn range(r: &Range<u32>) -> String {
    if r.is_empty() {
        "-".into()
    } else {
        format!("{}..{}", r.start, r.end)
    }
}

impl PlanReport {
    /// The report as text.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: P {} → D {} ({} tokens, {} cached)",
            self.model, self.prefill, self.decode, self.tokens, self.cached_tokens
        );
        let _ = writeln!(out, "transforms:");
        for t in &self.transforms {
            let _ = writeln!(
                out,
                "  {} {}: {}",
                t.kind.label(),
                t.runs_on.label(),
                t.reason
            );
        }
        for p in &self.prefill_ranks {
            let _ = writeln!(
                out,
                "P {}: layers {} heads {} state {}, {} registrations{}",
                p.rank,
                range(&p.layers),
                range(&p.heads),
                range(&p.state_heads),
                p.registrations,
                if p.idle {
                    " (idle: a replica writes)"
                } else {
                    ""
                }
            );
            for t in &p.targets {
                let heads = t.heads.as_ref().map_or("-".into(), |h| {
                    format!(
                        "{} (P-local {}, D-local {})",
                        range(&h.global),
                        range(&h.prefill_local),
                        range(&h.decode_local)
                    )
                });
                let _ = writeln!(
                    out,
                    "  → D {}: layers {} heads {heads}{}: {} descriptors, {} bytes",
                    t.decode_rank,
                    range(&t.layers),
                    t.state.as_ref().map_or(String::new(), |s| format!(
                        " state heads {} (conv P {:?} → D {:?}, ssm P {:?} → D {:?})",
                        range(&s.global),
                        s.conv.prefill,
                        s.conv.decode,
                        s.ssm.prefill,
                        s.ssm.decode
                    )),
                    t.descriptors,
                    t.bytes
                );
            }
        }
        for d in &self.decode_ranks {
            let from: Vec<String> = d.from.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "D {}: layers {} heads {} state {}, waits for {} writes ({})",
                d.rank,
                range(&d.layers),
                range(&d.heads),
                range(&d.state_heads),
                d.writers,
                from.join(", ")
            );
        }
        let t = &self.totals;
        let _ = writeln!(
            out,
            "totals: {} bytes in {} descriptors; staging P {} B D {} B; jobs P {} D {}; {} bytes zeroed",
            t.bytes,
            t.descriptors,
            t.prefill_staging_bytes,
            t.decode_staging_bytes,
            t.prefill_jobs,
            t.decode_jobs,
            t.zeroed_bytes
        );
        let _ = writeln!(out, "vLLM 0.33: {} {}", self.vllm.verdict, self.vllm.reason);
        if let Some(v) = self.verified {
            let _ = writeln!(out, "verified: {v}");
        }
        out
    }
}
