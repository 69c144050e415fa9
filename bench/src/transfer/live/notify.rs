//! Notification round trips for each agent setting (progress thread, its delay).

use super::*;

/// The agent settings measured: the progress thread with `pthr_delay_us` 0 (the crate
/// default), 1, 10 and 100, and without it; only the default one unless `notify_sweep`.
pub(super) fn notification_sweep(
    options: &TransferOptions,
    default: &NixlConfig,
) -> Result<Vec<NotifyPoint>, TransferBenchError> {
    let settings: Vec<(bool, u64)> = if options.notify_sweep {
        vec![(true, 0), (true, 1), (true, 10), (true, 100), (false, 0)]
    } else {
        vec![(default.progress_thread, default.pthr_delay_us)]
    };
    settings
        .into_iter()
        .enumerate()
        .map(|(k, (on, delay))| notify_point(options, k, on, delay))
        .collect()
}

pub(super) fn notify_point(
    options: &TransferOptions,
    k: usize,
    progress_thread: bool,
    pthr_delay_us: u64,
) -> Result<NotifyPoint, TransferBenchError> {
    let config = AgentConfig {
        enable_prog_thread: progress_thread,
        pthr_delay_us,
        ..AgentConfig::default()
    };
    // One 32 MiB region per side (smaller for tiny runs), for the single-descriptor WRITE.
    let len: u64 = if options.notify_sweep {
        32 << 20
    } else {
        1 << 20
    };
    let mut pair = {
        let p = RawSide::new(&format!("bench-rtt{k}-a"), &config, &[(len, 1)])?;
        let d = RawSide::new(&format!("bench-rtt{k}-b"), &config, &[(len, 1)])?;
        connect(&p, &d)?;
        RawPair {
            prepared: None,
            p,
            d,
        }
    };
    let mut rtt = Vec::with_capacity(options.notify_rounds);
    let warmup = 10;
    for round in 0..warmup + options.notify_rounds {
        let sample = round_trip(&mut pair, round, options.timeout)?;
        if round >= warmup {
            rtt.push(sample);
        }
    }
    let descriptor = [Descriptor {
        local_addr: pair.p.regions[0].base,
        remote_addr: pair.d.regions[0].base,
        len,
    }];
    let mut write = Vec::new();
    for rep in 0..6 {
        let sample = pair.write(&descriptor, format!("w{rep}").as_bytes(), options.timeout)?;
        if rep > 0 {
            write.push(gbps(len, sample.total_us));
        }
    }
    Ok(NotifyPoint {
        progress_thread,
        pthr_delay_us,
        rtt_p50_us: median(&rtt),
        rtt_p99_us: percentile(&rtt, 99.0),
        rtt_min_us: min(&rtt),
        write_32mib_gbps: median(&write),
        rounds: rtt.len(),
    })
}

/// A → B, then B → A, each side polling both agents (`yield_now` between polls); µs.
pub(super) fn round_trip(
    pair: &mut RawPair,
    round: usize,
    timeout: Duration,
) -> Result<f64, TransferBenchError> {
    let ping = format!("ping-{round}").into_bytes();
    let pong = format!("pong-{round}").into_bytes();
    let start = Instant::now();
    let deadline = start + timeout;
    pair.p
        .agent
        .send_notification(&pair.d.name, &ping, None)
        .map_err(nixl("send_notification"))?;
    while !pair.d.received(&ping)? {
        pair.p.received(&[])?;
        if Instant::now() > deadline {
            return Err(run_error("ping not delivered"));
        }
        thread::yield_now();
    }
    pair.d
        .agent
        .send_notification(&pair.p.name, &pong, None)
        .map_err(nixl("send_notification"))?;
    while !pair.p.received(&pong)? {
        pair.d.received(&[])?;
        if Instant::now() > deadline {
            return Err(run_error("pong not delivered"));
        }
        thread::yield_now();
    }
    Ok(us(start.elapsed()))
}
