//! Deadlines, intervals and table bounds of an endpoint.

use std::time::Duration;

/// Every deadline and bound an [`Endpoint`](super::Endpoint) uses. [`Config::default`] holds
/// production values; tests shrink them.
///
/// ```
/// use kvhandoff_protocol::machine::Config;
/// let config = Config::default();
/// config.validate().unwrap();
/// assert!(config.peer_timeout < 2 * config.heartbeat_interval);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// How long P holds finished blocks without a registration or a renewal.
    pub lease_duration: Duration,
    /// How far one heartbeat pushes a lease's end past now.
    pub lease_extension: Duration,
    /// How often an endpoint sends each connected peer a heartbeat.
    pub heartbeat_interval: Duration,
    /// Silence after which a connected peer is declared dead.
    pub peer_timeout: Duration,
    /// How long a handshake may take.
    pub connect_timeout: Duration,
    /// How long D waits for P's data after allocating.
    pub decode_deadline: Duration,
    /// How long P keeps a registration whose prefill has not finished, without renewal.
    pub registration_ttl: Duration,
    /// How long a posted write may stay in flight before it is abandoned.
    pub write_timeout: Duration,
    /// How long after abandoning a write the transport has to confirm it.
    pub abandon_timeout: Duration,
    /// The longest a posted write can stay in flight whatever P does: NIXL cannot stop a
    /// transfer once posted (abandoning it is refused, invalidating the peer leaves its bytes
    /// landing: `tcp_in_progress_semantics` in `actors/tests/nixl_transport.rs`), so every fence
    /// that frees blocks a write
    /// may target waits at least this long. An assumption about the fabric, not a timeout P
    /// enforces; the simulator ends every write within it.
    pub max_write_life: Duration,
    /// The longest a control message can travel before it is delivered or lost. A fence must
    /// also outlast a registration still on its way to P.
    pub max_message_delay: Duration,
    /// How often D repeats a registration that nothing answered yet (no write landed): a lost
    /// `Register` would otherwise leave the request waiting until its deadline.
    pub register_retry_interval: Duration,
    /// How many times D repeats a registration.
    pub max_register_retries: u32,
    /// How often D repeats an unanswered cancel.
    pub cancel_retry_interval: Duration,
    /// How many times D repeats an unanswered cancel.
    pub max_cancel_retries: u32,
    /// How long after a cancel, or after declaring P dead, D frees its blocks without any proof
    /// (the fence). Must exceed the longest P may still start a write after D's last renewal
    /// (`registration_ttl` plus a heartbeat, plus `max_message_delay` for a registration on its
    /// way) plus the longest a posted write can stay in flight (`max_write_life`).
    pub quarantine: Duration,
    /// How long ended keys are remembered to swallow late messages.
    pub tombstone_ttl: Duration,
    /// Most live requests per side (D requests; P requests).
    pub max_requests: usize,
    /// Most registrations P keeps waiting for their prefill.
    pub max_pending_registrations: usize,
    /// Most ended keys remembered per side.
    pub max_tombstones: usize,
    /// Most peers known at once.
    pub max_peers: usize,
    /// Most messages queued for a peer whose handshake is in progress.
    pub max_queued_per_peer: usize,
    /// Most blocks one read covers (single-group imports): a failed read then loses only its
    /// own blocks, and the engine recomputes from the first one that did not arrive.
    pub read_chunk_blocks: u32,
    /// How P pairs its blocks with the ones D registered (see [`BlockPairing`]).
    pub block_pairing: BlockPairing,
    /// Integrity digests of written blocks (off by default): P digests what it writes, D
    /// checks what landed and fails a mismatching write (see [`crate::integrity`]). Both sides
    /// must agree: the setting is part of the compatibility hash.
    pub integrity_digest: bool,
}

