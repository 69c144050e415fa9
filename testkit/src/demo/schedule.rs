//! The seeded schedule: request ids, prompt lengths, arrivals and call offsets.
//!
//! Both sides derive it from the same [`DemoOptions`], so two processes given the same options
//! agree on every request without talking to each other.
//!
//! [`DemoMode::Bidir`] plans conversations instead of single requests: `turns` turns each (the
//! last conversation may have fewer), every turn a handoff of its own (a request on each side,
//! pushed or pulled as its conversation was drawn) whose prompt is the whole conversation so
//! far. Turn 1's prompt is drawn log-uniformly from `[min_prompt_tokens, max_prompt_tokens / 2]`
//! (short prompts are common, as in chats); each later turn adds what D decoded on the turn
//! before (a quarter of the turn's growth at most) and the user's next message, so that the
//! last turn stays within `max_prompt_tokens`. After a turn, D keeps what it holds (the prompt
//! and its decoded tokens) for the next one; the next turn reaches P a think time after D's
//! keep: 5–150 ms, except one turn in eight ([`LATE_TURN_ONE_IN`]) that comes back late, less
//! than [`near_expiry_margin`] before the end of the keep's TTL or after it.

use std::time::Duration;

use kvhandoff::TransferMode;
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::{KvGeometry, PairingKey, RequestId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{DemoError, DemoMode, DemoOptions};
use crate::pattern::{demo_geometry, request_key};

/// Mixed into the seed for [`DemoMode::Mixed`]'s draws, which come from a generator of their
/// own so that the rest of the schedule is the same in every mode.
const MODE_SALT: u64 = 0x6d6f_6465_2d64_7261;

/// In [`DemoMode::Bidir`], one later turn in this many comes back late: its think time is
/// drawn from `[ttl - margin / 2, ttl + margin]` (margin: [`near_expiry_margin`]), so P finds
/// D's kept blocks near (or past) the end of their TTL and recomputes instead of reading.
pub(crate) const LATE_TURN_ONE_IN: u32 = 8;

/// The shortest and longest think time of a later turn that is not late.
const THINK_MS: (u64, u64) = (5, 150);

/// How close to the end of D's TTL P still reads kept blocks back: a quarter of the TTL (P
/// declines, and recomputes, when less is left: its ask must reach D within the lease).
pub(crate) fn near_expiry_margin(ttl: Duration) -> Duration {
    ttl / 4
}

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
    /// Later turns: the tokens D kept after the turn before (its prompt and what it decoded),
    /// which P reads back or recomputes; 0 on turn 1.
    pub(crate) prefix_tokens: u32,
    /// Turns with a next one: the tokens D keeps after decoding (the next turn's
    /// `prefix_tokens`); 0 on a conversation's last turn.
    pub(crate) kept_tokens: u32,
    /// Later turns: from D's keep of the turn before to this turn reaching P.
    pub(crate) think: Duration,
    /// The plan index of the conversation's turn before, if any.
    pub(crate) prev: Option<usize>,
    /// The plan index of the conversation's next turn, if any.
    pub(crate) next: Option<usize>,
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

    /// Whether the request is a later turn of a conversation (P reads its prefix back from D,
    /// or recomputes it).
    pub(crate) fn later_turn(&self) -> bool {
        self.prev.is_some()
    }

    /// Blocks D allocates for the request: the prompt's, and room for what it decodes when the
    /// conversation goes on (kept for the next turn).
    pub(crate) fn decode_blocks(&self, block_tokens: u32) -> usize {
        self.blocks
            .max(self.kept_tokens.div_ceil(block_tokens) as usize)
    }

    /// Blocks of the prefix a later turn reads back (or recomputes).
    pub(crate) fn prefix_blocks(&self, block_tokens: u32) -> usize {
        self.prefix_tokens.div_ceil(block_tokens) as usize
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
    if options.mode == DemoMode::Bidir {
        if options.turns == 0 {
            return Err(DemoError::Options("turns must be at least 1".into()));
        }
        let floor = options.min_prompt_tokens.max(2 * (options.turns - 1));
        if options.max_prompt_tokens / 2 < floor {
            return Err(DemoError::Options(format!(
                "conversations of {} turns need max_prompt_tokens >= {} (twice the larger of \
                 min_prompt_tokens and 2 per later turn)",
                options.turns,
                2 * floor
            )));
        }
        if options.keep_ttl.is_zero() {
            return Err(DemoError::Options("keep_ttl must be positive".into()));
        }
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

/// A fresh request id pair (P's, D's) of `base`, whose suffixes differ.
fn id_pair(rng: &mut ChaCha8Rng, base: &str) -> Result<(RequestId, RequestId), DemoError> {
    let p_suffix = hex(rng, 8);
    let mut d_suffix = hex(rng, 8);
    while d_suffix == p_suffix {
        d_suffix = hex(rng, 8);
    }
    let prefill_id = RequestId::new(format!("{base}-{p_suffix}"))
        .map_err(|e| DemoError::Options(e.to_string()))?;
    let decode_id = RequestId::new(format!("{base}-{d_suffix}"))
        .map_err(|e| DemoError::Options(e.to_string()))?;
    debug_assert_eq!(
        PairingKey::from_request_id(&prefill_id),
        PairingKey::from_request_id(&decode_id)
    );
    Ok((prefill_id, decode_id))
}

fn uuid(rng: &mut ChaCha8Rng) -> String {
    format!(
        "{}-{}-{}-{}-{}",
        hex(rng, 8),
        hex(rng, 4),
        hex(rng, 4),
        hex(rng, 4),
        hex(rng, 12)
    )
}

/// The transfer rate below which a demo run is taken as stuck rather than slow: far under any
/// transport here (the in-memory one copies at GB/s), so that a busy or slow machine makes
/// runs slower, not FAILED.
pub const FLOOR_BYTES_PER_SEC: f64 = 50e6;

/// The limit of a run of `plan` (whose blocks are `block_bytes` each over all regions): at
/// least `options.timeout`; else the last arrival and call, plus the protocol's bound on one
/// request's end (`Config::decode_deadline`), plus the plan's bytes (twice over in the
/// bidirectional mode, whose turns read prefixes back) at [`FLOOR_BYTES_PER_SEC`].
pub(crate) fn run_limit(options: &DemoOptions, plan: &[Planned], block_bytes: u64) -> Duration {
    if !options.limit_grows_with_work {
        return options.timeout;
    }
    let last = plan
        .iter()
        .map(|q| q.arrival + q.prefill_delay.max(q.decode_delay))
        .max()
        .unwrap_or_default();
    let moves = if options.mode == DemoMode::Bidir {
        2
    } else {
        1
    };
    let bytes: u64 = plan
        .iter()
        .map(|q| q.blocks as u64 * block_bytes * moves)
        .sum();
    let work = Duration::from_secs_f64(bytes as f64 / FLOOR_BYTES_PER_SEC);
    options
        .timeout
        .max(last + Config::default().decode_deadline + work)
}

/// The schedule of `options` (a function of its seed and sizes only).
///
/// # Errors
/// [`DemoError::Options`] if an id would be invalid.
pub(crate) fn schedule(
    options: &DemoOptions,
    block_tokens: u32,
) -> Result<Vec<Planned>, DemoError> {
    if options.mode == DemoMode::Bidir {
        return conversations(options, block_tokens);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let mut modes = ChaCha8Rng::seed_from_u64(options.seed ^ MODE_SALT);
    let mut arrival = Duration::ZERO;
    let skew = options.max_call_skew.as_nanos() as u64;
    let mean_gap = options.mean_arrival_gap.as_secs_f64();
    let mut plan = Vec::with_capacity(options.requests);
    for _ in 0..options.requests {
        let base = format!("cmpl-{}-0", uuid(&mut rng));
        let (prefill_id, decode_id) = id_pair(&mut rng, &base)?;
        let pairing = PairingKey::from_request_id(&prefill_id);
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
                DemoMode::Mixed | DemoMode::Bidir if modes.gen_bool(0.5) => TransferMode::Pull,
                DemoMode::Mixed | DemoMode::Bidir => TransferMode::Push,
            },
            prefix_tokens: 0,
            kept_tokens: 0,
            think: Duration::ZERO,
            prev: None,
            next: None,
        });
    }
    Ok(plan)
}

/// The plan of [`DemoMode::Bidir`]: conversations of `options.turns` turns, `options.requests`
/// turns in all (see the module docs). Turn `t` of a conversation pairs by the key
/// `cmpl-<uuid>-<t - 1>`; every turn's bytes follow the pattern of the conversation (the key
/// of its turn 1), token positions counted from the conversation's start.
fn conversations(options: &DemoOptions, block_tokens: u32) -> Result<Vec<Planned>, DemoError> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let mut modes = ChaCha8Rng::seed_from_u64(options.seed ^ MODE_SALT);
    let skew = options.max_call_skew.as_nanos() as u64;
    let mean_gap = options.mean_arrival_gap.as_secs_f64();
    let turns = options.turns.max(1) as usize;
    let ttl = options.keep_ttl;
    let margin = near_expiry_margin(ttl);
    let (min, max) = (options.min_prompt_tokens, options.max_prompt_tokens);
    let first_max = (max / 2).max(min);
    let mut arrival = Duration::ZERO;
    let mut plan: Vec<Planned> = Vec::with_capacity(options.requests);
    while plan.len() < options.requests {
        let uuid = uuid(&mut rng);
        let count = turns.min(options.requests - plan.len());
        let mode = if modes.gen_bool(0.5) {
            TransferMode::Pull
        } else {
            TransferMode::Push
        };
        let gap = -mean_gap * (1.0 - rng.gen::<f64>()).ln();
        arrival += Duration::from_secs_f64(gap);
        // Turn 1's prompt, log-uniform; then each turn's growth within the budget left.
        let span = f64::from(first_max) / f64::from(min);
        let first = (f64::from(min) * span.powf(rng.gen::<f64>())).round() as u32;
        let first = first.clamp(min, first_max);
        let per_turn = (max - first) / (turns as u32 - 1).max(1);
        let mut key = None;
        let mut tokens = first;
        let start = plan.len();
        for t in 0..count {
            let (prefill_id, decode_id) = id_pair(&mut rng, &format!("cmpl-{uuid}-{t}"))?;
            let pattern =
                *key.get_or_insert_with(|| request_key(&PairingKey::from_request_id(&prefill_id)));
            // What D decodes on this turn, and what the user adds before the next one.
            let decoded = rng.gen_range(1..=(per_turn / 4).max(1));
            let added = rng.gen_range(1..=per_turn.saturating_sub(decoded).max(1));
            let last = t + 1 == count;
            let late = t > 0 && rng.gen_ratio(1, LATE_TURN_ONE_IN);
            let think = if late {
                let lo = ttl.saturating_sub(margin / 2);
                let hi = ttl + margin;
                Duration::from_nanos(rng.gen_range(lo.as_nanos() as u64..=hi.as_nanos() as u64))
            } else {
                Duration::from_millis(rng.gen_range(THINK_MS.0..=THINK_MS.1))
            };
            let prefix = if t == 0 {
                0
            } else {
                plan[start + t - 1].kept_tokens
            };
            plan.push(Planned {
                prefill_id,
                decode_id,
                key: pattern,
                tokens,
                blocks: tokens.div_ceil(block_tokens) as usize,
                arrival: if t == 0 { arrival } else { Duration::ZERO },
                prefill_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
                decode_delay: Duration::from_nanos(rng.gen_range(0..=skew)),
                mode,
                prefix_tokens: prefix,
                kept_tokens: if last { 0 } else { tokens + decoded },
                think: if t == 0 { Duration::ZERO } else { think },
                prev: (t > 0).then(|| start + t - 1),
                next: (!last).then(|| start + t + 1),
            });
            tokens += decoded + added;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of a few requests keeps the default limit; one of thousands gets the time its
    /// bytes need on a slow machine (the 2,000-request demo moved 68 GB past a fixed 60 s).
    #[test]
    fn the_run_limit_grows_with_the_work() {
        let small = DemoOptions::default();
        let plan = schedule(&small, 16).unwrap();
        let block_bytes = 16 * 8 * 128 * 2 * 2 * 8;
        let limit = run_limit(&small, &plan, block_bytes);
        assert!(limit >= small.timeout);
        let large = DemoOptions {
            requests: 2_000,
            ..DemoOptions::default()
        };
        let plan = schedule(&large, 16).unwrap();
        let bytes: u64 = plan.iter().map(|q| q.blocks as u64 * block_bytes).sum();
        let limit = run_limit(&large, &plan, block_bytes);
        assert!(
            limit.as_secs_f64() >= bytes as f64 / FLOOR_BYTES_PER_SEC,
            "{limit:?} for {bytes} bytes"
        );
        assert!(limit > large.timeout);
    }

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

#[cfg(test)]
mod bidir_tests {
    use super::*;

    fn bidir(requests: usize, turns: u32) -> DemoOptions {
        DemoOptions {
            mode: DemoMode::Bidir,
            requests,
            turns,
            max_prompt_tokens: 256,
            ..DemoOptions::default()
        }
    }

    #[test]
    fn conversations_grow_turn_by_turn_within_the_limit() {
        let options = bidir(18, 4);
        check(&options).unwrap();
        let plan = schedule(&options, 16).unwrap();
        assert_eq!(plan.len(), 18);
        let firsts: Vec<usize> = (0..plan.len()).filter(|&i| !plan[i].later_turn()).collect();
        // 4 + 4 + 4 + 4 + 2 turns.
        assert_eq!(firsts, vec![0, 4, 8, 12, 16]);
        let mut keys = std::collections::BTreeSet::new();
        for (i, q) in plan.iter().enumerate() {
            assert!(q.tokens <= 256 && q.tokens >= 16, "{}", q.tokens);
            assert!(keys.insert(PairingKey::from_request_id(&q.prefill_id)));
            assert!(q.decode_blocks(16) >= q.blocks);
            match q.prev {
                None => assert_eq!(q.prefix_tokens, 0),
                Some(j) => {
                    let before = &plan[j];
                    assert_eq!(j + 1, i);
                    assert_eq!(before.next, Some(i));
                    assert_eq!(before.key, q.key, "one pattern per conversation");
                    assert_eq!(before.mode, q.mode, "one mode per conversation");
                    assert_eq!(q.prefix_tokens, before.kept_tokens);
                    assert!(before.tokens < q.prefix_tokens && q.prefix_tokens < q.tokens);
                    assert_eq!(
                        before.decode_blocks(16),
                        q.prefix_blocks(16),
                        "D keeps exactly the blocks P reads back"
                    );
                }
            }
            assert_eq!(q.next.is_none(), q.kept_tokens == 0);
        }
    }

    #[test]
    fn some_later_turns_come_back_late_and_some_prefixes_are_short() {
        let options = bidir(400, 4);
        let plan = schedule(&options, 16).unwrap();
        let margin = near_expiry_margin(options.keep_ttl);
        let later: Vec<&Planned> = plan.iter().filter(|q| q.later_turn()).collect();
        let late = later
            .iter()
            .filter(|q| q.think >= options.keep_ttl - margin)
            .count();
        assert!(late > later.len() / 16 && late < later.len() / 4, "{late}");
        let short = later.iter().filter(|q| q.prefix_tokens < 64).count();
        assert!(short > 0 && short < later.len() / 4, "{short}");
        assert!(later
            .iter()
            .filter(|q| q.think < options.keep_ttl - margin)
            .all(|q| q.think <= Duration::from_millis(150)));
    }

    #[test]
    fn bidir_options_are_checked() {
        assert!(check(&bidir(8, 0)).is_err());
        let tiny = DemoOptions {
            max_prompt_tokens: 16,
            ..bidir(8, 4)
        };
        assert!(check(&tiny).is_err());
        let no_ttl = DemoOptions {
            keep_ttl: Duration::ZERO,
            ..bidir(8, 4)
        };
        assert!(check(&no_ttl).is_err());
    }
}
