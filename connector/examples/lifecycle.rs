//! The Rust API's cost per request lifecycle, both sides, over the in-memory transport in one
//! process: the same workload as `python/bench_lifecycle.py`, so that the two compare (see
//! `docs/benchmarks.md`, "The Python API").
//!
//! A P and a D rank, each started with [`RankBuilder::start`] (a runtime of its own, a TCP side
//! channel on loopback, as `kvhandoff.Connector` does), one region of 1,024 blocks of 4 KiB;
//! every request is one block. `serial`: one request at a time in vLLM's order (P's
//! `request_finished`, D's `request_allocated`, D polled until `BlocksReady`, P until
//! `BlocksFree`); `pipelined`: 64 in flight. Prints one JSON line per mode.
//!
//! ```text
//! cargo run --release -p kvhandoff --example lifecycle -- --requests 2000 --rounds 5
//! ```

use std::time::{Duration, Instant};

use kvhandoff::{
    BlockIds, ConnectorEvent, EngineId, EngineRank, KvGeometry, KvRegion, KvTransferParams,
    MemFabric, ModelIdentity, RankBuilder, RequestId, SideChannel, TransportKind,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

const BLOCK_BYTES: u64 = 4096;
const POOL: u32 = 1024;
const TIMEOUT: Duration = Duration::from_secs(30);

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: u32| -> Result<u32, Error> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).ok_or("a flag without its value")?.parse()?),
            None => Ok(default),
        }
    };
    let (requests, rounds) = (arg("--requests", 2000)?, arg("--rounds", 5)?);
    let fabric = MemFabric::new();
    let start = |name: &str| -> Result<EngineRank, Error> {
        let geometry = KvGeometry::opaque_blocks(1, BLOCK_BYTES, 16)?;
        let model = ModelIdentity {
            model: "opaque".into(),
            dtype: "opaque".into(),
            cache_dtype: "opaque".into(),
        };
        Ok(RankBuilder::new(EngineId::new(name)?, geometry, model)
            .region(KvRegion::zeroed((BLOCK_BYTES * u64::from(POOL)) as usize))
            .transport(TransportKind::Mem(fabric.clone()))
            .side_channel(SideChannel::tcp("127.0.0.1:0".parse()?))
            .start()?)
    };
    let mut p = start("bench-prefill")?;
    let mut d = start("bench-decode")?;
    let p_id = p.identity().engine.clone();
    d.add_peer(&p_id, p.side_channel().ok_or("P has no side channel")?)?;
    p.add_peer(
        &d.identity().engine.clone(),
        d.side_channel().ok_or("D has no side channel")?,
    )?;
    let leg = KvTransferParams {
        do_remote_decode: true,
        ..KvTransferParams::default()
    };
    let mut seq = 0u64;
    let mut lifecycles = Vec::new();
    let mut pipelined = Vec::new();
    for _ in 0..rounds {
        for i in 0..requests {
            seq += 1;
            let request = RequestId::new(format!("s{seq}"))?;
            let block = BlockIds::single_group(vec![i % POOL]);
            let t0 = Instant::now();
            let answer = p.request_finished(&request, block.clone(), 16, &leg)?;
            d.request_allocated(&request, block, 16, &answer)?;
            expect(&mut d, "BlocksReady")?;
            expect(&mut p, "BlocksFree")?;
            lifecycles.push(t0.elapsed().as_nanos() as f64 / 1000.0);
        }
        let t0 = Instant::now();
        let mut done = 0;
        while done < requests {
            let size = (requests - done).min(64);
            for k in 0..size {
                seq += 1;
                let request = RequestId::new(format!("b{seq}"))?;
                let block = BlockIds::single_group(vec![k]);
                let answer = p.request_finished(&request, block.clone(), 16, &leg)?;
                d.request_allocated(&request, block, 16, &answer)?;
            }
            let (mut want_d, mut want_p) = (size, size);
            let deadline = Instant::now() + TIMEOUT;
            while want_d + want_p > 0 {
                if Instant::now() > deadline {
                    return Err("a batch got stuck".into());
                }
                want_d -= d.poll_events().len() as u32;
                want_p -= p.poll_events().len() as u32;
            }
            done += size;
        }
        pipelined.push(t0.elapsed().as_nanos() as f64 / 1000.0 / f64::from(requests));
    }
    lifecycles.sort_by(f64::total_cmp);
    pipelined.sort_by(f64::total_cmp);
    let mean = lifecycles.iter().sum::<f64>() / lifecycles.len().max(1) as f64;
    let pick = |v: &[f64], q: f64| v.get(((v.len() as f64 - 1.0) * q) as usize).copied();
    println!(
        "{{\"api\":\"rust\",\"serial_lifecycle_us\":{{\"p50\":{:.2},\"mean\":{:.2},\"p99\":{:.2}}},\"pipelined_us_per_request_median\":{:.2},\"requests\":{},\"rounds\":{}}}",
        pick(&lifecycles, 0.5).unwrap_or(0.0),
        mean,
        pick(&lifecycles, 0.99).unwrap_or(0.0),
        pick(&pipelined, 0.5).unwrap_or(0.0),
        requests,
        rounds
    );
    p.shutdown();
    d.shutdown();
    Ok(())
}

/// Polls `rank` (busy, as the Python bench's default) until one event, which must be `kind`.
fn expect(rank: &mut EngineRank, kind: &str) -> Result<(), Error> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let events = rank.poll_events();
        if let Some(event) = events.first() {
            let ok = match event {
                ConnectorEvent::BlocksReady { .. } => kind == "BlocksReady",
                ConnectorEvent::BlocksFree { released: None, .. } => kind == "BlocksFree",
                _ => false,
            };
            return if ok && events.len() == 1 {
                Ok(())
            } else {
                Err(format!("expected one {kind}, got {events:?}").into())
            };
        }
        if Instant::now() > deadline {
            return Err(format!("no {kind} within {TIMEOUT:?}").into());
        }
    }
}
