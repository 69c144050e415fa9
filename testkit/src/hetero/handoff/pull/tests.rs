//! The pull plan on its own, in memory: every model and TP pair over block and layout pairs
//! that put each transform on each side, both requests of a matrix cell, checked byte for byte;
//! and a mirror that lost a block, which the verifier must catch.

use kvhandoff_protocol::hetero::{model, plan_pair, SideSpec, MODELS};
use kvhandoff_protocol::KvLayout;

use super::super::{Handoff, RequestShape};
use crate::hetero::matrix::{PASSES, TPS};

const PAIRS: [((u32, KvLayout), (u32, KvLayout)); 4] = [
    ((16, KvLayout::Nhd), (16, KvLayout::Nhd)),
    ((16, KvLayout::Hnd), (64, KvLayout::Nhd)),
    ((64, KvLayout::Nhd), (32, KvLayout::Hnd)),
    ((32, KvLayout::Hnd), (16, KvLayout::Hnd)),
];

#[test]
fn every_model_and_tp_pair_pulls_byte_for_byte() {
    let (mut runs, mut mirrored) = (0, 0);
    for m in &MODELS {
        for p_tp in TPS {
            for d_tp in TPS {
                for ((pb, pl), (db, dl)) in PAIRS {
                    let (p, d) = (SideSpec::new(p_tp, pb, pl), SideSpec::new(d_tp, db, dl));
                    let Ok(pair) = plan_pair(m, p, d) else {
                        continue;
                    };
                    for (i, (tokens, cached)) in PASSES.into_iter().enumerate() {
                        let shape = RequestShape {
                            tokens,
                            cached_tokens: cached,
                            seed: 7 + i as u64,
                        };
                        let Ok(mut h) = Handoff::prepare(pair.clone(), shape) else {
                            continue;
                        };
                        mirrored += (0..pair.decode.ranks.len())
                            .flat_map(|d| h.pull_links_into(d))
                            .filter(|l| l.mirror_len > 0)
                            .count();
                        h.run_pull()
                            .unwrap_or_else(|e| panic!("{} {p} → {d}: {e}", m.name));
                        if let Err(mismatch) = h.verify() {
                            panic!("{} {p} → {d} ({tokens} tokens): {mismatch}", m.name);
                        }
                        runs += 1;
                    }
                }
            }
        }
    }
    assert!(runs > 500, "{runs} pulls ran");
    assert!(
        mirrored > 0,
        "no pair staged on P: the mirror was never exercised"
    );
}

/// P would slice its NHD heads (P stages): D reads P's whole blocks into the mirror and slices
/// them itself. A mirror that lost its first block leaves D's blocks wrong, and the verifier says
/// so.
#[test]
fn a_mirror_short_of_a_block_is_caught() {
    let pair = plan_pair(
        model("gqa8").unwrap(),
        "tp=1,block=16,layout=NHD".parse().unwrap(),
        "tp=2,block=16,layout=NHD".parse().unwrap(),
    )
    .unwrap();
    let shape = RequestShape {
        tokens: 150,
        cached_tokens: 0,
        seed: 3,
    };
    let clean = Handoff::prepare(pair, shape).unwrap();
    let links = clean.pull_links_into(0);
    assert!(
        links.iter().any(|l| l.mirror_len > 0),
        "the precondition: this pair stages on P, so its pull mirrors P's blocks"
    );
    let mut ok = clean.clone();
    ok.run_pull().unwrap();
    ok.verify().unwrap();

    // The same pull, with the first mirrored block's bytes lost in flight.
    let mut broken = clean;
    for d in 0..broken.pair.decode.ranks.len() {
        for pulled in broken.pull_links_into(d) {
            let mut mirror = vec![0u8; pulled.mirror_len as usize];
            let p = broken.pair.links[pulled.link].prefill;
            let kv = broken.arena(
                kvhandoff_protocol::hetero::SideName::Prefill,
                p,
                kvhandoff_protocol::hetero::Space::Kv,
            );
            let mut first = true;
            for piece in &pulled.pieces {
                let at = piece.src as usize;
                let bytes = broken.arenas[kv].bytes[at..at + piece.len as usize].to_vec();
                if piece.dst >= pulled.mirror_at
                    && piece.dst_space == kvhandoff_protocol::hetero::Space::Staging
                {
                    let m = (piece.dst - pulled.mirror_at) as usize;
                    if !std::mem::take(&mut first) {
                        mirror[m..m + bytes.len()].copy_from_slice(&bytes);
                    }
                } else {
                    let dst = broken.arena(
                        kvhandoff_protocol::hetero::SideName::Decode,
                        d,
                        piece.dst_space,
                    );
                    let at = piece.dst as usize;
                    broken.arenas[dst].bytes[at..at + bytes.len()].copy_from_slice(&bytes);
                }
            }
            broken.land_pulled_link(&pulled, &mirror).unwrap();
        }
    }
    broken.run_decode_side().unwrap();
    let mismatch = broken
        .verify()
        .expect_err("a lost mirrored block is caught");
    assert!(mismatch.wrong_bytes > 0);
}
