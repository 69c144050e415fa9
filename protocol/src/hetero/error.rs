//! Why a side spec, a pair of geometries or a request cannot be planned.

use serde::Serialize;

use crate::geometry::GeometryError;

/// Which engine of the pair a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum SideName {
    /// The prefill engine, which writes.
    Prefill,
    /// The decode engine, which is written to.
    Decode,
}

impl std::fmt::Display for SideName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SideName::Prefill => "P",
            SideName::Decode => "D",
        })
    }
}

/// Why a side spec (`tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]`) does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// Nothing was given.
    #[error("the side spec is empty; expected tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]")]
    Empty,
    /// An item is not `field=value`.
    #[error("{item:?} is not field=value")]
    NotAField {
        /// The item as given.
        item: String,
    },
    /// A field name the spec does not know.
    #[error("unknown field {field:?} (known: tp, pp, block, kbpl, layout)")]
    UnknownField {
        /// The name as given.
        field: String,
    },
    /// A field given twice.
    #[error("field {field} is given twice")]
    Duplicate {
        /// The field.
        field: &'static str,
    },
    /// A required field is missing.
    #[error("field {field} is missing (tp, block and layout are required)")]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A numeric field's value is not a number.
    #[error("{field}={value:?} is not a number")]
    NotANumber {
        /// The field.
        field: &'static str,
        /// The value as given.
        value: String,
    },
    /// A numeric field is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// A numeric field is above its limit.
    #[error("{field}={value} is above the limit of {limit}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// The layout is neither NHD nor HND.
    #[error("layout={value:?} is neither NHD nor HND")]
    BadLayout {
        /// The value as given.
        value: String,
    },
}

/// Why a pair of geometries, or one request between them, cannot be planned. Every message says
/// why the pair (or the request) cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeteroError {
    /// The model is not in the catalog.
    #[error("unknown model {name:?}; the catalog has {known}")]
    UnknownModel {
        /// The name as given.
        name: String,
        /// The catalog's names.
        known: &'static str,
    },
    /// A side's spec does not parse.
    #[error("{side} spec: {source}")]
    Spec {
        /// Which side.
        side: SideName,
        /// Why.
        #[source]
        source: SpecError,
    },
    /// A rank of one side has no valid geometry (heads that neither split nor replicate over
    /// the TP ranks, layers that do not split over the PP ranks, a block size in bytes that
    /// overflows, ...).
    #[error("{side} side: {source}")]
    Geometry {
        /// Which side.
        side: SideName,
        /// The geometry's own reason.
        #[source]
        source: GeometryError,
    },
    /// More ranks (TP × PP) than the planner handles.
    #[error("{side} side: tp × pp = {ranks} ranks, above the limit of {limit}")]
    TooManyRanks {
        /// Which side.
        side: SideName,
        /// TP × PP.
        ranks: u64,
        /// [`super::MAX_RANKS`].
        limit: u32,
    },
    /// The mamba state heads do not split evenly over the TP ranks (they are sharded, never
    /// replicated).
    #[error(
        "{side} side: the model's {state_heads} mamba state heads cannot be split evenly over \
         tp={tp} (mamba state is sharded by head, never replicated)"
    )]
    StateHeads {
        /// Which side.
        side: SideName,
        /// State heads of the model.
        state_heads: u32,
        /// TP size.
        tp: u32,
    },
    /// A PP stage would hold no layer of some cache group, so the stages' block tables would
    /// not line up.
    #[error(
        "{side} side: pp={pp} leaves stage {stage} with no {group} layer; kvhandoff gives every \
         PP stage the model's whole list of cache groups, each with at least one layer"
    )]
    PpSplitsGroup {
        /// Which side.
        side: SideName,
        /// PP size.
        pp: u32,
        /// The stage without the group.
        stage: u32,
        /// The group's kind.
        group: &'static str,
    },
    /// The two kernel block sizes do not divide one another.
    #[error(
        "kernel block sizes {prefill} (P) and {decode} (D) do not divide one another, so a \
         block of one side never covers whole blocks of the other"
    )]
    BlockSizesNotNested {
        /// P's kernel block size in tokens.
        prefill: u32,
        /// D's kernel block size in tokens.
        decode: u32,
    },
    /// A request of zero tokens.
    #[error("the request has no tokens")]
    NoTokens,
    /// A request above the token limit.
    #[error("the request has {tokens} tokens, above the limit of {limit}")]
    TooManyTokens {
        /// Tokens given.
        tokens: u64,
        /// [`super::MAX_REQUEST_TOKENS`].
        limit: u64,
    },
    /// A side lists block ids for a different number of cache groups than the model has.
    #[error("{side} lists blocks for {given} cache groups but the model has {expected}")]
    GroupCount {
        /// Which side.
        side: SideName,
        /// Groups listed.
        given: usize,
        /// Groups of the model.
        expected: usize,
    },
    /// A side lists more blocks for a group than the request's tokens fill.
    #[error(
        "{side} lists {len} blocks for cache group {group}, but the request's tokens fill only {max}"
    )]
    ListTooLong {
        /// Which side.
        side: SideName,
        /// The group.
        group: usize,
        /// Blocks listed.
        len: usize,
        /// Blocks the tokens fill.
        max: u64,
    },
    /// P's blocks do not reach back to the first token D needs.
    #[error(
        "cache group {group}: P's blocks start at token {covered_from}, after token {needed_from} \
         that D needs"
    )]
    NotCovered {
        /// The group.
        group: usize,
        /// First token D needs.
        needed_from: u64,
        /// First token P's list holds.
        covered_from: u64,
    },
    /// A block id is not below the side's pool.
    #[error("{side} block {block} of cache group {group} is not below its pool of {pool} blocks")]
    BlockOutOfRange {
        /// Which side.
        side: SideName,
        /// The group.
        group: usize,
        /// The logical id.
        block: u32,
        /// Logical blocks in the pool.
        pool: u32,
    },
    /// A block id is used twice in memory that one tensor holds (twice in a group, or by two
    /// groups that share tensors).
    #[error("{side} block {block} is listed twice in cache groups that share tensors ({first} and {second})")]
    DuplicateBlock {
        /// Which side.
        side: SideName,
        /// The logical id.
        block: u32,
        /// The first group listing it.
        first: usize,
        /// The second group listing it.
        second: usize,
    },
    /// A side's memory description does not match its ranks or tensors.
    #[error("{side} memory: {why}")]
    Memory {
        /// Which side.
        side: SideName,
        /// What does not match.
        why: String,
    },
    /// A size or address does not fit in 64 bits.
    #[error("{what} overflows")]
    Overflow {
        /// What overflowed.
        what: &'static str,
    },
    /// The planner's own tables disagree (a bug, never an input's fault).
    #[error("internal inconsistency: {what}")]
    Inconsistent {
        /// What disagrees.
        what: &'static str,
    },
    /// The plan would exceed its piece limit.
    #[error("the request needs more than {limit} pieces")]
    TooManyPieces {
        /// [`super::MAX_PIECES`].
        limit: usize,
    },
}

impl HeteroError {
    pub(crate) fn geometry(side: SideName) -> impl Fn(GeometryError) -> HeteroError {
        move |source| HeteroError::Geometry { side, source }
    }
}
