//! The parts that need the NIXL runtime.

use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::system::{RegionBytes, ShellConfig};
use kvhandoff_actors::transport::nixl::{nixl_runtime_available, NixlConfig};
use kvhandoff_protocol::planner::{Descriptor, PlanInput, Planner, TransferPlan};
use kvhandoff_protocol::{BlockIds, KvGeometry, RegionDesc, RegionSpec, RequestId};
use nixl_sys::{
    AgentConfig, MemType, NixlError, XferDescList, XferDlistHandle, XferOp, XferStatus,
};

use kvhandoff_testkit::stats::min;

use super::{
    block_tables, gbps, median, memcpy_gbps, percentile, plan_fragmented_70b, us, BlockTable,
    IdleCpu, LatencyNumbers, LatencySamples, NotifyPoint, PreparedRequest, PushNumbers, RawNumbers,
    RequestShape, TableNumbers, TransferBenchError, TransferOptions, TransferReport, BLOCK_TOKENS,
    TARGET_LATENCY_RATIO, TARGET_RATIO,
};
use kvhandoff::{
    ConnectorEvent, ConnectorSettings, KvCache, KvConnector, KvTransferParams, Runtime, StartError,
    TransportKind,
};

mod notify;
mod push;
mod raw;
mod sweep;

use crate::stamps::{cache_regions, check, clear, fill, stamp};
use notify::*;
use push::*;
use raw::*;
pub(super) use sweep::sweep;

fn nixl(what: &str) -> impl Fn(NixlError) -> TransferBenchError + '_ {
    move |e| TransferBenchError::Nixl(format!("{what}: {e}"))
}

fn run_error(why: impl Into<String>) -> TransferBenchError {
    TransferBenchError::Run(why.into())
}

