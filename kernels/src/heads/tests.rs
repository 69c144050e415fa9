use proptest::prelude::*;

use super::*;
use crate::reference::{self, strategy};

/// A shape and a non-empty head range inside it.
fn shape_and_range() -> impl Strategy<Value = (BlockShape, Range<usize>)> {
    strategy::shape().prop_flat_map(|shape| {
        (0..shape.heads)
            .prop_flat_map(move |start| (Just(start), start + 1..=shape.heads))
            .prop_map(move |(start, end)| (shape, start..end))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn slice_matches_the_naive_reference(
        (shape, heads) in shape_and_range(),
        blocks in 0usize..=5,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(blocks * shape.block_bytes().unwrap(), seed);
        let out = shape.with_heads(heads.len());
        let mut dst = vec![0x55; blocks * out.block_bytes().unwrap()];
        slice_heads(&src, &mut dst, shape, heads.clone(), layout, threads).unwrap();
        prop_assert!(dst == reference::slice_heads(&src, shape, heads, layout));
    }

    #[test]
    fn gather_matches_the_naive_reference(
        shape in strategy::shape(),
        sources in 1usize..=4,
        blocks in 0usize..=4,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let parts: Vec<Vec<u8>> = (0..sources)
            .map(|i| reference::bytes(blocks * shape.block_bytes().unwrap(), seed + i as u64))
            .collect();
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let mut dst = vec![0x55; sources * parts[0].len()];
        gather_heads(&parts, &mut dst, shape, layout, threads).unwrap();
        prop_assert!(dst == reference::gather_heads(&parts, shape, layout));
    }

    /// Slicing a block into equal head ranges and gathering them back gives the block.
    #[test]
    fn gather_after_slice_is_the_identity(
        shape in strategy::shape(),
        blocks in 1usize..=4,
        layout in strategy::layout(),
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(blocks * shape.block_bytes().unwrap(), seed);
        for parts in [1, 2, shape.heads].into_iter().filter(|p| shape.heads % p == 0) {
            let each = shape.heads / parts;
            let slices: Vec<Vec<u8>> = (0..parts)
                .map(|p| {
                    let mut dst = vec![0; src.len() / parts];
                    slice_heads(&src, &mut dst, shape, p * each..(p + 1) * each, layout, threads)
                        .unwrap();
                    dst
                })
                .collect();
            let slices: Vec<&[u8]> = slices.iter().map(Vec::as_slice).collect();
            let mut back = vec![0; src.len()];
            gather_heads(&slices, &mut back, shape.with_heads(each), layout, threads).unwrap();
            prop_assert!(back == src, "{parts} parts");
        }
    }
}

#[test]
fn threads_do_not_change_the_result() {
    let shape = BlockShape::new(16, 8, 128, 2);
    let src = reference::bytes(80 * shape.block_bytes().unwrap(), 5);
    for layout in [Layout::Nhd, Layout::Hnd] {
        let mut one = vec![0; src.len() / 2];
        let mut two = vec![1; src.len() / 2];
        slice_heads(&src, &mut one, shape, 4..8, layout, 1).unwrap();
        slice_heads(&src, &mut two, shape, 4..8, layout, 2).unwrap();
        assert_eq!(one, two);
        let mut back = vec![0; src.len() * 2];
        let mut back2 = vec![1; src.len() * 2];
        gather_heads(&[&src, &src], &mut back, shape, layout, 1).unwrap();
        gather_heads(&[&src, &src], &mut back2, shape, layout, 2).unwrap();
        assert_eq!(back, back2);
    }
}

/// NHD slices that pass over the skipped heads (skipped ≤ copied: before the range, after it,
/// on both sides) and those that do not, against the reference.
#[test]
fn nhd_slices_with_and_without_the_pass_over_the_gap() {
    let shape = BlockShape::new(16, 8, 128, 2);
    let src = reference::bytes(3 * shape.block_bytes().unwrap(), 11);
    for heads in [0..4, 4..8, 2..6, 1..8, 0..7, 0..8, 3..4, 0..2, 6..8] {
        let out = shape.with_heads(heads.len());
        let mut dst = vec![0x55; 3 * out.block_bytes().unwrap()];
        slice_heads(&src, &mut dst, shape, heads.clone(), Layout::Nhd, 1).unwrap();
        assert!(
            dst == reference::slice_heads(&src, shape, heads.clone(), Layout::Nhd),
            "{heads:?}"
        );
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let shape = BlockShape::new(16, 8, 64, 2);
    let block = shape.block_bytes().unwrap();
    let src = vec![1u8; 2 * block];
    let mut dst = vec![0u8; block];
    for (start, end) in [(0, 0), (3, 2), (4, 9)] {
        assert_eq!(
            slice_heads(&src, &mut dst, shape, start..end, Layout::Nhd, 1),
            Err(KernelError::HeadRange {
                start,
                end,
                heads: 8
            })
        );
    }
    assert_eq!(
        slice_heads(&src, &mut dst[1..], shape, 0..4, Layout::Nhd, 1),
        Err(KernelError::Length {
            buffer: "dst",
            expected: block,
            actual: block - 1
        })
    );
    assert_eq!(
        gather_heads(&[], &mut dst, shape, Layout::Hnd, 1),
        Err(KernelError::Zero { field: "sources" })
    );
    assert_eq!(
        gather_heads(&[&src, &src[block..]], &mut dst, shape, Layout::Hnd, 1),
        Err(KernelError::Length {
            buffer: "source",
            expected: 2 * block,
            actual: block
        })
    );
    assert_eq!(
        gather_heads(&[&src], &mut dst, shape, Layout::Hnd, 1),
        Err(KernelError::Length {
            buffer: "dst",
            expected: 2 * block,
            actual: block
        })
    );
    assert!(dst.iter().all(|&b| b == 0));
}

proptest! {
    #[test]
    fn never_panics(
        sizes in prop::array::uniform4(0usize..9),
        start in 0usize..10,
        end in 0usize..10,
        sources in 0usize..4,
        src_len in 0usize..800,
        dst_len in 0usize..800,
        threads in 0usize..3,
        layout in strategy::layout(),
    ) {
        let shape = BlockShape::new(sizes[0], sizes[1], sizes[2], sizes[3]);
        let src = vec![1u8; src_len];
        let mut dst = vec![0u8; dst_len];
        let _ = slice_heads(&src, &mut dst, shape, start..end, layout, threads);
        let parts = vec![src.as_slice(); sources];
        let _ = gather_heads(&parts, &mut dst, shape, layout, threads);
    }
}
