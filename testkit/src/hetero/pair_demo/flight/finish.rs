//! The end of a request in flight: how each side ended, counted once per request, and for a
//! request whose D ranks all got their blocks, the slot read back and every byte checked.

use kvhandoff_protocol::hetero::{PairPlan, SideName, Space};

use super::super::Tally;
use super::filing::withdraw;
use super::{lock, region, Ended, Flight, Rank, Shared};
use crate::hetero::handoff::Handoff;

/// Counts how request `flight` ended on each side (per request, not per rank), and the
/// blocks of ranks that never had their event.
pub(super) fn settle(flight: &Flight, h: &Handoff, ranks: &[Rank], tally: &mut Tally) -> bool {
    let (mut all_ready, mut all_sent) = (true, true);
    let (mut decode_missing, mut prefill_missing) = (false, false);
    for (rank, end) in ranks.iter().zip(&flight.ended) {
        match (rank.side, end) {
            (SideName::Decode, Some(Ended::Ready)) | (SideName::Prefill, Some(Ended::Sent)) => {}
            (SideName::Decode, Some(_)) => all_ready = false,
            (SideName::Prefill, Some(_)) => all_sent = false,
            (SideName::Decode, None) => {
                decode_missing = true;
                all_ready = false;
                tally.leaks.decode += h.decode_blocks.total() as u64;
            }
            (SideName::Prefill, None) => {
                prefill_missing = true;
                all_sent = false;
                tally.leaks.prefill += h.prefill_blocks.total() as u64;
            }
        }
    }
    // A side's event is the request's once every rank of it had its own.
    tally.decode_events += u64::from(!decode_missing);
    tally.prefill_events += u64::from(!prefill_missing);
    if decode_missing {
        tally.decode_missing += 1;
    } else if all_ready {
        tally.ready += 1;
    } else {
        tally.failed += 1;
    }
    if prefill_missing {
        tally.prefill_missing += 1;
    } else if all_sent {
        tally.sent += 1;
        tally.sent_bytes += if flight.pull {
            h.pull_bytes()
        } else {
            h.plan.bytes()
        };
    } else {
        tally.released += 1;
    }
    all_ready
}

/// Ends a request every rank had its event for: counts it, and if every D rank got its
/// blocks, reads the slot back, runs D's half and checks every byte of both sides.
pub(super) fn finish(
    flight: &Flight,
    shared: &Shared,
    pair: &PairPlan,
    ranks: &[Rank],
    tally: &mut Tally,
) -> Result<(), String> {
    tally
        .latencies_us
        .push(flight.called.elapsed().as_secs_f64() * 1e6);
    // A sub-request that ended without its write leaves its filing behind.
    withdraw(flight.r, pair, ranks);
    let mut h = lock(shared)?;
    if !settle(flight, &h, ranks, tally) {
        return Err("not every D rank got its blocks".into());
    }
    for rank in ranks {
        for (i, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
            let arena = h.arena(rank.side, rank.index, space);
            let bytes = &mut h.arenas[arena].bytes;
            rank.kv
                .read(region(flight.slot, i), 0, bytes)
                .map_err(|e| format!("{} rank {}: {e}", rank.side, rank.id))?;
        }
    }
    let d_ranks: Vec<usize> = ranks
        .iter()
        .filter(|r| r.side == SideName::Decode)
        .map(|r| r.index)
        .collect();
    let held: Vec<(SideName, usize)> = ranks.iter().map(|r| (r.side, r.index)).collect();
    if flight.pull {
        super::super::pull::land(&mut h, ranks, flight.slot)?;
    }
    let stats = h
        .run_decode_side_of(Some(&d_ranks))
        .map_err(|e| e.to_string())?;
    tally.prefill_jobs += stats.prefill_jobs as u64;
    tally.decode_jobs += stats.decode_jobs as u64;
    tally.zeroed += stats.zeroed_bytes;
    match h.verify_ranks(&held) {
        Ok(()) => tally.verified += 1,
        Err(mismatch) => {
            tally.byte_errors += mismatch.wrong_bytes.max(1);
            tally.error(format!("request {}: {mismatch}", flight.r));
        }
    }
    Ok(())
}