/// How P pairs its finished blocks with the blocks D registered before it writes, and a
/// reader its blocks with the ones the holder granted.
///
/// ```
/// use kvhandoff_protocol::machine::{BlockPairing, Config};
/// assert_eq!(Config::default().block_pairing, BlockPairing::TailAligned);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BlockPairing {
    /// Both sides count blocks of the same size (the same logical block on P and D): P
    /// writes its last blocks, as many per group as D registered (D caches the prefix of the
    /// rest), and refuses (`PlanMismatch`) a registration with more blocks than it holds.
    #[default]
    TailAligned,
    /// The sides' blocks differ in size (a heterogeneous pair): the counts say nothing about
    /// each other, so P hands its whole list and D's to the transfer route, whose plan of the
    /// pair aligns them by tokens. P still refuses a registration whose group count differs
    /// from its own, or with no blocks. A reader likewise reads both whole lists in one read
    /// (no tail alignment, no chunks), and fails a grant whose group count differs
    /// (`PlanMismatch`).
    AsGiven,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            lease_duration: Duration::from_secs(30),
            lease_extension: Duration::from_secs(20),
            heartbeat_interval: Duration::from_secs(2),
            peer_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            decode_deadline: Duration::from_secs(120),
            registration_ttl: Duration::from_secs(120),
            write_timeout: Duration::from_secs(10),
            abandon_timeout: Duration::from_secs(5),
            max_write_life: Duration::from_secs(60),
            max_message_delay: Duration::from_secs(10),
            register_retry_interval: Duration::from_secs(5),
            max_register_retries: 3,
            cancel_retry_interval: Duration::from_secs(1),
            max_cancel_retries: 5,
            quarantine: Duration::from_secs(200),
            tombstone_ttl: Duration::from_secs(60),
            max_requests: 1 << 16,
            max_pending_registrations: 1 << 16,
            max_tombstones: 1 << 17,
            max_peers: 1024,
            max_queued_per_peer: 1024,
            read_chunk_blocks: 64,
            block_pairing: BlockPairing::TailAligned,
            integrity_digest: false,
        }
    }
}

