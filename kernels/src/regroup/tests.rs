use proptest::prelude::*;

use super::*;
use crate::reference::{self, strategy};

fn big_len(sub: BlockShape, ratio: usize, n: usize) -> usize {
    n.div_ceil(ratio) * sub.with_tokens(sub.tokens * ratio).block_bytes().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn gather_matches_the_naive_reference(
        sub in strategy::shape(),
        ratio in 1usize..=4,
        n in 0usize..=9,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(n * sub.block_bytes().unwrap(), seed);
        let mut dst = vec![0x55; big_len(sub, ratio, n)];
        regroup_gather(&src, &mut dst, sub, ratio, layout, threads).unwrap();
        prop_assert!(dst == reference::regroup_gather(&src, sub, ratio, layout));
    }

    #[test]
    fn split_matches_the_naive_reference(
        sub in strategy::shape(),
        ratio in 1usize..=4,
        n in 0usize..=9,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(big_len(sub, ratio, n), seed);
        let mut dst = vec![0x55; n * sub.block_bytes().unwrap()];
        regroup_split(&src, &mut dst, sub, ratio, layout, threads).unwrap();
        prop_assert!(dst == reference::regroup_split(&src, sub, ratio, layout, n));
    }

    /// split ∘ gather = id on the sub-blocks, however many there are.
    #[test]
    fn split_after_gather_is_the_identity(
        sub in strategy::shape(),
        ratio in 1usize..=4,
        n in 1usize..=9,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(n * sub.block_bytes().unwrap(), seed);
        let mut big = vec![0; big_len(sub, ratio, n)];
        let mut back = vec![0; src.len()];
        regroup_gather(&src, &mut big, sub, ratio, layout, threads).unwrap();
        regroup_split(&big, &mut back, sub, ratio, layout, threads).unwrap();
        prop_assert!(back == src);
    }

    /// gather ∘ split = id on fully covered large blocks.
    #[test]
    fn gather_after_split_is_the_identity(
        sub in strategy::shape(),
        ratio in 1usize..=4,
        big_blocks in 1usize..=3,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let n = big_blocks * ratio;
        let src = reference::bytes(big_len(sub, ratio, n), seed);
        let mut small = vec![0; n * sub.block_bytes().unwrap()];
        let mut back = vec![0; src.len()];
        regroup_split(&src, &mut small, sub, ratio, layout, threads).unwrap();
        regroup_gather(&small, &mut back, sub, ratio, layout, threads).unwrap();
        prop_assert!(back == src);
    }
}

/// Five 16-token blocks gathered by 4: the second large block holds one source block, and its
/// tokens 16..64 are zero in both layouts, whatever was there before.
#[test]
fn the_tail_of_a_partly_covered_block_is_zeroed() {
    let sub = BlockShape::new(16, 2, 64, 2);
    let row = sub.row_bytes().unwrap();
    let big = sub.with_tokens(64);
    let src = vec![0xEEu8; 5 * sub.block_bytes().unwrap()];
    for layout in [Layout::Nhd, Layout::Hnd] {
        let mut dst = vec![0x77u8; 2 * big.block_bytes().unwrap()];
        regroup_gather(&src, &mut dst, sub, 4, layout, 1).unwrap();
        let (first, second) = dst.split_at(big.block_bytes().unwrap());
        assert!(first.iter().all(|&b| b == 0xEE), "{layout:?}");
        for h in 0..2 {
            for t in 0..64 {
                let at = reference::at(&big, layout, 0, t, h, 0);
                let want = if t < 16 { 0xEE } else { 0 };
                assert!(
                    second[at..at + row].iter().all(|&b| b == want),
                    "{layout:?} head {h} token {t}"
                );
            }
        }
    }
}

/// In HND a large block is each head's rows of sub-block 0, then of sub-block 1, ...: head 1's
/// first row comes from sub-block 0, head 0's row 16 from sub-block 1.
#[test]
fn hnd_gather_interleaves_heads() {
    let sub = BlockShape::new(16, 2, 64, 1);
    let sb = sub.block_bytes().unwrap();
    let mut src = vec![0u8; 2 * sb];
    src[..sb].fill(1);
    src[sb..].fill(2);
    let mut dst = vec![0u8; 2 * sb];
    regroup_gather(&src, &mut dst, sub, 2, Layout::Hnd, 1).unwrap();
    let big = sub.with_tokens(32);
    assert_eq!(dst[reference::at(&big, Layout::Hnd, 0, 0, 1, 0)], 1);
    assert_eq!(dst[reference::at(&big, Layout::Hnd, 0, 16, 0, 0)], 2);
    assert_eq!(dst[reference::at(&big, Layout::Hnd, 0, 15, 1, 0)], 1);
    assert_eq!(dst[reference::at(&big, Layout::Hnd, 0, 31, 1, 0)], 2);
}

#[test]
fn threads_do_not_change_the_result() {
    let sub = BlockShape::new(16, 8, 128, 2);
    let n = 61;
    let src = reference::bytes(n * sub.block_bytes().unwrap(), 11);
    let mut one = vec![0; big_len(sub, 4, n)];
    let mut two = vec![1; one.len()];
    regroup_gather(&src, &mut one, sub, 4, Layout::Hnd, 1).unwrap();
    regroup_gather(&src, &mut two, sub, 4, Layout::Hnd, 2).unwrap();
    assert_eq!(one, two);
    let mut back = vec![0; src.len()];
    regroup_split(&two, &mut back, sub, 4, Layout::Hnd, 2).unwrap();
    assert_eq!(back, src);
}

#[test]
fn bad_arguments_are_typed_errors() {
    let sub = BlockShape::new(16, 2, 64, 2);
    let sb = sub.block_bytes().unwrap();
    let src = vec![1u8; 3 * sb];
    let mut dst = vec![0u8; 2 * 4 * sb];
    assert_eq!(
        regroup_gather(&src, &mut dst, sub, 0, Layout::Hnd, 1),
        Err(KernelError::Zero { field: "ratio" })
    );
    assert_eq!(
        regroup_gather(&src, &mut dst, sub, 4, Layout::Hnd, 1),
        Err(KernelError::Length {
            buffer: "dst",
            expected: 4 * sb,
            actual: 8 * sb
        })
    );
    assert_eq!(
        regroup_split(&dst, &mut dst.clone()[..3 * sb + 1], sub, 4, Layout::Nhd, 1),
        Err(KernelError::NotWholeBlocks {
            buffer: "dst",
            len: 3 * sb + 1,
            block_bytes: sb
        })
    );
    assert_eq!(
        regroup_gather(&src, &mut dst, sub, usize::MAX, Layout::Hnd, 1),
        Err(KernelError::Overflow {
            what: "regrouped block"
        })
    );
    assert!(dst.iter().all(|&b| b == 0));
}

proptest! {
    #[test]
    fn never_panics(
        sizes in prop::array::uniform4(0usize..9),
        ratio in 0usize..5,
        src_len in 0usize..800,
        dst_len in 0usize..800,
        threads in 0usize..3,
        layout in strategy::layout(),
    ) {
        let shape = BlockShape::new(sizes[0], sizes[1], sizes[2], sizes[3]);
        let src = vec![1u8; src_len];
        let mut dst = vec![0u8; dst_len];
        let _ = regroup_gather(&src, &mut dst, shape, ratio, layout, threads);
        let _ = regroup_split(&src, &mut dst, shape, ratio, layout, threads);
    }
}
