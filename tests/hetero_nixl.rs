//! The heterogeneous executor's bytes over real NIXL: [`NixlWire`] moves every transfer as a
//! UCX WRITE between one agent per arena (loopback), and the slice of the verification matrix
//! the issue names runs through it, byte-verified. Needs the NIXL runtime:
//! `source scripts/nixl-env.sh && cargo test --features nixl --test hetero_nixl`.
#![cfg(feature = "nixl")]

use kvhandoff_cli::hetero::nixl_wire::NixlWire;
use kvhandoff_cli::hetero::wire::{Arena, MemoryWire, Piece, Transfer, Wire};

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
