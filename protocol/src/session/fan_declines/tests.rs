//! Declines of multi-rank exports in the session: which holders are told, under which keys,
//! and the refusal while a part is being read.

use super::*;
use crate::machine::{Config, Endpoint, LoadFailurePolicy};
use crate::session::{ConnectorCall, ConnectorIdentity, ConnectorSettings};
use crate::{BlockIds, EngineId, PairingKey};

fn session(engine: &str, links: RankLinks, turn_links: Option<RankLinks>) -> Session {
    let engine = EngineId::new(engine).unwrap();
    let endpoint = Endpoint::new(engine.clone(), 0, Config::default()).unwrap();
    let settings = ConnectorSettings {
        block_tokens: Some(32),
        load_failure_policy: LoadFailurePolicy::Fail,
        ..ConnectorSettings::default()
    };
    let mut session = Session::new(
        endpoint,
        ConnectorIdentity::in_process(engine, 0, 1),
        settings,
    );
    session.set_links(links).unwrap();
    if let Some(turn) = turn_links {
        session.set_turn_links(turn).unwrap();
    }
    session
}

fn links(side: SideName, peers: Vec<u32>) -> RankLinks {
    RankLinks {
        side,
        rank: 0,
        remote_tp: 2,
        remote_ranks: 2,
        peers,
    }
}

/// What a holder's answer gives the reader: `engine` at TP 2, pull, the request's key.
fn answer(engine: &str) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some(engine.into()),
        tp_size: Some(2),
        transfer_mode: Some("pull".into()),
        transfer_id: Some("conv-7".into()),
        remote_block_ids: Some(vec![vec![10, 11, 12, 13]]),
        ..KvTransferParams::default()
    }
}

fn decline(params: KvTransferParams) -> ConnectorCall {
    ConnectorCall::DeclineExport {
        request: RequestId::new("conv-7").unwrap(),
        params,
    }
}

/// The peers this session asked to reach (a decline is queued to each until it connects).
fn contacted(session: &mut Session) -> Vec<PeerAddr> {
    let mut peers = Vec::new();
    while let Some(out) = session.poll_output() {
        match out {
            SessionOutput::Connect(peer) => peers.push(peer),
            SessionOutput::Event(event) => panic!("a decline owes no event: {event:?}"),
            SessionOutput::Transport(_)
            | SessionOutput::PeerAddress(_)
            | SessionOutput::Observed(_) => {}
        }
    }
    peers.sort();
    peers
}

/// A D rank reading from P ranks 0 and 1 declines both; a P rank declines a kept turn at every
/// D rank its turn links read from; a rank linked to read nothing cannot decline.
#[test]
fn a_decline_reaches_every_holder_rank_the_reader_is_linked_to() {
    let mut d = session("decode", links(SideName::Decode, vec![0, 1]), None);
    d.handle_call(Time::ZERO, decline(answer("prefill")))
        .unwrap();
    let prefill = EngineId::new("prefill").unwrap();
    assert_eq!(
        contacted(&mut d),
        vec![PeerAddr::new(prefill.clone(), 0), PeerAddr::new(prefill, 1)]
    );

    let mut p = session(
        "prefill",
        links(SideName::Prefill, vec![0]),
        Some(links(SideName::Decode, vec![0, 1])),
    );
    p.handle_call(Time::ZERO, decline(answer("decode")))
        .unwrap();
    let decode = EngineId::new("decode").unwrap();
    assert_eq!(
        contacted(&mut p),
        vec![PeerAddr::new(decode.clone(), 0), PeerAddr::new(decode, 1)]
    );

    let mut holder = session("prefill", links(SideName::Prefill, vec![0, 1]), None);
    assert!(matches!(
        holder.handle_call(Time::ZERO, decline(answer("decode"))),
        Err(ConnectorError::Unsupported(_))
    ));
    // The links' TP must be the router's.
    let mut wrong_tp = answer("prefill");
    wrong_tp.tp_size = Some(4);
    assert!(matches!(
        d.handle_call(Time::ZERO, decline(wrong_tp)),
        Err(ConnectorError::InvalidParam {
            name: "tp_size",
            ..
        })
    ));
}

/// While the reader reads the export (its imports live), a decline of it is refused whole:
/// no holder is told anything.
#[test]
fn a_decline_of_an_export_being_read_is_refused_whole() {
    let mut d = session("decode", links(SideName::Decode, vec![0, 1]), None);
    let read = ConnectorCall::RequestAllocated {
        request: RequestId::new("conv-7").unwrap(),
        blocks: BlockIds::single_group(vec![2, 3]),
        num_tokens: 64,
        params: answer("prefill"),
    };
    d.handle_call(Time::ZERO, read).unwrap();
    let _ = contacted(&mut d);
    let key = PairingKey::new("conv-7").unwrap().for_pair(0, 0).unwrap();
    assert!(d
        .endpoint
        .is_reading(&key, &PeerAddr::new(EngineId::new("prefill").unwrap(), 0)));
    assert!(matches!(
        d.handle_call(Time::ZERO, decline(answer("prefill"))),
        Err(ConnectorError::Rejected(Rejected::ImportInProgress(_)))
    ));
    assert_eq!(contacted(&mut d), vec![]);
}
