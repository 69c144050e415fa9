use super::*;
use kvhandoff_protocol::driver::PeerInfo;
use kvhandoff_protocol::hetero::{model, plan_pair};
use kvhandoff_protocol::{AgentName, CompatHash, EngineId, Epoch, Incarnation, PeerAddr};

fn pair() -> PairPlan {
    plan_pair(
        model("gqa8").unwrap(),
        "tp=1,block=16,layout=NHD".parse().unwrap(),
        "tp=2,block=32,layout=HND".parse().unwrap(),
    )
    .unwrap()
}

fn peer(geometry: KvGeometry) -> PeerInfo {
    PeerInfo {
        peer: PeerAddr::new(EngineId::new("decode").unwrap(), geometry.tp_rank),
        agent: AgentName::new("decode-rank0").unwrap(),
        metadata: Vec::new(),
        regions: Vec::new(),
        geometry,
        compat: CompatHash([0; 32]),
        incarnation: Incarnation::random(),
        routed: false,
    }
}

#[test]
fn accepts_only_the_planned_geometries() {
    let pair = pair();
    let route = PlannedRoute::new(&pair, SideName::Prefill);
    let own = &pair.prefill.ranks[0].geometry;
    for d in &pair.decode.ranks {
        route.accepts(own, &d.geometry).unwrap();
    }
    let mut other = pair.decode.ranks[0].geometry.clone();
    other.kernel_block_size = 64;
    assert!(route.accepts(own, &other).is_err());
}

#[test]
fn places_a_filed_write_once_and_only_for_its_blocks() {
    let pair = pair();
    let route = PlannedRoute::new(&pair, SideName::Prefill);
    let key = PairingKey::new("k#p0d1").unwrap();
    let (p, d) = (
        BlockIds::single_group(vec![1, 2]),
        BlockIds::single_group(vec![7]),
    );
    let descriptor = Descriptor {
        local_addr: 10,
        remote_addr: 20,
        len: 30,
    };
    let staged = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = staged.clone();
    let staging: Staging = Box::new(move || {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    });
    route
        .file(
            key.clone(),
            p.clone(),
            d.clone(),
            vec![descriptor],
            Some(staging),
        )
        .unwrap();
    assert!(route
        .file(key.clone(), p.clone(), d.clone(), Vec::new(), None)
        .is_err());
    let info = peer(pair.decode.ranks[1].geometry.clone());
    let ask = |local: &BlockIds, remote: &BlockIds, out: &mut Vec<Descriptor>| {
        route.descriptors(
            &RouteRequest {
                direction: RouteDirection::Write,
                peer: &info,
                key: &key,
                epoch: Epoch::FIRST,
                local,
                remote,
                remote_memory: &[],
            },
            out,
        )
    };
    let mut out = Vec::new();
    // A registration naming other blocks is refused, and nothing is appended.
    assert!(ask(&p, &BlockIds::single_group(vec![8]), &mut out).is_err());
    assert!(out.is_empty());
    assert!(
        !staged.load(std::sync::atomic::Ordering::SeqCst),
        "staged for other blocks"
    );
    ask(&p, &d, &mut out).unwrap();
    assert_eq!(out, vec![descriptor]);
    assert!(staged.load(std::sync::atomic::Ordering::SeqCst));
    // Placed once: a second post of the key finds nothing.
    assert!(ask(&p, &d, &mut out).is_err());
    assert_eq!(route.pending(), 0);
}