pub(super) fn run(options: &TransferOptions) -> Result<TransferReport, TransferBenchError> {
    nixl_runtime_available().map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
    let geometry = super::bench_geometry(options);
    geometry
        .validate()
        .map_err(|e| TransferBenchError::Options(e.to_string()))?;
    let specs = geometry
        .regions()
        .map_err(|e| TransferBenchError::Options(e.to_string()))?;
    let block_bytes = specs[0].block_len;
    let blocks = options.blocks();
    let (pool_blocks, tables) = block_tables(blocks);
    let request_bytes = block_bytes * u64::from(blocks) * specs.len() as u64;
    let shape = RequestShape {
        num_layers: options.num_layers,
        kv_heads: options.kv_heads,
        head_dim: options.head_dim,
        block_tokens: BLOCK_TOKENS,
        blocks,
        regions: specs.len(),
        block_bytes,
        request_bytes,
        pool_blocks,
    };
    let mut nixl_config = NixlConfig::default();
    if !options.arrival_poller {
        nixl_config.poller = None;
    }
    let shell = ShellConfig::default();

    let fragmented_70b = plan_fragmented_70b(options.plan_repeats)?;
    let memcpy = memcpy_gbps(request_bytes, options.repeats.clamp(3, 10));

    let agent_config = AgentConfig {
        enable_prog_thread: nixl_config.progress_thread,
        pthr_delay_us: nixl_config.pthr_delay_us,
        ..AgentConfig::default()
    };
    let mut raw = RawPair::new(&agent_config, &specs, pool_blocks, "bench-raw")?;
    let mut push = Push::new(
        &geometry,
        pool_blocks,
        nixl_config.clone(),
        shell.clone(),
        "",
    )?;
    // The same ranks with prepared block lists off: every post builds dynamic lists.
    let dynamic_config = NixlConfig {
        prepared_lists: false,
        ..nixl_config.clone()
    };
    let mut push_dynamic = Push::new(
        &geometry,
        pool_blocks,
        dynamic_config,
        shell.clone(),
        "-dynamic",
    )?;
    // Real bytes in every source page (untouched pages would all read the shared zero page).
    let region_len = block_bytes * u64::from(pool_blocks);
    fill(&byte_regions(&raw.p), region_len).map_err(run_error)?;
    fill(&cache_regions(&push.p_kv), region_len).map_err(run_error)?;
    fill(&cache_regions(&push_dynamic.p_kv), region_len).map_err(run_error)?;

    let mut numbers = Vec::new();
    for table in &tables {
        let (table_numbers, _) = run_table(
            options.repeats,
            options.timeout,
            &geometry,
            &specs,
            table,
            request_bytes,
            &mut raw,
            &mut push,
            &mut push_dynamic,
        )?;
        numbers.push(table_numbers);
    }
    // The fixed cost: one block, P's first of the contiguous table to D's.
    let one = one_block(&tables[0]);
    let one_bytes =
        specs[0].block_len * u64::from(geometry.kernel_blocks_per_logical) * specs.len() as u64;
    let (one_numbers, one_samples) = run_table(
        options.latency_repeats,
        options.timeout,
        &geometry,
        &specs,
        &one,
        one_bytes,
        &mut raw,
        &mut push,
        &mut push_dynamic,
    )?;
    let latency = latency_numbers(
        &one_numbers,
        one_bytes,
        options.latency_repeats,
        one_samples,
    );
    drop(raw);
    let idle_cpu = (options.idle_secs > 0)
        .then(|| idle_cpu(Duration::from_secs(options.idle_secs)))
        .transpose()?;
    push.shutdown();
    push_dynamic.shutdown();

    let notification_sweep = notification_sweep(options, &nixl_config)?;
    let notification_rtt_us = notification_sweep
        .iter()
        .find(|p| {
            p.progress_thread == nixl_config.progress_thread
                && p.pthr_delay_us == nixl_config.pthr_delay_us
        })
        .map_or(0.0, |p| p.rtt_p50_us);

    let headline = numbers
        .iter()
        .find(|t| t.table == "fragmented")
        .or(numbers.first())
        .cloned()
        .ok_or_else(|| run_error("no table ran"))?;
    let ratio_min = numbers
        .iter()
        .map(|t| t.ratio)
        .fold(f64::INFINITY, f64::min);
    Ok(TransferReport {
        memcpy_gbps: memcpy,
        raw_nixl_gbps: headline.raw.gbps,
        kvhandoff_gbps: headline.kvhandoff.gbps,
        ratio: headline.ratio,
        descriptors: headline.descriptors,
        headline_table: headline.table.clone(),
        ratio_min,
        target_ratio: TARGET_RATIO,
        ratio_met: ratio_min >= TARGET_RATIO,
        prepared_gain: headline.prepared_gain,
        prepared_request_gain: headline.prepared_request.gain,
        latency,
        arrival_poller: options.arrival_poller,
        idle_cpu,
        handoff_latency_p50_us: headline.kvhandoff.latency_p50_us,
        handoff_latency_p99_us: headline.kvhandoff.latency_p99_us,
        raw_post_us: headline.raw.post_us,
        notification_rtt_us,
        fragmented_70b,
        request: shape,
        repeats: options.repeats,
        progress_thread: nixl_config.progress_thread,
        pthr_delay_us: nixl_config.pthr_delay_us,
        writer_poll_us: us(shell.poll_interval),
        tables: numbers,
        notification_sweep,
    })
}

/// The first block of `table` on each side.
fn one_block(table: &BlockTable) -> BlockTable {
    let first = |ids: &BlockIds| {
        BlockIds::single_group(ids.groups.iter().flatten().take(1).copied().collect())
    };
    BlockTable {
        name: "one-block",
        local: first(&table.local),
        remote: first(&table.remote),
    }
}

