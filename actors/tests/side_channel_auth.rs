//! The TCP side channel's pre-shared-key authentication over real loopback sockets: ranks with
//! the same key connect and deliver; different keys, or a key on one side only, are refused on
//! both sides and counted as `AuthenticationFailed`; the bytes of a recorded successful exchange,
//! replayed on a new connection, are refused in both directions; a keyed listener writes nothing
//! to a peer without the key, and cuts one that stalls after its hello at the I/O deadline. (The
//! plain exchange's tests are in `side_channel.rs`.)

mod fixture;
use fixture::{call, decode_start, fill, geometry, model, next_event, wrong_bytes};

/// How long a test waits for a rank's next event.
const EVENT_WITHIN: Duration = Duration::from_secs(10);

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use kvhandoff_actors::system::{
    build_mem_rank, start_rank, AcceptPolicy, AddPeerAddress, Handshaker, KvPool, Psk,
    QuerySideChannel, RankHandle, RejectReason, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::machine::{Config, DecodeFailure, EndpointCall, FreeProof, PrefillStart};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::{
    wire, BlockIds, EngineId, Message, PairingKey, PeerAddr, RequestId, TransferMode,
};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const KEY_A: &[u8; 32] = b"the first pre-shared key, 32 B.!";
const KEY_B: &[u8; 32] = b"another pre-shared key of 32 B.!";

fn key(bytes: &[u8]) -> Option<Psk> {
    Some(Psk::new(bytes).unwrap())
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

/// Short real timeouts (with [`quick_shell`]); takes `decode`, `decode-2` and `raw-d`;
/// authenticated with `psk`.
fn keyed(psk: Option<Psk>) -> SideChannelConfig {
    SideChannelConfig {
        connect_timeout: Duration::from_millis(300),
        accept: AcceptPolicy::Known(
            ["decode", "decode-2", "raw-d"]
                .iter()
                .map(|n| engine(n))
                .collect(),
        ),
        psk,
        ..SideChannelConfig::new(loopback())
    }
}

struct Rank {
    handle: RankHandle,
    pool: KvPool,
    addr: SocketAddr,
}

/// The shells of the test's ranks: a short handshake budget, so hostile peers are cut quickly.
fn quick_shell() -> ShellConfig {
    ShellConfig {
        handshake_timeout: Duration::from_millis(300),
        ..ShellConfig::default()
    }
}

fn start(fabric: &MemFabric, name: &str, config: SideChannelConfig) -> Rank {
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine(name),
        geometry(),
        &model(),
        32,
        Config::fast(),
        quick_shell(),
    )
    .unwrap();
    let handle = start_rank(setup, Handshaker::Tcp(config), None).unwrap();
    let addr = handle.side_channel.expect("a TCP rank reports its address");
    Rank { handle, pool, addr }
}

async fn add_peer(rank: &Rank, name: &str, addr: SocketAddr) {
    rank.handle
        .link
        .send(AddPeerAddress {
            peer: PeerAddr::new(engine(name), 0),
            addr,
        })
        .await
        .unwrap()
        .unwrap();
}

async fn stats(rank: &Rank) -> SideChannelStats {
    rank.handle.link.send(QuerySideChannel).await.unwrap()
}

/// D registers, P finishes: the push completes and every byte lands.
async fn push(p: &mut Rank, d: &mut Rank, tag: &str) {
    let (d_blocks, p_blocks) = (vec![3, 4, 5], vec![20, 21, 22]);
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start(
            &format!("{tag}-11111111"),
            "prefill",
            d_blocks.clone(),
        )),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    fill(&p.pool, tag, &p_blocks);
    let request = RequestId::new(format!("{tag}-22222222")).unwrap();
    let start = PrefillStart {
        key: PairingKey::from_request_id(&request),
        request,
        blocks: BlockIds::single_group(p_blocks),
    };
    call(&p.handle, EndpointCall::PrefillFinished(start))
        .await
        .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(&event, ConnectorEvent::BlocksReady { .. }),
        "{event:?}"
    );
    assert_eq!(
        wrong_bytes(&d.pool, tag, &d_blocks),
        0,
        "every byte of {tag}"
    );
}

