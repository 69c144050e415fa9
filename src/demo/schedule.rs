//! The seeded schedule: request ids, prompt lengths, arrivals and call offsets.
//!
//! Both sides derive it from the same [`DemoOptions`], so two processes given the same options
//! agree on every request without talking to each other.

use std::time::Duration;

use kvhandoff::TransferMode;
use kvhandoff_protocol::{KvGeometry, PairingKey, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::pattern::{demo_geometry, request_key};
use super::{DemoError, DemoMode, DemoOptions};

/// Mixed into the seed for [`DemoMode::Mixed`]'s draws, which come from a generator of their
/// own so that the rest of the schedule is the same in every mode.
const MODE_SALT: u64 = 0x6d6f_6465_2d64_7261;

/// One request of the schedule.
#[derive(Debug, Clone)]
pub(crate) struct Planned {
    /// P's id of the request.
    pub(crate) prefill_id: RequestId,
    /// D's id of the request (same base, another suffix: the same pairing key).
    pub(crate) decode_id: RequestId,
    /// The pattern key ([`request_key`] of the pairing key).
    pub(crate) key: u64,
    pub(crate) tokens: u32,
    pub(crate) blocks: usize,
    /// When the prompt reaches P, from the start.
    pub(crate) arrival: Duration,
    /// P calls `request_finished` this long after its prefill is done.
    pub(crate) prefill_delay: Duration,
    /// D calls `request_allocated` this long after P's prefill is done (in pull mode, or once
    /// P's answer came, if later).
    pub(crate) decode_delay: Duration,
    /// How the request's KV moves.
    pub(crate) mode: TransferMode,
}

impl Planned {
    /// The request's `transfer_mode`, as the router asks P for it.
    pub(crate) fn mode_name(&self) -> &'static str {
        if self.mode == TransferMode::Pull {
            "pull"
        } else {
            "push"
        }
    }
}

/// What the checked options give: the geometry and its block sizes.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    pub(crate) geometry: KvGeometry,
    /// Tokens per logical block.
    pub(crate) block_tokens: u32,
    /// Bytes of one logical block over every region.
    pub(crate) block_bytes: u64,
}

/// Checks `options` (everything but the transport) against the demo geometry.
///
/// # Errors
/// [`DemoError::Options`] for contradicting options.
pub(crate) fn check(options: &DemoOptions) -> Result<Workload, DemoError> {
    let geometry = demo_geometry();
    let block_tokens = geometry.kernel_block_size * geometry.kernel_blocks_per_logical;
    if options.requests == 0 {
        return Err(DemoError::Options("requests must be at least 1".into()));
    }
    if options.min_prompt_tokens == 0 || options.min_prompt_tokens > options.max_prompt_tokens {
        return Err(DemoError::Options(
            "prompt lengths need 1 <= min_prompt_tokens <= max_prompt_tokens".into(),
        ));
    }
    let max_blocks = options.max_prompt_tokens.div_ceil(block_tokens);
    if max_blocks > options.pool_blocks {
        return Err(DemoError::Options(format!(
            "a {}-token prompt needs {max_blocks} blocks; the pool has {}",
            options.max_prompt_tokens, options.pool_blocks
        )));
    }
    if options.poll_interval.is_zero() || options.timeout.is_zero() {
        return Err(DemoError::Options(
            "poll_interval and timeout must be positive".into(),
        ));
    }
    let block_bytes = geometry
        .logical_block_bytes(0)
        .map_err(|e| DemoError::Options(e.to_string()))?;
    Ok(Workload {
        geometry,
        block_tokens,
        block_bytes,
    })
}

fn hex(rng: &mut ChaCha8Rng, digits: usize) -> String {
    (0..digits)
        .map(|_| char::from_digit(rng.gen_range(0..16), 16).unwrap_or('0'))
        .collect()
}

