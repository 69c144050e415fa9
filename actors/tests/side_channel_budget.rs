//! The rank's handshake budget (`ShellConfig::handshake_timeout`) governs a TCP handshake end to
//! end: an initiator waits that long for a slow answer, and no longer. A vLLM deployment sets it
//! to 30 s to ride out a stalled peer process; a fixed 5 s frame deadline once cut it short.
//!
//! The slow peer is a real P rank behind a loopback proxy that holds P's answer back.

mod fixture;
use fixture::{call, decode_start, geometry, model};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{
    build_mem_rank, start_rank, AcceptPolicy, AddPeerAddress, Handshaker, QuerySideChannel,
    RankHandle, RejectReason, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, EndpointCall};
use kvhandoff_protocol::{EngineId, PeerAddr};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long the proxy holds P's answer back.
const ANSWER_DELAY: Duration = Duration::from_millis(700);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

/// A TCP rank whose handshakes may take `handshake`; the endpoint's own connect deadline is
/// longer, so the side channel's budget is what is tested.
fn start(fabric: &MemFabric, name: &str, accept: &[&str], handshake: Duration) -> RankHandle {
    let config = Config {
        connect_timeout: Duration::from_secs(5),
        ..Config::fast()
    };
    let shell = ShellConfig {
        handshake_timeout: handshake,
        ..ShellConfig::default()
    };
    let (setup, _pool) = build_mem_rank(
        fabric,
        &engine(name),
        geometry(),
        &model(),
        32,
        config,
        shell,
    )
    .unwrap();
    let side = SideChannelConfig {
        accept: AcceptPolicy::Known(accept.iter().map(|n| engine(n)).collect()),
        ..SideChannelConfig::new(loopback())
    };
    start_rank(setup, Handshaker::Tcp(side), None).unwrap()
}

/// A proxy to `target` that passes the initiator's bytes at once and holds the answer back
/// for [`ANSWER_DELAY`].
async fn slow_answer_proxy(target: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    actix_rt::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            actix_rt::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                actix_rt::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                    let _ = server_write.shutdown().await;
                });
                let mut answer = Vec::new();
                let _ = server_read.read_to_end(&mut answer).await;
                tokio::time::sleep(ANSWER_DELAY).await;
                let _ = client_write.write_all(&answer).await;
                let _ = client_write.shutdown().await;
            });
        }
    });
    addr
}

async fn stats(rank: &RankHandle) -> SideChannelStats {
    rank.link.send(QuerySideChannel).await.unwrap()
}

/// Asks `d` for a request from `prefill` (reached at `addr`), so that it dials, and waits for
/// the dial's verdict: `Ok` if it handshook, the failure's reason if not.
async fn dial(
    d: &RankHandle,
    prefill: &str,
    addr: SocketAddr,
) -> (Result<(), RejectReason>, Duration) {
    d.link
        .send(AddPeerAddress {
            peer: PeerAddr::new(engine(prefill), 0),
            addr,
        })
        .await
        .unwrap()
        .unwrap();
    let started = Instant::now();
    call(
        d,
        EndpointCall::DecodeAllocated(decode_start("slow-req", prefill, vec![1, 2])),
    )
    .await
    .unwrap();
    let give_up = started + Duration::from_secs(10);
    loop {
        let s = stats(d).await;
        if s.outgoing_ok == 1 {
            return (Ok(()), started.elapsed());
        }
        if let Some((reason, _)) = s.outgoing_failed.iter().find(|(_, n)| **n > 0) {
            return (Err(*reason), started.elapsed());
        }
        assert!(Instant::now() < give_up, "no verdict on the dial: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[actix_rt::test]
async fn an_initiator_waits_its_handshake_budget_and_no_longer() {
    let fabric = MemFabric::new();
    let p = start(
        &fabric,
        "prefill",
        &["patient", "hasty"],
        Duration::from_secs(5),
    );
    let p_addr = p.side_channel.expect("a TCP rank reports its address");
    let proxy = slow_answer_proxy(p_addr).await;

    // Precondition: the answer really is late, past the hasty budget.
    let hasty_budget = Duration::from_millis(250);
    assert!(ANSWER_DELAY > hasty_budget * 2);

    let patient = start(&fabric, "patient", &[], Duration::from_secs(3));
    let (verdict, took) = dial(&patient, "prefill", proxy).await;
    assert_eq!(
        verdict,
        Ok(()),
        "a 3 s budget waits out a {ANSWER_DELAY:?} answer"
    );
    assert!(took >= ANSWER_DELAY, "the answer was held back: {took:?}");

    let hasty = start(&fabric, "hasty", &[], hasty_budget);
    let (verdict, took) = dial(&hasty, "prefill", proxy).await;
    assert_eq!(
        verdict,
        Err(RejectReason::TimedOut),
        "a {hasty_budget:?} budget gives up on a {ANSWER_DELAY:?} answer"
    );
    assert!(
        took < ANSWER_DELAY,
        "cut at its budget, before the answer: {took:?}"
    );
    // P served both: the budget that failed was the initiator's own.
    let served = stats(&p).await;
    assert_eq!(served.incoming_ok, 2, "{served:?}");
}
