//! The side-channel address of P travels with D's request: a D rank on a TCP side channel that
//! was never told where P listens learns it from the `kv_transfer_params` of its first request
//! (the connector hands it to the rank with the call), shakes hands with P and receives the KV.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvhandoff::{
    ConnectorError, ConnectorEvent, ConnectorIdentity, KvConnector, KvTransferParams, Runtime,
};
use kvhandoff_actors::system::{
    build_mem_rank, AcceptPolicy, Handshaker, RankOptions, ShellConfig, SideChannelConfig,
};
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::{BlockIds, EngineId, KvGeometry, KvLayout, ModelIdentity, RequestId};

fn model() -> ModelIdentity {
    ModelIdentity {
        model: "side-channel-address-test".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}

fn listen() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A connector on its own TCP rank; `accept_any`: its listener takes any engine's handshake
/// (P never learns D's address: D dials P).
fn connector(
    runtime: &mut Runtime,
    fabric: &MemFabric,
    engine: &str,
    accept_any: bool,
) -> KvConnector {
    let engine_id = EngineId::new(engine).unwrap();
    let (setup, _pool) = build_mem_rank(
        fabric,
        &engine_id,
        KvGeometry::dense(1, 1, 8, 2, 16, KvLayout::Hnd),
        &model(),
        8,
        Config::fast(),
        ShellConfig::default(),
    )
    .unwrap();
    let side_channel = SideChannelConfig {
        accept: if accept_any {
            AcceptPolicy::AnyEngine
        } else {
            AcceptPolicy::default()
        },
        ..SideChannelConfig::new(listen())
    };
    let options = RankOptions {
        handshaker: Some(Handshaker::Tcp(side_channel)),
        ..RankOptions::default()
    };
    let handle = runtime.add_rank(setup, options).unwrap();
    let addr = handle
        .side_channel
        .expect("a TCP rank reports where it listens");
    KvConnector::new(
        ConnectorIdentity {
            engine: engine_id,
            rank: 0,
            tp_size: 1,
            host: addr.ip().to_string(),
            port: addr.port(),
        },
        handle,
    )
}

fn wait_for_event(conn: &mut KvConnector, deadline: Instant) -> ConnectorEvent {
    loop {
        if let Some(event) = conn.poll_events().into_iter().next() {
            return event;
        }
        assert!(Instant::now() < deadline, "no event before the deadline");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_prefill_address_travels_with_the_request() {
    let mut runtime = Runtime::start().unwrap();
    let fabric = MemFabric::new();
    let mut p = connector(&mut runtime, &fabric, "prefill-0", true);
    let mut d = connector(&mut runtime, &fabric, "decode-0", false);
    let p_request = RequestId::new("cmpl-addr-0-aaaaaaaa").unwrap();
    let d_request = RequestId::new("cmpl-addr-0-bbbbbbbb").unwrap();

    // P finishes first; what it returns is what the router hands D.
    let params = p
        .request_finished(
            &p_request,
            BlockIds::single_group(vec![1, 2]),
            32,
            &KvTransferParams::default(),
        )
        .unwrap();
    assert!(params.remote_host.is_some() && params.remote_port.is_some());

    // Without the address, a TCP rank cannot find P: a typed refusal, nothing sent.
    let no_address = KvTransferParams {
        remote_host: None,
        ..params.clone()
    };
    assert_eq!(
        d.request_allocated(
            &d_request,
            BlockIds::single_group(vec![3, 4]),
            32,
            &no_address
        ),
        Err(ConnectorError::MissingParam("remote_host"))
    );
    assert!(!d.has_pending_work());

    // With it, nobody else tells D's link where P is.
    d.request_allocated(&d_request, BlockIds::single_group(vec![3, 4]), 32, &params)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    match wait_for_event(&mut d, deadline) {
        ConnectorEvent::BlocksReady { request, .. } => assert_eq!(request, d_request),
        other => panic!("D: {other:?}"),
    }
    match wait_for_event(&mut p, deadline) {
        ConnectorEvent::BlocksFree {
            request, released, ..
        } => {
            assert_eq!(request, p_request);
            assert_eq!(released, None, "P sent the KV");
        }
        other => panic!("P: {other:?}"),
    }
    drop((p, d));
    runtime.shutdown();
}

#[test]
fn the_link_learns_the_address_from_the_call_alone() {
    let mut runtime = Runtime::start().unwrap();
    let fabric = MemFabric::new();
    let mut p = connector(&mut runtime, &fabric, "prefill-0", true);
    let mut d = connector(&mut runtime, &fabric, "decode-0", false);
    let params = p
        .request_finished(
            &RequestId::new("cmpl-book-0-aaaaaaaa").unwrap(),
            BlockIds::single_group(vec![1]),
            16,
            &KvTransferParams::default(),
        )
        .unwrap();
    d.request_allocated(
        &RequestId::new("cmpl-book-0-bbbbbbbb").unwrap(),
        BlockIds::single_group(vec![2]),
        16,
        &params,
    )
    .unwrap();
    let _ = wait_for_event(&mut d, Instant::now() + Duration::from_secs(20));
    // D dialled P once, with the address that came with the request.
    let stats = d
        .rank()
        .side_channel_stats(Duration::from_secs(5))
        .expect("stats");
    assert_eq!(stats.outgoing_ok, 1, "{stats:?}");
    drop((p, d));
    runtime.shutdown();
}
