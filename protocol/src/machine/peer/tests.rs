//! Table-driven tests of `Peer`: every (state, input) pair, with the exact next state and notice.

use std::collections::{BTreeSet, VecDeque};

use crate::{Epoch, Incarnation, Message, PairingKey, Release, ReleaseReason};

use super::{Peer, PeerConnecting, PeerCtx, PeerDown, PeerInput, PeerNotice, PeerUp};
use crate::machine::effects::Outbox;
use crate::machine::shape::Machine;
use crate::machine::types::{ConnectFailure, Time};
use crate::machine::Config;

fn ms(n: u64) -> Time {
    Time::from_nanos(n * 1_000_000)
}

/// When every case's input happens unless it says otherwise.
const NOW_MS: u64 = 1_000;
/// The `Connecting` fixture's handshake deadline.
const CONNECT_DL_MS: u64 = 1_400;
/// The `Connected` fixture: last heard, next heartbeat (peer timeout is 150 ms).
const HEARD_MS: u64 = 950;
const HEARTBEAT_MS: u64 = 1_050;
/// The `Dead` fixture's end.
const DEAD_UNTIL_MS: u64 = 3_000;

fn config() -> Config {
    // heartbeat 100 ms, peer_timeout 150 ms, connect_timeout 500 ms, tombstone_ttl 5000 ms.
    Config::fast()
}

fn message(n: u64) -> Message {
    Message::Release(Release {
        key: PairingKey::new("key-1").unwrap(),
        epoch: Epoch(n),
        reason: ReleaseReason::Aborted,
    })
}

fn connecting() -> Peer {
    Peer::Connecting(PeerConnecting {
        deadline: ms(CONNECT_DL_MS),
        queued: VecDeque::from([message(1), message(2)]),
    })
}

/// The incarnation the `Connected` fixture reaches.
const LIVE: Incarnation = Incarnation(0x11);
/// Another incarnation of the same peer (a restart).
const NEXT: Incarnation = Incarnation(0x22);

fn up_to(last_heard: Time, next_heartbeat: Time, incarnation: Incarnation) -> Peer {
    Peer::Connected(PeerUp {
        last_heard,
        next_heartbeat,
        incarnation,
    })
}

fn up(last_heard: Time, next_heartbeat: Time) -> Peer {
    up_to(last_heard, next_heartbeat, LIVE)
}

fn connected() -> Peer {
    up(ms(HEARD_MS), ms(HEARTBEAT_MS))
}

fn dead_until(until: Time) -> Peer {
    Peer::Dead(PeerDown { until })
}

fn dead() -> Peer {
    dead_until(ms(DEAD_UNTIL_MS))
}

struct Case {
    name: &'static str,
    state: Peer,
    now: Time,
    input: PeerInput,
    next: Peer,
    notice: PeerNotice,
}

fn case(name: &'static str, state: Peer, input: PeerInput, next: Peer, notice: PeerNotice) -> Case {
    Case {
        name,
        state,
        now: ms(NOW_MS),
        input,
        next,
        notice,
    }
}

impl Case {
    fn at(self, now: Time) -> Case {
        Case { now, ..self }
    }
}

