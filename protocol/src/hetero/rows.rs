//! Rows and pieces: where one row (one token of one head) of a region lives in a run of blocks,
//! and the merging of row copies into the fewest contiguous pieces.

use std::ops::Range;

use serde::Serialize;

use super::transforms::BlockFormat;
use super::{HeteroError, MAX_PIECES};
use crate::geometry::KvLayout;

/// One contiguous copy: `len` bytes from `src` to `dst` (addresses in each rank's space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Blocks of one region as a transform or the wire sees them: block `i` at `addrs[i]`, holding
/// tokens `first_token + i × format.tokens ..`, every block in `format`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct BlockRun {
    /// Address of each block, in token order.
    pub addrs: Vec<u64>,
    /// The token of the first block's first row.
    pub first_token: u64,
    /// The blocks' format.
    pub format: BlockFormat,
    /// Bytes of one row.
    pub row: u64,
}

impl BlockRun {
    /// Blocks laid end to end from `base` (a staging area).
    pub fn contiguous(
        base: u64,
        blocks: u64,
        first_token: u64,
        format: BlockFormat,
        row: u64,
    ) -> Option<BlockRun> {
        let len = format.block_bytes(row)?;
        let mut addrs = Vec::new();
        addrs.try_reserve(usize::try_from(blocks).ok()?).ok()?;
        for i in 0..blocks {
            addrs.push(base.checked_add(i.checked_mul(len)?)?);
        }
        Some(BlockRun {
            addrs,
            first_token,
            format,
            row,
        })
    }

    /// One past the last token the blocks hold.
    pub fn end_token(&self) -> u64 {
        self.first_token + self.addrs.len() as u64 * u64::from(self.format.tokens)
    }

    /// Bytes of one block.
    pub fn block_len(&self) -> u64 {
        self.format.block_bytes(self.row).unwrap_or(0)
    }

    /// Address of the row of `token` and block-local `head`; the token must be inside the run.
    pub fn row_addr(&self, token: u64, head: u64) -> u64 {
        let tokens = u64::from(self.format.tokens);
        let rel = token - self.first_token;
        self.addrs[(rel / tokens) as usize] + self.format.row_offset(rel % tokens, head, self.row)
    }
}

/// Collects pieces, merging each with the previous one when both sides continue it.
#[derive(Debug, Default)]
pub(crate) struct Merger {
    pub pieces: Vec<Piece>,
    pub bytes: u64,
    /// Pieces before this index are closed: the next push never extends them (a region
    /// boundary: a descriptor must stay inside one registration).
    closed: usize,
}

impl Merger {
    /// Closes the pieces so far: the next piece starts a new one even if contiguous.
    pub fn cut(&mut self) {
        self.closed = self.pieces.len();
    }

    pub fn push(&mut self, src: u64, dst: u64, len: u64) -> Result<(), HeteroError> {
        self.bytes = self.bytes.saturating_add(len);
        let open = self.pieces.len() > self.closed;
        if let Some(last) = self.pieces.last_mut().filter(|_| open) {
            if last.src.checked_add(last.len) == Some(src)
                && last.dst.checked_add(last.len) == Some(dst)
            {
                last.len += len;
                return Ok(());
            }
        }
        if self.pieces.len() >= MAX_PIECES {
            return Err(HeteroError::TooManyPieces { limit: MAX_PIECES });
        }
        self.pieces.push(Piece { src, dst, len });
        Ok(())
    }
}

/// Copies the rows of `tokens` × link heads `0..heads` from `src` (whose link heads start at
/// block head `src_head`) to `dst` (at `dst_head`), walking the source in address order so that
/// runs contiguous on both sides merge into one piece.
pub(crate) fn copy_rows(
    src: &BlockRun,
    src_head: u32,
    dst: &BlockRun,
    dst_head: u32,
    tokens: Range<u64>,
    heads: u32,
    out: &mut Merger,
) -> Result<(), HeteroError> {
    let t = u64::from(src.format.tokens);
    let row = src.row;
    for (i, _) in src.addrs.iter().enumerate() {
        let block_start = src.first_token + i as u64 * t;
        let lo = block_start.max(tokens.start);
        let hi = (block_start + t).min(tokens.end);
        if lo >= hi {
            continue;
        }
        let mut one = |token: u64, h: u32| {
            let s = src.row_addr(token, u64::from(src_head + h));
            let d = dst.row_addr(token, u64::from(dst_head + h));
            out.push(s, d, row)
        };
        if src.format.layout == KvLayout::Nhd || src.format.heads == 1 {
            for token in lo..hi {
                for h in 0..heads {
                    one(token, h)?;
                }
            }
        } else {
            for h in 0..heads {
                for token in lo..hi {
                    one(token, h)?;
                }
            }
        }
    }
    Ok(())
}
