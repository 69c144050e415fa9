//! Unit tests of a node: the timing flags, the part of the plan a restarted node runs, and the
//! addresses of a rank of a multi-rank engine.

use super::drive::part_of;
use super::*;
use crate::demo::schedule;

/// A rank of a TP engine listens on, and finds its peer rank at, its engine's base port + its
/// rank; a rank past the TP size, a TP the heads do not divide or a port past 65535 is refused.
#[test]
fn a_rank_moves_every_address_by_its_rank() {
    let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let mut options = NodeOptions::new(NodeRole::Decode, at(5600), at(5500));
    options.router = Some(at(5700));
    options.tp = 4;
    options.rank = 3;
    let ranked = options.for_rank().unwrap();
    assert_eq!(
        (ranked.listen, ranked.peer, ranked.router),
        (at(5603), at(5503), Some(at(5703)))
    );
    // Port 0 (any port) stays 0.
    options.listen = at(0);
    assert_eq!(options.for_rank().unwrap().listen, at(0));
    let refused = |tp, rank, peer: u16| {
        let mut o = NodeOptions::new(NodeRole::Prefill, at(5600), at(peer));
        (o.tp, o.rank) = (tp, rank);
        o.for_rank().unwrap_err().to_string()
    };
    assert!(refused(2, 2, 5500).contains("--rank 2 is not below --tp 2"));
    assert!(refused(3, 0, 5500).contains("--tp 3 does not divide"));
    assert!(refused(0, 0, 5500).contains("--tp 0"));
    assert!(refused(2, 1, u16::MAX).contains("past 65535"));
    // TP 1, rank 0: the addresses as given.
    let one = NodeOptions::new(NodeRole::Prefill, at(5600), at(5500));
    assert_eq!(one.for_rank().unwrap(), one);
}

#[test]
fn timing_flags_give_a_valid_config() {
    let ms = Duration::from_millis;
    let c = NodeTiming {
        heartbeat: Some(ms(200)),
        lease: Some(ms(3000)),
        decode_deadline: Some(ms(1500)),
        ..NodeTiming::default()
    }
    .config()
    .unwrap();
    assert_eq!(
        (c.heartbeat_interval, c.peer_timeout, c.lease_duration),
        (ms(200), ms(300), ms(3000))
    );
    assert_eq!(c.decode_deadline, ms(1500));
    assert!(c.lease_extension <= c.lease_duration);
    // A heartbeat longer than the default quarantine allows moves the quarantine.
    let long = NodeTiming {
        heartbeat: Some(Duration::from_secs(20)),
        ..NodeTiming::default()
    };
    long.config().unwrap();
    assert_eq!(NodeTiming::default().config().unwrap(), Config::default());
    let bad = NodeTiming {
        heartbeat: Some(ms(500)),
        lease: Some(ms(400)),
        ..NodeTiming::default()
    };
    assert!(bad.config().is_err());
    let tiny = NodeTiming {
        heartbeat: Some(ms(5)),
        ..NodeTiming::default()
    };
    assert!(tiny.config().is_err());
    // The fence flags: P's write deadline and abandon wait fit inside the write's life, and the
    // quarantine moves above the fence floor they make.
    let fenced = NodeTiming {
        heartbeat: Some(ms(200)),
        registration_ttl: Some(ms(1000)),
        max_write_life: Some(ms(1500)),
        max_message_delay: Some(ms(500)),
        ..NodeTiming::default()
    }
    .config()
    .unwrap();
    assert_eq!(fenced.write_timeout + fenced.abandon_timeout, ms(1500));
    assert_eq!(fenced.fence_floor(), ms(1000 + 200 + 500 + 300 + 1500));
    assert!(fenced.quarantine > fenced.fence_floor());
    assert!(fenced.quarantine < ms(4000), "{:?}", fenced.quarantine);
}

#[test]
fn a_later_part_of_the_plan_keeps_ids_and_shifts_arrivals() {
    let options = DemoOptions {
        requests: 20,
        ..DemoOptions::default()
    };
    let whole = schedule(&options, 16).unwrap();
    let part = part_of(&whole, 12);
    assert_eq!(part.len(), 8);
    assert_eq!(part[0].arrival, Duration::ZERO);
    for (q, w) in part.iter().zip(&whole[12..]) {
        assert_eq!((&q.prefill_id, &q.decode_id), (&w.prefill_id, &w.decode_id));
        assert_eq!(q.arrival, w.arrival - whole[12].arrival);
    }
    assert!(part_of(&whole, 20).is_empty());
}

