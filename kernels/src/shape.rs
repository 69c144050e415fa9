//! Block shapes and layouts, and the checked sizes every kernel derives from them.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::KernelError;

/// Memory layout of one kernel block (the same two as `kvhandoff_protocol::KvLayout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Layout {
    /// Tokens outermost: `[tokens, heads, head_dim]`.
    Nhd,
    /// Heads outermost: `[heads, tokens, head_dim]`.
    Hnd,
}

impl Layout {
    /// The other layout.
    pub fn other(self) -> Layout {
        match self {
            Layout::Nhd => Layout::Hnd,
            Layout::Hnd => Layout::Nhd,
        }
    }
}

/// The shape of one kernel block of one attention region (K, V or latent).
///
/// From a `KvGeometry`: `tokens = kernel_block_size`, `heads = heads_per_rank()`, `head_dim`,
/// `dtype_bytes`; `block_bytes()` is then its `attention_block_len()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockShape {
    /// Tokens per kernel block.
    pub tokens: usize,
    /// KV heads in the block.
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Bytes per element.
    pub dtype_bytes: usize,
}

impl BlockShape {
    /// A shape from its four sizes.
    pub const fn new(tokens: usize, heads: usize, head_dim: usize, dtype_bytes: usize) -> Self {
        BlockShape {
            tokens,
            heads,
            head_dim,
            dtype_bytes,
        }
    }

    /// Bytes of one row: one token of one head (`head_dim × dtype_bytes`).
    ///
    /// # Errors
    /// [`KernelError::Zero`] for a zero size, [`KernelError::Overflow`] on overflow.
    pub fn row_bytes(&self) -> Result<usize, KernelError> {
        Ok(self.dims()?.row)
    }

    /// Bytes of one block (`tokens × heads × head_dim × dtype_bytes`).
    ///
    /// # Errors
    /// [`KernelError::Zero`] for a zero size, [`KernelError::Overflow`] on overflow.
    pub fn block_bytes(&self) -> Result<usize, KernelError> {
        Ok(self.dims()?.block)
    }

    /// The same shape with another token count.
    pub const fn with_tokens(self, tokens: usize) -> Self {
        BlockShape { tokens, ..self }
    }

    /// The same shape with another head count.
    pub const fn with_heads(self, heads: usize) -> Self {
        BlockShape { heads, ..self }
    }

    /// Checks every size and derives the byte sizes.
    pub(crate) fn dims(&self) -> Result<Dims, KernelError> {
        for (field, value) in [
            ("tokens", self.tokens),
            ("heads", self.heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
        ] {
            if value == 0 {
                return Err(KernelError::Zero { field });
            }
        }
        let overflow = KernelError::Overflow { what: "block" };
        let row = self
            .head_dim
            .checked_mul(self.dtype_bytes)
            .ok_or(overflow.clone())?;
        let block = [self.tokens, self.heads]
            .into_iter()
            .try_fold(row, usize::checked_mul)
            .ok_or(overflow)?;
        Ok(Dims {
            tokens: self.tokens,
            heads: self.heads,
            row,
            block,
        })
    }
}

/// A checked shape: every product below fits in `usize` and nothing is zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dims {
    pub tokens: usize,
    pub heads: usize,
    /// Bytes of one row (one token of one head).
    pub row: usize,
    /// Bytes of one block.
    pub block: usize,
}

impl Dims {
    /// Byte offset of the row of `token`, `head` inside a block of this shape.
    #[inline]
    pub fn offset(&self, layout: Layout, token: usize, head: usize) -> usize {
        match layout {
            Layout::Nhd => (token * self.heads + head) * self.row,
            Layout::Hnd => (head * self.tokens + token) * self.row,
        }
    }
}

/// How many `block`-byte blocks `buffer` holds, refusing a partial block.
pub(crate) fn whole_blocks(
    buffer: &'static str,
    len: usize,
    block_bytes: usize,
) -> Result<usize, KernelError> {
    if len % block_bytes != 0 {
        return Err(KernelError::NotWholeBlocks {
            buffer,
            len,
            block_bytes,
        });
    }
    Ok(len / block_bytes)
}

/// Refuses a buffer whose length is not `expected`.
pub(crate) fn exact_len(
    buffer: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if actual != expected {
        return Err(KernelError::Length {
            buffer,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Refuses zero threads.
pub(crate) fn check_threads(threads: usize) -> Result<(), KernelError> {
    if threads == 0 {
        return Err(KernelError::Zero { field: "threads" });
    }
    Ok(())
}
