//! D's table: the live request of every pairing key, its engine id, and a record of every key's
//! recently ended epoch. The component beside P's [`PrefillTable`](super::prefill_table::PrefillTable);
//! the endpoint adds what needs the peers (connecting, sending, failing requests bound to a
//! peer that died).

use std::collections::BTreeMap;

use crate::{EngineId, Epoch, PairingKey, RequestId};

use super::decode::{DecodeCommon, DecodeCtx, DecodeEnded, DecodeInput, DecodeRequest};
use super::effects::{Outbox, Step};
use super::prefill_table::{assert_old_record_to_evict, young_cutoff};
use super::shape::Machine;
use super::tables::{Machines, Tombstones};
use super::types::{DecodeStart, FreeProof, Rejected, Time};
use super::{ActiveMutation, Config, Mutation};

/// The live D requests of one rank and the records of ended ones.
#[derive(Debug)]
pub(crate) struct DecodeTable {
    requests: Machines<PairingKey, DecodeRequest>,
    by_request: BTreeMap<RequestId, PairingKey>,
    /// The epoch each recently ended key ended at.
    tombstones: Tombstones<PairingKey, Epoch>,
}

impl DecodeTable {
    pub(crate) fn new(config: &Config) -> Self {
        DecodeTable {
            requests: Machines::default(),
            by_request: BTreeMap::new(),
            tombstones: Tombstones::new(config.max_tombstones),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub(crate) fn key_of(&self, request: &RequestId) -> Option<&PairingKey> {
        self.by_request.get(request)
    }

    pub(crate) fn get(&self, key: &PairingKey) -> Option<&DecodeRequest> {
        self.requests.get(key)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &PairingKey> {
        self.requests.keys()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&PairingKey, &DecodeRequest)> {
        self.requests.iter()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &DecodeRequest> {
        self.requests.values()
    }

    /// Whether `key` ended recently (its late messages are `Late`, not `UnknownKey`).
    pub(crate) fn ended_recently(&self, key: &PairingKey) -> bool {
        self.tombstones.get(key).is_some()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    pub(crate) fn tombstones_evicted(&self) -> u64 {
        self.tombstones.evicted()
    }

    /// The earliest timer of any request or record.
    pub(crate) fn next_timer(&self) -> Option<Time> {
        [self.requests.next_timer(), self.tombstones.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Forgets expired records and returns the keys whose request timers are due.
    pub(crate) fn take_due(&mut self, now: Time) -> Vec<PairingKey> {
        let due = self.requests.take_due(now);
        self.tombstones.expire(now);
        due
    }

    /// Checks `start` against the table's rules (`duplicate_elsewhere`: the id is live on P's
    /// side) and returns it with its epoch lifted past the key's ended attempt, if any. A
    /// refusal changes nothing.
    pub(crate) fn admit(
        &mut self,
        now: Time,
        start: DecodeStart,
        duplicate_elsewhere: bool,
        own: &EngineId,
        config: &Config,
        mutation: ActiveMutation,
    ) -> Result<DecodeStart, Rejected> {
        if self.by_request.contains_key(&start.request) || duplicate_elsewhere {
            return Err(Rejected::DuplicateRequest(start.request));
        }
        if self.requests.contains_key(&start.key) {
            return Err(Rejected::DuplicateKey(start.key));
        }
        if self.requests.len() >= config.max_requests {
            return Err(Rejected::TableFull {
                table: "decode requests",
                limit: config.max_requests,
            });
        }
        if start.expected_writes == 0 {
            return Err(Rejected::Invalid("expected_writes must be at least 1"));
        }
        if !start.epoch.is_valid() {
            return Err(Rejected::EpochOutOfRange(start.epoch));
        }
        start.blocks.validate().map_err(Rejected::BlockList)?;
        if start.prefill.engine == *own {
            return Err(Rejected::Invalid("the prefill peer is this engine"));
        }
        let young = self.tombstones.written_after(young_cutoff(now, config));
        if self.requests.len() + young >= config.max_tombstones
            && !mutation.is(Mutation::EvictYoungTombstones)
        {
            // Every live D request leaves a record of its ended epoch, which a new attempt at
            // the key must get past (see below); a young one is never evicted, so the request
            // waits until older records have aged.
            return Err(Rejected::TableFull {
                table: "decode tombstones (young)",
                limit: config.max_tombstones,
            });
        }
        let mut start = start;
        if let Some(&ended) = self.tombstones.get(&start.key) {
            // A new attempt at a recently ended key must not be confused with the old one's
            // late messages.
            let next = ended.next().ok_or(Rejected::EpochOutOfRange(ended))?;
            self.tombstones.remove(&start.key);
            start.epoch = start.epoch.max(next);
        }
        Ok(start)
    }

    /// Adds the admitted request of `common`.
    pub(crate) fn insert(&mut self, common: DecodeCommon, config: &Config) {
        let key = common.key.clone();
        self.by_request.insert(common.request.clone(), key.clone());
        self.requests
            .insert(key, DecodeRequest::new(common), config);
    }

    /// Remembers that `key` ended at `epoch`, so that a new attempt at the key starts above it
    /// (and late messages of the old one are told apart). Admission kept room: a full table
    /// evicts an old record, never a young one.
    pub(crate) fn remember(
        &mut self,
        now: Time,
        key: PairingKey,
        epoch: Epoch,
        config: &Config,
        mutation: ActiveMutation,
    ) {
        if !mutation.is(Mutation::EvictYoungTombstones) {
            assert_old_record_to_evict(&mut self.tombstones, now, &key, config);
        }
        self.tombstones
            .insert(key, epoch, now + config.tombstone_ttl);
    }

    /// Runs one input through the request of `key`; a request that ended leaves the table (its
    /// epoch recorded, its fence counted) and is returned for the endpoint to report.
    pub(crate) fn step(
        &mut self,
        ctx: &DecodeCtx<'_>,
        key: &PairingKey,
        input: DecodeInput,
        fx: &mut Outbox,
    ) -> Option<DecodeEnded> {
        let span = tracing::debug_span!(
            "decode",
            key = %key,
            rank = ctx.own.rank,
            epoch = tracing::field::Empty,
            trace_id = tracing::field::Empty
        );
        // Entered over the filing too, so the request's end is recorded in its span.
        let _entered = span.enter();
        let transition = |request: DecodeRequest| {
            let common = request.common();
            super::spans::record_attempt(&span, Some(common.epoch), Some(common.trace));
            match request.handle(ctx, input, &mut *fx) {
                Step::Live(next) => (Some(next), None),
                Step::Ended(ended) => (None, Some(ended)),
            }
        };
        let ended = self.requests.step(key, ctx.config, transition).flatten()?;
        let common = &ended.common;
        tracing::debug!(
            key = %common.key, epoch = %common.epoch, outcome = ?ended.outcome,
            proof = ?ended.proof, "decode request ended"
        );
        self.by_request.remove(&common.request);
        self.remember(
            ctx.now,
            common.key.clone(),
            common.epoch,
            ctx.config,
            ctx.mutation,
        );
        match ended.proof {
            FreeProof::Quarantine => fx.counters.quarantine_frees += 1,
            FreeProof::DeadPeerFence => fx.counters.fence_frees += 1,
            FreeProof::NeverExposed
            | FreeProof::WritesCompleted
            | FreeProof::CancelAcknowledged
            | FreeProof::PeerQuiesced => {}
        }
        Some(ended)
    }

    /// Asserts the table's own invariants; the endpoint checks those that involve the peers.
    pub(crate) fn check_invariants(&self, config: &Config) {
        assert!(self.requests.len() <= config.max_requests);
        assert_eq!(self.requests.len(), self.by_request.len());
        assert!(self.requests.all_armed(), "every D request has a timer");
        for (key, request) in self.requests.iter() {
            let common = request.common();
            assert_eq!(&common.key, key);
            assert_eq!(self.by_request.get(&common.request), Some(key));
            assert!(
                self.tombstones.get(key).is_none(),
                "a live key is not tombstoned"
            );
        }
    }
}
