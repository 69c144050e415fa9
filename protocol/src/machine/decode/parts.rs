//! What D knows of a layer-wise write: which layers of each P rank's write landed.

use std::collections::BTreeMap;

use crate::MAX_WRITE_LAYERS;

use super::super::types::DropReason;

/// The layers one P rank's parts covered so far.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RankParts {
    /// The write's layers, as its first part said.
    of: u32,
    /// The parts seen: first layer → layer count. Disjoint.
    parts: BTreeMap<u32, u32>,
    /// Layers covered (the sum of the parts' counts).
    covered: u32,
}

/// Per P rank, the parts of its layer-wise write that landed. Bounded: a rank's parts are
/// disjoint ranges of at most [`MAX_WRITE_LAYERS`] layers, and only ranks D expects a write
/// from are tallied (the endpoint routes nothing else here).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct PartTally {
    ranks: BTreeMap<u32, RankParts>,
}

/// What one more part means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartVerdict {
    /// Some of the rank's layers are still to land.
    Partial,
    /// The rank's parts now cover every layer of its write: as a `WriteDone` of the rank.
    Complete,
    /// The part repeats or overlaps one seen, or disagrees on the write's layers: dropped.
    Refused(DropReason),
}

impl PartTally {
    /// Counts the part `first .. first + count` of `of` layers from `rank`. `early` is the
    /// simulator's deliberate bug: a rank counts as landed at its first part.
    pub(crate) fn add(
        &mut self,
        rank: u32,
        (first, count, of): (u32, u32, u32),
        early: bool,
    ) -> PartVerdict {
        // The wire checked the range; an in-process caller must have too.
        assert!(count >= 1 && of <= MAX_WRITE_LAYERS && first + count <= of);
        let entry = self.ranks.entry(rank).or_insert(RankParts {
            of,
            parts: BTreeMap::new(),
            covered: 0,
        });
        if entry.of != of {
            return PartVerdict::Refused(DropReason::Unexpected);
        }
        if entry.covered == entry.of {
            return PartVerdict::Refused(DropReason::Duplicate);
        }
        let end = first + count;
        let before = entry.parts.range(..end).next_back();
        if before.is_some_and(|(&start, &len)| start + len > first) {
            return PartVerdict::Refused(DropReason::Duplicate);
        }
        entry.parts.insert(first, count);
        entry.covered += count;
        debug_assert!(entry.covered <= entry.of, "disjoint parts within the write");
        if entry.covered == entry.of || early {
            PartVerdict::Complete
        } else {
            PartVerdict::Partial
        }
    }

    /// Whether any part of any rank landed (P has the registration).
    pub(crate) fn any(&self) -> bool {
        !self.ranks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_lands_when_its_parts_cover_every_layer() {
        let mut tally = PartTally::default();
        assert_eq!(tally.add(0, (0, 2, 6), false), PartVerdict::Partial);
        assert_eq!(tally.add(1, (0, 6, 6), false), PartVerdict::Complete);
        assert_eq!(tally.add(0, (4, 2, 6), false), PartVerdict::Partial);
        assert_eq!(tally.add(0, (2, 2, 6), false), PartVerdict::Complete);
        assert!(tally.any());
    }

    #[test]
    fn repeats_overlaps_and_other_sizes_are_refused() {
        let mut tally = PartTally::default();
        assert_eq!(tally.add(0, (2, 2, 8), false), PartVerdict::Partial);
        let dup = PartVerdict::Refused(DropReason::Duplicate);
        assert_eq!(tally.add(0, (2, 2, 8), false), dup);
        assert_eq!(tally.add(0, (3, 1, 8), false), dup);
        assert_eq!(tally.add(0, (0, 3, 8), false), dup);
        assert_eq!(
            tally.add(0, (5, 1, 9), false),
            PartVerdict::Refused(DropReason::Unexpected)
        );
        assert_eq!(tally.add(0, (0, 2, 8), false), PartVerdict::Partial);
        assert_eq!(tally.add(0, (4, 4, 8), false), PartVerdict::Complete);
        assert_eq!(tally.add(0, (4, 4, 8), false), dup);
    }

    #[test]
    fn the_deliberate_bug_lands_a_rank_at_its_first_part() {
        let mut tally = PartTally::default();
        assert_eq!(tally.add(0, (0, 1, 4), true), PartVerdict::Complete);
    }
}
