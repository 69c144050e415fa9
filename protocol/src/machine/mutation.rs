//! Deliberate bugs for the simulator's mutation check: each breaks one safety rule on purpose,
//! and the simulator must catch every one of them (`kvhandoff sim --mutation NAME`).
//!
//! A mutation is not part of [`Config`](super::Config): it is set on an endpoint with
//! `Endpoint::set_mutation`, which exists only with the crate feature `mutations` (enabled by
//! the simulator). Without the feature no endpoint can carry one and every check below is the
//! constant `false`.

use std::fmt;
use std::str::FromStr;

/// One deliberate bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mutation {
    /// D frees its blocks at its deadline without P's cancel ack.
    FreeOnDeadline,
    /// D frees its blocks as soon as it declares P dead, trusting the invalidation.
    FreeOnPeerDead,
    /// D counts a `WriteDone` of an older epoch as one of the current epoch.
    AcceptStaleWriteDone,
    /// P lets a registration below the key's epoch floor reach a new request's blocks.
    SkipEpochFloor,
    /// P frees the source blocks of an abandoned write the transport never confirmed.
    FreeSourceOnAbandon,
    /// P lets any peer's heartbeat renew a pending registration, whatever its sender and epoch.
    IgnoreHeartbeatSender,
    /// A handshake repeating the connected incarnation is taken as a restart.
    HandshakeAlwaysRestart,
    /// P admits requests and answers without keeping room for their tombstones: a full table
    /// evicts records still young enough to stop a late registration copy.
    EvictYoungTombstones,
    /// P expires pending registrations only when its timer fires, so a late shell can match
    /// one whose wait has ended.
    MatchExpiredRegistration,
    /// A reader releases the holder's blocks, and hands its own back, as soon as one of its
    /// reads completes, while the others may still run.
    ReleaseBeforeReadsEnd,
    /// A holder's grant fence forgets the fabric's bound on a read (`max_write_life`): it frees
    /// blocks a slow read may still be reading.
    ShortGrantFence,
    /// A multi-rank request's fan-in hands the shared blocks back as soon as its first failed
    /// sub-request hands back, while the siblings' peer ranks may still write them (D) or read
    /// them (P).
    FreeOnFirstSourceSettled,
    /// A holder fences a grant with the push path's quarantine instead of a read's span, and
    /// moves the export's hard end out to that fence: the blocks come back later than the hard
    /// end the engine was promised at the export's start (`export_hard_end`).
    LongGrantFence,
    /// An import counts every read of a grant but never hands the last one's post to the
    /// shell (an output lost on its way): that read never runs, and the import waits for it
    /// until its reads' bound and falls back to recomputing.
    LoseLastReadPost,
    /// A reader's engine declines an export the reader is reading, and the decline goes out:
    /// the holder ends the export and reuses the blocks while the reads still land.
    DeclineDuringRead,
    /// A message from a peer whose liveness deadline passed long ago (the receiver was stalled
    /// with it queued) is taken as from a live peer.
    AcceptFromOverduePeer,
    /// P writes into a registration that reaches blocks whose lease ended (its timer had not
    /// run: a stalled process), and a stale heartbeat renews such a lease.
    WriteOnExpiredLease,
    /// A reader posts its reads under a grant that arrived later than a grant can travel (it
    /// sat in a stalled process's queue): the holder's fence may have freed the blocks.
    ReadOnStaleGrant,
    /// P writes records on a peer's behalf for keys it holds nothing for without a budget: a
    /// flood of cancels for made-up keys fills the tombstone table, and admission control then
    /// refuses the engine's own prefills.
    UnboundedPeerTombstones,
    /// P takes a registration that may be a late one of a restarted D's previous incarnation
    /// (within `max_message_delay` of the restart) as the new incarnation's: a record of the old
    /// run stops judging at once, and the copy reaches blocks.
    AcceptPriorIncarnation,
    /// D counts a P answer (`WriteDone`, `WriteFailed`, `CancelAck`) for the rank the message
    /// names, whichever rank of the P engine sent it: one rank can settle another's share.
    TrustNamedRank,
    /// A reader trusts the bytes of a read reported done after the fabric's bound on it (the
    /// reader was stalled while it was in flight; the holder's fence may have freed the blocks
    /// before they were read).
    TrustLateReads,
    /// A reader hands its blocks back at the fabric's bound on its reads although one is still
    /// unreported (frozen by a stall of the reader, it lands after the resume).
    ReturnBlocksAtReadBound,
    /// P serves registrations of a D rank that reconnected after a death (same incarnation: a
    /// false death healed) at once, though one of the old session may still arrive, or sit in
    /// a stalled P's queue, naming blocks D fenced and reused.
    ServeRejoinedSessionAtOnce,
    /// D waits out the fence of requests fenced from a peer declared dead even when the same
    /// incarnation connects again (a liveness bug: the blocks wait the whole quarantine).
    WaitOutRejoinedPeersFence,
    /// D tells the engine a request failed early (`DecodeFenced`) again at every death of its
    /// peer, though it told it already: an engine that recomputes on the event does it twice.
    TellFencedTwice,
    /// The session hands a multi-rank request's shared blocks back to the engine as soon as
    /// the request's failure is decided, not when every sub-request handed them back: a
    /// sibling's peer rank may still write into them (D) or read them (P).
    FanHandBackAtFailure,
    /// The session tells the engine the proof of the multi-rank request's last pair to hand
    /// back, not the most cautious of its pairs' (a `Quarantine` one reported as
    /// `CancelAcknowledged`, say).
    FanProofOfLastPair,
    /// D counts a P rank's layer-wise write as landed at its first part, while the other
    /// layers' parts may still be on their way.
    ReadyOnFirstPart,
    /// P answers a cancel of a layer-wise write whose last part is not posted yet at once,
    /// as if nothing were in flight, while its posted parts may still land.
    AckPartialWriteAtOnce,
    /// P posts the next part of a layer-wise write after D's registration lapsed (this
    /// process stalled past D's heartbeats): D may have fenced and reused its blocks.
    ExtendLapsedRegistration,
    /// A multi-rank read's fan-in takes its first loaded part for the whole read: the request
    /// is `Loaded` though another holder rank's part may still fail (its slice of every block
    /// never arrives), and a later failure aborts no sibling.
    ReaderReadyOnFirstPart,
    /// P's next turn on a linked rank reads back only from the first D rank its turn links
    /// name, as if the pair were 1:1: the slices the other D ranks hold never arrive, though
    /// the read ends `Loaded`, and their exports are never read.
    ReadBackFromFirstRank,
    /// A reader takes a holder's "nothing under this key" for final at once, though it came
    /// soon after its first ask: a holder whose engine answered the router before its rank
    /// had the export (vLLM's scheduler answers, its worker hands the export over a step
    /// later) loses the request.
    GiveUpOnEarlyRefusal,
    /// P leaves a record that refuses a registration as it was written, though the
    /// registration's copies count from their own first send: a sibling D of the key that
    /// starts registering as the record ages (the router sent the decode leg twice) outlives
    /// it, and a late copy waits in P as a pending registration for blocks that D gave back.
    SkipRecordRefresh,
    /// The answer an engine gives the router ahead of its rank's call
    /// (`Session::preview_call`) leaves out where the holder listens (`remote_host`,
    /// `remote_port`), as an engine would that answered before its rank had published its
    /// side channel: the call's own answer names it, the router's does not.
    AnswerAheadWithoutAddress,
}