/// D asks for a request from P; the handshake fails, so the request fails typed.
async fn handshake_fails(d: &mut Rank, id: &str) {
    call(
        &d.handle,
        EndpointCall::DecodeAllocated(decode_start(id, "prefill", vec![1, 2])),
    )
    .await
    .unwrap();
    let event = next_event(&mut d.handle, EVENT_WITHIN).await;
    assert!(
        matches!(
            event,
            ConnectorEvent::Failed {
                reason: DecodeFailure::HandshakeFailed,
                proof: FreeProof::NeverExposed,
                ..
            }
        ),
        "{id}: {event:?}"
    );
}

/// Waits (3 s at most) until `check` holds of `rank`'s stats; returns them.
async fn eventually(
    rank: &Rank,
    what: &str,
    check: impl Fn(&SideChannelStats) -> bool,
) -> SideChannelStats {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let s = stats(rank).await;
        if check(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[actix_rt::test]
async fn the_same_key_connects_and_delivers() {
    let fabric = MemFabric::new();
    let mut p = start(&fabric, "prefill", keyed(key(KEY_A)));
    let mut d = start(&fabric, "decode", keyed(key(KEY_A)));
    add_peer(&d, "prefill", p.addr).await;
    add_peer(&p, "decode", d.addr).await;
    push(&mut p, &mut d, "same-key").await;
    let (ds, ps) = (stats(&d).await, stats(&p).await);
    assert_eq!((ds.outgoing_ok, ps.incoming_ok), (1, 1), "{ds:?} {ps:?}");
    assert_eq!(ds.total_rejected() + ps.total_rejected(), 0);
    assert!(ds.outgoing_failed.is_empty(), "{ds:?}");
    let clock = ds
        .clocks
        .get(&engine("prefill"))
        .expect("D's clock estimate");
    assert!(clock.rtt_us.is_some(), "{clock:?}");
}

#[actix_rt::test]
async fn different_keys_are_refused_on_both_sides() {
    let fabric = MemFabric::new();
    let p = start(&fabric, "prefill", keyed(key(KEY_A)));
    let mut d = start(&fabric, "decode", keyed(key(KEY_B)));
    add_peer(&d, "prefill", p.addr).await;
    handshake_fails(&mut d, "other-key-1").await;
    let ds = eventually(&d, "D counts the failure", |s| {
        s.failures(RejectReason::AuthenticationFailed) == 1
    })
    .await;
    assert_eq!(ds.outgoing_ok, 0, "{ds:?}");
    let ps = eventually(&p, "P counts the refusal", |s| {
        s.rejections(RejectReason::AuthenticationFailed) == 1
    })
    .await;
    assert_eq!((ps.incoming_ok, ps.total_rejected()), (0, 1), "{ps:?}");
}

#[actix_rt::test]
async fn a_key_on_one_side_only_is_refused() {
    let fabric = MemFabric::new();
    // P has a key, D none: P refuses and counts; D sees a plain refusal.
    let p = start(&fabric, "prefill", keyed(key(KEY_A)));
    let mut d = start(&fabric, "decode", keyed(None));
    add_peer(&d, "prefill", p.addr).await;
    handshake_fails(&mut d, "keyless-d-1").await;
    let ps = eventually(&p, "P refuses a keyless D", |s| {
        s.rejections(RejectReason::AuthenticationFailed) == 1
    })
    .await;
    assert_eq!(ps.incoming_ok, 0, "{ps:?}");
    let ds = eventually(&d, "D fails", |s| !s.outgoing_failed.is_empty()).await;
    assert_eq!(ds.outgoing_ok, 0, "{ds:?}");

    // P has none, D a key: both count an authentication failure (a fabric of their own).
    let fabric = MemFabric::new();
    let p = start(&fabric, "prefill", keyed(None));
    let mut d = start(&fabric, "decode-2", keyed(key(KEY_A)));
    add_peer(&d, "prefill", p.addr).await;
    handshake_fails(&mut d, "keyless-p-1").await;
    eventually(&p, "a keyless P refuses a keyed D", |s| {
        s.rejections(RejectReason::AuthenticationFailed) == 1 && s.incoming_ok == 0
    })
    .await;
    eventually(&d, "a keyed D fails without a challenge", |s| {
        s.failures(RejectReason::AuthenticationFailed) == 1 && s.outgoing_ok == 0
    })
    .await;
}

/// A TCP relay to `to` that records what each side wrote: (initiator's bytes, listener's).
type Recorded = Arc<Mutex<(Vec<u8>, Vec<u8>)>>;

async fn recording_relay(to: SocketAddr) -> (SocketAddr, Recorded) {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorded: Recorded = Arc::default();
    let log = recorded.clone();
    actix_rt::spawn(async move {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let server = TcpStream::connect(to).await.unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let up_log = log.clone();
        let up = actix_rt::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = cr.read(&mut buf).await {
                if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
                up_log.lock().unwrap().0.extend_from_slice(&buf[..n]);
            }
            let _ = sw.shutdown().await;
        });
        let mut buf = [0u8; 4096];
        while let Ok(n) = sr.read(&mut buf).await {
            if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
            log.lock().unwrap().1.extend_from_slice(&buf[..n]);
        }
        let _ = cw.shutdown().await;
        let _ = up.await;
    });
    (addr, recorded)
}

