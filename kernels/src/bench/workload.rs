//! What each benchmarked kernel is given: its inputs and output, sized from one geometry.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::{
    gather_heads, permute, regroup_gather, regroup_split, slice_heads, BlockShape, KernelError,
    Layout,
};

/// The geometry every kernel of a run works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Shape of the (small) kernel block.
    pub shape: BlockShape,
    /// Kernel blocks in a buffer.
    pub blocks: usize,
    /// Regroup: kernel blocks per large block.
    pub ratio: usize,
    /// Head slicing: the ranks one block's heads are split over (heads `[0, H / tp_split)` are
    /// sliced; `tp_split` blocks of `H / tp_split` heads are gathered).
    pub tp_split: usize,
}

/// One kernel and direction, as benchmarked and as run on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Case {
    /// [`permute`] from this layout to the other.
    Permute {
        /// The source layout.
        from: Layout,
    },
    /// [`regroup_gather`] of `ratio` kernel blocks into one.
    RegroupGather {
        /// Layout of both sides.
        layout: Layout,
    },
    /// [`regroup_split`] of one large block into `ratio`.
    RegroupSplit {
        /// Layout of both sides.
        layout: Layout,
    },
    /// [`slice_heads`] of the first `H / tp_split` heads.
    SliceHeads {
        /// Layout of both sides.
        layout: Layout,
    },
    /// [`gather_heads`] of `tp_split` blocks of `H / tp_split` heads.
    GatherHeads {
        /// Layout of both sides.
        layout: Layout,
    },
}

impl Case {
    /// Every case, in report order.
    pub fn all() -> Vec<Case> {
        let mut cases = vec![
            Case::Permute { from: Layout::Nhd },
            Case::Permute { from: Layout::Hnd },
        ];
        for layout in [Layout::Hnd, Layout::Nhd] {
            cases.extend([
                Case::RegroupGather { layout },
                Case::RegroupSplit { layout },
                Case::SliceHeads { layout },
                Case::GatherHeads { layout },
            ]);
        }
        cases
    }

    /// The name in reports: `permute_nhd_to_hnd`, `regroup_gather_hnd`, ...
    pub fn name(&self) -> String {
        let l = |layout: &Layout| match layout {
            Layout::Nhd => "nhd",
            Layout::Hnd => "hnd",
        };
        match self {
            Case::Permute { from } => format!("permute_{}_to_{}", l(from), l(&from.other())),
            Case::RegroupGather { layout } => format!("regroup_gather_{}", l(layout)),
            Case::RegroupSplit { layout } => format!("regroup_split_{}", l(layout)),
            Case::SliceHeads { layout } => format!("slice_heads_{}", l(layout)),
            Case::GatherHeads { layout } => format!("gather_heads_{}", l(layout)),
        }
    }
}

impl Workload {
    /// Checks the workload: a valid shape, at least one block, a positive ratio and a split that
    /// divides the heads.
    ///
    /// # Errors
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), KernelError> {
        let block = self.shape.block_bytes()?;
        for (field, value) in [
            ("blocks", self.blocks),
            ("ratio", self.ratio),
            ("tp_split", self.tp_split),
        ] {
            if value == 0 {
                return Err(KernelError::Zero { field });
            }
        }
        if self.shape.heads % self.tp_split != 0 {
            return Err(KernelError::Mismatch {
                what: "heads and their multiple of tp_split",
                left: self.shape.heads,
                right: self.shape.heads / self.tp_split * self.tp_split,
            });
        }
        let big = self.big_shape()?.block_bytes()?;
        let overflow = KernelError::Overflow { what: "buffer" };
        self.blocks.checked_mul(block).ok_or(overflow.clone())?;
        self.blocks
            .div_ceil(self.ratio)
            .checked_mul(big)
            .ok_or(overflow)?;
        Ok(())
    }

    /// The large block of a regroup.
    pub fn big_shape(&self) -> Result<BlockShape, KernelError> {
        let tokens = self
            .shape
            .tokens
            .checked_mul(self.ratio)
            .ok_or(KernelError::Overflow {
                what: "regrouped block",
            })?;
        Ok(self.shape.with_tokens(tokens))
    }

    /// The block of one rank's share of the heads.
    pub fn part_shape(&self) -> BlockShape {
        self.shape
            .with_heads(self.shape.heads / self.tp_split.max(1))
    }

    /// Bytes of `blocks` blocks of the shape: the plain buffer.
    pub fn buffer_bytes(&self) -> Result<usize, KernelError> {
        self.blocks
            .checked_mul(self.shape.block_bytes()?)
            .ok_or(KernelError::Overflow { what: "buffer" })
    }

    /// Lengths of a case's input buffers and of its output (validated workload).
    pub fn sizes(&self, case: Case) -> Result<(Vec<usize>, usize), KernelError> {
        let plain = self.buffer_bytes()?;
        let big = self.blocks.div_ceil(self.ratio) * self.big_shape()?.block_bytes()?;
        let part = self.blocks * self.part_shape().block_bytes()?;
        Ok(match case {
            Case::Permute { .. } => (vec![plain], plain),
            Case::RegroupGather { .. } => (vec![plain], big),
            Case::RegroupSplit { .. } => (vec![big], plain),
            Case::SliceHeads { .. } => (vec![plain], part),
            Case::GatherHeads { .. } => (vec![part; self.tp_split], plain),
        })
    }

    /// Runs a case's CPU kernel.
    ///
    /// # Errors
    /// The kernel's, for inputs or an output of the wrong length.
    pub fn run_cpu(
        &self,
        case: Case,
        inputs: &[&[u8]],
        out: &mut [u8],
        threads: usize,
    ) -> Result<(), KernelError> {
        let first = inputs.first().copied().unwrap_or(&[]);
        match case {
            Case::Permute { from } => permute(first, out, self.shape, from, from.other(), threads),
            Case::RegroupGather { layout } => {
                regroup_gather(first, out, self.shape, self.ratio, layout, threads)
            }
            Case::RegroupSplit { layout } => {
                regroup_split(first, out, self.shape, self.ratio, layout, threads)
            }
            Case::SliceHeads { layout } => {
                let heads = 0..self.part_shape().heads;
                slice_heads(first, out, self.shape, heads, layout, threads)
            }
            Case::GatherHeads { layout } => {
                gather_heads(inputs, out, self.part_shape(), layout, threads)
            }
        }
    }
}

/// Fills `buf` with pseudo-random bytes (xorshift64*, 8 bytes a step).
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut chunks = buf.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&next().to_le_bytes());
    }
    let tail = chunks.into_remainder();
    let last = next().to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}
