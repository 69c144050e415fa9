//! The staging jobs of a [`Handoff`]: P's before the wire, D's after it, each a few
//! `kvhandoff-kernels` transforms on whole blocks laid end to end, then D's scatter of the
//! result into its blocks.

use std::ops::Range;

use kvhandoff_kernels::{self as kernels, BlockShape, KernelError, Layout};
use kvhandoff_protocol::hetero::{
    BlockFormat, BlockRun, DecodeJob, PrefillJob, SideName, Space, StageOp,
};
use kvhandoff_protocol::KvLayout;

use super::{slice, slice_mut, Arena, Handoff, HandoffError};

fn kernel_layout(layout: KvLayout) -> Layout {
    match layout {
        KvLayout::Nhd => Layout::Nhd,
        KvLayout::Hnd => Layout::Hnd,
    }
}

/// Contiguous blocks in one format, starting at `first` (a staging job's working buffer).
struct Buf {
    bytes: Vec<u8>,
    first: u64,
    format: BlockFormat,
}

impl Buf {
    fn blocks(&self, row: u64) -> u64 {
        let len = self.format.block_bytes(row).unwrap_or(1).max(1);
        self.bytes.len() as u64 / len
    }
}

impl Handoff {
    fn row(&self) -> u64 {
        self.pair.model.row_bytes()
    }

    fn shape_of(&self, format: BlockFormat) -> BlockShape {
        let m = &self.pair.model;
        BlockShape::new(
            format.tokens as usize,
            format.heads as usize,
            m.head_dim as usize,
            m.dtype_bytes as usize,
        )
    }

    /// Reads `run`'s blocks out of `arena` into one buffer.
    fn collect(
        &self,
        arena: usize,
        run: &BlockRun,
        what: &'static str,
    ) -> Result<Buf, HandoffError> {
        let len = run.format.block_bytes(self.row()).unwrap_or(0);
        let mut bytes = Vec::with_capacity(run.addrs.len() * len as usize);
        for &addr in &run.addrs {
            bytes.extend_from_slice(slice(&self.arenas[arena], what, addr, len)?);
        }
        Ok(Buf {
            bytes,
            first: run.first_token,
            format: run.format,
        })
    }

    /// Applies one op (not a gather) to `buf`.
    fn apply(&self, op: StageOp, buf: Buf, heads: &Range<u32>) -> Result<Buf, StepError> {
        let row = self.row();
        let format = buf.format;
        let layout = kernel_layout(format.layout);
        let shape = self.shape_of(format);
        let blocks = buf.blocks(row);
        let sized = |format: BlockFormat, blocks: u64| {
            vec![0u8; (format.block_bytes(row).unwrap_or(0) * blocks) as usize]
        };
        match op {
            StageOp::SliceHeads => {
                let out_format = BlockFormat {
                    heads: heads.end.saturating_sub(heads.start),
                    ..format
                };
                let mut out = sized(out_format, blocks);
                let range = heads.start as usize..heads.end as usize;
                kernels::slice_heads(&buf.bytes, &mut out, shape, range, layout, self.threads)?;
                Ok(Buf {
                    bytes: out,
                    first: buf.first,
                    format: out_format,
                })
            }
            StageOp::Permute { from, to } => {
                if from != format.layout {
                    return Err(StepError::Shape(format!(
                        "a permute from {from:?} of blocks laid out {:?}",
                        format.layout
                    )));
                }
                let mut out = vec![0u8; buf.bytes.len()];
                kernels::permute(
                    &buf.bytes,
                    &mut out,
                    shape,
                    layout,
                    kernel_layout(to),
                    self.threads,
                )?;
                Ok(Buf {
                    bytes: out,
                    first: buf.first,
                    format: BlockFormat {
                        layout: to,
                        ..format
                    },
                })
            }
            StageOp::Regroup { from, to } => {
                if from != format.tokens || from == 0 || to == 0 {
                    return Err(StepError::Shape(format!(
                        "a regroup from {from} tokens of {}-token blocks",
                        format.tokens
                    )));
                }
                let (first, out_blocks) = op.span(buf.first, blocks);
                let out_format = BlockFormat {
                    tokens: to,
                    ..format
                };
                let mut out = sized(out_format, out_blocks);
                if to > from {
                    let ratio = (to / from) as usize;
                    let lead = ((buf.first - first) / u64::from(from)) as usize;
                    let sub = shape.block_bytes().unwrap_or(0);
                    let mut src = vec![0u8; lead * sub];
                    src.extend_from_slice(&buf.bytes);
                    kernels::regroup_gather(&src, &mut out, shape, ratio, layout, self.threads)?;
                } else {
                    let ratio = (from / to) as usize;
                    let small = self.shape_of(out_format);
                    kernels::regroup_split(
                        &buf.bytes,
                        &mut out,
                        small,
                        ratio,
                        layout,
                        self.threads,
                    )?;
                }
                Ok(Buf {
                    bytes: out,
                    first,
                    format: out_format,
                })
            }
            StageOp::GatherHeads => Err(StepError::Shape(
                "a gather of one source (gathers come first, over every writer)".into(),
            )),
        }
    }

