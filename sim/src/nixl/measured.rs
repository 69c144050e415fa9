//! What happens to a posted NIXL write when something happens around it, as measured: the one
//! table both simulated worlds follow, the seeded one ([`crate::World`]) and the scripted one
//! ([`crate::scripted::Harness`]). Each world states at compile time, next to the code that
//! implements a row, that the table says what that code does, so a changed row fails the build
//! until both worlds follow it.

/// Something that happens to a write's poster, target or connection while it is posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Happening {
    /// The poster releases (abandons) the transfer request.
    PosterAbandons,
    /// Either side invalidates (unloads) the other's metadata.
    Invalidation,
    /// The target's process dies (a restart is another agent with other memory).
    TargetDies,
    /// The poster's process dies.
    PosterDies,
    /// `max_write_life` has passed since the post (while the poster ran).
    LifeBound,
    /// The poster's process is stopped (SIGSTOP, a VM pause) and later resumed.
    PosterStalls,
}

/// What that does to the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Nothing: the write lands or fails in its own time and is reported then.
    GoesOn,
    /// It fails without landing (or after landing part of its bytes: NIXL does not roll back),
    /// and a live poster is told.
    Fails,
    /// It ends silently: no more bytes land and nobody is told.
    Vanishes,
    /// It has ended by then, landed or failed.
    HasEnded,
}

/// The row of the table.
pub(crate) const fn effect(happening: Happening) -> Effect {
    match happening {
        Happening::PosterAbandons | Happening::Invalidation | Happening::PosterStalls => {
            Effect::GoesOn
        }
        Happening::TargetDies => Effect::Fails,
        Happening::LifeBound => Effect::HasEnded,
        Happening::PosterDies => Effect::Vanishes,
    }
}

/// Where the row comes from: the test that measured it (`actors/tests/nixl_transport.rs`,
/// NIXL 1.5.1 over UCX), or why it is an assumption.
pub(crate) const fn evidence(happening: Happening) -> &'static str {
    match happening {
        Happening::PosterAbandons => {
            "tcp_in_progress_semantics / child_tcp_in_progress step 1: releasing a transfer in \
             progress is refused and its bytes still land"
        }
        Happening::Invalidation => {
            "child_tcp_in_progress steps 2 and 3: bytes (up to all 64 MiB) landed after the \
             poster, and after the target, invalidated the other"
        }
        Happening::TargetDies => {
            "write_to_dropped_peer_fails_typed and child_tcp_in_progress step 4: a write to a \
             dropped agent fails"
        }
        Happening::PosterDies => {
            "assumed (pessimistic): part of the bytes may land, nothing more, nobody is told"
        }
        Happening::LifeBound => {
            "assumed while the poster runs: the fabric ends every transfer within \
             max_write_life; the protocol's quarantine is sized on it (a stopped poster \
             suspends it: PosterStalls)"
        }
        Happening::PosterStalls => {
            "actors/tests/nixl_stall.rs stall_write_lands_after_the_resume, \
             stall_read_returns_bytes_written_after_the_fence: nothing (or only socket \
             buffers) moves while the poster is stopped, the rest lands after the resume \
             however long the stop, and the poster reports Ok"
        }
    }
}

/// A post needs the target's metadata: after the poster unloaded it (invalidated the target),
/// NIXL refuses the post until a new handshake loads it again. The shell's driver makes the
/// refusal `WriteFailed(PostFailed)`.
pub(crate) const POST_WITHOUT_METADATA_IS_REFUSED: bool = true;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_names_its_evidence() {
        for happening in [
            Happening::PosterAbandons,
            Happening::Invalidation,
            Happening::TargetDies,
            Happening::PosterDies,
            Happening::LifeBound,
            Happening::PosterStalls,
        ] {
            let _ = effect(happening);
            assert!(evidence(happening).len() > 20, "{happening:?}");
        }
    }
}