/// A listener that answers every connection with `bytes` (after reading what comes first).
async fn replaying_listener(bytes: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    actix_rt::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let bytes = bytes.clone();
            actix_rt::spawn(async move {
                let mut hello = [0u8; 40];
                let _ = stream.read_exact(&mut hello).await;
                let _ = stream.write_all(&bytes).await;
                let mut sink = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut sink))
                    .await;
            });
        }
    });
    addr
}

/// Connects, writes `bytes` and reads until the listener closes; returns what it wrote.
async fn replay_to(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(bytes).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got))
        .await
        .expect("the listener closes");
    got
}

#[actix_rt::test]
async fn a_replayed_exchange_is_refused_both_ways() {
    let fabric = MemFabric::new();
    let mut p = start(&fabric, "prefill", keyed(key(KEY_A)));
    let mut d = start(&fabric, "decode", keyed(key(KEY_A)));
    let (relay, recorded) = recording_relay(p.addr).await;
    add_peer(&d, "prefill", relay).await;
    push(&mut p, &mut d, "recorded").await;
    eventually(&p, "the recorded exchange completed", |s| {
        s.incoming_ok == 1
    })
    .await;
    let (from_d, from_p) = recorded.lock().unwrap().clone();
    // Hello, D's handshake frame and its tag; the challenge, P's frame and its tag.
    assert!(from_d.starts_with(b"KVHA") && from_p.starts_with(b"KVHA"));
    assert!(
        from_d.len() > 40 + 40 + wire::HEADER_LEN,
        "{}",
        from_d.len()
    );

    // D's bytes again, on a new connection: P's nonce is new, so the tag fails. P answers the
    // hello with its challenge (72 bytes) and nothing of its handshake.
    let answer = replay_to(p.addr, &from_d).await;
    assert_eq!(answer.len(), 72, "only the challenge");
    assert!(answer.starts_with(b"KVHA"));
    assert_ne!(answer, from_p[..72], "a fresh nonce and proof");
    let ps = eventually(&p, "P refuses the replay", |s| {
        s.rejections(RejectReason::AuthenticationFailed) == 1
    })
    .await;
    assert_eq!(ps.incoming_ok, 1, "the replay changed nothing: {ps:?}");

    // A client with the key, fresh nonces, and a handshake altered after it was tagged
    // (one byte of its payload): refused. The same client unaltered is answered.
    let raw = raw_info(&fabric);
    let (answered, _) = raw_client(p.addr, &raw, KEY_A, false).await;
    assert!(answered, "a faithful client is answered");
    let (answered, got) = raw_client(p.addr, &raw, KEY_A, true).await;
    assert!(!answered && got.is_empty(), "nothing after the challenge");
    let ps = eventually(&p, "P refuses the altered frame", |s| {
        s.rejections(RejectReason::AuthenticationFailed) == 2
    })
    .await;
    assert_eq!(ps.incoming_ok, 2, "{ps:?}");

    // P's recorded answer served to a new D: D's nonce is new, so P's old proof fails and D
    // sends nothing of its handshake.
    let mut d2 = start(&fabric, "decode-2", keyed(key(KEY_A)));
    add_peer(&d2, "prefill", replaying_listener(from_p).await).await;
    handshake_fails(&mut d2, "replayed-answer-1").await;
    eventually(&d2, "D refuses the replayed answer", |s| {
        s.failures(RejectReason::AuthenticationFailed) == 1 && s.outgoing_ok == 0
    })
    .await;
}

