//! Two engines' ranks, P and D, started by a [`RankBuilder`] on one runtime, each on KV memory
//! it allocated itself: what the benches that move bytes through kvhandoff run on.

use std::time::Instant;

use kvhandoff::{
    ConnectorEvent, ConnectorSettings, KvCache, KvConnector, RankBuilder, Runtime, StartError,
    TransportKind,
};
use kvhandoff_actors::system::ShellConfig;
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::BlockIds;
use kvhandoff_protocol::{EngineId, KvGeometry, RegionDesc};
use kvhandoff_testkit::demo::{self, DECODE_ENGINE, PREFILL_ENGINE};

/// What to start.
pub(crate) struct PairSpec<'a> {
    pub geometry: &'a KvGeometry,
    pub pool_blocks: u32,
    pub transport: TransportKind,
    pub settings: ConnectorSettings,
    pub shell: ShellConfig,
    /// Appended to both engines' names (two pairs in one process need distinct agents).
    pub suffix: &'a str,
}

/// Why a pair did not start.
#[derive(Debug)]
pub(crate) enum PairError {
    /// The engine ids or the memory could not be made.
    Setup(String),
    /// A rank did not start.
    Start(StartError),
}

/// The started pair.
// Only the NIXL benches read the regions the ranks advertised.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) struct EnginePair {
    pub p_conn: KvConnector,
    pub d_conn: KvConnector,
    pub p_kv: KvCache,
    pub d_kv: KvCache,
    pub p_regions: Vec<RegionDesc>,
    pub d_regions: Vec<RegionDesc>,
    pub runtime: Runtime,
}

/// Starts P's rank, then D's, on one new runtime.
pub(crate) fn start_pair(spec: PairSpec<'_>) -> Result<EnginePair, PairError> {
    let mut runtime = Runtime::start().map_err(|e| PairError::Setup(e.to_string()))?;
    let mut start = |engine: &str| {
        let engine = EngineId::new(format!("{engine}{}", spec.suffix))
            .map_err(|e| PairError::Setup(e.to_string()))?;
        let memory = demo::engine_memory(spec.geometry, spec.pool_blocks)
            .map_err(|e| PairError::Setup(e.to_string()))?;
        let rank = RankBuilder::new(engine, spec.geometry.clone(), demo::model())
            .regions(memory)
            .transport(spec.transport.clone())
            .config(Config::default())
            .connector_settings(spec.settings)
            .shell(spec.shell.clone())
            .start_on(&mut runtime)
            .map_err(PairError::Start)?;
        // What the rank advertised: its regions as the transport registered them.
        let regions = rank.peer_info().regions.clone();
        let (conn, kv, _) = rank.into_parts();
        Ok::<_, PairError>((conn, kv, regions))
    };
    let (p_conn, p_kv, p_regions) = start(PREFILL_ENGINE)?;
    let (d_conn, d_kv, d_regions) = start(DECODE_ENGINE)?;
    Ok(EnginePair {
        p_conn,
        d_conn,
        p_kv,
        d_kv,
        p_regions,
        d_regions,
        runtime,
    })
}

/// `Ok` if an event handed back exactly the blocks `want`.
pub(crate) fn check_blocks(got: &BlockIds, want: &BlockIds) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("blocks {got:?} returned, {want:?} expected"))
    }
}

/// Waits on `conn` ([`KvConnector::wait_events`]: woken by the event, no poll timer and no CPU
/// meanwhile) until `accept` settles an event; returns when it was seen.
pub(crate) fn wait_for(
    conn: &mut KvConnector,
    deadline: Instant,
    accept: impl Fn(&ConnectorEvent) -> Option<Result<(), String>>,
) -> Result<Instant, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no event before the deadline".into());
        }
        let events = conn.wait_events(left);
        let now = Instant::now();
        for event in &events {
            match accept(event) {
                Some(Ok(())) => return Ok(now),
                Some(Err(why)) => return Err(why),
                None => {}
            }
        }
        if conn.rank_stopped() {
            return Err("the rank stopped".into());
        }
    }
}
