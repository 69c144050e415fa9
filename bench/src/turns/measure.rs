//! The reads: two ranks built as kvhandoff builds them ([`build_rank`]), each behind the shell's
//! [`TransportDriver`], and P's driver performing [`TransportOp::PostRead`] orders against D's
//! blocks exactly as the transport actor does for a turn-2 import (planner, then
//! `Transport::post_read`; on NIXL `create_xfer_req(XferOp::Read)` or the prepared path, then
//! `post_xfer_req`). The time runs from the order to the `WriteCompleted` that P's driver polls
//! (`yield_now` between polls), which is when P may compute on the blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Instant;

use kvhandoff_actors::system::{agent_name, build_rank, KvPool, RankMemory, ShellConfig};
use kvhandoff_protocol::driver::{TransportDriver, TransportOp};
use kvhandoff_protocol::machine::{Config, NetEvent, ReadOrder, FIRST_READ_ID};
use kvhandoff_protocol::{AgentName, EngineId, Epoch, PairingKey, PeerAddr, WriteId};

use super::*;
use crate::stamps::{check, clear, fill, pool_block_bytes, pool_regions, stamp};
use crate::transfer::{block_tables, BlockTable};
use kvhandoff_testkit::demo;

fn run_error(why: impl Into<String>) -> TurnsBenchError {
    TurnsBenchError::Run(why.into())
}

/// Engine names unique in the process (NIXL agents of one process must not share a name).
fn engines() -> Result<(EngineId, EngineId), TurnsBenchError> {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let id = |role: &str| {
        EngineId::new(format!("turns{run}-{role}"))
            .map_err(|e| TurnsBenchError::Options(e.to_string()))
    };
    Ok((id("prefill")?, id("decode")?))
}

/// The measured reads of one prefix.
pub(super) struct Measured {
    pub(super) prefix_tokens: u32,
    pub(super) descriptors: u64,
    pub(super) samples_ms: Vec<f64>,
}

/// One side: its driver and its pool's bytes.
struct Side<T: RankMemory> {
    driver: TransportDriver<T>,
    pool: KvPool,
}

/// Builds a rank of `geometry` with `pool_blocks` blocks on `transport`, its source pattern
/// written into every page.
/// Not via `RankBuilder`: the bench drives the rank's [`TransportDriver`] itself, no actors.
fn side<T: RankMemory>(
    transport: T,
    engine: &EngineId,
    geometry: &KvGeometry,
    pool_blocks: u32,
) -> Result<(Side<T>, kvhandoff_protocol::driver::PeerInfo), TurnsBenchError> {
    let (setup, pool) = build_rank(
        transport,
        engine,
        geometry.clone(),
        &demo::model(),
        pool_blocks,
        Config::default(),
        ShellConfig::default(),
    )
    .map_err(|e| run_error(format!("build the {engine} rank: {e}")))?;
    let info = setup.info.clone();
    let mut driver = TransportDriver::new(setup.transport, setup.info);
    driver.prepare_own();
    let len = pool_block_bytes(&pool) * u64::from(pool.logical_blocks());
    fill(&pool_regions(&pool), len).map_err(run_error)?;
    Ok((Side { driver, pool }, info))
}

/// P (the reader) and D (the holder of the previous turn's blocks).
pub(super) struct Pair<T: RankMemory> {
    p: Side<T>,
    d: Side<T>,
    d_peer: PeerAddr,
    key: PairingKey,
    next_read: u64,
    feed: Vec<NetEvent>,
}

impl<T: RankMemory> Pair<T> {
    /// Two ranks of `geometry` with `pool_blocks` blocks each, on the transports `make` builds
    /// for an agent name, each with the other loaded as a peer.
    pub(super) fn new(
        geometry: &KvGeometry,
        pool_blocks: u32,
        mut make: impl FnMut(AgentName) -> Result<T, TurnsBenchError>,
    ) -> Result<Self, TurnsBenchError> {
        let (p_engine, d_engine) = engines()?;
        let mut transport = |engine: &EngineId| {
            let name = agent_name(engine, geometry.rank_index())
                .map_err(|e| TurnsBenchError::Options(e.to_string()))?;
            make(name)
        };
        let (mut p, p_info) = side(transport(&p_engine)?, &p_engine, geometry, pool_blocks)?;
        let (mut d, d_info) = side(transport(&d_engine)?, &d_engine, geometry, pool_blocks)?;
        let d_peer = d_info.peer.clone();
        p.driver
            .load_peer(d_info)
            .map_err(|e| run_error(format!("P loads D: {e}")))?;
        d.driver
            .load_peer(p_info)
            .map_err(|e| run_error(format!("D loads P: {e}")))?;
        // Every block D holds carries its mark, whichever table reads it.
        let all: Vec<u32> = (0..d.pool.logical_blocks()).collect();
        stamp(&pool_regions(&d.pool), pool_block_bytes(&d.pool), &all).map_err(run_error)?;
        Ok(Pair {
            p,
            d,
            d_peer,
            key: PairingKey::from_transfer_id("turn2-bench")
                .map_err(|e| TurnsBenchError::Options(e.to_string()))?,
            next_read: FIRST_READ_ID,
            feed: Vec::new(),
        })
    }

