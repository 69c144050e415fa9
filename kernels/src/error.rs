//! The one error type of the crate.
#![forbid(unsafe_code)]

/// Why a kernel refused its arguments, or why the CUDA side could not do its part.
///
/// Every kernel checks its arguments before it touches a byte: on an error, nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A size that must be positive is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The argument or shape field.
        field: &'static str,
    },
    /// A byte size does not fit in `usize`.
    #[error("the {what} size in bytes overflows")]
    Overflow {
        /// What was being sized.
        what: &'static str,
    },
    /// A buffer is not a whole number of blocks.
    #[error("{buffer} holds {len} bytes: not a whole number of {block_bytes}-byte blocks")]
    NotWholeBlocks {
        /// Which buffer.
        buffer: &'static str,
        /// Its length.
        len: usize,
        /// The block length it must be a multiple of.
        block_bytes: usize,
    },
    /// A buffer does not have the length the other arguments imply.
    #[error("{buffer} holds {actual} bytes but {expected} are needed")]
    Length {
        /// Which buffer.
        buffer: &'static str,
        /// The length implied by the other arguments.
        expected: usize,
        /// Its length.
        actual: usize,
    },
    /// A head range is empty or not inside the source's heads.
    #[error("head range {start}..{end} is empty or not inside 0..{heads}")]
    HeadRange {
        /// First head of the range.
        start: usize,
        /// One past the last head.
        end: usize,
        /// Heads of the source block.
        heads: usize,
    },
    /// Two shapes that must agree do not.
    #[error("{what} differ: {left} vs {right}")]
    Mismatch {
        /// What differs.
        what: &'static str,
        /// The source side's value.
        left: usize,
        /// The destination side's value.
        right: usize,
    },
    /// NVRTC could not be loaded (`libnvrtc.so.12` not on the loader's path).
    #[error("NVRTC is not available: {reason}")]
    NvrtcUnavailable {
        /// What was searched.
        reason: String,
    },
    /// NVRTC refused a CUDA kernel's source.
    #[error("NVRTC could not compile {kernel}: {log}")]
    Compile {
        /// The kernel's source name.
        kernel: &'static str,
        /// NVRTC's error and log.
        log: String,
    },
    /// The CUDA driver failed a call.
    #[error("CUDA driver: {op} failed: {message}")]
    Driver {
        /// The operation.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
    /// A CUDA kernel's output differed from the CPU kernel's on the same input.
    #[error("CUDA kernel {kernel} differs from the CPU kernel at byte {first_difference}")]
    CudaMismatch {
        /// The kernel.
        kernel: String,
        /// First differing byte offset.
        first_difference: usize,
    },
}
