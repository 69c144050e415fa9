//! The actix part of `bench control` (the actix system): P and D engines calling their connectors as fast as
//! they accept calls, each rank on its own threads, started with a [`RankBuilder`] on memory
//! its engine allocated.

use super::*;

pub(super) fn tiny_geometry() -> KvGeometry {
    KvGeometry::dense(1, 1, 8, 2, 16, KvLayout::Hnd)
}

pub(super) struct Engine {
    pub(super) conn: KvConnector,
    pub(super) free: FreeList,
    /// The block of each call whose verdict came late, until its event or refusal.
    pub(super) late: std::collections::HashMap<RequestId, u32>,
    pub(super) ids: Arc<Vec<(RequestId, RequestId)>>,
    pub(super) decode: bool,
    pub(super) batch: usize,
    pub(super) deadline: Instant,
}

pub(super) struct EngineResult {
    pub(super) good: u64,
    pub(super) bad: u64,
    pub(super) errors: Vec<String>,
    pub(super) last_event: Option<Instant>,
}

impl Engine {
    pub(super) fn handle(&mut self, events: Vec<ConnectorEvent>, r: &mut EngineResult) {
        for event in events {
            r.last_event = Some(Instant::now());
            if !matches!(event, ConnectorEvent::Refused { .. }) && !self.late.is_empty() {
                // A late call was accepted after all: its event brings the block back.
                self.late.remove(event.request());
            }
            let (why_bad, blocks) = match event {
                // The request's `Failed` follows and brings the blocks back; counted there.
                ConnectorEvent::DecodeFenced { .. } => continue,
                ConnectorEvent::BlocksReady { blocks, .. } => (
                    (!self.decode).then(|| "P got BlocksReady".to_string()),
                    blocks,
                ),
                ConnectorEvent::BlocksFree {
                    released, blocks, ..
                } => {
                    let why = match released {
                        Some(cause) => Some(format!("P released: {cause:?}")),
                        None if self.decode => Some("D got BlocksFree".to_string()),
                        None => None,
                    };
                    (why, blocks)
                }
                ConnectorEvent::Failed { reason, blocks, .. } => {
                    (Some(format!("D failed: {reason:?}")), blocks)
                }
                ConnectorEvent::ExportEnded {
                    outcome, blocks, ..
                } => (Some(format!("export in a push bench: {outcome:?}")), blocks),
                ConnectorEvent::Imported {
                    outcome, blocks, ..
                } => (Some(format!("import in a push bench: {outcome:?}")), blocks),
                ConnectorEvent::Refused { request, error } => {
                    let Some(block) = self.late.remove(&request) else {
                        r.bad += 1;
                        r.errors
                            .push(format!("refusal of an unknown call: {request}"));
                        continue;
                    };
                    (
                        Some(format!("refused late: {error}")),
                        BlockIds::single_group(vec![block]),
                    )
                }
            };
            match why_bad {
                None => r.good += 1,
                Some(why) => {
                    r.bad += 1;
                    if r.errors.len() < 8 {
                        r.errors.push(why);
                    }
                }
            }
            self.free.release(&blocks);
        }
    }

    pub(super) fn run(mut self) -> EngineResult {
        let n = self.ids.len();
        let mut r = EngineResult {
            good: 0,
            bad: 0,
            errors: Vec::new(),
            last_event: None,
        };
        let router = KvTransferParams {
            do_remote_prefill: self.decode,
            do_remote_decode: !self.decode,
            remote_engine_id: self.decode.then(|| PREFILL_ENGINE.to_string()),
            tp_size: Some(1),
            ..KvTransferParams::default()
        };
        let ids = Arc::clone(&self.ids);
        let mut next = 0usize;
        let mut failed_calls = 0u64;
        while (r.good + r.bad + failed_calls) < n as u64 {
            if Instant::now() >= self.deadline {
                r.errors
                    .push(format!("deadline with {} of {n} events", r.good + r.bad));
                break;
            }
            let events = self.conn.poll_events();
            self.handle(events, &mut r);
            // One engine step: every request that has blocks, up to the batch, in one call.
            let mut calls = Vec::with_capacity(self.batch);
            // The one block and the request of each call, to take back if the call is refused.
            let mut taken = Vec::with_capacity(self.batch);
            while next < n && calls.len() < self.batch {
                let Some(blocks) = self.free.alloc(1) else {
                    break;
                };
                let (p_id, d_id) = &ids[next];
                let request = if self.decode { d_id } else { p_id };
                taken.extend(blocks.first().map(|&b| (b, request.clone())));
                let blocks = BlockIds::single_group(blocks);
                calls.push(if self.decode {
                    ConnectorCall::RequestAllocated {
                        request: d_id.clone(),
                        blocks,
                        num_tokens: 16,
                        params: router.clone(),
                    }
                } else {
                    ConnectorCall::RequestFinished {
                        request: p_id.clone(),
                        blocks,
                        num_tokens: 16,
                        params: router.clone(),
                    }
                });
                next += 1;
            }
            if !calls.is_empty() {
                for (result, (block, request)) in self.conn.submit(calls).into_iter().zip(taken) {
                    match result {
                        Ok(_) => {}
                        // It may still be applied: the block stays out until its event tells.
                        Err(ConnectorError::VerdictLate) => {
                            self.late.insert(request, block);
                        }
                        Err(e) => {
                            failed_calls += 1;
                            self.free.release(&BlockIds::single_group(vec![block]));
                            if r.errors.len() < 8 {
                                r.errors.push(e.to_string());
                            }
                        }
                    }
                }
                continue;
            }
            let events = self.conn.wait_events(Duration::from_millis(1));
            self.handle(events, &mut r);
        }
        if self.free.double_frees > 0 || self.free.in_use() > 0 {
            r.errors.push(format!(
                "{} double frees, {} blocks not returned",
                self.free.double_frees,
                self.free.in_use()
            ));
        }
        r
    }
}

