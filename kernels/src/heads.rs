//! TP head slicing: some heads of a block into a block with fewer heads, and the reverse gather.
#![forbid(unsafe_code)]

use std::ops::Range;

use crate::copy::copy_run;
use crate::par::for_each_block;
use crate::shape::{check_threads, exact_len, whole_blocks, Dims};
use crate::{BlockShape, KernelError, Layout};

/// Bytes [`pass_over`] reads at a time.
const PASS: usize = 256;

/// Reads `bytes` into `lane` (whose content means nothing; `black_box` keeps the reads) so that
/// the hardware prefetchers keep streaming through a source read with gaps.
///
/// NHD head slicing copies `count` heads of every token and skips the others. Measured on the
/// reference machine (2 threads, 64 MiB, bench kernels' shape: 1 KiB copied, 1 KiB skipped per
/// token): reading only the copied half took 0.64 of the time of a copy of the whole buffer,
/// reading all of it 0.50 — the prefetchers lose the stream at every gap, so the skipped half
/// costs more unread than read. Passing over the skipped heads in address order took
/// `slice_heads_nhd` from 0.47–0.58 of the copy to 0.55–0.73 (same build, runs alternated). In
/// 256-byte pieces through `copy_from_slice`, as `copy_run` copies: pieces of 128 or 512 bytes,
/// or the copied heads moved 32 bytes at a time in the loop, did no better; one piece per gap
/// (1 KiB, glibc's slow length) did worse, and loading one byte a cache line instead of copying
/// the piece no better (median 0.75 against 0.71 over 22 alternated runs each, ahead in 13).
///
/// Why it stays near 0.7 of the copy: with gaps this short the machine fetches the skipped lines
/// whether they are read or not (read alone, one line in two, or 1 KiB in 2 KiB, took as long as
/// every line), and a core fills about as many lines a second however it spends them (a read of
/// 64 MiB took about as long as a copy of 32 MiB, a write of 32 MiB a little under half of it). The
/// copy fills two lines per line it writes (source, destination), this kernel three, so it sits
/// near 2/3 of the copy, a little above as glibc's large-copy loop is slower than 256-byte pieces.
/// What would read fewer lines or fill them faster measured worse or the same (same machine, a
/// harness of the bench's shape, medians): only the copied runs read, with the first line of a run
/// 2–16 tokens ahead loaded early (0.60–0.68 where this took 0.68–0.78); the runs of 4–16 tokens
/// read interleaved or column-wise, into the destination or an L1 scratch (0.44–0.60); 8 lines or
/// more of each gap left unread (the stream breaks: 0.42–0.56); the whole block staged in a scratch
/// by one copy, then sliced (0.47); the destination written from a scratch by one `rep movsb` copy
/// (0.49–0.52) or zeroed first (no better); blocks dealt to the threads in chunks of 1–64 instead
/// of halves (no change).
#[inline]
fn pass_over(bytes: &[u8], lane: &mut [u8; PASS]) {
    for piece in bytes.chunks(PASS) {
        lane[..piece.len()].copy_from_slice(piece);
        std::hint::black_box(&mut *lane);
    }
}

/// Copies heads `[src_h0, src_h0 + count)` of one source block into heads
/// `[dst_h0, dst_h0 + count)` of one destination block; both blocks have the same tokens and rows.
/// In HND that is one contiguous run; in NHD one run per token.
#[allow(clippy::too_many_arguments)]
fn copy_heads(
    src: &[u8],
    sd: &Dims,
    src_h0: usize,
    dst: &mut [u8],
    dd: &Dims,
    dst_h0: usize,
    count: usize,
    layout: Layout,
) {
    match layout {
        Layout::Hnd => {
            let len = count * sd.tokens * sd.row;
            let (from, to) = (sd.offset(layout, 0, src_h0), dd.offset(layout, 0, dst_h0));
            copy_run(&mut dst[to..to + len], &src[from..from + len]);
        }
        Layout::Nhd => {
            let len = count * sd.row;
            let token = sd.heads * sd.row;
            let skipped = token - len;
            // Pass over the skipped heads too when they are no more than the copied ones
            // (`pass_over`). In a stand-alone loop, with three times the copied bytes skipped
            // (2 heads of 8) reading them gained nothing, with seven times (1 of 8) it lost.
            let stream = skipped > 0 && skipped <= len;
            let mut lane = [0u8; PASS];
            for t in 0..sd.tokens {
                let (from, to) = (sd.offset(layout, t, src_h0), dd.offset(layout, t, dst_h0));
                if stream {
                    pass_over(&src[t * token..from], &mut lane);
                }
                copy_run(&mut dst[to..to + len], &src[from..from + len]);
                if stream {
                    pass_over(&src[from + len..(t + 1) * token], &mut lane);
                }
            }
            std::hint::black_box(&mut lane);
        }
    }
}

