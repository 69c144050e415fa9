//! kvhandoff's own push: both engines' ranks started by a [`RankBuilder`] in one runtime, on
//! KV memory each engine allocated itself (registered with NIXL as it is), driven through the
//! connector.

use super::*;
use crate::pair::{check_blocks, start_pair, PairError, PairSpec};

pub(super) struct PushSample {
    pub(super) latency_us: f64,
    pub(super) d_call_us: f64,
    pub(super) p_call_us: f64,
}

pub(super) struct Push {
    pub(super) p_conn: KvConnector,
    pub(super) d_conn: KvConnector,
    pub(super) p_kv: KvCache,
    pub(super) d_kv: KvCache,
    pub(super) p_regions: Vec<RegionDesc>,
    pub(super) d_regions: Vec<RegionDesc>,
    pub(super) runtime: Option<Runtime>,
}

impl Push {
    pub(super) fn new(
        geometry: &KvGeometry,
        pool_blocks: u32,
        nixl_config: NixlConfig,
        shell: ShellConfig,
        suffix: &str,
    ) -> Result<Self, TransferBenchError> {
        let pair = start_pair(PairSpec {
            geometry,
            pool_blocks,
            transport: TransportKind::Nixl(nixl_config),
            // The connector's defaults, as `KvConnector::new` gives (push only).
            settings: ConnectorSettings::default(),
            shell,
            suffix,
        })
        .map_err(|e| match e {
            PairError::Setup(why) => TransferBenchError::Options(why),
            PairError::Start(StartError::Transport(e)) => TransferBenchError::Nixl(e.to_string()),
            PairError::Start(StartError::Build(e)) => {
                TransferBenchError::Nixl(format!("build a rank: {e}"))
            }
            PairError::Start(e) => run_error(e.to_string()),
        })?;
        Ok(Push {
            p_conn: pair.p_conn,
            d_conn: pair.d_conn,
            p_kv: pair.p_kv,
            d_kv: pair.d_kv,
            p_regions: pair.p_regions,
            d_regions: pair.d_regions,
            runtime: Some(pair.runtime),
        })
    }

    pub(super) fn stamp_source(
        &self,
        block_bytes: u64,
        blocks: &[u32],
    ) -> Result<(), TransferBenchError> {
        stamp(&cache_regions(&self.p_kv), block_bytes, blocks).map_err(run_error)
    }

    /// One request: P finishes, D allocates; waits for D's `BlocksReady` and P's
    /// `BlocksFree`; checks the stamps. `label` and `rep` make the request ids (unique per run).
    pub(super) fn once(
        &mut self,
        table: &BlockTable,
        label: &str,
        rep: usize,
        block_bytes: u64,
        tables: (&[u32], &[u32]),
        timeout: Duration,
    ) -> Result<PushSample, TransferBenchError> {
        let d_regions = cache_regions(&self.d_kv);
        clear(&d_regions, block_bytes, tables.1).map_err(run_error)?;
        // vLLM-like ids: one base, a random-looking 8-hex suffix per engine.
        let base = format!("cmpl-bench-{label}-{rep:06}-0");
        let id = |suffix: u32| {
            RequestId::new(format!("{base}-{suffix:08x}"))
                .map_err(|e| TransferBenchError::Options(e.to_string()))
        };
        let (p_id, d_id) = (id(0x9e37_79b9)?, id(0x7f4a_7c15)?);
        let tokens = table.local.total() as u64 * u64::from(BLOCK_TOKENS);
        let connector = |e: kvhandoff::ConnectorError| run_error(format!("connector: {e}"));

        let p_start = Instant::now();
        let params = self
            .p_conn
            .request_finished(
                &p_id,
                table.local.clone(),
                tokens,
                &KvTransferParams::default(),
            )
            .map_err(connector)?;
        let d_start = Instant::now();
        self.d_conn
            .request_allocated(&d_id, table.remote.clone(), tokens, &params)
            .map_err(connector)?;
        let d_returned = Instant::now();
        let deadline = d_start + timeout;
        let ready = wait_for(&mut self.d_conn, deadline, |event| match event {
            ConnectorEvent::BlocksReady { request, blocks } if *request == d_id => {
                Some(check_blocks(blocks, &table.remote))
            }
            _ => Some(Err(format!("D: unexpected event {event:?}"))),
        })?;
        wait_for(&mut self.p_conn, deadline, |event| match event {
            ConnectorEvent::BlocksFree {
                request,
                released: None,
                blocks,
            } if *request == p_id => Some(check_blocks(blocks, &table.local)),
            _ => Some(Err(format!("P: unexpected event {event:?}"))),
        })?;
        check("kvhandoff", &d_regions, block_bytes, tables).map_err(run_error)?;
        Ok(PushSample {
            latency_us: us(ready - d_start),
            d_call_us: us(d_returned - d_start),
            p_call_us: us(d_start - p_start),
        })
    }

    pub(super) fn shutdown(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown();
        }
    }
}

/// [`crate::pair::wait_for`], failing as this bench fails.
pub(super) fn wait_for(
    conn: &mut KvConnector,
    deadline: Instant,
    accept: impl Fn(&ConnectorEvent) -> Option<Result<(), String>>,
) -> Result<Instant, TransferBenchError> {
    crate::pair::wait_for(conn, deadline, accept).map_err(run_error)
}

impl Drop for Push {
    fn drop(&mut self) {
        self.shutdown();
    }
}