/// The schedule of `options` (a function of its seed and sizes only).
///
/// # Errors
/// [`DemoError::Options`] if an id would be invalid.
pub(crate) fn schedule(
    options: &DemoOptions,
    block_tokens: u32,
) -> Result<Vec<Planned>, DemoError> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let mut modes = ChaCha8Rng::seed_from_u64(options.seed ^ MODE_SALT);
    let mut arrival = Duration::ZERO;
    let skew = options.max_call_skew.as_nanos() as u64;
    let mean_gap = options.mean_arrival_gap.as_secs_f64();
    let mut plan = Vec::with_capacity(options.requests);
    for _ in 0..options.requests {
        let uuid = format!(
            "{}-{}-{}-{}-{}",
            hex(&mut rng, 8),
            hex(&mut rng, 4),
            hex(&mut rng, 4),
            hex(&mut rng, 4),
            hex(&mut rng, 12)
        );
        let base = format!("cmpl-{uuid}-0");
        let p_suffix = hex(&mut rng, 8);
        let mut d_suffix = hex(&mut rng, 8);
        while d_suffix == p_suffix {
            d_suffix = hex(&mut rng, 8);
        }
        let prefill_id = RequestId::new(format!("{base}-{p_suffix}"))
            .map_err(|e| DemoError::Options(e.to_string()))?;
        let decode_id = RequestId::new(format!("{base}-{d_suffix}"))
            .map_err(|e| DemoError::Options(e.to_string()))?;
        let pairing = PairingKey::from_request_id(&prefill_id);
        debug_assert_eq!(pairing, PairingKey::from_request_id(&decode_id));
        let tokens = rng.gen_range(options.min_prompt_tokens..=options.max_prompt_tokens);
        let gap = -mean_gap * (1.0 - rng.gen::<f64>()).ln();
        arrival += Duration::from_secs_f64(gap);
        plan.push(Planned {
            prefill_id,
            decode_id,
            key: request_key(&pairing),
            tokens,
            blocks: tokens.div_ceil(block_tokens) as usize,
            arrival,
            prefill_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
            decode_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
            mode: match options.mode {
                DemoMode::Push => TransferMode::Push,
                DemoMode::Pull => TransferMode::Pull,
                DemoMode::Mixed if modes.gen_bool(0.5) => TransferMode::Pull,
                DemoMode::Mixed => TransferMode::Push,
            },
        });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_pairs_ids_and_varies_suffixes() {
        let plan = schedule(&DemoOptions::default(), 16).unwrap();
        assert_eq!(plan.len(), 64);
        for p in &plan {
            assert_ne!(p.prefill_id, p.decode_id);
            assert_eq!(
                PairingKey::from_request_id(&p.prefill_id),
                PairingKey::from_request_id(&p.decode_id)
            );
            assert!(p.prefill_id.as_str().starts_with("cmpl-"));
            assert_eq!(p.blocks, p.tokens.div_ceil(16) as usize);
        }
        let d_first = plan
            .iter()
            .filter(|p| p.decode_delay < p.prefill_delay)
            .count();
        assert!(d_first > 16 && d_first < 48, "{d_first}");
    }

    #[test]
    fn modes_change_nothing_else_and_mixed_draws_both() {
        let push = schedule(&DemoOptions::default(), 16).unwrap();
        assert!(push.iter().all(|p| p.mode == TransferMode::Push));
        for mode in [DemoMode::Pull, DemoMode::Mixed] {
            let options = DemoOptions {
                mode,
                ..DemoOptions::default()
            };
            let other = schedule(&options, 16).unwrap();
            assert!(push
                .iter()
                .zip(&other)
                .all(|(x, y)| x.prefill_id == y.prefill_id
                    && x.tokens == y.tokens
                    && x.arrival == y.arrival
                    && x.decode_delay == y.decode_delay));
            let pulled = other
                .iter()
                .filter(|p| p.mode == TransferMode::Pull)
                .count();
            match mode {
                DemoMode::Pull => assert_eq!(pulled, 64),
                _ => assert!(pulled > 16 && pulled < 48, "{pulled}"),
            }
        }
    }

    #[test]
    fn the_schedule_is_a_function_of_the_options() {
        let a = schedule(&DemoOptions::default(), 16).unwrap();
        let b = schedule(&DemoOptions::default(), 16).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| x.prefill_id == y.prefill_id
            && x.decode_id == y.decode_id
            && x.arrival == y.arrival
            && x.decode_delay == y.decode_delay));
    }
}
