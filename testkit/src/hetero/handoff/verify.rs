//! The check of a [`Handoff`] after its run: every byte of every KV arena against what it must
//! hold, computed from the request and D's geometry alone (never from the plan).

use std::fmt;

use kvhandoff_protocol::hetero::{
    tensor_len, BlockFormat, ModelGroup, RankLayout, SideName, Space,
};
use serde::Serialize;

use super::Handoff;
use crate::pattern::{reference_row, Part};

/// What a byte was expected to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Expected {
    /// The reference KV.
    Reference,
    /// Zero: the tail past the request's last token.
    Zero,
    /// Whatever it held before the run: outside the request, or before the tokens that move.
    Untouched,
}

/// The first wrong byte of a run, located.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// The arena.
    pub arena: String,
    /// Offset in it.
    pub offset: u64,
    /// Where that is (tensor, layer and part, block, token, head, byte).
    pub location: String,
    /// What the byte should be.
    pub expected: Expected,
    /// Its expected value.
    pub want: u8,
    /// Its value.
    pub found: u8,
    /// Whether the found byte is what the arena held before the run.
    pub found_untouched: bool,
    /// Bytes of the arena that differ from what they should be.
    pub wrong_bytes: u64,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.expected {
            Expected::Reference => "the reference KV",
            Expected::Zero => "zero (the tail past the last token)",
            Expected::Untouched => "left as it was",
        };
        let found = if self.found_untouched {
            " (as it was before the run)"
        } else {
            ""
        };
        write!(
            f,
            "{}: {} bytes wrong; first at offset {} ({}): should be {what}, 0x{:02x}, found \
             0x{:02x}{found}",
            self.arena, self.wrong_bytes, self.offset, self.location, self.want, self.found
        )
    }
}

/// Checks every KV arena of `h` (see [`Handoff::verify`]).
pub(crate) fn verify(h: &Handoff, only: Option<&[(SideName, usize)]>) -> Result<(), Mismatch> {
    let mine = |side: SideName, rank: usize| only.is_none_or(|o| o.contains(&(side, rank)));
    for (ri, _) in h.pair.prefill.ranks.iter().enumerate() {
        if !mine(SideName::Prefill, ri) {
            continue;
        }
        let arena = h.arena(SideName::Prefill, ri, Space::Kv);
        let before = &h.before[arena / 2];
        compare(h, arena, before, before, &[], None)?;
    }
    for (ri, rank) in h.pair.decode.ranks.iter().enumerate() {
        if !mine(SideName::Decode, ri) {
            continue;
        }
        let arena = h.arena(SideName::Decode, ri, Space::Kv);
        let before = &h.before[arena / 2];
        let (want, classes) = expected_decode(h, ri, rank, before);
        compare(h, arena, &want, before, &classes, Some(rank))?;
    }
    Ok(())
}

fn compare(
    h: &Handoff,
    arena: usize,
    want: &[u8],
    before: &[u8],
    classes: &[Expected],
    rank: Option<&RankLayout>,
) -> Result<(), Mismatch> {
    let found = &h.arenas[arena].bytes;
    if found.as_slice() == want {
        return Ok(());
    }
    let wrong = found.iter().zip(want).filter(|(a, b)| a != b).count() as u64
        + found.len().abs_diff(want.len()) as u64;
    let offset = found
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(found.len().min(want.len()));
    Err(Mismatch {
        arena: h.arenas[arena].name.clone(),
        offset: offset as u64,
        location: rank.map_or_else(
            || "P's memory must not change".to_string(),
            |r| locate(h, r, offset as u64),
        ),
        expected: classes.get(offset).copied().unwrap_or(Expected::Untouched),
        want: want.get(offset).copied().unwrap_or(0),
        found: found.get(offset).copied().unwrap_or(0),
        found_untouched: found.get(offset) == before.get(offset),
        wrong_bytes: wrong,
    })
}

