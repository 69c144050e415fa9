//! Kernel block size: `ratio` blocks of `B` tokens ↔ one block of `ratio × B` tokens.
#![forbid(unsafe_code)]

use crate::copy::copy_run;
use crate::par::for_each_block;
use crate::shape::{check_threads, exact_len, whole_blocks, Dims};
use crate::{BlockShape, KernelError, Layout};

/// Checked sizes of a regroup: the small (`sub`) and large (`big`) block.
struct Regroup {
    sub: Dims,
    big: Dims,
    ratio: usize,
}

impl Regroup {
    fn new(sub: BlockShape, ratio: usize) -> Result<Regroup, KernelError> {
        if ratio == 0 {
            return Err(KernelError::Zero { field: "ratio" });
        }
        let sub_dims = sub.dims()?;
        let big_tokens = sub.tokens.checked_mul(ratio).ok_or(KernelError::Overflow {
            what: "regrouped block",
        })?;
        let big = sub.with_tokens(big_tokens).dims()?;
        Ok(Regroup {
            sub: sub_dims,
            big,
            ratio,
        })
    }

    /// Bytes of the large blocks that hold `n` sub-blocks.
    fn big_len(&self, n: usize) -> Result<usize, KernelError> {
        n.div_ceil(self.ratio)
            .checked_mul(self.big.block)
            .ok_or(KernelError::Overflow {
                what: "regrouped buffer",
            })
    }

    /// Bytes of one head's run of one sub-block (HND) or of one whole sub-block (NHD); the
    /// offset of sub-block `j`'s run of `head` inside a big block, and inside a sub-block.
    fn runs(&self, layout: Layout) -> (usize, usize) {
        match layout {
            // Sub-block j is bytes [j·sub, (j+1)·sub) of the big block: one run.
            Layout::Nhd => (self.sub.block, 1),
            // Per head: the sub-block's B rows, at token j·B of that head in the big block.
            Layout::Hnd => (self.sub.tokens * self.sub.row, self.sub.heads),
        }
    }

    fn big_offset(&self, layout: Layout, j: usize, run: usize) -> usize {
        match layout {
            Layout::Nhd => j * self.sub.block,
            Layout::Hnd => self.big.offset(layout, j * self.sub.tokens, run),
        }
    }
}

/// Gathers kernel blocks of `sub` tokens into blocks of `ratio × sub.tokens` tokens, as a
/// receiver with the larger kernel block does (vLLM's `kv_postprocess_blksize_on_receive`).
///
/// `src` holds `n ≥ 0` blocks of shape `sub`, in order; `dst` holds `⌈n / ratio⌉` blocks of shape
/// `sub.with_tokens(ratio × sub.tokens)`, both in `layout`. Destination block `b` takes source
/// blocks `b·ratio .. b·ratio + ratio`: in NHD they are simply laid end to end; in HND each head's
/// rows of source block `j` land at tokens `j·B ..` of that head. When `n` is not a multiple of
/// `ratio`, the last destination block is partly covered and its tokens from `(n mod ratio) × B`
/// on are zeroed (vLLM zeroes the same tail).
///
/// # Errors
/// A zero size, `ratio` or `threads`, a size that overflows, `src` not whole blocks, or `dst` not
/// exactly `⌈n / ratio⌉` large blocks.
pub fn regroup_gather(
    src: &[u8],
    dst: &mut [u8],
    sub: BlockShape,
    ratio: usize,
    layout: Layout,
    threads: usize,
) -> Result<(), KernelError> {
    let g = Regroup::new(sub, ratio)?;
    check_threads(threads)?;
    let n = whole_blocks("src", src.len(), g.sub.block)?;
    exact_len("dst", dst.len(), g.big_len(n)?)?;
    let (run_len, runs) = g.runs(layout);
    for_each_block(dst, g.big.block, threads, |b, out| {
        for j in 0..g.ratio {
            let s = b * g.ratio + j;
            for run in 0..runs {
                let at = g.big_offset(layout, j, run);
                let to = &mut out[at..at + run_len];
                if s < n {
                    let from = s * g.sub.block + run * run_len;
                    copy_run(to, &src[from..from + run_len]);
                } else {
                    to.fill(0);
                }
            }
        }
    });
    Ok(())
}

/// Splits blocks of `ratio × sub.tokens` tokens into blocks of `sub.tokens` tokens: the inverse of
/// [`regroup_gather`] (a sender with the larger kernel block, or a receiver with the smaller).
///
/// `dst` holds `n` blocks of shape `sub`; `src` holds `⌈n / ratio⌉` large blocks, both in
/// `layout`. Source sub-blocks past `n` (the tail of a partly covered last block) are not read.
///
/// # Errors
/// A zero size, `ratio` or `threads`, a size that overflows, `dst` not whole blocks, or `src` not
/// exactly `⌈n / ratio⌉` large blocks.
pub fn regroup_split(
    src: &[u8],
    dst: &mut [u8],
    sub: BlockShape,
    ratio: usize,
    layout: Layout,
    threads: usize,
) -> Result<(), KernelError> {
    let g = Regroup::new(sub, ratio)?;
    check_threads(threads)?;
    let n = whole_blocks("dst", dst.len(), g.sub.block)?;
    exact_len("src", src.len(), g.big_len(n)?)?;
    let (run_len, runs) = g.runs(layout);
    for_each_block(dst, g.sub.block, threads, |s, out| {
        let (b, j) = (s / g.ratio, s % g.ratio);
        let big = &src[b * g.big.block..(b + 1) * g.big.block];
        for run in 0..runs {
            let at = g.big_offset(layout, j, run);
            copy_run(
                &mut out[run * run_len..(run + 1) * run_len],
                &big[at..at + run_len],
            );
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests;