/// The handshake payload of a rank `raw-d` that is not started (a raw client speaks for it).
fn raw_info(fabric: &MemFabric) -> PeerInfo {
    let (setup, _) = build_mem_rank(
        fabric,
        &engine("raw-d"),
        geometry(),
        &model(),
        32,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    setup.info
}

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 of the documented input: label, nonces, then each frame length-prefixed.
fn mac(key: &[u8], label: &str, n_i: &[u8], n_l: &[u8], frames: &[&[u8]]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).unwrap();
    mac.update(format!("kvhandoff side channel psk v1: {label}").as_bytes());
    mac.update(n_i);
    mac.update(n_l);
    for frame in frames {
        mac.update(&(frame.len() as u64).to_le_bytes());
        mac.update(frame);
    }
    mac
}

/// An initiator written from the documented exchange (not the crate's code): hello, checks the
/// challenge's proof, sends `info`'s handshake and its tag — the handshake with one byte
/// flipped after tagging if `alter` — and checks the answer's tag. Returns whether a verified
/// answer came, and what came after the challenge.
async fn raw_client(addr: SocketAddr, info: &PeerInfo, key: &[u8], alter: bool) -> (bool, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let n_i = [0x5a_u8; 32];
    let mut hello = b"KVHA\x01\x01\x00\x00".to_vec();
    hello.extend_from_slice(&n_i);
    stream.write_all(&hello).await.unwrap();
    let mut challenge = [0u8; 72];
    stream.read_exact(&mut challenge).await.unwrap();
    assert_eq!(&challenge[..8], b"KVHA\x01\x02\x00\x00");
    let n_l = &challenge[8..40];
    mac(key, "listener proof", &n_i, n_l, &[])
        .verify_slice(&challenge[40..])
        .expect("the listener's proof");
    let mut ours = wire::encode(&Message::Handshake(Box::new(info.handshake(
        vec![TransferMode::Push],
        7,
        kvhandoff_protocol::TraceId::from_u128(7),
    ))));
    let tag = mac(key, "initiator handshake", &n_i, n_l, &[&ours])
        .finalize()
        .into_bytes();
    let sent = ours.clone();
    if alter {
        ours[wire::HEADER_LEN + 2] ^= 1;
    }
    ours.extend_from_slice(b"KVHA\x01\x03\x00\x00");
    ours.extend_from_slice(&tag);
    stream.write_all(&ours).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got))
        .await
        .expect("the listener closes");
    if got.len() < 40 {
        return (false, got);
    }
    let (theirs, tag) = got.split_at(got.len() - 40);
    assert_eq!(&tag[..8], b"KVHA\x01\x03\x00\x00");
    let ok = mac(key, "listener handshake", &n_i, n_l, &[&sent, theirs])
        .verify_slice(&tag[8..])
        .is_ok();
    (ok, got)
}

#[actix_rt::test]
async fn a_keyed_listener_writes_nothing_to_a_keyless_peer() {
    let fabric = MemFabric::new();
    let p = start(&fabric, "prefill", keyed(key(KEY_A)));
    let raw = raw_info(&fabric);
    let plain = wire::encode(&Message::Handshake(Box::new(raw.handshake(
        vec![TransferMode::Push],
        7,
        kvhandoff_protocol::TraceId::from_u128(7),
    ))));
    assert!(
        replay_to(p.addr, &plain).await.is_empty(),
        "nothing written"
    );
    // A hello of another auth version: refused, nothing written.
    let mut hello = b"KVHA\x02\x01\x00\x00".to_vec();
    hello.extend_from_slice(&[0; 32]);
    assert!(replay_to(p.addr, &hello).await.is_empty());
    // Garbage is what it was without a key.
    assert!(replay_to(p.addr, b"GET / HTTP/1.1\r\n\r\n")
        .await
        .is_empty());
    // A hello, then silence: the challenge, then cut at the I/O deadline (300 ms).
    let mut hello = b"KVHA\x01\x01\x00\x00".to_vec();
    hello.extend_from_slice(&[7; 32]);
    let started = Instant::now();
    let mut stream = TcpStream::connect(p.addr).await.unwrap();
    stream.write_all(&hello).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got))
        .await
        .expect("the listener cuts a silent peer");
    assert_eq!(got.len(), 72, "the challenge only");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let s = eventually(&p, "all four counted", |s| s.total_rejected() == 4).await;
    assert_eq!(s.rejections(RejectReason::AuthenticationFailed), 2, "{s:?}");
    assert_eq!(s.rejections(RejectReason::BadMagic), 1, "{s:?}");
    assert_eq!(s.rejections(RejectReason::TimedOut), 1, "{s:?}");
    assert_eq!(s.incoming_ok, 0);
}