/// A configuration that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A duration or bound that must be positive is zero.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// A duration or count beyond what the endpoint accepts ([`Config::MAX_DURATION`],
    /// [`Config::MAX_RETRIES`]).
    #[error("{0} is beyond its limit")]
    TooLarge(&'static str),
    /// Two settings contradict each other.
    #[error("{0}")]
    Contradiction(&'static str),
}

impl Config {
    /// The longest any duration of a configuration may be (30 days). Sums of a few of them —
    /// the fences — then stay far from `Duration`'s range, so no rule below can overflow.
    pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

    /// The most retries of a registration or a cancel a configuration may ask for.
    pub const MAX_RETRIES: u32 = 1_000;

    /// Checks that every value is positive and within its limit, and that the settings agree
    /// with each other. Never panics, whatever the values.
    ///
    /// # Errors
    /// The first broken rule.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let durations = [
            ("lease_duration", self.lease_duration),
            ("lease_extension", self.lease_extension),
            ("heartbeat_interval", self.heartbeat_interval),
            ("peer_timeout", self.peer_timeout),
            ("connect_timeout", self.connect_timeout),
            ("decode_deadline", self.decode_deadline),
            ("registration_ttl", self.registration_ttl),
            ("write_timeout", self.write_timeout),
            ("abandon_timeout", self.abandon_timeout),
            ("max_write_life", self.max_write_life),
            ("max_message_delay", self.max_message_delay),
            ("register_retry_interval", self.register_retry_interval),
            ("cancel_retry_interval", self.cancel_retry_interval),
            ("quarantine", self.quarantine),
            ("tombstone_ttl", self.tombstone_ttl),
        ];
        for (name, value) in durations {
            if value.is_zero() {
                return Err(ConfigError::Zero(name));
            }
            if value > Self::MAX_DURATION {
                return Err(ConfigError::TooLarge(name));
            }
        }
        let retries = [
            ("max_register_retries", self.max_register_retries),
            ("max_cancel_retries", self.max_cancel_retries),
        ];
        for (name, value) in retries {
            if value > Self::MAX_RETRIES {
                return Err(ConfigError::TooLarge(name));
            }
        }
        let bounds = [
            ("max_requests", self.max_requests),
            ("max_pending_registrations", self.max_pending_registrations),
            ("max_tombstones", self.max_tombstones),
            ("max_peers", self.max_peers),
            ("max_queued_per_peer", self.max_queued_per_peer),
            ("read_chunk_blocks", self.read_chunk_blocks as usize),
        ];
        for (name, value) in bounds {
            if value == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.peer_timeout <= self.heartbeat_interval {
            return Err(ConfigError::Contradiction(
                "peer_timeout must exceed heartbeat_interval, or a live peer is declared dead",
            ));
        }
        if self.lease_extension > self.lease_duration {
            return Err(ConfigError::Contradiction(
                "lease_extension must not exceed lease_duration",
            ));
        }
        if self.lease_extension <= self.heartbeat_interval {
            return Err(ConfigError::Contradiction(
                "lease_extension must exceed heartbeat_interval, or leases lapse between heartbeats",
            ));
        }
        if self.max_write_life < self.write_timeout + self.abandon_timeout {
            return Err(ConfigError::Contradiction(
                "max_write_life must cover write_timeout + abandon_timeout: P gives up on a write \
                 before the fabric can be assumed to have ended it",
            ));
        }
        if self.quarantine <= self.fence_floor() {
            return Err(ConfigError::Contradiction(
                "quarantine must exceed registration_ttl + heartbeat_interval + max_message_delay + \
                 peer_timeout + max_write_life (the latest a write can land after D's last \
                 renewal)",
            ));
        }
        if self.tombstone_ttl < self.tombstone_min_life() {
            return Err(ConfigError::Contradiction(
                "tombstone_ttl must cover max_register_retries * register_retry_interval + \
                 register_retry_interval / 4 + max_message_delay + peer_timeout, or a late registration copy outlives the \
                 epoch floor",
            ));
        }
        if self.tombstone_ttl < self.peer_timeout {
            return Err(ConfigError::Contradiction(
                "tombstone_ttl must cover at least peer_timeout, or late messages look new",
            ));
        }
        Ok(())
    }

    /// The longest between a message's send and its handling that no check of the receiver
    /// notices: `max_message_delay` on the way, and then up to `peer_timeout` in the queue of a
    /// receiver that was stopped (SIGSTOP, a VM pause, a GC pause) with it queued. A receiver
    /// stopped longer finds the sender past its liveness deadline and handles the message as
    /// from a dead peer (`Endpoint::heard`); one stopped less cannot tell a message that waited
    /// in its queue from a fresh one, so every bound on when a message can still act counts
    /// this delay, not `max_message_delay` alone. Found by the simulator's swarm: with a peer
    /// timeout past the quarantine, a stopped P matched a registration D had freed by its
    /// quarantine (`sim/tests/regressions.rs`).
    pub fn max_handling_delay(&self) -> Duration {
        self.max_message_delay + self.peer_timeout
    }

    /// The latest a write for a lease can land after D's last renewal of it: P may still match a
    /// registration until `registration_ttl` after the renewal (plus a heartbeat of slack, plus
    /// a registration still travelling or waiting in a stopped P's queue:
    /// [`Config::max_handling_delay`]), and the write it posts may stay in flight for
    /// `max_write_life`. `quarantine` must exceed it.
    pub fn fence_floor(&self) -> Duration {
        self.registration_ttl
            + self.heartbeat_interval
            + self.max_handling_delay()
            + self.max_write_life
    }

    /// The longest a process may be stopped (SIGSTOP, a VM pause, a GC pause) while it has a
    /// write in flight without a time-based free (`DeadPeerFence`, `Quarantine`) handing out
    /// blocks the write can still land in: `quarantine − fence_floor`. Measured on NIXL over
    /// UCX (`actors/tests/nixl_stall.rs`): a stopped poster's transfer moves again on its resume,
    /// however long the stop, and nothing the target can do stops it; so the quarantine must
    /// exceed the fence floor by the longest stop a deployment allows. A deployment requirement
    /// the endpoint cannot enforce: it counts every stop it sees past it
    /// (`Counters::stalls_past_allowance`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvhandoff_protocol::machine::Config;
    /// assert_eq!(Config::default().stall_allowance(), Duration::from_secs(5));
    /// ```
    pub fn stall_allowance(&self) -> Duration {
        self.quarantine.saturating_sub(self.fence_floor())
    }

    /// How long a copy of a registration can still arrive after P settled its attempt: D
    /// repeats a registration for at most `max_register_retries × register_retry_interval`
    /// (plus [`Config::register_resend_grace`]) after sending it (P cannot settle an attempt before its registration arrived), and every
    /// copy is handled within [`Config::max_handling_delay`]. P's tombstone of an attempt (its
    /// epoch floor) is never evicted younger than this; `tombstone_ttl` must cover it.
    pub fn tombstone_min_life(&self) -> Duration {
        self.register_retry_interval * self.max_register_retries
            + self.register_resend_grace()
            + self.max_handling_delay()
    }

    /// How late after its time D may still send a registration's resend: a quarter of
    /// `register_retry_interval`, room for a timer that fires late on a loaded host. A resend
    /// later than that (a stall of D's process) is skipped, so that every copy leaves within
    /// `max_register_retries × register_retry_interval` and this grace of the first send.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvhandoff_protocol::machine::Config;
    /// assert_eq!(Config::default().register_resend_grace(), Duration::from_millis(1250));
    /// ```
    pub fn register_resend_grace(&self) -> Duration {
        self.register_retry_interval / 4
    }

    /// How soon a reader asks again when the holder answered its first asks that it exports
    /// nothing under the key: a tenth of `register_retry_interval`. An engine may hand the
    /// router its answer before its rank has the export (vLLM's scheduler answers, and its
    /// worker hands the blocks to the rank at its next step), so such an answer soon after
    /// the first ask may only mean "not yet".
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvhandoff_protocol::machine::Config;
    /// assert_eq!(Config::default().ask_again_after(), Duration::from_millis(500));
    /// ```
    pub fn ask_again_after(&self) -> Duration {
        self.register_retry_interval / 10
    }

    /// A configuration with short deadlines for tests and demos: heartbeats every 100 ms.
    pub fn fast() -> Config {
        let ms = Duration::from_millis;
        Config {
            lease_duration: ms(3_000),
            lease_extension: ms(2_000),
            heartbeat_interval: ms(100),
            peer_timeout: ms(150),
            connect_timeout: ms(500),
            decode_deadline: ms(5_000),
            registration_ttl: ms(5_000),
            write_timeout: ms(1_000),
            abandon_timeout: ms(500),
            max_write_life: ms(2_000),
            max_message_delay: ms(1_000),
            register_retry_interval: ms(500),
            max_register_retries: 3,
            cancel_retry_interval: ms(100),
            max_cancel_retries: 5,
            quarantine: ms(8_500),
            tombstone_ttl: ms(5_000),
            ..Config::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_fast_are_valid() {
        Config::default().validate().unwrap();
        Config::fast().validate().unwrap();
    }

    /// Found by the simulator's swarm (a timing profile with the peer timeout past D's deadline
    /// plus its quarantine, seed 7049 of `kvhandoff sim --seeds 7000..7300 --requests 40` as
    /// the swarm first drew it): P, stopped for 17.9 s with D's `Register` queued, was not
    /// overdue to itself (peer timeout 18.6 s), matched the registration on its resume and
    /// wrote into blocks D had freed by its quarantine at 15.3 s. A message can wait a peer
    /// timeout in a stopped receiver's queue unnoticed, so the fence floor counts it, and such
    /// a configuration is refused.
    #[test]
    fn the_fence_floor_counts_a_message_waiting_in_a_stopped_queue() {
        let fast = Config::fast();
        assert_eq!(
            fast.fence_floor(),
            fast.registration_ttl
                + fast.heartbeat_interval
                + fast.max_message_delay
                + fast.peer_timeout
                + fast.max_write_life
        );
        let swarmed = Config {
            heartbeat_interval: Duration::from_secs(1),
            peer_timeout: Duration::from_millis(18_600),
            tombstone_ttl: Duration::from_secs(30),
            ..Config::fast()
        };
        assert!(swarmed.quarantine < swarmed.decode_deadline + swarmed.peer_timeout);
        assert!(matches!(
            swarmed.validate(),
            Err(ConfigError::Contradiction(m)) if m.starts_with("quarantine must exceed")
        ));
        let fixed = Config {
            quarantine: swarmed.fence_floor() + swarmed.heartbeat_interval,
            ..swarmed
        };
        fixed.validate().unwrap();
        assert!(
            fixed.quarantine > fixed.peer_timeout,
            "a stall the peer timeout lets pass never outlasts the quarantine"
        );
    }

    #[test]
    fn zero_and_contradictions_are_refused() {
        let c = Config {
            lease_duration: Duration::ZERO,
            ..Config::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::Zero("lease_duration")));

        let c = Config {
            max_peers: 0,
            ..Config::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::Zero("max_peers")));

        let mut c = Config::default();
        c.peer_timeout = c.heartbeat_interval;
        assert!(matches!(c.validate(), Err(ConfigError::Contradiction(_))));

        let mut c = Config::default();
        c.quarantine = c.write_timeout;
        assert!(matches!(c.validate(), Err(ConfigError::Contradiction(_))));

        let mut c = Config::default();
        c.lease_extension = c.lease_duration + Duration::from_secs(1);
        assert!(matches!(c.validate(), Err(ConfigError::Contradiction(_))));
    }

    /// Durations near `Duration::MAX` once made the fence arithmetic overflow (a panic inside
    /// `validate`); now each is refused by name, before any sum.
    #[test]
    fn huge_values_are_refused_without_a_panic() {
        let c = Config {
            max_write_life: Duration::MAX,
            max_message_delay: Duration::MAX,
            quarantine: Duration::MAX,
            ..Config::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::TooLarge("max_write_life")));
        let c = Config {
            register_retry_interval: Config::MAX_DURATION,
            max_register_retries: u32::MAX,
            ..Config::default()
        };
        assert_eq!(
            c.validate(),
            Err(ConfigError::TooLarge("max_register_retries"))
        );
        // Every duration at its limit: the rules are judged, nothing overflows.
        let at_limit = Config {
            lease_duration: Config::MAX_DURATION,
            lease_extension: Config::MAX_DURATION,
            heartbeat_interval: Config::MAX_DURATION,
            peer_timeout: Config::MAX_DURATION,
            connect_timeout: Config::MAX_DURATION,
            decode_deadline: Config::MAX_DURATION,
            registration_ttl: Config::MAX_DURATION,
            write_timeout: Config::MAX_DURATION,
            abandon_timeout: Config::MAX_DURATION,
            max_write_life: Config::MAX_DURATION,
            max_message_delay: Config::MAX_DURATION,
            register_retry_interval: Config::MAX_DURATION,
            max_register_retries: Config::MAX_RETRIES,
            cancel_retry_interval: Config::MAX_DURATION,
            max_cancel_retries: Config::MAX_RETRIES,
            quarantine: Config::MAX_DURATION,
            tombstone_ttl: Config::MAX_DURATION,
            ..Config::default()
        };
        assert!(matches!(
            at_limit.validate(),
            Err(ConfigError::Contradiction(_))
        ));
    }
}