impl Mutation {
    /// Every mutation, in a fixed order.
    pub const ALL: [Mutation; 36] = [
        Mutation::FreeOnDeadline,
        Mutation::FreeOnPeerDead,
        Mutation::AcceptStaleWriteDone,
        Mutation::SkipEpochFloor,
        Mutation::FreeSourceOnAbandon,
        Mutation::IgnoreHeartbeatSender,
        Mutation::HandshakeAlwaysRestart,
        Mutation::EvictYoungTombstones,
        Mutation::MatchExpiredRegistration,
        Mutation::ReleaseBeforeReadsEnd,
        Mutation::ShortGrantFence,
        Mutation::FreeOnFirstSourceSettled,
        Mutation::LongGrantFence,
        Mutation::LoseLastReadPost,
        Mutation::DeclineDuringRead,
        Mutation::AcceptFromOverduePeer,
        Mutation::WriteOnExpiredLease,
        Mutation::ReadOnStaleGrant,
        Mutation::UnboundedPeerTombstones,
        Mutation::AcceptPriorIncarnation,
        Mutation::TrustNamedRank,
        Mutation::TrustLateReads,
        Mutation::ReturnBlocksAtReadBound,
        Mutation::ServeRejoinedSessionAtOnce,
        Mutation::WaitOutRejoinedPeersFence,
        Mutation::TellFencedTwice,
        Mutation::FanHandBackAtFailure,
        Mutation::FanProofOfLastPair,
        Mutation::ReadyOnFirstPart,
        Mutation::AckPartialWriteAtOnce,
        Mutation::ExtendLapsedRegistration,
        Mutation::ReaderReadyOnFirstPart,
        Mutation::ReadBackFromFirstRank,
        Mutation::GiveUpOnEarlyRefusal,
        Mutation::SkipRecordRefresh,
        Mutation::AnswerAheadWithoutAddress,
    ];

