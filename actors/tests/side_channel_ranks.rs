//! One D rank reaching two ranks of one P engine over the TCP side channel, each P rank
//! listening on its own port as vLLM's ranks do (base port + rank): the link's peer book keeps
//! one address per peer rank, so each handshake dials the rank it names and both pushes land.
//! (With one address per engine the second address replaced the first, and the handshake with
//! rank 0 reached rank 1: `UnexpectedRank`.)
//!
//! The ranks share one `MemFabric` in process (MemTransport metadata is only valid there): the
//! point is the addressing, not the transport. Every rank has the same TP 2 layout (D rank 0
//! pairs with either P rank here: the side channel refuses different layouts).

mod fixture;
use fixture::{call, decode_start, fill, geometry, model, next_event, prefill_start, wrong_bytes};

use std::net::SocketAddr;
use std::time::Duration;

use kvhandoff_actors::system::{
    build_mem_rank, start_rank, AcceptPolicy, AddPeerAddress, Handshaker, KvPool, PeerBookFull,
    QuerySideChannel, RankHandle, ShellConfig, SideChannelConfig, SideChannelStats,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::{Config, EndpointCall};
use kvhandoff_protocol::session::ConnectorEvent;
use kvhandoff_protocol::{EngineId, KvGeometry, PeerAddr};

/// How long a test waits for a rank's next event, or for its link's answer.
const WITHIN: Duration = Duration::from_secs(10);

struct Rank {
    handle: RankHandle,
    pool: KvPool,
    addr: SocketAddr,
}

fn engine(name: &str) -> EngineId {
    EngineId::new(name).unwrap()
}

/// Rank `tp_rank` of a TP 2 engine `name`, listening on a free loopback port.
fn start(fabric: &MemFabric, name: &str, tp_rank: u32, config: SideChannelConfig) -> Rank {
    let geometry = KvGeometry {
        tp_size: 2,
        tp_rank,
        ..geometry()
    };
    let (setup, pool) = build_mem_rank(
        fabric,
        &engine(name),
        geometry,
        &model(),
        32,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    let handle = start_rank(setup, Handshaker::Tcp(config), None).unwrap();
    let addr = handle.side_channel.expect("a TCP rank reports its address");
    Rank { handle, pool, addr }
}

async fn add_peer(rank: &Rank, peer: PeerAddr, addr: SocketAddr) -> Result<(), PeerBookFull> {
    tokio::time::timeout(WITHIN, rank.handle.link.send(AddPeerAddress { peer, addr }))
        .await
        .expect("the link answers")
        .unwrap()
}

async fn stats(rank: &Rank) -> SideChannelStats {
    tokio::time::timeout(WITHIN, rank.handle.link.send(QuerySideChannel))
        .await
        .expect("the link answers")
        .unwrap()
}

#[actix_rt::test]
async fn a_decode_rank_handshakes_with_two_ranks_of_one_prefill_engine() {
    let fabric = MemFabric::new();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let p_config = SideChannelConfig {
        accept: AcceptPolicy::Known([engine("decode")].into()),
        ..SideChannelConfig::new(loopback)
    };
    let mut p = [
        start(&fabric, "prefill", 0, p_config.clone()),
        start(&fabric, "prefill", 1, p_config),
    ];
    let mut d = start(
        &fabric,
        "decode",
        0,
        SideChannelConfig {
            max_peer_addresses: 2,
            ..SideChannelConfig::new(loopback)
        },
    );
    let prefill = |rank| PeerAddr::new(engine("prefill"), rank);
    add_peer(&d, prefill(0), p[0].addr).await.unwrap();
    add_peer(&d, prefill(1), p[1].addr).await.unwrap();

    for (rank, p) in (0u32..).zip(p.iter_mut()) {
        let tag = format!("req-p{rank}");
        let mut start = decode_start(&format!("{tag}-1111"), "prefill", vec![3, 4]);
        start.prefill = prefill(rank);
        let p_start = prefill_start(&format!("{tag}-1111"), vec![10, 11]);
        call(&d.handle, EndpointCall::DecodeAllocated(start))
            .await
            .unwrap();
        fill(&p.pool, &tag, &[10, 11]);
        call(&p.handle, EndpointCall::PrefillFinished(p_start))
            .await
            .unwrap();
        let event = next_event(&mut d.handle, WITHIN).await;
        assert!(
            matches!(event, ConnectorEvent::BlocksReady { .. }),
            "from P rank {rank}: {event:?}"
        );
        assert_eq!(
            wrong_bytes(&d.pool, &tag, &[3, 4]),
            0,
            "P rank {rank}'s bytes"
        );
        let event = next_event(&mut p.handle, WITHIN).await;
        assert!(
            matches!(event, ConnectorEvent::BlocksFree { released: None, .. }),
            "P rank {rank}: {event:?}"
        );
    }

    let ds = stats(&d).await;
    assert_eq!(ds.outgoing_ok, 2, "one handshake per P rank: {ds:?}");
    assert!(ds.outgoing_failed.is_empty(), "{ds:?}");
    for p in &p {
        let ps = stats(p).await;
        assert_eq!(
            ps.incoming_ok, 1,
            "each P rank was dialled at its own port: {ps:?}"
        );
        assert_eq!(ps.total_rejected(), 0, "{ps:?}");
    }
    // The bound counts peer ranks.
    assert_eq!(
        add_peer(&d, prefill(2), p[1].addr).await,
        Err(PeerBookFull { limit: 2 })
    );
}