fn latency_numbers(
    t: &TableNumbers,
    bytes: u64,
    repeats: usize,
    samples: LatencySamples,
) -> LatencyNumbers {
    let ratio = t.kvhandoff.latency_p50_us / t.raw.total_us.max(f64::MIN_POSITIVE);
    LatencyNumbers {
        blocks: 1,
        descriptors: t.descriptors,
        bytes,
        raw_us: t.raw.total_us,
        kvhandoff_us: t.kvhandoff.latency_p50_us,
        ratio,
        raw_p99_us: t.raw.total_p99_us,
        kvhandoff_p99_us: t.kvhandoff.latency_p99_us,
        kvhandoff_min_us: t.kvhandoff.latency_min_us,
        target_ratio: TARGET_LATENCY_RATIO,
        met: ratio <= TARGET_LATENCY_RATIO,
        dynamic_us: t.kvhandoff_dynamic.latency_p50_us,
        prepared_us: t.kvhandoff_prepared.latency_p50_us,
        prepared_gain: t.prepared_gain,
        prepared_request: t.prepared_request.clone(),
        repeats,
        samples,
    }
}

/// User + system time of this process (all its threads), from `/proc/self/stat`.
fn process_cpu() -> Result<Duration, TransferBenchError> {
    let stat = std::fs::read_to_string("/proc/self/stat")
        .map_err(|e| run_error(format!("/proc/self/stat: {e}")))?;
    // The fields after the command name (which may hold spaces, inside parentheses): utime and
    // stime are the 12th and 13th of them, in USER_HZ ticks (100 per second on Linux).
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| run_error("/proc/self/stat without a command name"))?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| -> Result<u64, TransferBenchError> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| run_error(format!("/proc/self/stat: field {i} unreadable")))
    };
    let ticks = tick(11)? + tick(12)?;
    Ok(Duration::from_millis(ticks * 10))
}

/// The process's CPU while it sleeps `span` (the ranks idle).
fn idle_cpu(span: Duration) -> Result<IdleCpu, TransferBenchError> {
    let (cpu0, wall0) = (process_cpu()?, Instant::now());
    thread::sleep(span);
    let (cpu, wall) = (process_cpu()? - cpu0, wall0.elapsed());
    Ok(IdleCpu {
        seconds: wall.as_secs_f64(),
        cpu_seconds: cpu.as_secs_f64(),
        cpu_percent: 100.0 * cpu.as_secs_f64() / wall.as_secs_f64().max(f64::MIN_POSITIVE),
    })
}

