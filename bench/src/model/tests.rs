//! The model's properties: deterministic, monotone in load, push no worse than pull, layer-wise
//! no worse than push above its threshold, and driven by its mechanisms (not a table).

use super::*;

fn options(mode: Mode, input_len: u32, output_len: u32, qps: f64) -> ModelOptions {
    ModelOptions {
        runs: 3,
        ..ModelOptions::seed(mode, 4, input_len, output_len, qps)
    }
}

fn mean_ttft(options: &ModelOptions) -> f64 {
    run_model(options).map_or(f64::NAN, |r| r.mean_ttft_ms)
}

#[test]
fn a_seed_gives_the_same_report_and_another_seed_another() {
    let base = options(Mode::Pull, 1024, 128, 4.0);
    let first = run_model(&base).expect("runs");
    assert_eq!(Ok(first.clone()), run_model(&base));
    let other = run_model(&ModelOptions { seed: 99, ..base }).expect("runs");
    assert_ne!(first.mean_ttft_ms, other.mean_ttft_ms);
}

#[test]
fn more_load_never_lowers_mean_ttft() {
    for mode in [Mode::Push, Mode::Pull, Mode::Layerwise] {
        let mut previous = 0.0;
        for qps in [0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0] {
            let ttft = mean_ttft(&options(mode, 1024, 128, qps));
            assert!(ttft >= previous, "{mode:?} at {qps}: {ttft} < {previous}");
            previous = ttft;
        }
    }
}

#[test]
fn push_is_no_slower_than_pull_at_equal_load() {
    for (input_len, output_len, qps) in [(512, 64, 4.0), (512, 128, 8.0), (2048, 128, 4.0)] {
        let push = mean_ttft(&options(Mode::Push, input_len, output_len, qps));
        let pull = mean_ttft(&options(Mode::Pull, input_len, output_len, qps));
        assert!(
            push <= pull,
            "{input_len}/{output_len}/{qps}: {push} > {pull}"
        );
    }
}

/// Layer-wise push hides the write behind the prefill's compute, so it is tested with prompts P
/// computes (with repeated prompts P computes one block and there is nothing to hide behind).
#[test]
fn layerwise_is_no_slower_than_push_above_the_threshold_and_push_below() {
    let computed = |mode, input_len| {
        let mut o = options(mode, input_len, 128, 2.0);
        o.deployment.repeated_prompts = false;
        o
    };
    for input_len in [512, 1024, 2048, 4096] {
        let push = run_model(&computed(Mode::Push, input_len)).expect("runs");
        let layerwise = run_model(&computed(Mode::Layerwise, input_len)).expect("runs");
        assert!(layerwise.mean_ttft_ms <= push.mean_ttft_ms, "{input_len}");
        assert!(
            layerwise.mean_transfer_ms < push.mean_transfer_ms,
            "{input_len}"
        );
    }
    let push = run_model(&options(Mode::Push, 128, 128, 2.0)).expect("runs");
    let layerwise = run_model(&options(Mode::Layerwise, 128, 128, 2.0)).expect("runs");
    assert_eq!(push.mean_ttft_ms, layerwise.mean_ttft_ms);
}

/// A lookup of the seed's table would not move with the network: the model does.
#[test]
fn the_network_bandwidth_moves_ttft_and_the_ratio() {
    let at = |bandwidth: f64, mode| {
        let mut o = options(mode, 2048, 128, 4.0);
        o.deployment.link_bytes_per_s = bandwidth;
        mean_ttft(&o)
    };
    let fast = (at(50e9, Mode::Pull), at(50e9, Mode::Push));
    let slow = (at(2e9, Mode::Pull), at(2e9, Mode::Push));
    assert!(slow.0 > fast.0 && slow.1 > fast.1, "{fast:?} {slow:?}");
    assert!(
        (slow.0 / slow.1 - fast.0 / fast.1).abs() > 0.01,
        "{fast:?} {slow:?}"
    );
}

#[test]
fn fragmented_tables_cost_pull_more_than_push() {
    let at = |table, mode| {
        let mut o = options(mode, 2048, 128, 4.0);
        o.deployment.block_table = table;
        mean_ttft(&o)
    };
    let pull_cost = at(BlockTable::Fragmented, Mode::Pull) - at(BlockTable::Contiguous, Mode::Pull);
    let push_cost = at(BlockTable::Fragmented, Mode::Push) - at(BlockTable::Contiguous, Mode::Push);
    assert!(
        pull_cost > push_cost && pull_cost > 0.0,
        "{pull_cost} {push_cost}"
    );
}

