//! Multi-rank pulls in the session: the parts a call starts, and how their ends fold into the
//! engine's one event (the parts' events played by the test, or the endpoint's own for aborts).

use super::*;
use crate::machine::Endpoint;
use crate::machine::{
    Config, EndpointEvent, ExportEnd, ExportOutcome, ImportFailure, ImportOutcome, ReadProof,
};
use crate::session::{
    ConnectorCall, ConnectorEvent, ConnectorIdentity, ConnectorSettings, SessionOutput,
};
use crate::{EngineId, PairingKey};

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

/// D's blocks (block size 32) and P's (block size 16): the counts differ, as in a
/// heterogeneous pair.
fn d_blocks() -> BlockIds {
    BlockIds::single_group(vec![2, 3])
}

fn p_blocks() -> BlockIds {
    BlockIds::single_group(vec![10, 11, 12, 13])
}

fn session(engine: &str, side: SideName, peers: Vec<u32>, policy: LoadFailurePolicy) -> Session {
    let engine = EngineId::new(engine).unwrap();
    let endpoint = Endpoint::new(engine.clone(), 0, Config::default()).unwrap();
    let settings = ConnectorSettings {
        block_tokens: Some(32),
        load_failure_policy: policy,
        ..ConnectorSettings::default()
    };
    let mut session = Session::new(
        endpoint,
        ConnectorIdentity::in_process(engine, 0, 1),
        settings,
    );
    session
        .set_links(RankLinks {
            side,
            rank: 0,
            remote_tp: 2,
            remote_ranks: 2,
            peers,
        })
        .unwrap();
    session
}

fn pull_allocated(request: &RequestId) -> ConnectorCall {
    ConnectorCall::RequestAllocated {
        request: request.clone(),
        blocks: d_blocks(),
        num_tokens: 64,
        params: KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("prefill".into()),
            tp_size: Some(2),
            transfer_mode: Some("pull".into()),
            remote_block_ids: Some(p_blocks().groups),
            ..KvTransferParams::default()
        },
    }
}

fn pull_finished(request: &RequestId) -> ConnectorCall {
    ConnectorCall::RequestFinished {
        request: request.clone(),
        blocks: p_blocks(),
        num_tokens: 64,
        params: KvTransferParams {
            do_remote_decode: true,
            transfer_mode: Some("pull".into()),
            ..KvTransferParams::default()
        },
    }
}

fn events(session: &mut Session) -> Vec<ConnectorEvent> {
    let mut events = Vec::new();
    while let Some(out) = session.poll_output() {
        if let SessionOutput::Event(event) = out {
            events.push(event);
        }
    }
    events
}

/// The part of `parent` between P rank `p` and D rank `d`, and its key.
fn part(parent: &RequestId, p: u32, d: u32) -> (RequestId, PairingKey) {
    let key = PairingKey::from_request_id(parent).for_pair(p, d).unwrap();
    (sub_request_id(parent, p, d).unwrap(), key)
}

fn imported(parent: &RequestId, p: u32, outcome: ImportOutcome) -> EndpointEvent {
    let (request, key) = part(parent, p, 0);
    EndpointEvent::Import {
        request,
        key,
        epoch: crate::Epoch::FIRST,
        outcome,
        blocks: d_blocks(),
    }
}

fn exported(parent: &RequestId, d: u32, outcome: ExportOutcome, proof: ReadProof) -> EndpointEvent {
    let (request, key) = part(parent, 0, d);
    EndpointEvent::Export {
        request,
        key,
        outcome,
        proof,
        blocks: p_blocks(),
    }
}

/// D rank 0 reads from P ranks 0 and 1: one import each, under the pair's key, with every
/// block of both sides (their counts differ); `Imported` comes once, after both loaded.
#[test]
fn a_multi_rank_read_is_loaded_only_when_every_holder_rank_was_read() {
    let mut d = session(
        "decode",
        SideName::Decode,
        vec![0, 1],
        LoadFailurePolicy::Fail,
    );
    let request = id("req-1");
    d.handle_call(Time::ZERO, pull_allocated(&request)).unwrap();
    assert_eq!(d.fans_in_progress(), 1);
    let _ = events(&mut d);
    d.engine_event(imported(&request, 1, ImportOutcome::Loaded));
    assert_eq!(events(&mut d), vec![], "one holder rank is not the request");
    d.engine_event(imported(&request, 0, ImportOutcome::Loaded));
    assert_eq!(
        events(&mut d),
        vec![ConnectorEvent::Imported {
            request,
            outcome: ImportOutcome::Loaded,
            blocks: d_blocks(),
        }]
    );
    assert_eq!(d.fans_in_progress(), 0);
}

