//! Which transforms a pair needs, and on which side each runs: the *pipeline* of its attention
//! data (mamba state never needs one: it moves as byte ranges).
//!
//! A link carries `hl = min(P's heads per block, D's heads per block)` heads. Four things can
//! differ between what P holds and what D wants:
//!
//! | what | transform | by addressing (no kernel) when |
//! |---|---|---|
//! | P holds more heads than the link | slice heads, on P | P's blocks are HND (a head's tokens are one run) |
//! | D holds more heads than the link | gather heads, on D | D's blocks are HND (each writer's heads are one run) |
//! | layouts differ | permute, on P or D | the link carries one head (NHD and HND are the same bytes) |
//! | kernel block sizes differ | regroup, on P or D | the wire's data is NHD or one head (a big block is the small ones end to end) |
//!
//! Slicing must run on P (sending D heads it does not hold would multiply the bytes) and
//! gathering on D (it needs every writer's data). A permute or regroup runs on the side that
//! already stages (one staging pass instead of two); when neither does, on the side whose
//! busiest rank handles fewer head-layers, ties to P (off D's decode path). At most one side
//! stages. Every choice is recorded as a [`Transform`] with its reason, shown in the plan.

use serde::Serialize;

use super::spec::layout_name;
use super::{SideLayout, SideName};
use crate::geometry::KvLayout;

/// The shape of a block as a transform sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct BlockFormat {
    /// Tokens per block.
    pub tokens: u32,
    /// Heads in the block.
    pub heads: u32,
    /// Layout.
    pub layout: KvLayout,
}

impl BlockFormat {
    /// Bytes of one block with rows of `row` bytes, or `None` on overflow.
    pub fn block_bytes(&self, row: u64) -> Option<u64> {
        u64::from(self.tokens)
            .checked_mul(u64::from(self.heads))?
            .checked_mul(row)
    }

    /// Where heads `heads` lie in one block of this format: `count` runs of `len` bytes,
    /// `stride` apart, from `offset` (one run in HND, or for all the block's heads; one per
    /// token in NHD).
    ///
    /// ```
    /// use kvhandoff_protocol::hetero::{BlockFormat, StridedBytes};
    /// use kvhandoff_protocol::KvLayout;
    /// let hnd = BlockFormat { tokens: 16, heads: 8, layout: KvLayout::Hnd };
    /// assert_eq!(hnd.head_bytes(4..8, 16), StridedBytes { offset: 1024, len: 1024, stride: 1024, count: 1 });
    /// let nhd = BlockFormat { layout: KvLayout::Nhd, ..hnd };
    /// assert_eq!(nhd.head_bytes(4..8, 16), StridedBytes { offset: 64, len: 64, stride: 128, count: 16 });
    /// ```
    pub fn head_bytes(&self, heads: std::ops::Range<u32>, row: u64) -> StridedBytes {
        let n = u64::from(heads.end.saturating_sub(heads.start));
        let (tokens, all) = (u64::from(self.tokens), u64::from(self.heads));
        match self.layout {
            KvLayout::Nhd if n < all && tokens > 1 => StridedBytes {
                offset: u64::from(heads.start) * row,
                len: n * row,
                stride: all * row,
                count: tokens,
            },
            KvLayout::Nhd | KvLayout::Hnd => StridedBytes {
                offset: u64::from(heads.start) * tokens * row,
                len: n * tokens * row,
                stride: n * tokens * row,
                count: 1,
            },
        }
    }

    /// Byte offset of the row of `token` (in the block) and `head` (in the block).
    pub fn row_offset(&self, token: u64, head: u64, row: u64) -> u64 {
        match self.layout {
            KvLayout::Nhd => (token * u64::from(self.heads) + head) * row,
            KvLayout::Hnd => (head * u64::from(self.tokens) + token) * row,
        }
    }
}