#[test]
fn tpot_is_one_decode_step_and_grows_with_the_batch() {
    let light = run_model(&options(Mode::Push, 512, 128, 0.5)).expect("runs");
    let heavy = run_model(&options(Mode::Push, 512, 128, 4.0)).expect("runs");
    let d = Deployment::seed(4);
    assert!(light.mean_tpot_ms >= d.decode_step_s(0.0) * 1e3);
    assert!(heavy.mean_tpot_ms > light.mean_tpot_ms);
}

#[test]
fn bad_options_are_errors() {
    let base = options(Mode::Push, 512, 128, 4.0);
    let with_tp = |tp| {
        let mut o = base.clone();
        o.deployment.tp = tp;
        run_model(&o)
    };
    assert_eq!(with_tp(0).err(), Some(ModelError::Tp(0)));
    assert_eq!(with_tp(3).err(), Some(ModelError::Tp(3)));
    for qps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let result = run_model(&ModelOptions {
            qps,
            ..base.clone()
        });
        assert!(matches!(result, Err(ModelError::Qps(_))), "{qps}");
    }
    let short = ModelOptions {
        output_len: 1,
        ..base.clone()
    };
    assert_eq!(run_model(&short).err(), Some(ModelError::OutputLen(1)));
    let empty = ModelOptions {
        requests: 0,
        ..base
    };
    assert_eq!(run_model(&empty).err(), Some(ModelError::NoRequests));
}

#[test]
fn arrivals_are_poisson_at_the_rate() {
    let times = sim::arrivals(4.0, 20_000, 7);
    let rate = times.len() as f64 / times[times.len() - 1];
    assert!((rate - 4.0).abs() < 0.15, "{rate}");
}

/// `np.random.seed(0); np.random.random_sample(3)` prints 0.5488135039273248, 0.7151893663724195,
/// 0.6027633760716439: the generator is numpy's, so seed 0 gives the seed's send times.
#[test]
fn the_bench_serve_generator_is_numpys_legacy_mt19937() {
    let mut rng = sim::NumpyLegacy::seed(0);
    for expected in [
        0.548_813_503_927_324_8,
        0.715_189_366_372_419_5,
        0.602_763_376_071_643_9,
    ] {
        assert_eq!(rng.next_double(), expected);
    }
}

#[test]
fn bench_serve_send_times_end_at_requests_over_qps_and_only_scale_with_the_rate() {
    let at4 = sim::bench_serve_arrivals(4.0, 100, 0);
    let at8 = sim::bench_serve_arrivals(8.0, 100, 0);
    assert!((at4[99] - 25.0).abs() < 1e-9, "{}", at4[99]);
    for (a, b) in at4.iter().zip(&at8) {
        assert!((a - 2.0 * b).abs() < 1e-9, "{a} {b}");
    }
    assert!(at4.windows(2).all(|w| w[0] < w[1]));
    assert_ne!(at4, sim::bench_serve_arrivals(4.0, 100, 1));
}

/// Push: D sends PUSH_REG only when its scheduler admits the request, so a full D delays P's
/// write. Without that, the write would start at the end of the prefill whatever D's queue.
#[test]
fn a_full_decoder_delays_the_push_write_until_it_admits_the_request() {
    let at = |max_running| {
        let mut o = options(Mode::Push, 512, 64, 8.0);
        o.deployment.decode_max_running = max_running;
        run_model(&o).expect("runs").mean_transfer_ms
    };
    let (free, full) = (at(1_000), at(1));
    assert!(full > 10.0 * free, "free {free} ms, full {full} ms");
}

/// With repeated prompts P computes only the last block, so a longer prompt barely costs P;
/// without, it costs P the FLOPs of every new token.
#[test]
fn repeated_prompts_take_the_prompt_length_out_of_the_prefill() {
    let growth = |repeated| {
        let at = |input_len| {
            let mut o = options(Mode::Push, input_len, 128, 0.5);
            o.deployment.repeated_prompts = repeated;
            mean_ttft(&o)
        };
        at(2048) - at(512)
    };
    let (with, without) = (growth(true), growth(false));
    assert!(with < 10.0, "{with}");
    assert!(without > 3.0 * with + 20.0, "{without} vs {with}");
}