/// One holder rank refuses: the live sibling is aborted through the endpoint at once (its own
/// import ends `Aborted`), and the engine gets one event, after both ended, with the first
/// failure: `Failed` under policy `Fail`, a recompute of every token under `Recompute` (one
/// rank's part is no prefix of the request).
#[test]
fn a_failed_part_aborts_its_sibling_and_keeps_no_token() {
    for (policy, want) in [
        (
            LoadFailurePolicy::Fail,
            ImportOutcome::Failed(ImportFailure::ReadFailed),
        ),
        (
            LoadFailurePolicy::Recompute,
            ImportOutcome::Recompute {
                valid_tokens: 0,
                failure: ImportFailure::ReadFailed,
            },
        ),
    ] {
        let mut d = session("decode", SideName::Decode, vec![0, 1], policy);
        let request = id("req-2");
        d.handle_call(Time::ZERO, pull_allocated(&request)).unwrap();
        let _ = events(&mut d);
        let partial = ImportOutcome::Recompute {
            valid_tokens: 32,
            failure: ImportFailure::ReadFailed,
        };
        d.engine_event(imported(&request, 0, partial));
        // The sibling's abort went to the endpoint, whose import of P rank 1 ends now.
        assert_eq!(
            events(&mut d),
            vec![ConnectorEvent::Imported {
                request,
                outcome: want,
                blocks: d_blocks(),
            }],
            "{policy:?}"
        );
        assert_eq!(d.fans_in_progress(), 0);
    }
}

/// P rank 0 is read by D ranks 0 and 1: the blocks go back when both exports ended, with the
/// first failure and the most cautious proof among them.
#[test]
fn a_multi_rank_export_ends_when_every_reader_rank_let_go() {
    let mut p = session(
        "prefill",
        SideName::Prefill,
        vec![0, 1],
        LoadFailurePolicy::Fail,
    );
    let request = id("req-3");
    let reply = p.handle_call(Time::ZERO, pull_finished(&request)).unwrap();
    let crate::session::ConnectorReply::DecodeParams(params) = reply else {
        panic!("an export answers with the reader's parameters: {reply:?}");
    };
    assert_eq!(params.remote_block_ids, Some(p_blocks().groups));
    assert_eq!(p.fans_in_progress(), 1);
    p.engine_event(exported(
        &request,
        1,
        ExportOutcome::Released(ExportEnd::GrantFenced),
        ReadProof::GrantFence,
    ));
    // The sibling's abort ended its export through the endpoint: nothing was granted there.
    assert_eq!(
        events(&mut p),
        vec![ConnectorEvent::ExportEnded {
            request: request.clone(),
            outcome: ExportOutcome::Released(ExportEnd::GrantFenced),
            proof: ReadProof::GrantFence,
            blocks: p_blocks(),
        }]
    );

    let mut p = session(
        "prefill",
        SideName::Prefill,
        vec![0, 1],
        LoadFailurePolicy::Fail,
    );
    p.handle_call(Time::ZERO, pull_finished(&request)).unwrap();
    let _ = events(&mut p);
    for d in [0, 1] {
        p.engine_event(exported(
            &request,
            d,
            ExportOutcome::Read,
            ReadProof::ReaderReleased,
        ));
    }
    assert_eq!(
        events(&mut p),
        vec![ConnectorEvent::ExportEnded {
            request,
            outcome: ExportOutcome::Read,
            proof: ReadProof::ReaderReleased,
            blocks: p_blocks(),
        }]
    );
}

/// A P rank no D rank reads from (a replica) ends its export at once, unread and not needed.
#[test]
fn a_replica_holder_ends_at_once() {
    let mut p = session(
        "prefill",
        SideName::Prefill,
        vec![],
        LoadFailurePolicy::Fail,
    );
    let request = id("req-4");
    p.handle_call(Time::ZERO, pull_finished(&request)).unwrap();
    assert_eq!(
        events(&mut p),
        vec![ConnectorEvent::ExportEnded {
            request,
            outcome: ExportOutcome::Released(ExportEnd::FullPrefixHit),
            proof: ReadProof::NeverGranted,
            blocks: p_blocks(),
        }]
    );
}

/// What a multi-rank read refuses before anything starts: another TP size than the links', a
/// holder's list with another number of cache groups.
#[test]
fn a_multi_rank_read_checks_what_the_router_passed() {
    let mut d = session(
        "decode",
        SideName::Decode,
        vec![0, 1],
        LoadFailurePolicy::Fail,
    );
    let mut call = pull_allocated(&id("req-5"));
    if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
        params.tp_size = Some(4);
    }
    assert!(matches!(
        d.handle_call(Time::ZERO, call),
        Err(ConnectorError::InvalidParam {
            name: "tp_size",
            ..
        })
    ));
    let mut call = pull_allocated(&id("req-6"));
    if let ConnectorCall::RequestAllocated { params, .. } = &mut call {
        params.remote_block_ids = Some(vec![vec![1], vec![2]]);
    }
    assert!(matches!(
        d.handle_call(Time::ZERO, call),
        Err(ConnectorError::InvalidParam {
            name: "remote_block_ids",
            ..
        })
    ));
    assert_eq!(d.fans_in_progress(), 0, "nothing started");
}

