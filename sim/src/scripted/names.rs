//! Names and builders of the scripted world: the engines, ranks, request ids and block lists
//! the scenarios use, and a few ready-made starting points.

use std::time::Duration;

use kvhandoff_protocol::machine::{
    Config, DecodeOutcome, DecodeStart, EndpointCall, EndpointEvent, ExportOutcome, ExportStart,
    FreeProof, ImportOutcome, ImportStart, LoadFailurePolicy, PrefillOutcome, PrefillStart,
    ReadProof, Time,
};
use kvhandoff_protocol::{BlockIds, EngineId, Epoch, Message, PairingKey, PeerAddr, RequestId};

use super::Harness;

/// An engine id.
pub fn engine(name: &str) -> EngineId {
    EngineId::new(name).expect("valid engine id")
}

/// P's rank 0.
pub fn p_addr() -> PeerAddr {
    PeerAddr::new(engine("prefill"), 0)
}

/// P's rank 1 (only present after [`Harness::add_endpoint`]).
pub fn p1_addr() -> PeerAddr {
    PeerAddr::new(engine("prefill"), 1)
}

/// D's rank 0.
pub fn d_addr() -> PeerAddr {
    PeerAddr::new(engine("decode"), 0)
}

/// The uuid of request number `n`.
pub fn uuid(n: u32) -> String {
    format!("{n:08x}-aaaa-bbbb-cccc-1234567890ab")
}

/// P's id of request `n`: `cmpl-<uuid>-0-aaaaaaaa` (vLLM's random suffix).
pub fn p_request(n: u32) -> RequestId {
    RequestId::new(format!("cmpl-{}-0-aaaaaaaa", uuid(n))).expect("valid id")
}

/// D's id of request `n`: `cmpl-<uuid>-0-bbbbbbbb` (another random suffix).
pub fn d_request(n: u32) -> RequestId {
    RequestId::new(format!("cmpl-{}-0-bbbbbbbb", uuid(n))).expect("valid id")
}

/// The pairing key both sides derive for request `n`.
pub fn key(n: u32) -> PairingKey {
    PairingKey::from_request_id(&d_request(n))
}

/// One cache group.
pub fn blocks(ids: &[u32]) -> BlockIds {
    BlockIds::single_group(ids.to_vec())
}

/// D allocated `ids` for request `n`, to be written by P's rank 0 (epoch 1, one write).
pub fn decode_start(n: u32, ids: &[u32]) -> DecodeStart {
    let request = d_request(n);
    DecodeStart {
        key: PairingKey::from_request_id(&request),
        request,
        epoch: Epoch::FIRST,
        prefill: p_addr(),
        blocks: blocks(ids),
        num_tokens: 16 * ids.len() as u64,
        expected_writes: 1,
    }
}

/// P finished request `n` with `ids`.
pub fn prefill_start(n: u32, ids: &[u32]) -> PrefillStart {
    let request = p_request(n);
    PrefillStart {
        key: PairingKey::from_request_id(&request),
        request,
        blocks: blocks(ids),
    }
}

/// The instant `d` after the start of the world.
pub fn at(d: Duration) -> Time {
    Time::from_duration(d)
}

/// A `Register`.
pub fn is_register(m: &Message) -> bool {
    matches!(m, Message::Register(_))
}

/// A `Cancel`.
pub fn is_cancel(m: &Message) -> bool {
    matches!(m, Message::Cancel(_))
}

/// Milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `(outcome, proof)` of a D event; panics on a P event.
pub fn decode_result(event: &EndpointEvent) -> (DecodeOutcome, FreeProof) {
    match event {
        EndpointEvent::Decode { outcome, proof, .. } => (*outcome, *proof),
        EndpointEvent::DecodeFenced { .. }
        | EndpointEvent::Prefill { .. }
        | EndpointEvent::Export { .. }
        | EndpointEvent::Import { .. } => {
            panic!("expected a decode event, got {event:?}")
        }
    }
}

/// The outcome of a P event; panics on a D event.
pub fn prefill_result(event: &EndpointEvent) -> PrefillOutcome {
    match event {
        EndpointEvent::Prefill { outcome, .. } => *outcome,
        EndpointEvent::Decode { .. }
        | EndpointEvent::DecodeFenced { .. }
        | EndpointEvent::Export { .. }
        | EndpointEvent::Import { .. } => {
            panic!("expected a prefill event, got {event:?}")
        }
    }
}