/// Staging that fails refuses the write, and nothing is appended.
#[test]
fn failed_staging_refuses_the_write() {
    let pair = plan_pair(
        model("gqa8").unwrap(),
        "tp=1,block=16,layout=NHD".parse().unwrap(),
        "tp=2,block=32,layout=HND".parse().unwrap(),
    )
    .unwrap();
    let route = PlannedRoute::new(&pair, SideName::Prefill);
    let key = PairingKey::new("k#p0d0").unwrap();
    let blocks = BlockIds::single_group(vec![1]);
    let staging: Staging = Box::new(|| Err("no kernel".into()));
    route
        .file(
            key.clone(),
            blocks.clone(),
            blocks.clone(),
            Vec::new(),
            Some(staging),
        )
        .unwrap();
    let info = PeerInfo {
        peer: PeerAddr::new(EngineId::new("decode").unwrap(), 0),
        agent: AgentName::new("decode-rank0").unwrap(),
        metadata: Vec::new(),
        regions: Vec::new(),
        geometry: pair.decode.ranks[0].geometry.clone(),
        compat: CompatHash([0; 32]),
        incarnation: Incarnation::random(),
        routed: false,
    };
    let mut out = Vec::new();
    let error = route
        .descriptors(
            &RouteRequest {
                direction: RouteDirection::Write,
                peer: &info,
                key: &key,
                epoch: Epoch::FIRST,
                local: &blocks,
                remote: &blocks,
                remote_memory: &[],
            },
            &mut out,
        )
        .unwrap_err();
    assert!(error.0.contains("no kernel"), "{error}");
    assert!(out.is_empty());
}

/// D's rank with one buffer advertised in its handshake: 64 KiB at 0x10000.
fn routed_peer(pair: &PairPlan) -> PeerInfo {
    let mut info = peer(pair.decode.ranks[0].geometry.clone());
    info.routed = true;
    info.regions = vec![kvhandoff_protocol::RegionDesc {
        base: 0x10000,
        len: 0x10000,
        num_blocks: 1,
        block_len: 0x10000,
    }];
    info
}

fn ask_at_post(
    route: &PlannedRoute,
    info: &PeerInfo,
    key: &PairingKey,
    blocks: &BlockIds,
    memory: &[MemorySpan],
) -> Result<Vec<Descriptor>, RouteError> {
    let mut out = Vec::new();
    route
        .descriptors(
            &RouteRequest {
                direction: RouteDirection::Write,
                peer: info,
                key,
                epoch: Epoch::FIRST,
                local: blocks,
                remote: blocks,
                remote_memory: memory,
            },
            &mut out,
        )
        .map(|()| out)
}

/// A planner that puts one 256-byte piece at `offset` into the first buffer D named.
fn one_piece(offset: u64) -> Planner {
    Box::new(move |request: &RouteRequest<'_>| {
        let span = request.remote_memory.first().ok_or("no memory")?;
        Ok(vec![Descriptor {
            local_addr: 0,
            remote_addr: span.addr + offset,
            len: 256,
        }])
    })
}

/// A write planned at post time lands only in the memory D's registration named, inside the
/// buffers D's handshake advertised; anything else is refused with nothing appended.
#[test]
fn a_write_planned_at_post_lands_only_where_d_said() {
    let pair = pair();
    let info = routed_peer(&pair);
    let blocks = BlockIds::single_group(vec![3]);
    let inside = [MemorySpan {
        addr: 0x11000,
        len: 0x1000,
    }];
    let cases: [(&str, u64, &[MemorySpan], bool); 5] = [
        ("inside", 0, &inside, true),
        ("D named nothing", 0, &[], false),
        ("a piece past the span", 0x0f80, &inside, false),
        (
            "a span outside every advertised buffer",
            0,
            &[MemorySpan {
                addr: 0x30000,
                len: 0x1000,
            }],
            false,
        ),
        (
            "a span across a buffer's end",
            0,
            &[MemorySpan {
                addr: 0x1f800,
                len: 0x1000,
            }],
            false,
        ),
    ];
    for (what, offset, memory, placed) in cases {
        let route = PlannedRoute::new(&pair, SideName::Prefill);
        let key = PairingKey::new("k#p0d0").unwrap();
        route
            .file_planner(key.clone(), blocks.clone(), one_piece(offset))
            .unwrap();
        let result = ask_at_post(&route, &info, &key, &blocks, memory);
        assert_eq!(result.is_ok(), placed, "{what}: {result:?}");
        if let Ok(out) = result {
            assert_eq!(out.len(), 1, "{what}");
            assert_eq!(out[0].remote_addr, memory[0].addr + offset);
        }
        // Placed or refused, once: a second post of the key finds nothing.
        assert!(ask_at_post(&route, &info, &key, &blocks, memory).is_err());
    }
}