/// `count` runs of `len` bytes, `stride` apart, from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct StridedBytes {
    /// Start of the first run.
    pub offset: u64,
    /// Bytes per run.
    pub len: u64,
    /// Distance between run starts.
    pub stride: u64,
    /// Runs.
    pub count: u64,
}

/// One step of a staging pass, applied to whole blocks laid end to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum StageOp {
    /// Keep the link's heads (its P-local range).
    SliceHeads,
    /// Join the D rank's writers' blocks, in head order, into blocks with all its heads.
    GatherHeads,
    /// Change the tokens per block (`from` → `to`; one divides the other).
    Regroup {
        /// Tokens per block before.
        from: u32,
        /// Tokens per block after.
        to: u32,
    },
    /// Change the layout.
    Permute {
        /// Layout before.
        from: KvLayout,
        /// Layout after.
        to: KvLayout,
    },
}

impl StageOp {
    /// The token span `(first_token, blocks)` of the result of this op on `blocks` blocks that
    /// start at `first_token`. A regroup to bigger blocks starts at the big block holding
    /// `first_token` (the sub-blocks before it are filler) and ends with a partly covered block
    /// if the count does not divide; one to smaller blocks keeps the start.
    pub fn span(&self, first_token: u64, blocks: u64) -> (u64, u64) {
        match *self {
            StageOp::Regroup { from, to } if to > from && from > 0 => {
                let (to, from) = (u64::from(to), u64::from(from));
                let start = first_token / to * to;
                let lead = (first_token - start) / from;
                (start, (lead + blocks).div_ceil(to / from))
            }
            StageOp::Regroup { from, to } if to < from && to > 0 => {
                (first_token, blocks * (u64::from(from) / u64::from(to)))
            }
            StageOp::Regroup { .. }
            | StageOp::SliceHeads
            | StageOp::GatherHeads
            | StageOp::Permute { .. } => (first_token, blocks),
        }
    }
}

/// A staging pass: the ops one side runs, from its input format to its output format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stage {
    /// Which side runs it: P before the write (into staging the wire reads), D after the
    /// write (from staging the wire filled, into its blocks).
    pub side: SideName,
    /// Format of each input block (P's own blocks, or one writer's staging on D).
    pub input: BlockFormat,
    /// The ops, in order.
    pub ops: Vec<StageOp>,
    /// Format of each output block (P's staging, or D's own blocks).
    pub output: BlockFormat,
}

/// What a transform is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum TransformKind {
    /// TP head slicing.
    SliceHeads,
    /// TP head gathering.
    GatherHeads,
    /// Kernel block size change.
    Regroup,
    /// NHD ↔ HND.
    Permute,
    /// Zeroing the untransferred tail of D's last, partly covered block.
    ZeroTail,
}

impl TransformKind {
    /// A short name: `slice heads`, `gather heads`, `regroup`, `permute`, `zero tail`.
    pub fn label(self) -> &'static str {
        match self {
            TransformKind::SliceHeads => "slice heads",
            TransformKind::GatherHeads => "gather heads",
            TransformKind::Regroup => "regroup",
            TransformKind::Permute => "permute",
            TransformKind::ZeroTail => "zero tail",
        }
    }
}

/// Where a transform runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RunsOn {
    /// On P, before the write, into staging.
    Prefill,
    /// On D, after the write lands.
    Decode,
    /// Nowhere: the wire's byte ranges do it (no kernel, no staging).
    Addressing,
}

impl RunsOn {
    /// `on P`, `on D` or `by addressing`.
    pub fn label(self) -> &'static str {
        match self {
            RunsOn::Prefill => "on P",
            RunsOn::Decode => "on D",
            RunsOn::Addressing => "by addressing",
        }
    }
}

/// One transform of a pair's plan, as shown to a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Transform {
    /// What.
    pub kind: TransformKind,
    /// Where.
    pub runs_on: RunsOn,
    /// Why there.
    pub reason: String,
}