/// A conversation's next turn on linked ranks: D keeps its blocks as one export per P rank of
/// its turn links (the pair planned the other way) and answers the router; P's next turn reads
/// them as one import per D rank; each folds into its one event. Without turn links, refused.
#[test]
fn turn_links_split_a_kept_turn_and_its_read_back() {
    let keep = |request: &RequestId| ConnectorCall::KeepForNextTurn {
        request: request.clone(),
        blocks: d_blocks(),
        num_tokens: 64,
        ttl: std::time::Duration::from_secs(30),
        params: KvTransferParams::default(),
    };
    // D rank 0 holds for P ranks 0 and 1 (the turn links' side is the holder's: Prefill).
    let mut d = session(
        "decode",
        SideName::Decode,
        vec![0, 1],
        LoadFailurePolicy::Fail,
    );
    let request = id("conv-1");
    assert!(matches!(
        d.handle_call(Time::ZERO, keep(&request)),
        Err(ConnectorError::Unsupported(_))
    ));
    d.set_turn_links(RankLinks {
        side: SideName::Prefill,
        rank: 0,
        remote_tp: 2,
        remote_ranks: 2,
        peers: vec![0, 1],
    })
    .unwrap();
    let reply = d.handle_call(Time::ZERO, keep(&request)).unwrap();
    let crate::session::ConnectorReply::NextTurnParams(params) = reply else {
        panic!("a kept turn answers with the next turn's parameters: {reply:?}");
    };
    assert_eq!(params.transfer_id.as_deref(), Some("conv-1"));
    assert_eq!(d.fans_in_progress(), 1);

    // P rank 0 reads D ranks 0 and 1 back (its turn links' side is the reader's: Decode).
    let mut p = session(
        "prefill",
        SideName::Prefill,
        vec![0],
        LoadFailurePolicy::Fail,
    );
    p.set_turn_links(RankLinks {
        side: SideName::Decode,
        rank: 0,
        remote_tp: 2,
        remote_ranks: 2,
        peers: vec![0, 1],
    })
    .unwrap();
    let next = id("conv-1-turn-2");
    let read_back = ConnectorCall::NextTurnAllocated {
        request: next.clone(),
        blocks: p_blocks(),
        num_tokens: 64,
        params: KvTransferParams {
            remote_engine_id: Some("decode".into()),
            tp_size: Some(2),
            transfer_id: Some("conv-1".into()),
            remote_block_ids: Some(d_blocks().groups),
            ..KvTransferParams::default()
        },
    };
    p.handle_call(Time::ZERO, read_back).unwrap();
    assert_eq!(p.fans_in_progress(), 1);
    let _ = events(&mut p);
    let key = PairingKey::new("conv-1").unwrap();
    for holder in [0, 1] {
        p.engine_event(EndpointEvent::Import {
            request: sub_request_id(&next, holder, 0).unwrap(),
            key: key.for_pair(holder, 0).unwrap(),
            epoch: crate::Epoch::FIRST,
            outcome: ImportOutcome::Loaded,
            blocks: p_blocks(),
        });
    }
    assert_eq!(
        events(&mut p),
        vec![ConnectorEvent::Imported {
            request: next,
            outcome: ImportOutcome::Loaded,
            blocks: p_blocks(),
        }]
    );
}

/// The engine's policy may change between a multi-rank read's start and its end (another
/// request's settings, or a reconfiguration): the read fails by the policy it started under,
/// as a single import does (`ImportStart::policy`). Found by the simulator (issue 23: seed 4 of
/// `sim --mode mixed --seeds 1..101 --requests 40`, a read started under `Recompute` ended
/// `Failed` after a later read on the rank set `Fail`).
#[test]
fn a_multi_rank_read_fails_by_the_policy_it_started_under() {
    for (start, later) in [
        (LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail),
        (LoadFailurePolicy::Fail, LoadFailurePolicy::Recompute),
    ] {
        let mut d = session("decode", SideName::Decode, vec![0, 1], start);
        let request = id("req-7");
        d.handle_call(Time::ZERO, pull_allocated(&request)).unwrap();
        let _ = events(&mut d);
        let mut settings = *d.settings();
        settings.load_failure_policy = later;
        d.set_settings(settings);
        d.engine_event(imported(
            &request,
            1,
            ImportOutcome::Failed(ImportFailure::PeerDead),
        ));
        let want = match start {
            LoadFailurePolicy::Fail => ImportOutcome::Failed(ImportFailure::PeerDead),
            LoadFailurePolicy::Recompute => ImportOutcome::Recompute {
                valid_tokens: 0,
                failure: ImportFailure::PeerDead,
            },
        };
        assert_eq!(
            events(&mut d),
            vec![ConnectorEvent::Imported {
                request,
                outcome: want,
                blocks: d_blocks(),
            }],
            "started under {start:?}, ended under {later:?}"
        );
    }
}