/// A planner's own refusal (here: other blocks than planned) refuses the write.
#[test]
fn a_planner_that_refuses_refuses_the_write() {
    let pair = pair();
    let info = routed_peer(&pair);
    let route = PlannedRoute::new(&pair, SideName::Prefill);
    let key = PairingKey::new("k#p0d1").unwrap();
    let blocks = BlockIds::single_group(vec![3]);
    let planner: Planner = Box::new(|_| Err("D registered other blocks".into()));
    route
        .file_planner(key.clone(), blocks.clone(), planner)
        .unwrap();
    let memory = [MemorySpan {
        addr: 0x10000,
        len: 0x100,
    }];
    let error = ask_at_post(&route, &info, &key, &blocks, &memory).unwrap_err();
    assert!(error.0.contains("other blocks"), "{error}");
}

/// D's side: the memory filed for a key is what its registrations name, until withdrawn.
#[test]
fn d_names_the_memory_filed_for_the_key_until_withdrawn() {
    let pair = pair();
    let route = PlannedRoute::new(&pair, SideName::Decode);
    let key = PairingKey::new("k#p0d0").unwrap();
    let spans = vec![
        MemorySpan { addr: 8, len: 8 },
        MemorySpan { addr: 64, len: 32 },
    ];
    assert!(route.named_memory(&key).is_empty());
    route.file_memory(key.clone(), spans.clone()).unwrap();
    assert!(route.file_memory(key.clone(), spans.clone()).is_err());
    assert_eq!(route.named_memory(&key), spans);
    assert_eq!(route.named_memory(&key), spans, "a repeat names the same");
    assert_eq!(route.pending(), 1);
    route.withdraw(&key);
    assert!(route.named_memory(&key).is_empty());
    assert_eq!(route.pending(), 0);
    let empty = vec![MemorySpan { addr: 8, len: 0 }];
    assert!(route.file_memory(key.clone(), empty).is_err());
    let many = vec![MemorySpan { addr: 8, len: 8 }; MAX_REGISTER_SPANS + 1];
    assert!(route.file_memory(key, many).is_err());
}

/// Pull: D's route places a read planned at post time inside the memory P's grant named (and
/// the buffers P's handshake advertised); a write on D's route is refused, with nothing
/// appended; P's route reads too (a later turn's read-back).
#[test]
fn a_read_planned_at_post_reads_only_where_the_holder_said() {
    let pair = pair();
    let mut holder = routed_peer(&pair);
    holder.peer =
        kvhandoff_protocol::PeerAddr::new(kvhandoff_protocol::EngineId::new("prefill").unwrap(), 0);
    holder.geometry = pair.prefill.ranks[0].geometry.clone();
    let blocks = BlockIds::single_group(vec![3]);
    let inside = [MemorySpan {
        addr: 0x12000,
        len: 0x1000,
    }];
    let read = |route: &PlannedRoute, key: &PairingKey, direction, memory: &[MemorySpan]| {
        let mut out = Vec::new();
        route
            .descriptors(
                &RouteRequest {
                    direction,
                    peer: &holder,
                    key,
                    epoch: Epoch::FIRST,
                    local: &blocks,
                    remote: &blocks,
                    remote_memory: memory,
                },
                &mut out,
            )
            .map(|()| out)
    };
    let key = PairingKey::new("k#p0d0").unwrap();
    let d = PlannedRoute::new(&pair, SideName::Decode);
    d.file_planner(key.clone(), blocks.clone(), one_piece(0x100))
        .unwrap();
    assert!(
        read(&d, &key, RouteDirection::Write, &inside).is_err(),
        "D never writes a pair's KV"
    );
    let out = read(&d, &key, RouteDirection::Read, &inside).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].remote_addr, 0x12100);

    let d = PlannedRoute::new(&pair, SideName::Decode);
    d.file_planner(key.clone(), blocks.clone(), one_piece(0x0f80))
        .unwrap();
    assert!(
        read(&d, &key, RouteDirection::Read, &inside).is_err(),
        "a piece past the span P named"
    );
    // A later turn: P reads D's kept blocks back, placed the same way.
    let p = PlannedRoute::new(&pair, SideName::Prefill);
    p.file_planner(key.clone(), blocks.clone(), one_piece(0))
        .unwrap();
    assert!(read(&p, &key, RouteDirection::Read, &inside).is_ok());
}
