//! The field rules [`Message::validate`](super::Message::validate) applies that are not a
//! type's own: epochs, list lengths, layer-wise parts.

use super::{FieldError, MemorySpan, WritePartDone, MAX_REGISTER_SPANS, MAX_WRITE_LAYERS};
use crate::ids::Epoch;

pub(super) fn check_epoch(epoch: Epoch) -> Result<(), FieldError> {
    if epoch.0 == 0 {
        return Err(FieldError::ZeroEpoch);
    }
    Ok(())
}

pub(super) fn check_part(part: &WritePartDone) -> Result<(), FieldError> {
    let end = part.first.checked_add(part.count);
    if part.count == 0 || part.of > MAX_WRITE_LAYERS || end.is_none_or(|end| end > part.of) {
        return Err(FieldError::BadPart {
            first: part.first,
            count: part.count,
            of: part.of,
        });
    }
    Ok(())
}

pub(super) fn check_digests(digests: &[u64]) -> Result<(), FieldError> {
    check_len(
        "write digests",
        digests.len(),
        crate::integrity::MAX_WRITE_DIGESTS,
    )
}

pub(super) fn check_len(field: &'static str, len: usize, limit: usize) -> Result<(), FieldError> {
    if len > limit {
        return Err(FieldError::TooMany { field, len, limit });
    }
    Ok(())
}

/// The memory a registration or a grant names: at most [`MAX_REGISTER_SPANS`] spans, each
/// non-empty and inside the address space.
pub(super) fn check_spans(field: &'static str, spans: &[MemorySpan]) -> Result<(), FieldError> {
    check_len(field, spans.len(), MAX_REGISTER_SPANS)?;
    if spans
        .iter()
        .any(|s| s.len == 0 || s.addr.checked_add(s.len).is_none())
    {
        return Err(FieldError::EmptySpan);
    }
    Ok(())
}
