//! The discrete-event simulation of one run: Poisson arrivals, P's batched prefill steps, the KV
//! transfers on each rank's link, and D's decode steps with requests joining at step boundaries.
//! P does not depend on D (in push it writes into blocks D registered on arrival; in pull it only
//! holds its blocks), so P's timeline is computed first and D's second.

use super::params::Deployment;
use super::{Arrivals, Mode};

/// One simulated request's times, s from the run's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RequestTimes {
    pub arrival: f64,
    pub first_token: f64,
    pub finish: f64,
    /// From the end of the prefill to the KV landing on D (push, layer-wise) or from D issuing
    /// the read to its landing (pull).
    pub transfer: f64,
}

/// What one run is: the workload and the mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Workload {
    pub mode: Mode,
    pub arrivals: Arrivals,
    pub input_len: u32,
    pub output_len: u32,
    pub qps: f64,
    pub requests: usize,
    pub seed: u64,
}

/// SplitMix64: a tiny deterministic generator, so that a seed gives the same arrivals on every
/// platform without a dependency.
struct SplitMix(u64);

impl SplitMix {
    fn next_unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 53 random bits in (0, 1]: never 0, so the logarithm below stays finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

/// Poisson arrivals at `qps` (exponential gaps, as `vllm bench serve` draws them with its default
/// burstiness 1).
pub(crate) fn arrivals(qps: f64, requests: usize, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix(seed);
    let mut now = 0.0;
    (0..requests)
        .map(|_| {
            now += -rng.next_unit().ln() / qps;
            now
        })
        .collect()
}

/// numpy's legacy generator (`np.random.seed(n)`: MT19937 seeded by Knuth's `init_genrand`), as
/// far as `vllm bench serve` uses it: 53-bit doubles in [0, 1).
pub(crate) struct NumpyLegacy {
    state: [u32; 624],
    index: usize,
}

impl NumpyLegacy {
    /// `np.random.seed(seed)` (a seed below 2³²).
    pub(crate) fn seed(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            let previous = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(previous ^ (previous >> 30))
                .wrapping_add(i as u32);
        }
        NumpyLegacy { state, index: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        if self.index >= 624 {
            for i in 0..624 {
                let y = (self.state[i] & UPPER) | (self.state[(i + 1) % 624] & LOWER);
                let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
                if y & 1 == 1 {
                    next ^= 0x9908_b0df;
                }
                self.state[i] = next;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `np.random.random_sample()`: 53 random bits in [0, 1).
    pub(crate) fn next_double(&mut self) -> f64 {
        let a = f64::from(self.next_u32() >> 5);
        let b = f64::from(self.next_u32() >> 6);
        (a * 67_108_864.0 + b) / 9_007_199_254_740_992.0
    }
}

/// The arrival times `vllm bench serve` draws (`get_request` in `vllm/benchmarks/serve.py`):
/// after `np.random.seed(seed)`, one `np.random.gamma(shape=1, scale=1/qps)` gap per request
/// (numpy's legacy gamma at shape 1 is `-ln(1 - U)`), summed, then rescaled so that the last
/// request is sent exactly at `requests / qps` s. The same seed gives the same sequence, only
/// scaled, at every rate and prompt length.
pub(crate) fn bench_serve_arrivals(qps: f64, requests: usize, seed: u64) -> Vec<f64> {
    let mut rng = NumpyLegacy::seed(seed as u32);
    let mut now = 0.0;
    let mut times: Vec<f64> = (0..requests)
        .map(|_| {
            now += -(1.0 - rng.next_double()).ln() / qps;
            now
        })
        .collect();
    let last = times.last().copied().unwrap_or(0.0);
    if last > 0.0 {
        let factor = requests as f64 / qps / last;
        for time in &mut times {
            *time *= factor;
        }
    }
    times
}

/// One rank's network link: transfers are served one after another (every rank of an instance
/// moves its own share at the same time, so one rank stands for all).
struct Link {
    free_at: f64,
}

impl Link {
    /// A transfer that may start at `ready` and takes `wire_s`: when it ends.
    fn transfer(&mut self, ready: f64, wire_s: f64) -> f64 {
        let start = self.free_at.max(ready);
        self.free_at = start + wire_s;
        self.free_at
    }
}

/// P's timeline: when each request's prefill ends, and (push, layer-wise) when its KV has landed
/// on D.
struct PrefillResult {
    prefill_end: Vec<f64>,
    kv_landed: Vec<f64>,
}

fn simulate_prefill(d: &Deployment, w: &Workload, arrival: &[f64]) -> PrefillResult {
    let n = arrival.len();
    let mut prefill_end = vec![0.0; n];
    let mut kv_landed = vec![f64::INFINITY; n];
    // The first request fills the prefix cache; later ones find the sonnet dataset's shared
    // prefix there (never the whole prompt: at least one token is computed).
    let to_compute = |index: usize| -> u32 {
        let cached = if d.repeated_prompts {
            // Every full block of the prompt; vLLM computes at least the last token.
            (w.input_len - 1) / d.block_tokens.max(1) * d.block_tokens.max(1)
        } else if index == 0 {
            0
        } else {
            d.cached_prefix_tokens.min(w.input_len.saturating_sub(1))
        };
        w.input_len - cached
    };
    let mut remaining: Vec<u32> = (0..n).map(to_compute).collect();
    let layerwise = w.mode == Mode::Layerwise && w.input_len >= d.layerwise_threshold_tokens;
    let pushes = matches!(w.mode, Mode::Push | Mode::Layerwise);
    let groups = d.layers.div_ceil(d.layer_group.max(1)).max(1);
    let mut link = Link { free_at: 0.0 };
    let mut next_arrival = 0;
    let mut queue: Vec<usize> = Vec::new();
    let mut now = 0.0_f64;
    while next_arrival < n || !queue.is_empty() {
        if queue.is_empty() {
            now = now.max(arrival[next_arrival] + d.proxy_hop_s);
        }
        while next_arrival < n && arrival[next_arrival] + d.proxy_hop_s <= now {
            queue.push(next_arrival);
            next_arrival += 1;
        }
        // vLLM's scheduler: requests in arrival order take chunks of the token budget.
        let mut budget = d.prefill_token_budget;
        let mut chunks: Vec<(usize, u32, u32)> = Vec::new(); // request, first position, tokens
        for &request in &queue {
            if budget == 0 {
                break;
            }
            let take = remaining[request].min(budget);
            let first_position = w.input_len - remaining[request];
            chunks.push((request, first_position, take));
            remaining[request] -= take;
            budget -= take;
        }
        let tokens: f64 = chunks.iter().map(|c| f64::from(c.2)).sum();
        let position_sum: f64 = chunks
            .iter()
            .map(|&(_, first, take)| f64::from(take) * (f64::from(first) + f64::from(take) / 2.0))
            .sum();
        let step = d.prefill_step_s(tokens, position_sum);
        let compute = step - d.prefill_step_overhead_s;
        let step_start = now;
        now += step;
        let mut posts_after_step = 0.0;
        for &(request, _, take) in &chunks {
            let finished = remaining[request] == 0;
            if layerwise {
                // Each layer group's KV of this chunk is written as the forward pass produces it;
                // the post runs beside the GPU's compute (it waits for the group's event, not the
                // step's end).
                let group_bytes = d.bytes_per_rank(take) / f64::from(groups);
                let group_layers = d.layer_group.min(d.layers);
                let mut landed = 0.0_f64;
                let mut poster_free = step_start;
                for group in 0..groups {
                    let ready = step_start
                        + d.prefill_step_overhead_s
                        + compute * f64::from(group + 1) / f64::from(groups);
                    let posted =
                        poster_free.max(ready) + d.post_s(d.descriptors(take, group_layers));
                    poster_free = posted;
                    landed = link.transfer(posted, d.wire_s(group_bytes));
                }
                if finished {
                    kv_landed[request] = landed + d.notification_s;
                }
            } else if pushes && finished {
                // Whole-request push: P's worker posts the write after the forward pass, before
                // its next step, so the post delays P's next step.
                let post = d.post_s(d.descriptors(w.input_len, d.layers));
                let posted = now + posts_after_step + post;
                posts_after_step += post;
                let landed = link.transfer(posted, d.wire_s(d.bytes_per_rank(w.input_len)));
                kv_landed[request] = landed + d.notification_s;
            }
            if finished {
                prefill_end[request] = now;
            }
        }
        now += posts_after_step;
        queue.retain(|&request| remaining[request] > 0);
    }
    PrefillResult {
        prefill_end,
        kv_landed,
    }
}

/// Runs one workload on the deployment.
pub(crate) fn simulate(d: &Deployment, w: &Workload) -> Vec<RequestTimes> {
    let arrival = match w.arrivals {
        Arrivals::BenchServe => bench_serve_arrivals(w.qps, w.requests, w.seed),
        Arrivals::Poisson => arrivals(w.qps, w.requests, w.seed),
    };
    let n = arrival.len();
    let prefill = simulate_prefill(d, w, &arrival);
    // When D's scheduler first sees each request: push registers D's blocks on arrival (the
    // proxy sends to both at once); pull learns of it after P's response went back through the
    // proxy and on to D.
    let visible: Vec<f64> = (0..n)
        .map(|r| match w.mode {
            Mode::Pull => prefill.prefill_end[r] + 2.0 * d.proxy_hop_s,
            Mode::Push | Mode::Layerwise => arrival[r] + d.proxy_hop_s,
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| visible[a].total_cmp(&visible[b]));

    let mut kv_landed = prefill.kv_landed.clone();
    let mut read_issued = vec![f64::NAN; n];
    let mut registered = vec![f64::NAN; n];
    let mut transfer: Vec<f64> = (0..n)
        .map(|r| kv_landed[r] - prefill.prefill_end[r])
        .collect();
    let mut link = Link { free_at: 0.0 };
    let mut first_token = vec![f64::NAN; n];
    let mut finish = vec![f64::NAN; n];
    let mut generated = vec![0u32; n];
    let mut waiting: Vec<usize> = Vec::new();
    let mut running: Vec<usize> = Vec::new();
    let mut next_visible = 0;
    let mut finished_count = 0;
    let mut now = 0.0_f64;
    while finished_count < n {
        while next_visible < n && visible[order[next_visible]] <= now {
            waiting.push(order[next_visible]);
            next_visible += 1;
        }
        // vLLM's scheduler at the step boundary: completions reported by the last step let
        // their requests join; a pulled request's read is issued when there is room to run.
        let mut posts = 0.0;
        let mut index = 0;
        while index < waiting.len() {
            if running.len() >= d.decode_max_running as usize {
                break;
            }
            let request = waiting[index];
            if w.mode != Mode::Pull && registered[request].is_nan() {
                // vLLM's D allocates a waiting request's blocks (and sends PUSH_REG to P) only
                // when its scheduler admits it; P writes once both its prefill and the
                // registration are there.
                registered[request] = now;
                let registration_at_p = now + d.notification_s;
                if registration_at_p > prefill.prefill_end[request] {
                    let post = d.post_s(d.descriptors(w.input_len, d.layers));
                    let landed = link.transfer(
                        registration_at_p + post,
                        d.wire_s(d.bytes_per_rank(w.input_len)),
                    ) + d.notification_s;
                    if landed > kv_landed[request] {
                        kv_landed[request] = landed;
                        transfer[request] = landed - prefill.prefill_end[request];
                    }
                }
            }
            if kv_landed[request] <= now {
                waiting.remove(index);
                running.push(request);
                continue;
            }
            if w.mode == Mode::Pull && read_issued[request].is_nan() {
                // The post sits in D's critical path, before the step's forward pass.
                posts += d.post_s(d.descriptors(w.input_len, d.layers));
                read_issued[request] = now;
                let landed = link.transfer(now + posts, d.wire_s(d.bytes_per_rank(w.input_len)));
                kv_landed[request] = landed + d.notification_s;
                transfer[request] = kv_landed[request] - now;
            }
            index += 1;
        }
        if running.is_empty() {
            if posts > 0.0 {
                now += d.decode_step_overhead_s + posts;
                continue;
            }
            // Idle: the next thing that can happen is a request becoming visible or a KV landing.
            let next_seen = (next_visible < n).then(|| visible[order[next_visible]]);
            let next_landing = waiting
                .iter()
                .map(|&r| kv_landed[r])
                .filter(|t| t.is_finite())
                .fold(f64::INFINITY, f64::min);
            let next = next_seen.unwrap_or(f64::INFINITY).min(next_landing);
            if !next.is_finite() {
                break;
            }
            now = now.max(next);
            continue;
        }
        let kv_tokens: f64 = running
            .iter()
            .map(|&r| f64::from(w.input_len + generated[r]))
            .sum();
        now += d.decode_step_s(kv_tokens) + posts;
        running.retain(|&request| {
            generated[request] += 1;
            if generated[request] == 1 {
                first_token[request] = now;
            }
            if generated[request] >= w.output_len {
                finish[request] = now;
                finished_count += 1;
                false
            } else {
                true
            }
        });
    }
    (0..n)
        .map(|r| RequestTimes {
            arrival: arrival[r],
            first_token: first_token[r] + d.proxy_hop_s,
            finish: finish[r] + d.proxy_hop_s,
            transfer: transfer[r],
        })
        .collect()
}