/// One table: planner count, then warm-ups, then alternating raw and kvhandoff repetitions; then
/// alternating kvhandoff and kvhandoff with dynamic lists only (`push_dynamic`); then the
/// request alone, created both ways. Also returns the first pass's samples (raw, kvhandoff).
#[allow(clippy::too_many_arguments)]
fn run_table(
    repeats: usize,
    timeout: Duration,
    geometry: &KvGeometry,
    specs: &[RegionSpec],
    table: &BlockTable,
    request_bytes: u64,
    raw: &mut RawPair,
    push: &mut Push,
    push_dynamic: &mut Push,
) -> Result<(TableNumbers, LatencySamples), TransferBenchError> {
    let kbpl = geometry.kernel_blocks_per_logical;
    let (raw_plan, push_count) = plan_both(specs, kbpl, table, table.name, raw, push)?;
    if raw_plan.bytes != request_bytes {
        return Err(run_error(format!(
            "{}: the plan moves {} bytes, the request has {request_bytes}",
            table.name, raw_plan.bytes
        )));
    }
    let block_bytes = specs[0].block_len * u64::from(kbpl);
    let local = table.local.groups.first().cloned().unwrap_or_default();
    let remote = table.remote.groups.first().cloned().unwrap_or_default();
    push_dynamic.stamp_source(block_bytes, &local)?;
    let (raw_samples, push_samples) = raw_vs_push(
        table.name,
        repeats,
        timeout,
        &raw_plan.descriptors,
        table,
        block_bytes,
        raw,
        push,
    )?;
    // Then kvhandoff against itself with dynamic lists only, in a second pass (so the raw vs
    // kvhandoff pass above runs as it did without it), the two pairs swapping places every
    // repetition: the one that runs second shares the cores with the first one's pollers
    // winding down.
    let mut prepared_samples = Vec::new();
    let mut dynamic_samples = Vec::new();
    for rep in 0..=repeats {
        let mut both = [(&mut *push, None), (&mut *push_dynamic, None)];
        if rep % 2 == 1 {
            both.reverse();
        }
        for (pair, sample) in &mut both {
            *sample = Some(pair.once(
                table,
                table.name,
                rep,
                block_bytes,
                (&local, &remote),
                timeout,
            )?);
        }
        if rep % 2 == 1 {
            both.reverse();
        }
        let [(_, prepared_sample), (_, dynamic_sample)] = both;
        let (Some(prepared_sample), Some(dynamic_sample)) = (prepared_sample, dynamic_sample)
        else {
            return Err(run_error("a kvhandoff repetition did not run"));
        };
        if rep > 0 {
            prepared_samples.push(prepared_sample);
            dynamic_samples.push(dynamic_sample);
        }
    }
    // The request alone, both ways, on the same descriptors (nothing posted).
    let mut create_samples = Vec::new();
    for rep in 0..=repeats {
        let sample = raw.create_only(
            &raw_plan.descriptors,
            format!("{}-create-{rep}", table.name).as_bytes(),
        )?;
        if rep > 0 {
            create_samples.push(sample);
        }
    }
    let create_us = median(
        &create_samples
            .iter()
            .map(|s| s.create_us)
            .collect::<Vec<_>>(),
    );
    let make_us = median(&create_samples.iter().map(|s| s.make_us).collect::<Vec<_>>());
    let prepared_request = PreparedRequest {
        create_us,
        make_us,
        entries: create_samples.first().map_or(0, |s| s.entries),
        gain: create_us / make_us.max(f64::MIN_POSITIVE),
    };
    let col = |f: fn(&RawSample) -> f64| raw_samples.iter().map(f).collect::<Vec<f64>>();
    let total = col(|s| s.total_us);
    let complete = col(|s| s.complete_us);
    let raw_numbers = RawNumbers {
        gbps: median(
            &total
                .iter()
                .map(|&t| gbps(request_bytes, t))
                .collect::<Vec<_>>(),
        ),
        complete_gbps: median(
            &complete
                .iter()
                .map(|&t| gbps(request_bytes, t))
                .collect::<Vec<_>>(),
        ),
        build_us: median(&col(|s| s.build_us)),
        post_us: median(&col(|s| s.post_us)),
        complete_us: median(&complete),
        total_us: median(&total),
        total_p99_us: percentile(&total, 99.0),
        done_in_post: raw_samples.iter().filter(|s| s.done_in_post).count(),
    };
    let push_numbers = summarize_push(&push_samples, request_bytes);
    let prepared_numbers = summarize_push(&prepared_samples, request_bytes);
    let dynamic_numbers = summarize_push(&dynamic_samples, request_bytes);
    let ratio = if raw_numbers.gbps > 0.0 {
        push_numbers.gbps / raw_numbers.gbps
    } else {
        0.0
    };
    let paired: Vec<f64> = raw_samples
        .iter()
        .zip(&push_samples)
        .map(|(r, p)| r.total_us / p.latency_us.max(f64::MIN_POSITIVE))
        .collect();
    let prepared_gain =
        dynamic_numbers.latency_p50_us / prepared_numbers.latency_p50_us.max(f64::MIN_POSITIVE);
    let samples = LatencySamples {
        raw_us: total.clone(),
        kvhandoff_us: push_samples.iter().map(|s| s.latency_us).collect(),
    };
    let numbers = TableNumbers {
        table: table.name.to_string(),
        paired_ratio: median(&paired),
        descriptors: push_count,
        overhead_us: push_numbers.latency_p50_us - raw_numbers.total_us,
        raw: raw_numbers,
        kvhandoff: push_numbers,
        ratio,
        kvhandoff_prepared: prepared_numbers,
        kvhandoff_dynamic: dynamic_numbers,
        prepared_gain,
        prepared_request,
    };
    Ok((numbers, samples))
}