fn cases() -> Vec<Case> {
    use PeerInput as I;
    use PeerNotice as N;
    let refused = || ConnectFailure::Refused("nope".into());
    // A fresh connection at `t`: heard now, next heartbeat one interval later.
    let fresh = |t: u64| up(ms(t), ms(t + 100));
    vec![
        // ---- Connecting
        case(
            "connecting + connect requested: already connecting",
            connecting(),
            I::ConnectRequested,
            connecting(),
            N::Quiet,
        ),
        case(
            "connecting + connected: up, queued messages in order",
            connecting(),
            I::Connected(LIVE),
            fresh(NOW_MS),
            N::Up(vec![message(1), message(2)]),
        ),
        case(
            "connecting + connect failed: reason passed on",
            connecting(),
            I::ConnectFailed(ConnectFailure::Incompatible),
            connecting(),
            N::ConnectFailed(ConnectFailure::Incompatible),
        ),
        case(
            "connecting + connect refused: reason passed on",
            connecting(),
            I::ConnectFailed(refused()),
            connecting(),
            N::ConnectFailed(refused()),
        ),
        case(
            "connecting + heard: not connected yet",
            connecting(),
            I::Heard,
            connecting(),
            N::NotConnected,
        ),
        case(
            "connecting + lost: handshake refused",
            connecting(),
            I::Lost,
            connecting(),
            N::ConnectFailed(ConnectFailure::Refused("peer lost".into())),
        ),
        case(
            "connecting + timeout before deadline: waits",
            connecting(),
            I::Timeout,
            connecting(),
            N::Quiet,
        )
        .at(ms(CONNECT_DL_MS - 1)),
        case(
            "connecting + timeout at deadline: timed out",
            connecting(),
            I::Timeout,
            connecting(),
            N::ConnectFailed(ConnectFailure::TimedOut),
        )
        .at(ms(CONNECT_DL_MS)),
        case(
            "connecting + timeout after deadline: timed out",
            connecting(),
            I::Timeout,
            connecting(),
            N::ConnectFailed(ConnectFailure::TimedOut),
        )
        .at(ms(CONNECT_DL_MS + 5)),
        // ---- Connected
        case(
            "connected + connect requested: quiet",
            connected(),
            I::ConnectRequested,
            connected(),
            N::Quiet,
        ),
        case(
            "connected + connected to another incarnation: the peer restarted",
            connected(),
            I::Connected(NEXT),
            up_to(ms(NOW_MS), ms(NOW_MS + 100), NEXT),
            N::Restarted,
        ),
        case(
            "connected + connected to the same incarnation: a repeat, heard from, nothing else",
            connected(),
            I::Connected(LIVE),
            up(ms(NOW_MS), ms(HEARTBEAT_MS)),
            N::Repeated,
        ),
        case(
            "connected + connect failed: quiet (a stale handshake)",
            connected(),
            I::ConnectFailed(ConnectFailure::TimedOut),
            connected(),
            N::Quiet,
        ),
        case(
            "connected + heard: last heard moves to now",
            connected(),
            I::Heard,
            up(ms(NOW_MS), ms(HEARTBEAT_MS)),
            N::Quiet,
        ),
        case(
            "connected + heard at an earlier time: last heard never moves back",
            connected(),
            I::Heard,
            connected(),
            N::Quiet,
        )
        .at(ms(HEARD_MS - 10)),
        case(
            "connected + lost: dead until now + tombstone ttl",
            connected(),
            I::Lost,
            dead_until(ms(NOW_MS + 5_000)),
            N::Died,
        ),
        case(
            "connected + timeout before heartbeat and silence limit: quiet",
            connected(),
            I::Timeout,
            connected(),
            N::Quiet,
        )
        .at(ms(HEARTBEAT_MS - 1)),
        case(
            "connected + timeout at heartbeat: heartbeat due, next one scheduled",
            connected(),
            I::Timeout,
            up(ms(HEARD_MS), ms(HEARTBEAT_MS + 100)),
            N::HeartbeatDue,
        )
        .at(ms(HEARTBEAT_MS)),
        case(
            "connected + timeout at the silence limit: died",
            up(ms(HEARD_MS), ms(HEARD_MS + 500)),
            I::Timeout,
            dead_until(ms(HEARD_MS + 150 + 5_000)),
            N::Died,
        )
        .at(ms(HEARD_MS + 150)),
        case(
            "connected + timeout with heartbeat and silence both due: died wins",
            connected(),
            I::Timeout,
            dead_until(ms(HEARD_MS + 200 + 5_000)),
            N::Died,
        )
        .at(ms(HEARD_MS + 200)),
        // ---- Dead
        case(
            "dead + connect requested: connecting afresh",
            dead(),
            I::ConnectRequested,
            Peer::Connecting(PeerConnecting {
                deadline: ms(NOW_MS + 500),
                queued: VecDeque::new(),
            }),
            N::Connect,
        ),
        case(
            "dead + connected: a new incarnation is up",
            dead(),
            I::Connected(LIVE),
            fresh(NOW_MS),
            N::Up(vec![]),
        ),
        case(
            "dead + connect failed: quiet",
            dead(),
            I::ConnectFailed(ConnectFailure::TooManyPeers),
            dead(),
            N::Quiet,
        ),
        case(
            "dead + heard: a late message from the dead",
            dead(),
            I::Heard,
            dead(),
            N::NotConnected,
        ),
        case("dead + lost: quiet", dead(), I::Lost, dead(), N::Quiet),
        case(
            "dead + timeout before the end: quiet",
            dead(),
            I::Timeout,
            dead(),
            N::Quiet,
        )
        .at(ms(DEAD_UNTIL_MS - 1)),
        case(
            "dead + timeout at the end: forget",
            dead(),
            I::Timeout,
            dead(),
            N::Forget,
        )
        .at(ms(DEAD_UNTIL_MS)),
    ]
}

