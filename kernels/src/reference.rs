//! Naive element-by-element references for the kernels' tests: every element addressed by
//! `(block, token, head, element)` and its `dtype_bytes` bytes copied one by one.

use std::ops::Range;

use crate::{BlockShape, Layout};

/// Byte offset of element `e` of `token`, `head` in block `block`.
pub fn at(
    shape: &BlockShape,
    layout: Layout,
    block: usize,
    token: usize,
    head: usize,
    e: usize,
) -> usize {
    let BlockShape {
        tokens,
        heads,
        head_dim,
        dtype_bytes,
    } = *shape;
    let in_block = match layout {
        Layout::Nhd => (token * heads + head) * head_dim + e,
        Layout::Hnd => (head * tokens + token) * head_dim + e,
    };
    (block * tokens * heads * head_dim + in_block) * dtype_bytes
}

fn block_len(shape: &BlockShape) -> usize {
    shape.tokens * shape.heads * shape.head_dim * shape.dtype_bytes
}

/// Calls `f(block, token, head, element)` for every element of `blocks` blocks of `shape`.
fn each(shape: &BlockShape, blocks: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    for b in 0..blocks {
        for t in 0..shape.tokens {
            for h in 0..shape.heads {
                for e in 0..shape.head_dim {
                    f(b, t, h, e);
                }
            }
        }
    }
}

// Byte by byte on purpose: the reference shares no copy routine with the kernels.
#[allow(clippy::manual_memcpy)]
fn copy_element(dst: &mut [u8], to: usize, src: &[u8], from: usize, dtype: usize) {
    for k in 0..dtype {
        dst[to + k] = src[from + k];
    }
}

pub fn permute(src: &[u8], shape: BlockShape, from: Layout, to: Layout) -> Vec<u8> {
    let mut dst = vec![0xAA; src.len()];
    let blocks = src.len() / block_len(&shape);
    each(&shape, blocks, |b, t, h, e| {
        let (s, d) = (at(&shape, from, b, t, h, e), at(&shape, to, b, t, h, e));
        copy_element(&mut dst, d, src, s, shape.dtype_bytes);
    });
    dst
}

pub fn regroup_gather(src: &[u8], sub: BlockShape, ratio: usize, layout: Layout) -> Vec<u8> {
    let n = src.len() / block_len(&sub);
    let big = sub.with_tokens(sub.tokens * ratio);
    let big_blocks = n.div_ceil(ratio);
    let mut dst = vec![0xAA; big_blocks * block_len(&big)];
    each(&big, big_blocks, |b, t, h, e| {
        let (j, st) = (t / sub.tokens, t % sub.tokens);
        let s = b * ratio + j;
        let d = at(&big, layout, b, t, h, e);
        if s < n {
            copy_element(
                &mut dst,
                d,
                src,
                at(&sub, layout, s, st, h, e),
                sub.dtype_bytes,
            );
        } else {
            dst[d..d + sub.dtype_bytes].fill(0);
        }
    });
    dst
}

pub fn regroup_split(
    src: &[u8],
    sub: BlockShape,
    ratio: usize,
    layout: Layout,
    n: usize,
) -> Vec<u8> {
    let big = sub.with_tokens(sub.tokens * ratio);
    let mut dst = vec![0xAA; n * block_len(&sub)];
    each(&sub, n, |s, t, h, e| {
        let (b, j) = (s / ratio, s % ratio);
        let from = at(&big, layout, b, j * sub.tokens + t, h, e);
        copy_element(
            &mut dst,
            at(&sub, layout, s, t, h, e),
            src,
            from,
            sub.dtype_bytes,
        );
    });
    dst
}

pub fn slice_heads(src: &[u8], shape: BlockShape, heads: Range<usize>, layout: Layout) -> Vec<u8> {
    let n = src.len() / block_len(&shape);
    let out = shape.with_heads(heads.len());
    let mut dst = vec![0xAA; n * block_len(&out)];
    each(&out, n, |b, t, h, e| {
        let from = at(&shape, layout, b, t, heads.start + h, e);
        copy_element(
            &mut dst,
            at(&out, layout, b, t, h, e),
            src,
            from,
            shape.dtype_bytes,
        );
    });
    dst
}

pub fn gather_heads(sources: &[&[u8]], shape: BlockShape, layout: Layout) -> Vec<u8> {
    let n = sources[0].len() / block_len(&shape);
    let out = shape.with_heads(shape.heads * sources.len());
    let mut dst = vec![0xAA; n * block_len(&out)];
    each(&out, n, |b, t, h, e| {
        let (i, sh) = (h / shape.heads, h % shape.heads);
        let from = at(&shape, layout, b, t, sh, e);
        copy_element(
            &mut dst,
            at(&out, layout, b, t, h, e),
            sources[i],
            from,
            shape.dtype_bytes,
        );
    });
    dst
}

/// Deterministic pseudo-random bytes (tests need no `rand` for this).
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = (seed ^ 0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub mod strategy {
    //! Proptest strategies over the shapes the kernels meet in practice.
    use proptest::prelude::*;

    use crate::{BlockShape, Layout};

    /// Block sizes 16/32/64, heads 1/2/8, head_dim 64/128, dtype 1/2/4 bytes.
    pub fn shape() -> impl Strategy<Value = BlockShape> {
        (
            prop::sample::select(vec![16usize, 32, 64]),
            prop::sample::select(vec![1usize, 2, 8]),
            prop::sample::select(vec![64usize, 128]),
            prop::sample::select(vec![1usize, 2, 4]),
        )
            .prop_map(|(t, h, d, b)| BlockShape::new(t, h, d, b))
    }

    pub fn layout() -> impl Strategy<Value = Layout> {
        prop_oneof![Just(Layout::Nhd), Just(Layout::Hnd)]
    }

    /// 1 to 3 threads (the parallel path needs ≥ 1 MiB, which the larger shapes reach).
    pub fn threads() -> impl Strategy<Value = usize> {
        1usize..=3
    }
}
