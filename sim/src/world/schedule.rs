//! What the world schedules: its messages, its future events, and the fault rates a seed draws.

use kvhandoff_protocol::machine::Time;
use std::time::Duration;

use kvhandoff_protocol::{Message, WriteFailure};

use super::NodeId;

/// A message in the simulated notification network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NetMsg {
    pub from: NodeId,
    /// The sender's incarnation when it sent (its NIXL agent): a message held through a stall
    /// may be handled after its sender died.
    pub from_inc: u32,
    pub to: NodeId,
    pub to_inc: u32,
    /// The connection it travels on (see [`World::conn`]).
    pub conn: u64,
    pub message: Message,
}

/// Something that happens at a future time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ev {
    /// A message reaches its destination's transport (judged by the network now; handed to the
    /// shell now, or held while the destination is stalled).
    Deliver(NetMsg),
    /// A message that arrived while its destination was stalled, handed to the resumed shell.
    Handle(NetMsg),
    Land {
        write: u64,
    },
    Report {
        write: u64,
        failure: Option<WriteFailure>,
    },
    Connect {
        from: NodeId,
        from_inc: u32,
        to: NodeId,
        ok: bool,
    },
    DecodeStart {
        request: usize,
    },
    PrefillStart {
        request: usize,
    },
    /// P's worker hands its rank the export of pulled attempt `attempt`, which its engine
    /// answered the router for earlier (incarnation `inc` of P's process:
    /// `engine/early_answers.rs`).
    FileExport {
        request: usize,
        attempt: usize,
        inc: u32,
    },
    /// D `node`'s worker hands its rank the keep of request `request`'s blocks (D's attempt
    /// `epoch`) for its second turn, which its engine answered the router for earlier
    /// (incarnation `inc` of D's process: `engine/early_keeps.rs`).
    FileKeep {
        request: usize,
        node: NodeId,
        epoch: u64,
        inc: u32,
    },
    /// D rank `node`'s worker hands its rank its share of multi-rank request `request`'s keep
    /// for its second turn, which the engine answered the router for earlier (incarnation
    /// `inc` of the rank's process: `engine/multi/turn/early.rs`).
    FileTurnKeep {
        request: usize,
        node: NodeId,
        inc: u32,
    },
    /// P rank `node`'s worker hands its rank its share of multi-rank pull `request`, which the
    /// engine answered the router for earlier (incarnation `inc` of the rank's process:
    /// `engine/multi/early.rs`).
    FileSubExports {
        request: usize,
        node: NodeId,
        inc: u32,
    },
    /// P's engine reports layers `0 .. ready` of a layer-wise prefill attempt (its process
    /// incarnation `inc`: a crash ends the prefill).
    LayersReady {
        request: usize,
        attempt: usize,
        inc: u32,
        ready: u32,
    },
    Abort {
        request: usize,
        decode: bool,
    },
    Crash {
        node: NodeId,
    },
    Restart {
        node: NodeId,
    },
    /// A late copy of a handshake between `a` and `b` (as each is now) completes: a repeat if
    /// both are connected to each other's live incarnation.
    RepeatHandshake {
        a: NodeId,
        b: NodeId,
    },
    /// A multi-rank request's D rank `node` allocates its blocks once and starts one
    /// sub-request per P rank that writes to it.
    SubDecodeStart {
        request: usize,
        node: NodeId,
    },
    /// A multi-rank request's P rank `node` finished its prefill and starts one sub-request per
    /// D rank it writes to, over the same source blocks.
    SubPrefillStart {
        request: usize,
        node: NodeId,
    },
    /// Another D engine starts a decode for this request's key.
    SecondDecode {
        request: usize,
    },
    /// P's engine starts the request's second turn (reads D's kept blocks, or declines).
    SecondTurn {
        request: usize,
    },
    /// P rank `node`'s engine starts its share of multi-rank request `request`'s second turn:
    /// it reads the turn back from the D ranks its turn links name (`engine/multi/turn.rs`).
    TurnBack {
        request: usize,
        node: NodeId,
    },
    /// A sibling request on `node` with the very transfer parameters of the import `node` is
    /// running (the same key, epoch and holder) declines the export: one the engine will
    /// recompute, or its reaction to an error.
    SiblingDecline {
        request: usize,
        node: NodeId,
        second_turn: bool,
    },
    /// `node`'s process stops for `length`; its transfers freeze with it or keep moving; its
    /// resume hands over what queued before the due timers (`messages_first`), or draws that
    /// from the world's share.
    Stall {
        node: NodeId,
        length: Duration,
        freeze: bool,
        messages_first: bool,
    },
    /// `node`'s process runs again after the stall that began at `since`.
    Resume {
        node: NodeId,
        since: Time,
    },
}

/// Fault rates drawn per seed (swarm testing).
#[derive(Debug, Clone, Default)]
pub(crate) struct Rates {
    pub slow_msg: f64,
    pub drop: f64,
    pub dup: f64,
    pub post_fail: f64,
    pub fail_later: f64,
    pub hang: f64,
    pub slow_write: f64,
    pub abort: f64,
    pub retry: f64,
    pub connect_fail: f64,
    pub slow_prefill: f64,
    /// Chance that a key's P→D answers (`WriteDone`, `WriteFailed`, `CancelAck`) are all lost
    /// during the faulty phase while P stays alive: D can then only free by quarantine.
    pub mute_answers: f64,
    /// Chance that a reader's `ReadAsk` is lost (drawn in modes that read; the reader asks
    /// again while its heartbeats keep the export).
    pub lose_ask: f64,
    /// Chance that the router sends a push request lost in its D's crash again once that D is
    /// back: a new request id, the same `transfer_id`, and no epoch (as a router that knows
    /// nothing of epochs retries: epoch 1). Drawn by the swarm only.
    pub router_retry: f64,
    /// Chance that a `WriteDone` takes the slowest a message may take: a retried request's new
    /// attempt may then be registered when its old attempt's completion lands (the stale-epoch
    /// guard on D). Drawn by the swarm only.
    pub slow_write_done: f64,
}