// Adding a state or an input breaks one of these matches: add its name to the list beside it,
// and the coverage test below then demands its cases.
const STATES: [&str; 3] = ["Connecting", "Connected", "Dead"];
const INPUTS: [&str; 6] = [
    "ConnectRequested",
    "Connected",
    "ConnectFailed",
    "Heard",
    "Lost",
    "Timeout",
];

fn state_name(state: &Peer) -> &'static str {
    match state {
        Peer::Connecting(_) => "Connecting",
        Peer::Connected(_) => "Connected",
        Peer::Dead(_) => "Dead",
    }
}

fn input_name(input: &PeerInput) -> &'static str {
    match input {
        PeerInput::ConnectRequested => "ConnectRequested",
        PeerInput::Connected(_) => "Connected",
        PeerInput::ConnectFailed(_) => "ConnectFailed",
        PeerInput::Heard => "Heard",
        PeerInput::Lost => "Lost",
        PeerInput::Timeout => "Timeout",
    }
}

#[test]
fn every_state_and_input() {
    let config = config();
    let mut names = BTreeSet::new();
    for case in cases() {
        let name = case.name;
        assert!(names.insert(name), "case names are unique: {name}");
        let (next, notice) = case.state.handle(
            &PeerCtx {
                now: case.now,
                config: &config,
            },
            case.input,
            &mut Outbox::default(),
        );
        assert_eq!(next, case.next, "case `{name}`: next state");
        assert_eq!(notice, case.notice, "case `{name}`: notice");
    }
}

#[test]
fn table_covers_every_state_input_pair() {
    let covered: BTreeSet<(&str, &str)> = cases()
        .iter()
        .map(|c| (state_name(&c.state), input_name(&c.input)))
        .collect();
    let all: BTreeSet<(&str, &str)> = STATES
        .iter()
        .flat_map(|s| INPUTS.iter().map(move |i| (*s, *i)))
        .collect();
    let missing: Vec<_> = all.difference(&covered).collect();
    let unknown: Vec<_> = covered.difference(&all).collect();
    assert!(missing.is_empty(), "pairs without a case: {missing:?}");
    assert!(
        unknown.is_empty(),
        "names missing from STATES/INPUTS: {unknown:?}"
    );
}

#[test]
fn constructors_timers_and_predicates() {
    let config = config();
    let now = ms(NOW_MS);
    assert_eq!(
        Peer::connecting(now, &config),
        Peer::Connecting(PeerConnecting {
            deadline: now + config.connect_timeout,
            queued: VecDeque::new(),
        })
    );
    assert_eq!(
        Peer::connected(now, &config, LIVE),
        up(now, now + config.heartbeat_interval)
    );
    // (peer, next timer, connected, dead)
    let table = [
        (connecting(), ms(CONNECT_DL_MS), false, false),
        (connected(), ms(HEARTBEAT_MS), true, false),
        // The silence limit comes before the next heartbeat.
        (
            up(ms(HEARD_MS), ms(HEARD_MS + 900)),
            ms(HEARD_MS + 150),
            true,
            false,
        ),
        (dead(), ms(DEAD_UNTIL_MS), false, true),
    ];
    for (peer, timer, is_connected, is_dead) in table {
        assert_eq!(peer.next_timer(&config), timer, "{peer:?}");
        assert_eq!(peer.is_connected(), is_connected, "{peer:?}");
        assert_eq!(peer.is_dead(), is_dead, "{peer:?}");
    }
}

#[test]
fn only_a_connecting_peer_queues_and_only_up_to_its_bound() {
    let config = Config {
        max_queued_per_peer: 2,
        ..config()
    };
    let mut peer = Peer::connecting(ms(0), &config);
    assert!(peer.queue(message(1), &config));
    assert!(peer.queue(message(2), &config));
    assert!(!peer.queue(message(3), &config), "the queue is bounded");
    let (_, notice) = peer.handle(
        &PeerCtx {
            now: ms(1),
            config: &config,
        },
        PeerInput::Connected(LIVE),
        &mut Outbox::default(),
    );
    assert_eq!(notice, PeerNotice::Up(vec![message(1), message(2)]));

    let mut up = connected();
    assert!(
        !up.queue(message(1), &config),
        "a connected peer sends at once"
    );
    assert_eq!(up, connected());
    let mut down = dead();
    assert!(
        !down.queue(message(1), &config),
        "a dead peer queues nothing"
    );
    assert_eq!(down, dead());
}
