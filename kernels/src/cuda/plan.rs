//! How each benchmark case runs as CUDA launches: which kernel, at which word size, on which
//! input, with which scalar arguments. [`device`](super::device) follows the plan on a GPU; the
//! tests follow the same plan with the CUDA C compiled as C++ on the CPU.

use super::WORDS;
use crate::bench::{Case, Workload};
use crate::{KernelError, Layout};

/// A scalar kernel argument, in the kernel's parameter order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    /// `u64` (`unsigned long long`).
    U64(u64),
    /// `int`.
    I32(i32),
}

/// One kernel launch: `entry(inputs[input], out, args...)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The source's name (the module the entry lives in).
    pub module: &'static str,
    /// The entry, with its word suffix (`kvh_permute_u128`).
    pub entry: String,
    /// Which input buffer is the source.
    pub input: usize,
    /// The scalar arguments after the two pointers.
    pub args: Vec<Arg>,
}

/// The launches of one case, in order, and the word size they move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Bytes per word (1, 2, 4, 8 or 16): the widest that divides a row.
    pub word: usize,
    /// The launches.
    pub launches: Vec<Launch>,
}

/// The launches that compute `case` on `w` (validated).
///
/// # Errors
/// The workload's, if it is not usable.
pub fn plan(w: &Workload, case: Case) -> Result<Plan, KernelError> {
    w.validate()?;
    let row = w.shape.row_bytes()?;
    let (suffix, word) = WORDS
        .iter()
        .rev()
        .find(|(_, size)| row % size == 0)
        .copied()
        .unwrap_or(("u8", 1));
    let u = |v: usize| Arg::U64(v as u64);
    let hnd = |layout: Layout| Arg::I32(i32::from(layout == Layout::Hnd));
    let row_words = u(row / word);
    let (tokens, heads, blocks, ratio) = (w.shape.tokens, w.shape.heads, w.blocks, w.ratio);
    let one = |module: &'static str, family: &str, input: usize, args: Vec<Arg>| Launch {
        module,
        entry: format!("{family}_{suffix}"),
        input,
        args,
    };
    let launches = match case {
        Case::Permute { from } => vec![one(
            "kvh_permute",
            "kvh_permute",
            0,
            vec![u(blocks), u(tokens), u(heads), row_words, hnd(from.other())],
        )],
        Case::RegroupGather { layout } => vec![one(
            "kvh_regroup",
            "kvh_regroup_gather",
            0,
            vec![
                u(blocks),
                u(blocks.div_ceil(ratio)),
                u(tokens),
                u(heads),
                row_words,
                u(ratio),
                hnd(layout),
            ],
        )],
        Case::RegroupSplit { layout } => vec![one(
            "kvh_regroup",
            "kvh_regroup_split",
            0,
            vec![
                u(blocks),
                u(tokens),
                u(heads),
                row_words,
                u(ratio),
                hnd(layout),
            ],
        )],
        Case::SliceHeads { layout } => {
            let count = w.part_shape().heads;
            vec![one(
                "kvh_heads",
                "kvh_copy_heads",
                0,
                vec![
                    u(blocks),
                    u(tokens),
                    u(heads),
                    u(0),
                    u(count),
                    u(0),
                    u(count),
                    row_words,
                    hnd(layout),
                ],
            )]
        }
        Case::GatherHeads { layout } => {
            let part = w.part_shape().heads;
            (0..w.tp_split)
                .map(|i| {
                    one(
                        "kvh_heads",
                        "kvh_copy_heads",
                        i,
                        vec![
                            u(blocks),
                            u(tokens),
                            u(part),
                            u(0),
                            u(heads),
                            u(i * part),
                            u(part),
                            row_words,
                            hnd(layout),
                        ],
                    )
                })
                .collect()
        }
    };
    Ok(Plan { word, launches })
}
