//! A prefill (P) and a decode (D) engine handing KV over, in one process on two threads: the
//! loops an engine integration runs, on KV memory the engines allocated themselves.
//!
//! P fills each request's blocks with a per-request byte pattern and hands them over
//! (`request_finished`); a router (here a channel) gives P's answer to D, which allocates blocks
//! (`request_allocated`) and, once they arrived, checks every byte. Exits non-zero on any
//! mismatch or failure.
//!
//! ```text
//! cargo run --release -p kvhandoff --example handoff -- --transport mem --mode push
//! source scripts/nixl-env.sh
//! cargo run --release -p kvhandoff --example handoff --features nixl -- --transport nixl
//! ```

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use kvhandoff::{
    BlockIds, ConnectorEvent, EngineId, EngineRank, ImportOutcome, KvCache, KvGeometry, KvLayout,
    KvRegion, KvTransferParams, MemFabric, ModelIdentity, RankBuilder, RequestId, Runtime,
    SideChannel, TransportKind,
};

type Error = Box<dyn std::error::Error + Send + Sync>;

const POOL_BLOCKS: u32 = 64;
const BLOCK_TOKENS: u32 = 16;
const TIMEOUT: Duration = Duration::from_secs(60);

/// What the router tells D: P's answer for a request, and how many blocks it needs.
type Handoff = (RequestId, u32, KvTransferParams);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: &str| {
        let at = args.iter().position(|a| a == name);
        at.and_then(|i| args.get(i + 1))
            .map_or(default.to_string(), Clone::clone)
    };
    let (transport, mode) = (arg("--transport", "mem"), arg("--mode", "push"));
    let requests: u32 = arg("--requests", "32").parse().unwrap_or(0);
    match run(&transport, &mode, requests) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("handoff FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(transport: &str, mode: &str, requests: u32) -> Result<(), Error> {
    if requests == 0 || !["push", "pull"].contains(&mode) {
        return Err("usage: --transport mem|nixl --mode push|pull --requests N (N > 0)".into());
    }
    let transport = match transport {
        "mem" => TransportKind::Mem(MemFabric::new()),
        #[cfg(feature = "nixl")]
        "nixl" => TransportKind::nixl(),
        other => return Err(format!("transport {other} (nixl needs --features nixl)").into()),
    };
    // 4 layers, 2 KV heads of 32 elements, bf16, 16-token blocks: 8 regions (K and V per layer).
    let geometry = KvGeometry::dense(4, 2, 32, 2, BLOCK_TOKENS, KvLayout::Hnd);
    let mut runtime = Runtime::start()?;
    let (p_id, d_id) = (EngineId::new("prefill-0")?, EngineId::new("decode-0")?);
    let build = |engine: &EngineId| -> Result<RankBuilder, Error> {
        Ok(RankBuilder::new(engine.clone(), geometry.clone(), model())
            .regions(engine_memory(&geometry)?)
            .transport(transport.clone())
            .side_channel(SideChannel::tcp("127.0.0.1:0".parse()?)))
    };
    let p = build(&p_id)?.start_on(&mut runtime)?;
    let p_addr = p.side_channel().ok_or("P has no side channel")?;
    let d = build(&d_id)?.peer(p_id, p_addr).start_on(&mut runtime)?;
    p.add_peer(&d_id, d.side_channel().ok_or("D has no side channel")?)?;

    let (router, from_router) = channel();
    let (p_result, d_result) = std::thread::scope(|s| {
        let p = s.spawn(move || prefill_engine(p, router, mode, requests));
        let d = s.spawn(move || decode_engine(d, from_router, requests));
        (p.join(), d.join())
    });
    runtime.shutdown();
    let sent = p_result.map_err(|_| "P panicked")??;
    let verified = d_result.map_err(|_| "D panicked")??;
    println!("summary: {requests} requests ({mode}), {sent} handed over by P, {verified} verified byte for byte by D");
    Ok(())
}

/// The engine's KV cache: one buffer per region of the geometry, allocated by the engine and
/// handed to the rank as is (in a real engine: its KV tensors).
fn engine_memory(geometry: &KvGeometry) -> Result<Vec<KvRegion>, Error> {
    let specs = geometry.regions()?;
    Ok(specs
        .iter()
        .map(|spec| {
            KvRegion::new(vec![
                0u8;
                (spec.block_len * u64::from(POOL_BLOCKS)) as usize
            ])
        })
        .collect())
}

fn model() -> ModelIdentity {
    ModelIdentity {
        model: "example-4l-2kvh-32d".into(),
        dtype: "bfloat16".into(),
        cache_dtype: "bfloat16".into(),
    }
}

/// The byte at `offset` of the `nth` block of `request` in `region`.
fn pattern(request: u32, region: usize, nth: usize, offset: usize) -> u8 {
    (request as usize * 131 + region * 31 + nth * 17 + offset * 7 + offset / 251) as u8
}

/// A request's blocks: 1 to 4, tokens not always a whole number of blocks.
fn shape(i: u32) -> (u32, u64) {
    let blocks = 1 + i % 4;
    (blocks, u64::from(blocks * BLOCK_TOKENS - i % BLOCK_TOKENS))
}