    pub(super) fn prefill_job(
        &mut self,
        index: usize,
        job: &PrefillJob,
    ) -> Result<(), HandoffError> {
        let side = SideName::Prefill;
        let wrap = |e: StepError| e.into_handoff(side, index);
        let kv = self.arena(side, job.rank, Space::Kv);
        let mut buf = self.collect(kv, &job.input, "a P staging job's input")?;
        for &op in &job.ops {
            buf = self.apply(op, buf, &job.heads).map_err(wrap)?;
        }
        let out = &job.output;
        let row = self.row();
        if buf.first != out.first_token
            || buf.blocks(row) != out.addrs.len() as u64
            || buf.format != out.format
        {
            return Err(wrap(StepError::Shape(format!(
                "made {} blocks of {:?} from token {}, the plan says {} of {:?} from {}",
                buf.blocks(row),
                buf.format,
                buf.first,
                out.addrs.len(),
                out.format,
                out.first_token
            ))));
        }
        let staging = self.arena(side, job.rank, Space::Staging);
        let len = out.block_len();
        for (i, &addr) in out.addrs.iter().enumerate() {
            let from = &buf.bytes[i * len as usize..(i + 1) * len as usize];
            slice_mut(&mut self.arenas[staging], "a P staging block", addr, len)?
                .copy_from_slice(from);
        }
        Ok(())
    }

    pub(super) fn decode_job(&mut self, index: usize, job: &DecodeJob) -> Result<(), HandoffError> {
        let side = SideName::Decode;
        let wrap = |e: StepError| e.into_handoff(side, index);
        let staging = self.arena(side, job.rank, Space::Staging);
        let mut sources = Vec::with_capacity(job.sources.len());
        for source in &job.sources {
            sources.push(self.collect(staging, source, "a D staging area")?);
        }
        let mut ops = job.ops.iter().copied().peekable();
        let mut buf = if ops.peek() == Some(&StageOp::GatherHeads) {
            ops.next();
            self.gather(sources).map_err(wrap)?
        } else {
            match <[Buf; 1]>::try_from(sources) {
                Ok([one]) => one,
                Err(many) => {
                    return Err(wrap(StepError::Shape(format!(
                        "{} sources and no gather",
                        many.len()
                    ))))
                }
            }
        };
        for op in ops {
            buf = self.apply(op, buf, &job.heads).map_err(wrap)?;
        }
        let out = &job.output;
        let heads = job.heads.end.saturating_sub(job.heads.start);
        let same_layout = buf.format.layout == out.format.layout || heads == 1;
        if buf.format.tokens != out.format.tokens || !same_layout || buf.format.heads != heads {
            return Err(wrap(StepError::Shape(format!(
                "made blocks of {:?}; D's blocks are {:?} and the job covers {heads} heads",
                buf.format, out.format
            ))));
        }
        let kv = self.arena(side, job.rank, Space::Kv);
        let result = BlockRun {
            addrs: (0..buf.blocks(self.row()))
                .map(|i| i * buf.format.block_bytes(self.row()).unwrap_or(0))
                .collect(),
            first_token: buf.first,
            format: buf.format,
            row: self.row(),
        };
        scatter(&buf.bytes, &result, &mut self.arenas[kv], out, job)
    }

