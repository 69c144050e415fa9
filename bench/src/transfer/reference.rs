//! The references the transfer is measured against: memcpy bandwidth and the planner's cost on
//! the fragmented 70B case.

use super::*;

/// One thread copying `bytes` between two buffers: GB/s, median of `repeats` after one warm-up.
pub fn memcpy_gbps(bytes: u64, repeats: usize) -> f64 {
    let len = usize::try_from(bytes).unwrap_or(usize::MAX);
    let src = vec![0x5au8; len];
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src);
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        samples.push(gbps(bytes, us(start.elapsed())));
    }
    median(&samples)
}

/// Plans [`fragmented_70b_case`] `plans` times with one reused [`Planner`].
///
/// # Errors
/// [`TransferBenchError::Run`] if the case does not plan (a bug).
pub fn plan_fragmented_70b(plans: usize) -> Result<Fragmented70b, TransferBenchError> {
    let (geometry, local, remote, p, d) = fragmented_70b_case();
    let specs = geometry
        .regions()
        .map_err(|e| TransferBenchError::Run(e.to_string()))?;
    let input = PlanInput::new(
        &local,
        &remote,
        &specs,
        &p,
        &d,
        geometry.kernel_blocks_per_logical,
    );
    let mut planner = Planner::new();
    let mut out = Vec::new();
    let mut plan = |out: &mut Vec<_>| {
        planner
            .plan_into(&input, out)
            .map_err(|e| TransferBenchError::Run(format!("the 70B case does not plan: {e}")))
    };
    // Warm-up: sizes the planner's buffers and the output once.
    plan(&mut out)?;
    let mut samples = Vec::with_capacity(plans);
    let mut descriptors = 0;
    for _ in 0..plans.max(1) {
        let start = Instant::now();
        let summary = plan(&mut out)?;
        samples.push(us(start.elapsed()));
        descriptors = std::hint::black_box(summary.descriptors);
    }
    let plan_us = median(&samples);
    Ok(Fragmented70b {
        descriptors,
        minimum: FRAGMENTED_70B_MIN_DESCRIPTORS,
        plan_us,
        plan_us_p99: percentile(&samples, 99.0),
        plans: samples.len(),
        met: descriptors == FRAGMENTED_70B_MIN_DESCRIPTORS && plan_us < TARGET_PLAN_US,
    })
}
