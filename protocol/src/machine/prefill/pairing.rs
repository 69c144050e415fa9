//! Which of P's blocks go into which of D's.

use crate::machine::BlockPairing;
use crate::BlockIds;

/// Pairs P's blocks with D's, tail-aligned per group: when D registered fewer blocks (it
/// already caches a prefix), P sends its last ones. `None` if they cannot be paired.
pub(crate) fn pair_blocks(
    local: &BlockIds,
    remote: &BlockIds,
    pairing: BlockPairing,
) -> Option<BlockIds> {
    if local.groups.len() != remote.groups.len() || remote.is_empty() {
        return None;
    }
    match pairing {
        BlockPairing::TailAligned => {}
        BlockPairing::AsGiven => return Some(local.clone()),
    }
    let mut trimmed = Vec::with_capacity(local.groups.len());
    for (ours, theirs) in local.groups.iter().zip(&remote.groups) {
        let skip = ours.len().checked_sub(theirs.len())?;
        trimmed.push(ours[skip..].to_vec());
    }
    Some(BlockIds { groups: trimmed })
}