pub(super) fn actix_run(options: &ControlOptions) -> Result<ActixNumbers, BenchError> {
    let n = options.actix_requests;
    let fabric = MemFabric::new();
    let (p_engine, d_engine, config) = engines_and_config(n)?;
    // P and D are separate engines: each rank gets a thread of its own (and its transport
    // another), as in separate processes; each on memory its engine allocated.
    let mut runtime = Runtime::start()?;
    let mut start = |engine: &EngineId| -> Result<KvConnector, BenchError> {
        let geometry = tiny_geometry();
        let regions = demo::engine_memory(&geometry, options.actix_pool_blocks)
            .map_err(|e| BenchError::Options(e.to_string()))?;
        let rank = RankBuilder::new(engine.clone(), geometry, demo::model())
            .regions(regions)
            .transport(TransportKind::Mem(fabric.clone()))
            .config(config.clone())
            // The connector's defaults, as `KvConnector::new` gives (push only).
            .connector_settings(ConnectorSettings::default())
            .placement(Placement::OwnThreads)
            .start_on(&mut runtime)
            .map_err(start_error)?;
        Ok(rank.into_parts().0)
    };
    let p_conn = start(&p_engine)?;
    let d_conn = start(&d_engine)?;
    let p_rank = p_conn.rank().rank.clone();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let base = vllm_like_base(i);
        let id = |suffix: u32| {
            RequestId::new(format!("{base}-{suffix:08x}"))
                .map_err(|e| BenchError::Options(e.to_string()))
        };
        ids.push((id(i as u32 ^ 0xaaaa_aaaa)?, id(i as u32 ^ 0x5555_5555)?));
    }
    let ids = Arc::new(ids);
    let start = Instant::now();
    let deadline = start + options.timeout;
    let make = |conn, decode| Engine {
        late: std::collections::HashMap::new(),
        conn,
        free: FreeList::new(options.actix_pool_blocks),
        ids: Arc::clone(&ids),
        decode,
        batch: options.actix_batch,
        deadline,
    };
    let (p, d) = (make(p_conn, false), make(d_conn, true));
    let p_thread = thread::spawn(move || p.run());
    let d_thread = thread::spawn(move || d.run());
    let p = p_thread
        .join()
        .map_err(|_| BenchError::Actix("the P thread panicked".into()))?;
    let d = d_thread
        .join()
        .map_err(|_| BenchError::Actix("the D thread panicked".into()))?;
    let counters = demo::query_counters(&p_rank);
    drop(p_rank);
    runtime.shutdown();

    let mut problems: VecDeque<String> = p.errors.into_iter().chain(d.errors).collect();
    if p.good != n as u64 || d.good != n as u64 {
        problems.push_front(format!(
            "{n} requests: P sent {} (+{} other), D ready {} (+{} other)",
            p.good, p.bad, d.good, d.bad
        ));
    }
    if !problems.is_empty() {
        let shown: Vec<&str> = problems.iter().take(4).map(String::as_str).collect();
        return Err(BenchError::Actix(format!(
            "{} ({} problems)",
            shown.join("; "),
            problems.len()
        )));
    }
    let end = match (p.last_event, d.last_event) {
        (Some(a), Some(b)) => a.max(b),
        _ => Instant::now(),
    };
    let counters = counters.unwrap_or_default();
    Ok(ActixNumbers {
        requests: n as u64,
        pool_blocks: options.actix_pool_blocks,
        batch: options.actix_batch as u64,
        wall_ms: end.saturating_duration_since(start).as_secs_f64() * 1e3,
        ready: d.good,
        sent: p.good,
        races: Races {
            decode_registers_first: counters.decode_registered_first,
            prefill_finishes_first: counters.prefill_finished_first,
        },
        rounds_requests_per_sec: Vec::new(),
    })
}

/// A [`RankBuilder`]'s refusal as the bench's error (the messages the hand-built ranks gave).
fn start_error(error: kvhandoff::StartError) -> BenchError {
    use kvhandoff::StartError;
    match error {
        StartError::Build(e) => BenchError::Build(e),
        StartError::Transport(e) => BenchError::Build(e.into()),
        StartError::Runtime(e) => BenchError::Runtime(e),
        other => BenchError::Actix(other.to_string()),
    }
}
