use proptest::prelude::*;

use super::*;
use crate::reference::{self, strategy};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matches_the_naive_reference(
        shape in strategy::shape(),
        from in strategy::layout(),
        blocks in 0usize..=5,
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(blocks * shape.block_bytes().unwrap(), seed);
        let mut dst = vec![0x55; src.len()];
        permute(&src, &mut dst, shape, from, from.other(), threads).unwrap();
        prop_assert!(dst == reference::permute(&src, shape, from, from.other()));
    }

    #[test]
    fn permuting_twice_is_the_identity(
        shape in strategy::shape(),
        from in strategy::layout(),
        blocks in 1usize..=5,
        threads in strategy::threads(),
        seed in any::<u64>(),
    ) {
        let src = reference::bytes(blocks * shape.block_bytes().unwrap(), seed);
        let mut there = vec![0; src.len()];
        let mut back = vec![0; src.len()];
        permute(&src, &mut there, shape, from, from.other(), threads).unwrap();
        permute(&there, &mut back, shape, from.other(), from, threads).unwrap();
        prop_assert!(back == src);
    }
}

#[test]
fn the_same_layout_is_a_copy() {
    let shape = BlockShape::new(16, 2, 64, 2);
    let src = reference::bytes(3 * shape.block_bytes().unwrap(), 7);
    let mut dst = vec![0; src.len()];
    permute(&src, &mut dst, shape, Layout::Hnd, Layout::Hnd, 2).unwrap();
    assert_eq!(dst, src);
}

/// A threaded run over many blocks (above `PAR_MIN_BYTES`) equals the single-threaded one.
#[test]
fn threads_do_not_change_the_result() {
    let shape = BlockShape::new(16, 8, 128, 2);
    let src = reference::bytes(64 * shape.block_bytes().unwrap(), 3);
    assert!(src.len() >= crate::PAR_MIN_BYTES);
    let mut one = vec![0; src.len()];
    let mut three = vec![0; src.len()];
    permute(&src, &mut one, shape, Layout::Nhd, Layout::Hnd, 1).unwrap();
    permute(&src, &mut three, shape, Layout::Nhd, Layout::Hnd, 3).unwrap();
    assert_eq!(one, three);
    assert_eq!(
        one,
        reference::permute(&src, shape, Layout::Nhd, Layout::Hnd)
    );
}

#[test]
fn bad_arguments_are_typed_errors_and_nothing_is_written() {
    let shape = BlockShape::new(16, 2, 64, 2);
    let block = shape.block_bytes().unwrap();
    let src = vec![1u8; 2 * block];
    let mut dst = vec![0u8; 2 * block];
    let run = |src: &[u8], dst: &mut [u8], shape, threads| {
        permute(src, dst, shape, Layout::Nhd, Layout::Hnd, threads)
    };
    assert_eq!(
        run(&src, &mut dst, shape.with_heads(0), 1),
        Err(KernelError::Zero { field: "heads" })
    );
    assert_eq!(
        run(&src, &mut dst, shape, 0),
        Err(KernelError::Zero { field: "threads" })
    );
    assert_eq!(
        run(&src[1..], &mut dst, shape, 1),
        Err(KernelError::NotWholeBlocks {
            buffer: "src",
            len: 2 * block - 1,
            block_bytes: block
        })
    );
    assert_eq!(
        run(&src, &mut dst[..block], shape, 1),
        Err(KernelError::Length {
            buffer: "dst",
            expected: 2 * block,
            actual: block
        })
    );
    let huge = BlockShape::new(usize::MAX / 2, 4, 64, 2);
    assert_eq!(
        run(&src, &mut dst, huge, 1),
        Err(KernelError::Overflow { what: "block" })
    );
    assert!(dst.iter().all(|&b| b == 0));
}

proptest! {
    /// Whatever the sizes and buffers, the kernel answers; it never panics.
    #[test]
    fn never_panics(
        sizes in prop::array::uniform4(0usize..9),
        src_len in 0usize..600,
        dst_len in 0usize..600,
        threads in 0usize..3,
    ) {
        let shape = BlockShape::new(sizes[0], sizes[1], sizes[2], sizes[3]);
        let src = vec![1u8; src_len];
        let mut dst = vec![0u8; dst_len];
        let _ = permute(&src, &mut dst, shape, Layout::Hnd, Layout::Nhd, threads);
    }
}
