//! Running a per-block kernel over many blocks on scoped threads.
#![forbid(unsafe_code)]

/// Below this many destination bytes a kernel runs on the calling thread alone: starting a
/// thread (tens of microseconds) costs more than it saves on less.
pub const PAR_MIN_BYTES: usize = 1 << 20;

/// The machine's parallelism (1 when unknown): a reasonable `threads` argument.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Calls `f(index, block)` for every `block_bytes`-byte block of `dst`, in order on one thread or
/// on up to `threads` threads each taking one contiguous run of blocks.
///
/// `dst.len()` is a multiple of `block_bytes` and `block_bytes > 0` (the callers checked).
pub(crate) fn for_each_block<F>(dst: &mut [u8], block_bytes: usize, threads: usize, f: F)
where
    F: Fn(usize, &mut [u8]) + Sync,
{
    let blocks = dst.len() / block_bytes.max(1);
    let threads = if dst.len() < PAR_MIN_BYTES {
        1
    } else {
        threads.clamp(1, blocks.max(1))
    };
    if threads == 1 {
        for (index, block) in dst.chunks_exact_mut(block_bytes).enumerate() {
            f(index, block);
        }
        return;
    }
    let per_thread = blocks.div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let mut runs = dst.chunks_mut(per_thread * block_bytes).enumerate();
        // The calling thread takes the first run itself.
        let first = runs.next();
        for (run, chunk) in runs {
            scope.spawn(move || {
                for (i, block) in chunk.chunks_exact_mut(block_bytes).enumerate() {
                    f(run * per_thread + i, block);
                }
            });
        }
        if let Some((_, chunk)) = first {
            for (i, block) in chunk.chunks_exact_mut(block_bytes).enumerate() {
                f(i, block);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_is_visited_once_with_its_index() {
        for threads in [1, 2, 3, 7] {
            for blocks in [1usize, 2, 5, 64] {
                let block = PAR_MIN_BYTES / 4;
                let mut dst = vec![0u8; blocks * block];
                for_each_block(&mut dst, block, threads, |i, b| {
                    for x in b.iter_mut() {
                        *x = x.wrapping_add(i as u8 + 1);
                    }
                });
                for (i, b) in dst.chunks_exact(block).enumerate() {
                    assert!(
                        b.iter().all(|&x| x == i as u8 + 1),
                        "{threads} {blocks} {i}"
                    );
                }
            }
        }
    }
}