    /// Joins the writers' blocks (in head order) into blocks with all their heads.
    fn gather(&self, sources: Vec<Buf>) -> Result<Buf, StepError> {
        let Some(first) = sources.first() else {
            return Err(StepError::Shape("a gather of no sources".into()));
        };
        let (format, start, len) = (first.format, first.first, first.bytes.len());
        if sources
            .iter()
            .any(|s| s.format != format || s.first != start || s.bytes.len() != len)
        {
            return Err(StepError::Shape(
                "writers' staging areas differ in shape".into(),
            ));
        }
        let out_format = BlockFormat {
            heads: format.heads * sources.len() as u32,
            ..format
        };
        let mut out = vec![0u8; len * sources.len()];
        let views: Vec<&[u8]> = sources.iter().map(|s| s.bytes.as_slice()).collect();
        let layout = kernel_layout(format.layout);
        kernels::gather_heads(
            &views,
            &mut out,
            self.shape_of(format),
            layout,
            self.threads,
        )?;
        Ok(Buf {
            bytes: out,
            first: start,
            format: out_format,
        })
    }
}

/// Copies the rows of `job.tokens` × the result's heads from `bytes` (laid out as `result`)
/// into heads `job.heads` of D's blocks `out`: whole blocks where a block is wholly covered,
/// row runs otherwise.
fn scatter(
    bytes: &[u8],
    result: &BlockRun,
    arena: &mut Arena,
    out: &BlockRun,
    job: &DecodeJob,
) -> Result<(), HandoffError> {
    let row = out.row;
    let tokens = u64::from(out.format.tokens);
    let heads = u64::from(result.format.heads);
    let whole = result.format == out.format;
    for (i, &addr) in out.addrs.iter().enumerate() {
        let block_start = out.first_token + i as u64 * tokens;
        let lo = block_start.max(job.tokens.start);
        let hi = (block_start + tokens).min(job.tokens.end);
        if lo >= hi {
            continue;
        }
        if lo < result.first_token || hi > result.end_token() {
            return Err(HandoffError::OutOfBounds {
                what: "a D job's rows",
                arena: arena.name.clone(),
                len: bytes.len(),
                start: lo,
                end: hi,
            });
        }
        let len = out.block_len();
        let from = result.row_addr(block_start.max(result.first_token), 0);
        if whole
            && lo == block_start
            && hi == block_start + tokens
            && block_start >= result.first_token
        {
            let dst = slice_mut(arena, "a D block", addr, len)?;
            dst.copy_from_slice(&bytes[from as usize..(from + len) as usize]);
            continue;
        }
        for t in lo..hi {
            for h in 0..heads {
                let s = result.row_addr(t, h) as usize;
                let d = out.row_addr(t, u64::from(job.heads.start) + h);
                slice_mut(arena, "a D row", d, row)?.copy_from_slice(&bytes[s..s + row as usize]);
            }
        }
    }
    Ok(())
}

/// A staging step's failure, before it is tied to its job.
#[derive(Debug)]
pub(super) enum StepError {
    Kernel(KernelError),
    Shape(String),
}

impl From<KernelError> for StepError {
    fn from(e: KernelError) -> Self {
        StepError::Kernel(e)
    }
}

impl StepError {
    fn into_handoff(self, side: SideName, job: usize) -> HandoffError {
        match self {
            StepError::Kernel(source) => HandoffError::Kernel { side, job, source },
            StepError::Shape(why) => HandoffError::Stage { side, job, why },
        }
    }
}
