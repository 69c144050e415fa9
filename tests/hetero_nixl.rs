//! The heterogeneous executor's bytes over real NIXL: [`NixlWire`] moves every transfer as a
//! UCX WRITE between one agent per arena (loopback), and the slice of the verification matrix
//! the issue names runs through it, byte-verified. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test hetero_nixl`.
#![cfg(feature = "nixl")]

use kvhandoff_testkit::hetero::nixl_wire::NixlWire;
use kvhandoff_testkit::hetero::wire::{Arena, MemoryWire, Piece, Transfer, Wire};

fn arena(name: &str, len: usize, seed: u8) -> Arena {
    Arena {
        name: name.into(),
        bytes: (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect(),
    }
}

/// Two sources write disjoint pieces into one target, and one source into two targets, in one
/// call: the NIXL wire leaves every arena exactly as the in-process copy does (untouched bytes
/// included).
#[test]
fn nixl_wire_moves_the_same_bytes_as_the_memory_wire() {
    let make = || {
        vec![
            arena("p0", 64 << 10, 1),
            arena("p1", 64 << 10, 2),
            arena("d0", 128 << 10, 3),
            arena("d1", 32 << 10, 4),
        ]
    };
    let piece = |src_offset, dst_offset, len| Piece {
        src_offset,
        dst_offset,
        len,
    };
    let transfers = vec![
        Transfer {
            src: 0,
            dst: 2,
            pieces: vec![
                piece(0, 0, 4096),
                piece(8192, 4096, 100),
                piece(60_000, 70_000, 5536),
            ],
        },
        Transfer {
            src: 1,
            dst: 2,
            pieces: vec![piece(1, 100_000, 20_000)],
        },
        Transfer {
            src: 0,
            dst: 3,
            pieces: vec![piece(4096, 0, 32 << 10)],
        },
    ];
    let mut expected = make();
    MemoryWire.write_all(&mut expected, &transfers).unwrap();
    let mut got = make();
    let before = got.clone();
    assert_ne!(
        before, expected,
        "the transfers change the targets (precondition)"
    );
    let mut wire =
        NixlWire::new("hetero-wire-test").expect("NIXL runtime (source scripts/nixl-env.sh)");
    wire.write_all(&mut got, &transfers).unwrap();
    assert_eq!(got, expected);
    assert_eq!(wire.pieces, 5);
    // A second call on the same agents (registrations kept).
    let mut again = expected.clone();
    let back = [Transfer {
        src: 3,
        dst: 1,
        pieces: vec![piece(0, 0, 1000)],
    }];
    MemoryWire.write_all(&mut again, &back).unwrap();
    wire.write_all(&mut got, &back).unwrap();
    assert_eq!(got, again);
}

/// The slice of the verification matrix issue 12 names, over real NIXL (one agent per rank's
/// arena and per staging buffer): TP 2→4, TP 4→1, block 16→64, NHD→HND, `swa`, `mla`, plus a
/// replicated `gqa2` and a `mamba` pair. Each cell runs both passes of the matrix (150 tokens;
/// 100 with 64 cached on D) and is verified byte for byte against the reference in D's
/// geometry; it must move exactly the bytes and descriptors the in-memory run moves.
#[test]
fn matrix_slice_over_real_nixl_is_byte_exact() {
    use kvhandoff_protocol::hetero::model;
    use kvhandoff_testkit::hetero::matrix::{memory_wires, run_cell, Cell, Outcome, PASSES};

    let cells = [
        (
            "gqa8",
            "tp=2,block=16,layout=HND",
            "tp=4,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=4,block=16,layout=HND",
            "tp=1,block=16,layout=HND",
        ),
        (
            "gqa8",
            "tp=1,block=16,layout=HND",
            "tp=1,block=64,layout=HND",
        ),
        (
            "gqa8",
            "tp=2,block=32,layout=NHD",
            "tp=2,block=32,layout=HND",
        ),
        (
            "swa",
            "tp=2,block=16,layout=NHD",
            "tp=4,block=32,layout=HND",
        ),
        (
            "mla",
            "tp=4,block=16,layout=NHD",
            "tp=2,block=64,layout=NHD",
        ),
        (
            "gqa2",
            "tp=2,block=32,layout=HND",
            "tp=8,block=16,layout=NHD",
        ),
        (
            "mamba",
            "tp=4,block=64,layout=HND",
            "tp=2,block=16,layout=HND",
        ),
    ];
    for (index, (name, prefill, decode)) in cells.into_iter().enumerate() {
        let cell = Cell {
            model: model(name).unwrap(),
            prefill: prefill.parse().unwrap(),
            decode: decode.parse().unwrap(),
        };
        let label = format!("{name} {prefill} -> {decode}");
        let in_memory = run_cell(&cell, &PASSES, 5, &mut memory_wires);
        assert_eq!(
            in_memory.outcome,
            Outcome::Verified,
            "{label} in memory: {in_memory:?}"
        );
        let mut passes_over_nixl = Vec::new();
        let mut wires = |pass: usize| {
            let wire = NixlWire::new(&format!("slice{index}-pass{pass}"))?;
            passes_over_nixl.push(pass);
            Ok(Box::new(wire) as Box<dyn Wire>)
        };
        let over_nixl = run_cell(&cell, &PASSES, 5, &mut wires);
        assert_eq!(
            over_nixl.outcome,
            Outcome::Verified,
            "{label} over NIXL: {over_nixl:?}"
        );
        assert_eq!(
            passes_over_nixl,
            [0, 1],
            "{label}: both passes ran over NIXL"
        );
        assert_eq!(
            over_nixl.passes, in_memory.passes,
            "{label}: same bytes and descriptors"
        );
        assert!(
            over_nixl.passes.iter().all(|p| p.bytes > 0),
            "{label}: {over_nixl:?}"
        );
        println!(
            "{label}: verified over NIXL, {:?} bytes, {:?} descriptors, transforms {:?}, \
             at most {} writers per D rank",
            over_nixl.passes.iter().map(|p| p.bytes).collect::<Vec<_>>(),
            over_nixl
                .passes
                .iter()
                .map(|p| p.descriptors)
                .collect::<Vec<_>>(),
            over_nixl.transforms,
            over_nixl.max_writers,
        );
    }
}

/// The heterogeneous demo over NIXL: one agent per rank of both engines, each request split
/// into pair sub-requests by the connectors and moved by the lease protocol as real NIXL
/// WRITEs into the ranks' registered memory, then every byte checked in D's geometry.
#[test]
fn demo_pairs_over_real_nixl_hand_off_through_the_lease_protocol() {
    use kvhandoff_testkit::demo::DemoTransport;
    use kvhandoff_testkit::hetero::pair_demo::{run, HeteroDemoOptions};
    for (model, p, d) in [
        (
            "gqa8",
            "tp=2,block=16,layout=NHD",
            "tp=4,block=32,layout=HND",
        ),
        (
            "mla",
            "tp=4,block=16,layout=NHD",
            "tp=2,block=64,layout=NHD",
        ),
        (
            "mamba",
            "tp=1,block=16,layout=HND",
            "tp=2,block=16,layout=NHD",
        ),
        // Two pipeline stages on P: four agents named by rank index.
        (
            "gqa8",
            "tp=2,block=16,layout=NHD,pp=2",
            "tp=1,block=64,layout=HND",
        ),
    ] {
        let options = HeteroDemoOptions {
            transport: DemoTransport::Nixl,
            requests: 6,
            ..HeteroDemoOptions::new(model, p.parse().unwrap(), d.parse().unwrap())
        };
        let report = run(&options).unwrap();
        assert!(report.ok, "{model} {p} -> {d}: {}", report.verdict);
        assert_eq!(report.transport, "nixl");
        assert_eq!(report.verified, 6);
        assert_eq!(report.bytes, report.expected_bytes);
        println!(
            "{model} {p} -> {d}: {} requests, {} sub-requests, {} bytes over NIXL",
            report.requests,
            report.hetero.as_ref().map_or(0, |h| h.sub_requests),
            report.bytes
        );
    }
}