/// D rank `ri`'s memory as it must be after the request, and what each byte is.
fn expected_decode(
    h: &Handoff,
    ri: usize,
    rank: &RankLayout,
    before: &[u8],
) -> (Vec<u8>, Vec<Expected>) {
    let mut want = before.to_vec();
    let mut class = vec![Expected::Untouched; want.len()];
    let model = &h.pair.model;
    let (p_spec, d_spec) = (h.pair.prefill.spec, h.pair.decode.spec);
    let n = h.shape.tokens;
    let row = model.row_bytes() as usize;
    let bases = &h.decode_memory.ranks[ri].tensor_bases;
    let mut buf = vec![0u8; row];
    for region in &rank.regions {
        let list = &h.decode_blocks.groups[region.group];
        if list.is_empty() {
            continue;
        }
        let tensor = &rank.tensors[region.tensor];
        let base = bases[region.tensor];
        let mut set = |at: usize, bytes: &[u8], c: Expected| {
            want[at..at + bytes.len()].copy_from_slice(bytes);
            class[at..at + bytes.len()].fill(c);
        };
        let (window, part) = match (model.groups[region.group], Part::of(region.kind)) {
            (ModelGroup::Mamba { .. }, _) | (_, None) => {
                let Some((_, conv, ssm)) = model.mamba() else {
                    continue;
                };
                let Some(&slot) = list.last() else { continue };
                let at = base + u64::from(slot) * tensor.block_len;
                let heads = rank.state_heads.clone();
                let count = u64::from(heads.end - heads.start);
                for (j, g) in heads.enumerate() {
                    let mut b = vec![0u8; conv as usize];
                    reference_row(region.layer, Part::Conv, g, 0, &mut b);
                    set((at + j as u64 * conv) as usize, &b, Expected::Reference);
                    let mut b = vec![0u8; ssm as usize];
                    reference_row(region.layer, Part::Ssm, g, 0, &mut b);
                    set(
                        (at + count * conv + j as u64 * ssm) as usize,
                        &b,
                        Expected::Reference,
                    );
                }
                continue;
            }
            (ModelGroup::SlidingWindow { window_tokens }, Some(p)) => {
                (Some(u64::from(window_tokens)), p)
            }
            (ModelGroup::Full, Some(p)) => (None, p),
        };
        // The first token D must hold exactly: where its list starts (the cached prefix ends),
        // and for a sliding window the later of where both sides' last ⌈w/b⌉+1 blocks start.
        let (ld, lp) = (d_spec.logical_block(), p_spec.logical_block());
        let list_first = (n.div_ceil(ld) - list.len() as u64) * ld;
        let from = match window {
            None => list_first,
            Some(w) => {
                let kept = |len: u64, b: u64| (n.div_ceil(b) - len.min(w.div_ceil(b) + 1)) * b;
                let p_len = h.prefill_blocks.groups[region.group].len() as u64;
                kept(list.len() as u64, ld).max(kept(p_len, lp))
            }
        };
        let format = BlockFormat {
            tokens: d_spec.block,
            heads: rank.block_heads(),
            layout: d_spec.layout,
        };
        let zero = vec![0u8; row];
        for (j, &id) in list.iter().enumerate() {
            for k in 0..u64::from(d_spec.kbpl) {
                let block = base + (u64::from(id) * u64::from(d_spec.kbpl) + k) * tensor.block_len;
                let origin =
                    list_first + (j as u64 * u64::from(d_spec.kbpl) + k) * u64::from(d_spec.block);
                for t in origin..origin + u64::from(d_spec.block) {
                    for hl in 0..rank.block_heads() {
                        let at =
                            (block + format.row_offset(t - origin, hl.into(), row as u64)) as usize;
                        if t >= n {
                            set(at, &zero, Expected::Zero);
                        } else if t >= from {
                            reference_row(region.layer, part, rank.heads.start + hl, t, &mut buf);
                            set(at, &buf, Expected::Reference);
                        }
                    }
                }
            }
        }
    }
    (want, class)
}

/// Where `offset` of D rank `rank`'s KV arena is, in words.
fn locate(h: &Handoff, rank: &RankLayout, offset: u64) -> String {
    let pool = h.decode_memory.pool_blocks;
    let ri = h
        .pair
        .decode
        .ranks
        .iter()
        .position(|r| r.rank == rank.rank)
        .unwrap_or(0);
    let bases = &h.decode_memory.ranks[ri].tensor_bases;
    for (t, tensor) in rank.tensors.iter().enumerate() {
        let base = bases[t];
        let len = tensor_len(tensor, pool).unwrap_or(0);
        if offset < base || offset >= base + len || tensor.block_len == 0 {
            continue;
        }
        let regions: Vec<String> = tensor
            .regions
            .iter()
            .map(|&r| {
                let r = &rank.regions[r];
                format!("layer {} {:?}", r.layer, r.kind)
            })
            .collect();
        let block = (offset - base) / tensor.block_len;
        let within = (offset - base) % tensor.block_len;
        let logical = block / u64::from(tensor.blocks_per_logical);
        let listed: Vec<String> = h
            .decode_blocks
            .groups
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(&(logical as u32)))
            .map(|(g, _)| format!("listed in group {g}"))
            .collect();
        let listed = if listed.is_empty() {
            "not a block of the request".to_string()
        } else {
            listed.join(", ")
        };
        let attention =
            rank.regions[tensor.regions[0]].kind != kvhandoff_protocol::RegionKind::State;
        let detail = if attention {
            let row = h.pair.model.row_bytes();
            let (tokens, heads) = (
                u64::from(rank.kernel_block()),
                u64::from(rank.block_heads()),
            );
            let r = within / row;
            let (token, head) = match rank.layout() {
                kvhandoff_protocol::KvLayout::Nhd => (r / heads, r % heads),
                kvhandoff_protocol::KvLayout::Hnd => (r % tokens, r / tokens),
            };
            format!(
                "block-local token {token}, head {} (global {}), byte {}",
                head,
                u64::from(rank.heads.start) + head,
                within % row
            )
        } else {
            format!("state byte {within}")
        };
        return format!(
            "tensor {t} ({}), kernel block {block} (logical {logical}, {listed}): {detail}",
            regions.join(", ")
        );
    }
    "outside every tensor".to_string()
}