    /// The mutation's name on the command line.
    ///
    /// ```
    /// use kvhandoff_protocol::machine::Mutation;
    /// assert_eq!(Mutation::FreeOnDeadline.name(), "free_on_deadline");
    /// assert_eq!("free_on_peer_dead".parse::<Mutation>(), Ok(Mutation::FreeOnPeerDead));
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Mutation::FreeOnDeadline => "free_on_deadline",
            Mutation::FreeOnPeerDead => "free_on_peer_dead",
            Mutation::AcceptStaleWriteDone => "accept_stale_write_done",
            Mutation::SkipEpochFloor => "skip_epoch_floor",
            Mutation::FreeSourceOnAbandon => "free_source_on_abandon",
            Mutation::IgnoreHeartbeatSender => "ignore_heartbeat_sender",
            Mutation::HandshakeAlwaysRestart => "handshake_always_restart",
            Mutation::EvictYoungTombstones => "evict_young_tombstones",
            Mutation::MatchExpiredRegistration => "match_expired_registration",
            Mutation::ReleaseBeforeReadsEnd => "release_before_reads_end",
            Mutation::ShortGrantFence => "short_grant_fence",
            Mutation::FreeOnFirstSourceSettled => "free_on_first_source_settled",
            Mutation::LongGrantFence => "long_grant_fence",
            Mutation::LoseLastReadPost => "lose_last_read_post",
            Mutation::DeclineDuringRead => "decline_during_read",
            Mutation::AcceptFromOverduePeer => "accept_from_overdue_peer",
            Mutation::WriteOnExpiredLease => "write_on_expired_lease",
            Mutation::ReadOnStaleGrant => "read_on_stale_grant",
            Mutation::TrustLateReads => "trust_late_reads",
            Mutation::ReturnBlocksAtReadBound => "return_blocks_at_read_bound",
            Mutation::ServeRejoinedSessionAtOnce => "serve_rejoined_session_at_once",
            Mutation::WaitOutRejoinedPeersFence => "wait_out_rejoined_peers_fence",
            Mutation::UnboundedPeerTombstones => "unbounded_peer_tombstones",
            Mutation::AcceptPriorIncarnation => "accept_prior_incarnation",
            Mutation::TrustNamedRank => "trust_named_rank",
            Mutation::TellFencedTwice => "tell_fenced_twice",
            Mutation::FanHandBackAtFailure => "fan_hand_back_at_failure",
            Mutation::FanProofOfLastPair => "fan_proof_of_last_pair",
            Mutation::ReadyOnFirstPart => "ready_on_first_part",
            Mutation::AckPartialWriteAtOnce => "ack_partial_write_at_once",
            Mutation::ExtendLapsedRegistration => "extend_lapsed_registration",
            Mutation::ReaderReadyOnFirstPart => "reader_ready_on_first_part",
            Mutation::ReadBackFromFirstRank => "read_back_from_first_rank",
            Mutation::GiveUpOnEarlyRefusal => "give_up_on_early_refusal",
            Mutation::SkipRecordRefresh => "skip_record_refresh",
            Mutation::AnswerAheadWithoutAddress => "answer_ahead_without_address",
        }
    }
}

impl fmt::Display for Mutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mutation {
    type Err = String;
    fn from_str(s: &str) -> Result<Mutation, String> {
        Mutation::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Mutation::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mutation {s:?} (one of: {})", names.join(", "))
            })
    }
}

/// The mutation an endpoint runs with: always `None` without the feature `mutations`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) struct ActiveMutation(#[cfg(feature = "mutations")] pub(crate) Option<Mutation>);

impl ActiveMutation {
    /// Whether `which` is the deliberate bug in force.
    #[inline]
    pub(crate) fn is(self, which: Mutation) -> bool {
        #[cfg(feature = "mutations")]
        {
            self.0 == Some(which)
        }
        #[cfg(not(feature = "mutations"))]
        {
            let _ = which;
            false
        }
    }
}