/// Plans `table` for the raw pair and for the kvhandoff ranks (P's own regions against the ones
/// D advertised, as the P rank's writer does) and checks that both make as many descriptors:
/// the raw plan and kvhandoff's count.
fn plan_both(
    specs: &[RegionSpec],
    kbpl: u32,
    table: &BlockTable,
    label: &str,
    raw: &RawPair,
    push: &Push,
) -> Result<(TransferPlan, usize), TransferBenchError> {
    let mut planner = Planner::new();
    let plan = |planner: &mut Planner, local: &[RegionDesc], remote: &[RegionDesc]| {
        let input = PlanInput::new(local, remote, specs, &table.local, &table.remote, kbpl);
        planner
            .plan(&input)
            .map_err(|e| run_error(format!("{label} table does not plan: {e}")))
    };
    let raw_plan = plan(&mut planner, &raw.p.regions, &raw.d.regions)?;
    let push_count = plan(&mut planner, &push.p_regions, &push.d_regions)?.descriptor_count();
    if raw_plan.descriptor_count() != push_count {
        return Err(run_error(format!(
            "{label}: raw plans {} descriptors, kvhandoff {push_count}",
            raw_plan.descriptor_count(),
        )));
    }
    Ok((raw_plan, push_count))
}

/// Stamps `table`'s source blocks on both paths, then `repeats` alternating raw and kvhandoff
/// repetitions after one untimed warm-up of each; `label` names the notifications and request
/// ids (unique per table within a run).
#[allow(clippy::too_many_arguments)]
fn raw_vs_push(
    label: &str,
    repeats: usize,
    timeout: Duration,
    descriptors: &[Descriptor],
    table: &BlockTable,
    block_bytes: u64,
    raw: &mut RawPair,
    push: &mut Push,
) -> Result<(Vec<RawSample>, Vec<PushSample>), TransferBenchError> {
    let local = table.local.groups.first().cloned().unwrap_or_default();
    let remote = table.remote.groups.first().cloned().unwrap_or_default();
    stamp(&byte_regions(&raw.p), block_bytes, &local).map_err(run_error)?;
    push.stamp_source(block_bytes, &local)?;
    let mut raw_samples = Vec::new();
    let mut push_samples = Vec::new();
    for rep in 0..=repeats {
        let raw_sample = raw.once(
            descriptors,
            format!("{label}-{rep}").as_bytes(),
            block_bytes,
            (&local, &remote),
            timeout,
        )?;
        let push_sample = push.once(table, label, rep, block_bytes, (&local, &remote), timeout)?;
        // Repetition 0 is the warm-up (connections, first touch of the pages).
        if rep > 0 {
            raw_samples.push(raw_sample);
            push_samples.push(push_sample);
        }
    }
    Ok((raw_samples, push_samples))
}

/// The medians of kvhandoff's samples on one table.
fn summarize_push(samples: &[PushSample], request_bytes: u64) -> PushNumbers {
    let latency: Vec<f64> = samples.iter().map(|s| s.latency_us).collect();
    PushNumbers {
        gbps: median(
            &latency
                .iter()
                .map(|&t| gbps(request_bytes, t))
                .collect::<Vec<_>>(),
        ),
        latency_p50_us: median(&latency),
        latency_p99_us: percentile(&latency, 99.0),
        latency_min_us: min(&latency),
        d_call_us: median(&samples.iter().map(|s| s.d_call_us).collect::<Vec<_>>()),
        p_call_us: median(&samples.iter().map(|s| s.p_call_us).collect::<Vec<_>>()),
    }
}