/// The attention pipeline of a pair: the heads a link carries and at most one staging pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pipeline {
    /// Heads one link carries, per attention region.
    pub link_heads: u32,
    /// P's staging pass, if any.
    pub prefill_stage: Option<Stage>,
    /// D's staging pass, if any.
    pub decode_stage: Option<Stage>,
    /// Every transform the pair needs, with where it runs and why.
    pub transforms: Vec<Transform>,
}

/// Decides the pipeline of `prefill` → `decode` (see the module documentation).
pub fn decide(prefill: &SideLayout, decode: &SideLayout, has_attention: bool) -> Pipeline {
    let (Some(p), Some(d)) = (prefill.ranks.first(), decode.ranks.first()) else {
        return Pipeline {
            link_heads: 0,
            prefill_stage: None,
            decode_stage: None,
            transforms: Vec::new(),
        };
    };
    let (hp, hd) = (p.block_heads(), d.block_heads());
    let hl = hp.min(hd);
    let (kp, kd) = (prefill.spec.block, decode.spec.block);
    let (lp, ld) = (prefill.spec.layout, decode.spec.layout);
    let mut transforms = Vec::new();
    let mut note = |kind, runs_on, reason: String| {
        transforms.push(Transform {
            kind,
            runs_on,
            reason,
        })
    };
    if !has_attention {
        return Pipeline {
            link_heads: hl,
            prefill_stage: None,
            decode_stage: None,
            transforms,
        };
    }
    let slice_p = hl < hp && lp == KvLayout::Nhd;
    let gather_d = hl < hd && ld == KvLayout::Nhd;
    let permute = hl > 1 && lp != ld;
    let p_work = u64::from(hp) * u64::from(p.layers.end - p.layers.start);
    let d_work = u64::from(hd) * u64::from(d.layers.end - d.layers.start);
    let (prefer_p, why_side) = if slice_p {
        (true, "P already stages to slice heads".to_string())
    } else if gather_d {
        (false, "D already stages to gather heads".to_string())
    } else {
        (
            p_work <= d_work,
            format!(
                "the busiest rank handles fewer head-layers there (P {p_work}, D {d_work}; ties go \
                 to P, off D's decode path)"
            ),
        )
    };
    let permute_on_p = permute && prefer_p;
    let wire_layout = if hl == 1 || permute_on_p { ld } else { lp };
    let regroup = kp != kd;
    let regroup_kernel = regroup && hl > 1 && wire_layout == KvLayout::Hnd;
    let p_staging = slice_p || permute_on_p;
    let d_staging = gather_d || (permute && !permute_on_p);
    let regroup_on_p = regroup_kernel && (p_staging || (!d_staging && prefer_p));
    let regroup_on_d = regroup_kernel && !regroup_on_p;

    if hl < hp {
        if slice_p {
            note(
                TransformKind::SliceHeads,
                RunsOn::Prefill,
                format!(
                    "P's NHD blocks interleave its {hp} heads token by token; P slices each \
                     link's {hl} into staging, so the wire moves only the heads a D rank holds, \
                     as whole blocks"
                ),
            );
        } else {
            note(
                TransformKind::SliceHeads,
                RunsOn::Addressing,
                format!(
                    "P's blocks are HND: each link's {hl} of P's {hp} heads are one run of \
                     every P block, read in place"
                ),
            );
        }
    }
    if hl < hd {
        let writers = hd / hl.max(1);
        if gather_d {
            note(
                TransformKind::GatherHeads,
                RunsOn::Decode,
                format!(
                    "D's NHD blocks interleave its {hd} heads token by token; the {hl}-head \
                     blocks of its {writers} writers land in staging and D gathers them"
                ),
            );
        } else {
            note(
                TransformKind::GatherHeads,
                RunsOn::Addressing,
                format!(
                    "D's blocks are HND: the {hl} head(s) of each of its {writers} writers are \
                     one run of every D block, written in place"
                ),
            );
        }
    }
    if lp != ld {
        if permute {
            note(
                TransformKind::Permute,
                if permute_on_p {
                    RunsOn::Prefill
                } else {
                    RunsOn::Decode
                },
                format!(
                    "layouts differ ({} → {}) and a link carries {hl} heads; on {}: {why_side}",
                    layout_name(lp),
                    layout_name(ld),
                    if permute_on_p { "P" } else { "D" },
                ),
            );
        } else {
            note(
                TransformKind::Permute,
                RunsOn::Addressing,
                format!(
                    "layouts differ ({} → {}) but a link carries one head, and with one head NHD \
                     and HND are the same bytes",
                    layout_name(lp),
                    layout_name(ld)
                ),
            );
        }
    }
    if regroup {
        if regroup_kernel {
            let (side, why) = if regroup_on_p && p_staging {
                (RunsOn::Prefill, "P already stages".to_string())
            } else if regroup_on_d && d_staging {
                (RunsOn::Decode, "D already stages".to_string())
            } else if regroup_on_p {
                (RunsOn::Prefill, why_side.clone())
            } else {
                (RunsOn::Decode, why_side.clone())
            };
            note(
                TransformKind::Regroup,
                side,
                format!(
                    "kernel blocks of {kp} (P) and {kd} (D) tokens, and the wire's blocks are HND \
                     with {hl} heads (a head's tokens of one block are not one run of the \
                     other's); on {}: {why}",
                    if side == RunsOn::Prefill { "P" } else { "D" }
                ),
            );
        } else {
            note(
                TransformKind::Regroup,
                RunsOn::Addressing,
                format!(
                    "kernel blocks of {kp} (P) and {kd} (D) tokens; the wire's data is {}, so a \
                     {}-token block is the {}-token ones end to end: one piece per smaller block, \
                     merged where contiguous",
                    if hl == 1 { "one head" } else { "NHD" },
                    kp.max(kd),
                    kp.min(kd)
                ),
            );
        }
    }
    note(
        TransformKind::ZeroTail,
        RunsOn::Decode,
        "D zeroes the tokens past the request's last one in its last logical block (the \
         untransferred tail of a partly covered block)"
            .to_string(),
    );

    let prefill_stage = (slice_p || permute_on_p || regroup_on_p).then(|| {
        let mut ops = Vec::new();
        if hl < hp {
            ops.push(StageOp::SliceHeads);
        }
        if regroup_on_p {
            ops.push(StageOp::Regroup { from: kp, to: kd });
        }
        if permute_on_p {
            ops.push(StageOp::Permute { from: lp, to: ld });
        }
        Stage {
            side: SideName::Prefill,
            input: BlockFormat {
                tokens: kp,
                heads: hp,
                layout: lp,
            },
            ops,
            output: BlockFormat {
                tokens: if regroup_on_p { kd } else { kp },
                heads: hl,
                layout: if permute_on_p { ld } else { lp },
            },
        }
    });
    let decode_stage = (gather_d || (permute && !permute_on_p) || regroup_on_d).then(|| {
        let mut ops = Vec::new();
        if gather_d {
            ops.push(StageOp::GatherHeads);
        }
        if regroup_on_d {
            ops.push(StageOp::Regroup { from: kp, to: kd });
        }
        if permute && !permute_on_p {
            ops.push(StageOp::Permute { from: lp, to: ld });
        }
        Stage {
            side: SideName::Decode,
            input: BlockFormat {
                tokens: if regroup_on_d { kp } else { kd },
                heads: hl,
                layout: wire_layout,
            },
            ops,
            output: BlockFormat {
                tokens: kd,
                heads: if gather_d { hd } else { hl },
                layout: ld,
            },
        }
    });
    Pipeline {
        link_heads: hl,
        prefill_stage,
        decode_stage,
        transforms,
    }
}