/// Takes heads `heads` of every block of `src` (shape `src_shape`) into `dst`, whose blocks
/// have `heads.len()` heads and otherwise the same shape, both in `layout`.
///
/// This is what one rank of the larger TP holds of a rank of the smaller TP (with GQA, the KV
/// heads of its query heads): a P rank at TP 1 writing to D ranks at TP 2 sends heads `[0, H/2)`
/// to one and `[H/2, H)` to the other.
///
/// # Errors
/// A zero size or `threads`, a size that overflows, an empty range or one outside
/// `0..src_shape.heads`, `src` not whole blocks, or `dst` not as many blocks of the sliced shape.
pub fn slice_heads(
    src: &[u8],
    dst: &mut [u8],
    src_shape: BlockShape,
    heads: Range<usize>,
    layout: Layout,
    threads: usize,
) -> Result<(), KernelError> {
    let sd = src_shape.dims()?;
    check_threads(threads)?;
    if heads.start >= heads.end || heads.end > sd.heads {
        return Err(KernelError::HeadRange {
            start: heads.start,
            end: heads.end,
            heads: sd.heads,
        });
    }
    let count = heads.end - heads.start;
    let dd = src_shape.with_heads(count).dims()?;
    let n = whole_blocks("src", src.len(), sd.block)?;
    exact_len("dst", dst.len(), n * dd.block)?;
    for_each_block(dst, dd.block, threads, |b, out| {
        let block = &src[b * sd.block..(b + 1) * sd.block];
        copy_heads(block, &sd, heads.start, out, &dd, 0, count, layout);
    });
    Ok(())
}

/// Gathers the blocks of several sources, each of shape `src_shape`, into blocks holding all
/// their heads: source `i`'s heads become heads `[i·H, (i+1)·H)` of `dst`
/// (`H = src_shape.heads`), both in `layout`. Every source holds the same number of blocks; block
/// `b` of `dst` is made of block `b` of each source.
///
/// The inverse of slicing `dst` into `sources.len()` equal head ranges: a rank of the smaller TP
/// assembling its block from the ranks of the larger TP.
///
/// # Errors
/// No sources, a zero size or `threads`, a size that overflows, a source not whole blocks or
/// not as long as the first, or `dst` not as many blocks of the gathered shape.
pub fn gather_heads(
    sources: &[&[u8]],
    dst: &mut [u8],
    src_shape: BlockShape,
    layout: Layout,
    threads: usize,
) -> Result<(), KernelError> {
    let sd = src_shape.dims()?;
    check_threads(threads)?;
    let Some(first) = sources.first() else {
        return Err(KernelError::Zero { field: "sources" });
    };
    let n = whole_blocks("source", first.len(), sd.block)?;
    for source in sources {
        exact_len("source", source.len(), first.len())?;
    }
    let heads = sd
        .heads
        .checked_mul(sources.len())
        .ok_or(KernelError::Overflow {
            what: "gathered block",
        })?;
    let dd = src_shape.with_heads(heads).dims()?;
    let expected = n.checked_mul(dd.block).ok_or(KernelError::Overflow {
        what: "gathered buffer",
    })?;
    exact_len("dst", dst.len(), expected)?;
    let run = sd.heads * sd.row;
    for_each_block(dst, dd.block, threads, |b, out| match layout {
        // Each source's block is one contiguous run of the destination block.
        Layout::Hnd => {
            for (i, source) in sources.iter().enumerate() {
                let block = &source[b * sd.block..(b + 1) * sd.block];
                copy_heads(block, &sd, 0, out, &dd, i * sd.heads, sd.heads, layout);
            }
        }
        // Token by token, the sources' runs side by side: the destination is written in order.
        Layout::Nhd => {
            for (t, to) in out.chunks_exact_mut(dd.heads * sd.row).enumerate() {
                for (i, source) in sources.iter().enumerate() {
                    let from = b * sd.block + t * run;
                    copy_run(&mut to[i * run..(i + 1) * run], &source[from..from + run]);
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests;