// ---------------------------------------------------------------------------------------------
// P: prefill, fill the blocks, hand them over, free them when the connector says so.

fn prefill_engine(
    mut p: EngineRank,
    router: Sender<Handoff>,
    mode: &str,
    n: u32,
) -> Result<u32, Error> {
    let mut free: VecDeque<u32> = (0..POOL_BLOCKS).collect();
    let (mut next, mut done) = (0u32, 0u32);
    let deadline = Instant::now() + TIMEOUT;
    while done < n {
        if Instant::now() > deadline {
            return Err(format!("P: timed out with {done} of {n} requests done").into());
        }
        let (blocks, tokens) = shape(next);
        if next < n && free.len() >= blocks as usize {
            let ids: Vec<u32> = free.drain(..blocks as usize).collect();
            fill(p.kv(), next, &ids)?;
            let request = RequestId::new(format!("req-{next}"))?;
            // What the router sends with the prefill leg: keep the KV for a remote decode.
            let leg = KvTransferParams {
                do_remote_decode: true,
                transfer_mode: Some(mode.into()),
                ..KvTransferParams::default()
            };
            let answer = p.request_finished(&request, BlockIds::single_group(ids), tokens, &leg)?;
            router.send((request, blocks, answer))?;
            next += 1;
            continue;
        }
        for event in p.wait_events(Duration::from_millis(5)) {
            match event {
                ConnectorEvent::BlocksFree {
                    blocks,
                    released: None,
                    ..
                }
                | ConnectorEvent::ExportEnded { blocks, .. } => {
                    free.extend(blocks.groups.concat());
                    done += 1;
                }
                other => return Err(format!("P: {other:?}").into()),
            }
        }
    }
    Ok(done)
}

/// P's "prefill": every byte of every block of the request, in every region.
fn fill(kv: &KvCache, request: u32, blocks: &[u32]) -> Result<(), Error> {
    for region in 0..kv.num_regions() {
        let mut bytes = vec![0u8; kv.block_len(region)? as usize];
        for (nth, &block) in blocks.iter().enumerate() {
            for (offset, b) in bytes.iter_mut().enumerate() {
                *b = pattern(request, region, nth, offset);
            }
            kv.write_block(region, block, &bytes)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// D: allocate blocks for each request P handed over, check them when they arrived, free them.

fn decode_engine(mut d: EngineRank, router: Receiver<Handoff>, n: u32) -> Result<u32, Error> {
    let mut free: VecDeque<u32> = (0..POOL_BLOCKS).collect();
    let mut waiting: VecDeque<Handoff> = VecDeque::new();
    let (mut allocated, mut verified) = (0u32, 0u32);
    let deadline = Instant::now() + TIMEOUT;
    while verified < n {
        if Instant::now() > deadline {
            return Err(format!("D: timed out with {verified} of {n} requests verified").into());
        }
        match router.try_recv() {
            Ok(handoff) => waiting.push_back(handoff),
            Err(TryRecvError::Disconnected) if waiting.is_empty() && allocated == verified => {
                return Err(format!("D: P stopped after {verified} of {n} requests").into());
            }
            Err(_) => {}
        }
        if let Some((request, blocks, answer)) = waiting.pop_front() {
            if free.len() >= blocks as usize {
                let ids = BlockIds::single_group(free.drain(..blocks as usize).collect());
                let tokens = answer
                    .remote_num_tokens
                    .ok_or("P's answer has no token count")?;
                d.request_allocated(&request, ids, tokens, &answer)?;
                allocated += 1;
            } else {
                waiting.push_front((request, blocks, answer));
            }
        }
        for event in d.wait_events(Duration::from_millis(5)) {
            let (request, blocks) = match event {
                ConnectorEvent::BlocksReady { request, blocks }
                | ConnectorEvent::Imported {
                    request,
                    blocks,
                    outcome: ImportOutcome::Loaded,
                } => (request, blocks),
                other => return Err(format!("D: {other:?}").into()),
            };
            let ids = blocks.groups.concat();
            check(d.kv(), &request, &ids)?;
            println!("{request}: {} blocks verified", ids.len());
            free.extend(ids);
            verified += 1;
        }
    }
    Ok(verified)
}

/// D's check: every byte of every block of the request, in every region, is P's.
fn check(kv: &KvCache, request: &RequestId, blocks: &[u32]) -> Result<(), Error> {
    let index: u32 = request.as_str().trim_start_matches("req-").parse()?;
    for region in 0..kv.num_regions() {
        let mut bytes = vec![0u8; kv.block_len(region)? as usize];
        for (nth, &block) in blocks.iter().enumerate() {
            kv.read_block(region, block, &mut bytes)?;
            let wrong = (0..bytes.len()).filter(|&o| bytes[o] != pattern(index, region, nth, o));
            if let Some(first) = wrong.clone().next() {
                let count = wrong.count();
                return Err(format!(
                    "{request}: region {region} block {block}: {count} wrong bytes from {first}"
                )
                .into());
            }
        }
    }
    Ok(())
}
