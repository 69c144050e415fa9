//! The one way the kernels copy a run of bytes.
#![forbid(unsafe_code)]

/// Runs longer than this and shorter than [`ONE_CALL_FROM`] are copied in pieces of this size.
pub(crate) const PIECE: usize = 256;
/// From this length on a run is one `copy_from_slice`.
pub(crate) const ONE_CALL_FROM: usize = 4096;

/// Copies `src` into `dst` (same length).
///
/// Measured on the reference machine (glibc 2.36, AMD EPYC; a 64 MiB buffer copied as runs of
/// one size, one `copy_from_slice` each): runs of 256–512 B and of 3 KiB and more take 5.5–7.4
/// ms, as one whole-buffer copy does (6.9–7.9 ms), but runs of 768 B–2 KiB take 9.7–16.4 ms:
/// glibc's path between eight vectors and its `rep movsb` threshold is slow there. The same
/// runs copied in 256-byte pieces take 5.7–7.4 ms, so every run between [`PIECE`] and
/// [`ONE_CALL_FROM`] is split.
#[inline]
pub(crate) fn copy_run(dst: &mut [u8], src: &[u8]) {
    if src.len() > PIECE && src.len() < ONE_CALL_FROM {
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
    } else {
        dst.copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_is_copied_whole() {
        for len in [0, 1, 255, 256, 257, 1000, 1024, 4095, 4096, 5000] {
            let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            copy_run(&mut dst, &src);
            assert_eq!(dst, src, "{len}");
        }
    }
}
