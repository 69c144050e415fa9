//! The descriptor-size sweep over NIXL ([`super::super::descriptor_sweep`]).

use super::*;
use crate::transfer::{run_table, sweep_pool, SweepOptions, SweepPoint, SweepReport};

pub(in crate::transfer) fn sweep(
    options: &SweepOptions,
) -> Result<SweepReport, TransferBenchError> {
    nixl_runtime_available().map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
    let geometry = options.geometry();
    geometry
        .validate()
        .map_err(|e| TransferBenchError::Options(e.to_string()))?;
    let specs = geometry
        .regions()
        .map_err(|e| TransferBenchError::Options(e.to_string()))?;
    let kbpl = geometry.kernel_blocks_per_logical;
    let block_bytes = specs[0].block_len * u64::from(kbpl);
    let pool = sweep_pool(options.blocks);
    let request_bytes = block_bytes * u64::from(options.blocks) * specs.len() as u64;
    let nixl_config = NixlConfig::default();
    let agent_config = AgentConfig {
        enable_prog_thread: nixl_config.progress_thread,
        pthr_delay_us: nixl_config.pthr_delay_us,
        ..AgentConfig::default()
    };
    let mut raw = RawPair::new(&agent_config, &specs, pool, "sweep-raw")?;
    let mut push = Push::new(
        &geometry,
        pool,
        nixl_config,
        ShellConfig::default(),
        "-sweep",
    )?;
    let region_len = specs[0].block_len * u64::from(pool);
    fill(&byte_regions(&raw.p), region_len).map_err(run_error)?;
    fill(&cache_regions(&push.p_kv), region_len).map_err(run_error)?;

    let mut points = Vec::with_capacity(options.runs.len());
    for &run in &options.runs {
        let table = run_table(options.blocks, run);
        let label = format!("sweep-run{run}");
        let (plan, descriptors) = plan_both(&specs, kbpl, &table, &label, &raw, &push)?;
        if plan.bytes != request_bytes {
            return Err(run_error(format!(
                "{label}: the plan moves {} bytes, the request has {request_bytes}",
                plan.bytes
            )));
        }
        let (raw_samples, push_samples) = raw_vs_push(
            &label,
            options.repeats,
            options.timeout,
            &plan.descriptors,
            &table,
            block_bytes,
            &mut raw,
            &mut push,
        )?;
        let raw_us: Vec<f64> = raw_samples.iter().map(|s| s.total_us).collect();
        let push_us: Vec<f64> = push_samples.iter().map(|s| s.latency_us).collect();
        let rate = |times: &[f64]| {
            median(
                &times
                    .iter()
                    .map(|&t| gbps(request_bytes, t))
                    .collect::<Vec<_>>(),
            )
        };
        let (raw_gbps, kvhandoff_gbps) = (rate(&raw_us), rate(&push_us));
        points.push(SweepPoint {
            run_blocks: run,
            descriptors,
            descriptor_bytes: request_bytes / descriptors.max(1) as u64,
            raw_gbps,
            kvhandoff_gbps,
            ratio: if raw_gbps > 0.0 {
                kvhandoff_gbps / raw_gbps
            } else {
                0.0
            },
            raw_p50_us: median(&raw_us),
            kvhandoff_p50_us: median(&push_us),
        });
    }
    drop(raw);
    push.shutdown();
    Ok(SweepReport {
        request_bytes,
        block_bytes,
        regions: specs.len(),
        repeats: options.repeats,
        points,
    })
}