#[test]
fn a_later_part_of_a_conversation_plan_renumbers_its_turns() {
    let options = DemoOptions {
        requests: 12,
        mode: crate::demo::DemoMode::Bidir,
        turns: 4,
        max_prompt_tokens: 256,
        ..DemoOptions::default()
    };
    let whole = schedule(&options, 16).unwrap();
    // From the middle of the second conversation (turns 4..8).
    let part = part_of(&whole, 6);
    assert_eq!(part.len(), 6);
    // Its turn 3 (whole index 6) starts the part: no turn before here, nothing to read back.
    assert_eq!((part[0].prev, part[0].prefix_tokens), (None, 0));
    assert_eq!(part[0].next, Some(1));
    assert_eq!(part[1].prev, Some(0));
    assert_eq!(part[1].prefix_tokens, whole[7].prefix_tokens);
    assert_eq!(part[1].next, None, "the conversation's last turn");
    // The third conversation, whole.
    assert_eq!((part[2].prev, part[2].next), (None, Some(3)));
    assert_eq!(part[5].prev, Some(4));
}

/// Starts a node's rank the way `kvhandoff node` does, on `kind`; fills a block of the node's
/// own memory through the rank's cache with the pattern and checks it back.
fn start_node_rank(kind: kvhandoff::TransportKind) -> super::NodeMemory {
    use super::rank::{start, RankSpec};
    use crate::pattern::{demo_geometry, pattern_block};

    let geometry = demo_geometry();
    let own = kvhandoff::EngineId::new("decode-0").unwrap();
    let node = start(
        RankSpec {
            own: &own,
            geometry: &geometry,
            pool_blocks: 4,
            config: &Config::default(),
            shell: kvhandoff::ShellConfig::default(),
            listen: "127.0.0.1:0".parse().unwrap(),
            psk: None,
        },
        kind,
    )
    .unwrap();
    let specs = geometry.regions().unwrap();
    let block_len: u64 = specs.iter().map(|s| s.block_len).sum();
    assert_eq!(node.memory.regions, specs.len());
    assert_eq!(node.memory.bytes, 4 * block_len);
    assert_eq!(node.kv.logical_blocks(), 4);
    let (mut scratch, mut actual) = (Vec::new(), Vec::new());
    pattern_block(&node.kv, 7, 3, 0, false, &mut scratch, &mut actual).unwrap();
    assert_eq!(
        pattern_block(&node.kv, 7, 3, 0, true, &mut scratch, &mut actual),
        Ok(0)
    );
    assert!(pattern_block(&node.kv, 8, 3, 0, true, &mut scratch, &mut actual).unwrap() > 0);
    let memory = node.memory.clone();
    drop(node.conn);
    node.runtime.shutdown();
    memory
}

#[test]
fn a_node_rank_runs_on_the_memory_the_node_allocated() {
    let memory = start_node_rank(kvhandoff::TransportKind::Mem(kvhandoff::MemFabric::new()));
    assert_eq!(memory.transport, "mem");
    // Moved into the fabric, which names regions by addresses of its own.
    assert!(!memory.in_place());
    let line = memory.describe(&kvhandoff::EngineId::new("decode-0").unwrap());
    assert!(line.contains("registered with mem as moved"), "{line}");
}

/// On NIXL the rank registers the node's buffers where the node allocated them: the
/// descriptors P writes through name the node's own addresses.
#[cfg(feature = "nixl")]
#[test]
fn a_node_rank_registers_the_node_memory_with_nixl_in_place() {
    let memory = start_node_rank(kvhandoff::TransportKind::nixl());
    assert_eq!(memory.transport, "nixl");
    assert_eq!(memory.allocated, memory.registered);
    assert!(memory.in_place());
    let line = memory.describe(&kvhandoff::EngineId::new("decode-0").unwrap());
    assert!(line.contains("registered with nixl in place"), "{line}");
}