    /// One read of `table` (P's blocks ← D's blocks): ms from the order to P's completion, and
    /// the descriptors posted. Checks that every block landed.
    pub(super) fn read(
        &mut self,
        table: &BlockTable,
        timeout: Duration,
    ) -> Result<(f64, u64), TurnsBenchError> {
        let local = table.local.groups.first().cloned().unwrap_or_default();
        let remote = table.remote.groups.first().cloned().unwrap_or_default();
        clear(
            &pool_regions(&self.p.pool),
            pool_block_bytes(&self.p.pool),
            &local,
        )
        .map_err(run_error)?;
        let id = WriteId(self.next_read);
        self.next_read += 1;
        let order = ReadOrder {
            read: id,
            from: self.d_peer.clone(),
            key: self.key.clone(),
            epoch: Epoch::FIRST,
            local: table.local.clone(),
            remote: table.remote.clone(),
            remote_memory: Vec::new(),
        };
        let before = self.p.driver.stats().descriptors;
        self.feed.clear();
        let start = Instant::now();
        self.p
            .driver
            .perform(TransportOp::PostRead(Box::new(order)), &mut self.feed);
        let deadline = start + timeout;
        while self.feed.is_empty() {
            if Instant::now() > deadline {
                return Err(run_error(format!(
                    "a read of {} blocks did not complete in {timeout:?}",
                    local.len()
                )));
            }
            thread::yield_now();
            self.p.driver.poll(&mut self.feed);
        }
        let ms = start.elapsed().as_secs_f64() * 1e3;
        match self.feed.as_slice() {
            [NetEvent::WriteCompleted { write }] if *write == id => {}
            other => return Err(run_error(format!("the read ended with {other:?}"))),
        }
        self.finish(before, &local, &remote)
            .map(|descriptors| (ms, descriptors))
    }

    /// Checks the blocks a read landed; returns the descriptors it posted.
    fn finish(
        &mut self,
        before: u64,
        local: &[u32],
        remote: &[u32],
    ) -> Result<u64, TurnsBenchError> {
        let descriptors = self.p.driver.stats().descriptors - before;
        // D's driver is only polled to drain what a transport may queue for it.
        self.d.driver.poll(&mut self.feed);
        self.feed.clear();
        // D's block `remote[i]` is the source of P's block `local[i]`.
        check(
            "the read",
            &pool_regions(&self.p.pool),
            pool_block_bytes(&self.p.pool),
            (remote, local),
        )
        .map_err(run_error)?;
        Ok(descriptors)
    }
}

/// Reads every prefix of `prefixes` (tokens) after one untimed round: `repeats` times, or
/// [`SMALL_READ_REPEATS`] times as often for reads of at most [`SMALL_READ_BYTES`] (cheap, and
/// the noisiest); the prefixes interleaved in each round so that machine drift hits them alike.
pub(super) fn measure<T: RankMemory>(
    options: &TurnsOptions,
    prefixes: &[u32],
    make: impl FnMut(AgentName) -> Result<T, TurnsBenchError>,
) -> Result<Vec<Measured>, TurnsBenchError> {
    let geometry = options.geometry.kv_geometry();
    let most = prefixes
        .iter()
        .map(|&t| options.geometry.blocks(t))
        .max()
        .unwrap_or(1);
    let (pool_blocks, _) = block_tables(most);
    let mut pair = Pair::new(&geometry, pool_blocks, make)?;
    let tables: Vec<BlockTable> = prefixes
        .iter()
        .map(|&t| {
            let (_, [contiguous, fragmented]) = block_tables(options.geometry.blocks(t));
            match options.table {
                TableKind::Contiguous => contiguous,
                TableKind::Fragmented => fragmented,
            }
        })
        .collect();
    let wanted: Vec<usize> = prefixes.iter().map(|&t| repeats_for(options, t)).collect();
    let mut measured: Vec<Measured> = prefixes
        .iter()
        .zip(&wanted)
        .map(|(&prefix_tokens, &n)| Measured {
            prefix_tokens,
            descriptors: 0,
            samples_ms: Vec::with_capacity(n),
        })
        .collect();
    let rounds = wanted.iter().copied().max().unwrap_or(0);
    for round in 0..=rounds {
        for ((m, table), &n) in measured.iter_mut().zip(&tables).zip(&wanted) {
            if m.samples_ms.len() >= n {
                continue;
            }
            let (ms, descriptors) = pair.read(table, options.timeout)?;
            m.descriptors = descriptors;
            // Round 0 is the warm-up (connections, the first touch of the lists).
            if round > 0 {
                m.samples_ms.push(ms);
            }
        }
    }
    Ok(measured)
}

/// Timed reads of a prefix of `tokens`.
pub(super) fn repeats_for(options: &TurnsOptions, tokens: u32) -> usize {
    if options.geometry.read_bytes(tokens) <= SMALL_READ_BYTES {
        options.repeats * SMALL_READ_REPEATS
    } else {
        options.repeats
    }
}
