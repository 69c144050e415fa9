//! Who may settle a D request's share: a P answer counts only for the rank that sent it, and
//! only if that rank is one of the request's sources (issue 19, finding 7).

use crate::machine::types::{
    DecodeStart, DropReason, EndpointCall, EndpointEvent, NetEvent, Output, Time,
};
use crate::machine::{Config, Endpoint};
use crate::{
    BlockIds, CancelAck, EngineId, Epoch, Incarnation, Message, PairingKey, PeerAddr, RequestId,
    WriteDone, WriteFailed, WriteFailure,
};

fn p(rank: u32) -> PeerAddr {
    PeerAddr::new(EngineId::new("prefill").unwrap(), rank)
}

fn key() -> PairingKey {
    PairingKey::new("shared-key").unwrap()
}

/// D registered `key()` with P rank 0, expecting `expected_writes`, and is connected to P ranks
/// 0 and 1.
fn registered(expected_writes: u32) -> Endpoint {
    let mut d = Endpoint::new(EngineId::new("decode").unwrap(), 0, Config::fast()).unwrap();
    for rank in [0, 1] {
        let incarnation = Incarnation(u128::from(rank) + 1);
        d.handle_event(
            Time::ZERO,
            NetEvent::PeerConnected {
                peer: p(rank),
                incarnation,
            },
        );
    }
    let start = DecodeStart {
        request: RequestId::new("d-req").unwrap(),
        key: key(),
        epoch: Epoch::FIRST,
        prefill: p(0),
        blocks: BlockIds::single_group(vec![5, 6]),
        num_tokens: 32,
        expected_writes,
    };
    d.handle_call(Time::ZERO, EndpointCall::DecodeAllocated(start))
        .unwrap();
    while d.poll_output().is_some() {}
    d
}

fn done(rank: u32) -> Message {
    Message::WriteDone(WriteDone {
        key: key(),
        epoch: Epoch::FIRST,
        prefill_rank: rank,
        digests: Vec::new(),
    })
}

fn failed(rank: u32) -> Message {
    Message::WriteFailed(WriteFailed {
        key: key(),
        epoch: Epoch::FIRST,
        prefill_rank: rank,
        reason: WriteFailure::TransferFailed,
    })
}

fn ack(rank: u32) -> Message {
    Message::CancelAck(CancelAck {
        key: key(),
        epoch: Epoch::FIRST,
        prefill_rank: rank,
    })
}

/// Feeds `inputs` (sender rank, message) to a fresh D (cancelling first if `cancelling`) and
/// returns whether the request ended, and how many messages it dropped as unexpected.
fn run(
    expected_writes: u32,
    cancelling: bool,
    inputs: &[(u32, Message)],
    mutated: bool,
) -> (bool, u64) {
    let mut d = registered(expected_writes);
    #[cfg(not(feature = "mutations"))]
    let _ = mutated;
    #[cfg(feature = "mutations")]
    if mutated {
        d.set_mutation(Some(crate::machine::Mutation::TrustNamedRank));
    }
    if cancelling {
        let abort = EndpointCall::Abort {
            request: RequestId::new("d-req").unwrap(),
        };
        d.handle_call(Time::ZERO, abort).unwrap();
    }
    let mut ended = false;
    for (rank, message) in inputs {
        let received = NetEvent::Received {
            from: p(*rank),
            message: message.clone(),
        };
        d.handle_event(Time::ZERO, received);
        while let Some(output) = d.poll_output() {
            ended |= matches!(output, Output::Event(EndpointEvent::Decode { .. }));
        }
    }
    (ended, d.counters().dropped(DropReason::Unexpected))
}

/// Each row: the expected writes, whether D cancelled first, what arrives (sender, message).
/// A forged answer is dropped and the request lives on; without the sender check each one
/// ended it (the blocks came back): a rank settled another's share, or a rank D never
/// registered with settled the one source's.
#[test]
fn a_p_answer_counts_only_for_the_rank_that_sent_it() {
    type Row = (&'static str, u32, bool, Vec<(u32, Message)>);
    let forged: Vec<Row> = vec![
        (
            "rank 0 lands for rank 1",
            2,
            false,
            vec![(0, done(0)), (0, done(1))],
        ),
        (
            "rank 0 fails for rank 1",
            2,
            false,
            vec![(0, done(0)), (0, failed(1))],
        ),
        (
            "rank 0 acknowledges for rank 1",
            2,
            true,
            vec![(0, ack(0)), (0, ack(1))],
        ),
        (
            "rank 1 lands for rank 0, the one source",
            1,
            false,
            vec![(1, done(0))],
        ),
        (
            "rank 1, not a source, lands for itself",
            1,
            false,
            vec![(1, done(1))],
        ),
        (
            "rank 1, not a source, acknowledges",
            1,
            true,
            vec![(1, ack(1))],
        ),
    ];
    for (name, expected, cancelling, inputs) in &forged {
        assert_eq!(
            run(*expected, *cancelling, inputs, false),
            (false, 1),
            "{name}"
        );
        #[cfg(feature = "mutations")]
        assert_eq!(
            run(*expected, *cancelling, inputs, true),
            (true, 0),
            "{name}: trusting the named rank ends the request"
        );
    }
    let honest: Vec<Row> = vec![
        (
            "each rank lands for itself",
            2,
            false,
            vec![(0, done(0)), (1, done(1))],
        ),
        (
            "each rank acknowledges for itself",
            2,
            true,
            vec![(0, ack(0)), (1, ack(1))],
        ),
        ("the one source lands", 1, false, vec![(0, done(0))]),
        ("the one source fails", 1, false, vec![(0, failed(0))]),
    ];
    for (name, expected, cancelling, inputs) in &honest {
        assert_eq!(
            run(*expected, *cancelling, inputs, false),
            (true, 0),
            "{name}"
        );
    }
}

mod fenced;