/// `(outcome, proof)` of an export event; panics on any other.
pub fn export_result(event: &EndpointEvent) -> (ExportOutcome, ReadProof) {
    match event {
        EndpointEvent::Export { outcome, proof, .. } => (*outcome, *proof),
        EndpointEvent::Decode { .. }
        | EndpointEvent::DecodeFenced { .. }
        | EndpointEvent::Prefill { .. }
        | EndpointEvent::Import { .. } => {
            panic!("expected an export event, got {event:?}")
        }
    }
}

/// The outcome of an import event; panics on any other.
pub fn import_result(event: &EndpointEvent) -> ImportOutcome {
    match event {
        EndpointEvent::Import { outcome, .. } => *outcome,
        EndpointEvent::Decode { .. }
        | EndpointEvent::DecodeFenced { .. }
        | EndpointEvent::Prefill { .. }
        | EndpointEvent::Export { .. } => {
            panic!("expected an import event, got {event:?}")
        }
    }
}

/// P (pull) exports `ids` for request `n` for `lease`: P's own id of the request.
pub fn export_start(n: u32, ids: &[u32], lease: Duration) -> ExportStart {
    let request = p_request(n);
    ExportStart {
        key: PairingKey::from_request_id(&request),
        request,
        blocks: blocks(ids),
        num_tokens: 16 * ids.len() as u64,
        lease,
    }
}

/// D (pull) reads request `n` from P's rank 0 into `ids`, P's blocks being `remote` (epoch 1,
/// 16 tokens per block, policy `Fail`, no known expiry).
pub fn import_start(n: u32, ids: &[u32], remote: &[u32]) -> ImportStart {
    let request = d_request(n);
    ImportStart {
        key: PairingKey::from_request_id(&request),
        request,
        epoch: Epoch::FIRST,
        holder: p_addr(),
        blocks: blocks(ids),
        remote_blocks: blocks(remote),
        num_tokens: 16 * remote.len() as u64,
        block_tokens: 16,
        policy: LoadFailurePolicy::Fail,
        expires: None,
    }
}

/// P finished request 1 ([10, 11]) and D registered [500, 501]: P's write is posted and
/// pending.
pub fn writing() -> Harness {
    let mut h = Harness::new();
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.decode(decode_start(1, &[500, 501])).unwrap();
    assert_eq!(h.writes.len(), 1);
    h
}

/// P ranks 0 and 1 both finished request 1 ([10, 11] and [20, 21]); D allocated [500, 501]
/// expecting two writes, and its registration reached both ranks (D sends it to P rank 0; the
/// harness fans it out to rank 1). Both writes are posted and pending.
pub fn two_writers() -> Harness {
    let mut h = Harness::new();
    h.add_endpoint(p1_addr(), Config::fast());
    h.connect(&d_addr(), &p1_addr());
    h.prefill(prefill_start(1, &[10, 11])).unwrap();
    h.call(
        &p1_addr(),
        EndpointCall::PrefillFinished(prefill_start(1, &[20, 21])),
    )
    .unwrap();
    let mut start = decode_start(1, &[500, 501]);
    start.expected_writes = 2;
    h.decode(start).unwrap();
    let register = h
        .sent
        .iter()
        .find(|(_, e)| matches!(e.message, Message::Register(_)))
        .map(|(_, e)| e.message.clone())
        .expect("D registered");
    h.inject(&d_addr(), &p1_addr(), register);
    assert_eq!(h.writes.len(), 2, "both ranks posted their write");
    h
}

/// Reading a scenario's engine events.
impl Harness {
    /// Engine events of `addr`, in order.
    pub fn events_of(&self, addr: &PeerAddr) -> Vec<EndpointEvent> {
        self.node(addr)
            .events
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// D's engine events.
    pub fn events_d(&self) -> Vec<EndpointEvent> {
        self.events_of(&d_addr())
    }

    /// D's early failures (`EndpointEvent::DecodeFenced`), in order.
    pub fn early_d(&self) -> Vec<EndpointEvent> {
        self.node(&d_addr())
            .early
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// P's engine events.
    pub fn events_p(&self) -> Vec<EndpointEvent> {
        self.events_of(&p_addr())
    }

    /// `(outcome, proof)` of every D event.
    pub fn d_results(&self) -> Vec<(DecodeOutcome, FreeProof)> {
        self.events_d().iter().map(decode_result).collect()
    }

    /// Outcome of every P event.
    pub fn p_results(&self) -> Vec<PrefillOutcome> {
        self.events_p().iter().map(prefill_result).collect()
    }

    /// When `addr` emitted its event about `request`.
    pub fn event_time(&self, addr: &PeerAddr, request: &RequestId) -> Option<Time> {
        self.node(addr)
            .events
            .iter()
            .find(|(_, e)| e.request() == request)
            .map(|(t, _)| *t)
    }
}
