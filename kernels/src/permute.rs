//! NHD ↔ HND: the same rows in the other order.
#![forbid(unsafe_code)]

use crate::copy::copy_run;
use crate::par::for_each_block;
use crate::shape::{check_threads, exact_len, whole_blocks, Dims};
use crate::{BlockShape, KernelError, Layout};

/// Bytes of source rows read contiguously per tile (about one page): the tile's source run and
/// its destination rows stay in L1 while it is copied.
const TILE_BYTES: usize = 4096;

/// Rewrites every block of `src`, laid out as `from`, into `dst` laid out as `to`.
///
/// `src` holds whole blocks of `shape` (the same shape in either layout); `dst` has the same
/// length. With `from == to` it is a copy. Blocks are spread over up to `threads` threads.
///
/// Rows (one token of one head) are copied whole. The copy walks the destination in order, a
/// tile of source rows at a time: for HND → NHD a tile is some tokens of every head, each head's
/// rows contiguous in the source; for NHD → HND some heads of every token.
///
/// # Errors
/// A zero size or `threads`, a shape whose size overflows, `src` not whole blocks, or `dst` not
/// as long as `src`.
pub fn permute(
    src: &[u8],
    dst: &mut [u8],
    shape: BlockShape,
    from: Layout,
    to: Layout,
    threads: usize,
) -> Result<(), KernelError> {
    let dims = shape.dims()?;
    check_threads(threads)?;
    whole_blocks("src", src.len(), dims.block)?;
    exact_len("dst", dst.len(), src.len())?;
    if from == to {
        for_each_block(dst, dims.block, threads, |b, out| {
            copy_run(out, &src[b * dims.block..(b + 1) * dims.block]);
        });
        return Ok(());
    }
    for_each_block(dst, dims.block, threads, |b, out| {
        permute_block(&src[b * dims.block..(b + 1) * dims.block], out, &dims, to);
    });
    Ok(())
}

/// One block into the layout `to` from the other one. Destination row `o * inner + i` is
/// source row `i * outer + o`, where `outer` is the destination's outer dimension.
fn permute_block(src: &[u8], dst: &mut [u8], dims: &Dims, to: Layout) {
    let row = dims.row;
    let (outer, inner) = match to {
        Layout::Hnd => (dims.heads, dims.tokens),
        Layout::Nhd => (dims.tokens, dims.heads),
    };
    let tile = (TILE_BYTES / row).clamp(1, outer);
    let mut o0 = 0;
    while o0 < outer {
        let o1 = (o0 + tile).min(outer);
        for i in 0..inner {
            // Source rows (i, o0..o1) are contiguous; each goes to its own destination run.
            let run = &src[(i * outer + o0) * row..(i * outer + o1) * row];
            for (k, from) in run.chunks_exact(row).enumerate() {
                let at = ((o0 + k) * inner + i) * row;
                copy_run(&mut dst[at..at + row], from);
            }
        }
        o0 = o1;
    }
}

#[cfg(test)]
mod tests;
