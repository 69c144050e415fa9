//! The read path's two tables, components of the endpoint beside D's and P's: the exports this
//! rank holds for remote readers, and the imports it reads from remote exports. The endpoint
//! adds what needs the peers (connecting, sending, the imports bound to a peer that died).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

use crate::{EngineId, Epoch, PairingKey, ReadRefusal, RequestId, WriteId};

use super::effects::{Outbox, Step};
use super::export::{ExportCommon, ExportCtx, ExportEnded, ExportInput, ExportRequest};
use super::import::{ImportCommon, ImportCtx, ImportEnded, ImportInput, ImportRequest};
use super::prefill_table::{assert_old_record_to_evict, young_cutoff};
use super::read_types::{ExportEnd, ExportOutcome, ExportStart, ImportStart, FIRST_READ_ID};
use super::shape::Machine;
use super::tables::{Machines, Tombstones};
use super::types::{Rejected, Time};
use super::Config;

/// The exports of one rank and what a late reader hears about ended ones.
#[derive(Debug)]
pub(crate) struct ExportTable {
    exports: Machines<PairingKey, ExportRequest>,
    by_request: BTreeMap<RequestId, PairingKey>,
    /// Why each recently ended export can no longer be read.
    ended: Tombstones<PairingKey, ReadRefusal>,
}

impl ExportTable {
    pub(crate) fn new(config: &Config) -> Self {
        ExportTable {
            exports: Machines::default(),
            by_request: BTreeMap::new(),
            ended: Tombstones::new(config.max_tombstones),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.exports.len()
    }

    pub(crate) fn contains(&self, key: &PairingKey) -> bool {
        self.exports.contains_key(key)
    }

    pub(crate) fn has_request(&self, request: &RequestId) -> bool {
        self.by_request.contains_key(request)
    }

    pub(crate) fn key_of(&self, request: &RequestId) -> Option<&PairingKey> {
        self.by_request.get(request)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &PairingKey> {
        self.exports.keys()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.ended.len()
    }

    /// What a reader asking for `key`, which has no live export, is told.
    pub(crate) fn refusal_for(&self, key: &PairingKey) -> ReadRefusal {
        self.ended
            .get(key)
            .copied()
            .unwrap_or(ReadRefusal::Unavailable)
    }

    pub(crate) fn next_timer(&self) -> Option<Time> {
        [self.exports.next_timer(), self.ended.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    pub(crate) fn take_due(&mut self, now: Time) -> Vec<PairingKey> {
        let due = self.exports.take_due(now);
        self.ended.expire(now);
        due
    }

    /// Checks `start` against the table's rules (`duplicate_elsewhere`: the id is live in
    /// another table) and adds it. An export of no blocks is admitted but not kept: the caller
    /// reports it ended. A refusal changes nothing.
    pub(crate) fn admit(
        &mut self,
        now: Time,
        start: ExportStart,
        duplicate_elsewhere: bool,
        config: &Config,
    ) -> Result<Option<ExportCommon>, Rejected> {
        if self.by_request.contains_key(&start.request) || duplicate_elsewhere {
            return Err(Rejected::DuplicateRequest(start.request));
        }
        if self.exports.contains_key(&start.key) {
            return Err(Rejected::DuplicateKey(start.key));
        }
        if self.exports.len() >= config.max_requests {
            return Err(Rejected::TableFull {
                table: "exports",
                limit: config.max_requests,
            });
        }
        if start.lease.is_zero() {
            return Err(Rejected::Invalid("an export's lease must be positive"));
        }
        if start.lease > crate::machine::MAX_EXPORT_LEASE {
            return Err(Rejected::TooLong {
                what: "an export's lease",
                given: start.lease,
                max: crate::machine::MAX_EXPORT_LEASE,
            });
        }
        start.blocks.validate().map_err(Rejected::BlockList)?;
        let lease = start.lease;
        let common = ExportCommon::from_start(start, now, config);
        if common.blocks.is_empty() {
            return Ok(Some(common));
        }
        let key = common.key.clone();
        self.ended.remove(&key);
        self.by_request.insert(common.request.clone(), key.clone());
        let lease_until = now + lease;
        self.exports
            .insert(key, ExportRequest::new(common, lease_until), config);
        Ok(None)
    }

    /// Runs one input through the export of `key`; one that ended leaves the table.
    pub(crate) fn step(
        &mut self,
        ctx: &ExportCtx<'_>,
        key: &PairingKey,
        input: ExportInput,
        fx: &mut Outbox,
    ) -> Option<ExportEnded> {
        let span = tracing::debug_span!(
            "export",
            key = %key,
            rank = ctx.own.rank,
            epoch = tracing::field::Empty,
            trace_id = tracing::field::Empty
        );
        let _entered = span.enter();
        let transition = |export: ExportRequest| {
            // An ask names the attempt it binds; otherwise the one granted, if any.
            let attempt = match &input {
                ExportInput::Ask { epoch, trace, .. } => Some((*epoch, *trace)),
                _ => export.granted_attempt(),
            };
            super::spans::record_attempt(&span, attempt.map(|a| a.0), attempt.map(|a| a.1));
            match export.handle(ctx, input, &mut *fx) {
                Step::Live(next) => (Some(next), None),
                Step::Ended(ended) => (None, Some(ended)),
            }
        };
        let ended = self.exports.step(key, ctx.config, transition).flatten()?;
        tracing::debug!(key = %key, outcome = ?ended.outcome, proof = ?ended.proof, "export ended");
        self.by_request.remove(&ended.common.request);
        let refusal = match ended.outcome {
            ExportOutcome::Released(ExportEnd::LeaseExpired | ExportEnd::GrantFenced) => {
                ReadRefusal::Expired
            }
            ExportOutcome::Released(ExportEnd::Aborted) => ReadRefusal::Aborted,
            ExportOutcome::Read | ExportOutcome::Released(_) => ReadRefusal::Unavailable,
        };
        // A late ask only learns a reason from this record: evicting a young one is harmless.
        self.ended
            .insert(key.clone(), refusal, ctx.now + ctx.config.tombstone_ttl);
        Some(ended)
    }

    pub(crate) fn check_invariants(&self, config: &Config) {
        assert!(self.exports.len() <= config.max_requests);
        assert_eq!(self.exports.len(), self.by_request.len());
        assert!(self.exports.all_armed(), "every export has a timer");
        for (key, export) in self.exports.iter() {
            assert_eq!(&export.common().key, key);
            assert_eq!(self.by_request.get(&export.common().request), Some(key));
        }
    }
}

/// What [`ImportTable::step`] runs a transition with (the table adds its read-id counter).
pub(crate) struct ImportStepAt<'a> {
    pub(crate) now: Time,
    pub(crate) own: &'a crate::PeerAddr,
    pub(crate) config: &'a Config,
    pub(crate) mutation: super::ActiveMutation,
}

/// The imports of one rank, their reads, and the epoch each recently ended key ended at.
#[derive(Debug)]
pub(crate) struct ImportTable {
    imports: Machines<PairingKey, ImportRequest>,
    by_request: BTreeMap<RequestId, PairingKey>,
    by_read: BTreeMap<WriteId, PairingKey>,
    next_read: Cell<u64>,
    ended: Tombstones<PairingKey, Epoch>,
}

impl ImportTable {
    pub(crate) fn new(config: &Config) -> Self {
        ImportTable {
            imports: Machines::default(),
            by_request: BTreeMap::new(),
            by_read: BTreeMap::new(),
            next_read: Cell::new(FIRST_READ_ID),
            ended: Tombstones::new(config.max_tombstones),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.imports.len()
    }

    pub(crate) fn reads_in_flight(&self) -> usize {
        self.by_read.len()
    }

    pub(crate) fn has_request(&self, request: &RequestId) -> bool {
        self.by_request.contains_key(request)
    }

    pub(crate) fn key_of(&self, request: &RequestId) -> Option<&PairingKey> {
        self.by_request.get(request)
    }

    pub(crate) fn key_of_read(&self, read: WriteId) -> Option<&PairingKey> {
        self.by_read.get(&read)
    }

    pub(crate) fn get(&self, key: &PairingKey) -> Option<&ImportRequest> {
        self.imports.get(key)
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &PairingKey> {
        self.imports.keys()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&PairingKey, &ImportRequest)> {
        self.imports.iter()
    }

    pub(crate) fn tombstones(&self) -> usize {
        self.ended.len()
    }

    pub(crate) fn next_timer(&self) -> Option<Time> {
        [self.imports.next_timer(), self.ended.next_expiry()]
            .into_iter()
            .flatten()
            .min()
    }

    pub(crate) fn take_due(&mut self, now: Time) -> Vec<PairingKey> {
        let due = self.imports.take_due(now);
        self.ended.expire(now);
        due
    }

    /// Checks `start` and returns it with its epoch lifted past the key's ended attempt (so a
    /// late grant or refusal of that attempt is never taken for this one's). A refusal changes
    /// nothing.
    pub(crate) fn admit(
        &mut self,
        now: Time,
        start: ImportStart,
        duplicate_elsewhere: bool,
        own: &EngineId,
        config: &Config,
    ) -> Result<ImportStart, Rejected> {
        if self.by_request.contains_key(&start.request) || duplicate_elsewhere {
            return Err(Rejected::DuplicateRequest(start.request));
        }
        if self.imports.contains_key(&start.key) {
            return Err(Rejected::DuplicateKey(start.key));
        }
        if self.imports.len() >= config.max_requests {
            return Err(Rejected::TableFull {
                table: "imports",
                limit: config.max_requests,
            });
        }
        if !start.epoch.is_valid() {
            return Err(Rejected::EpochOutOfRange(start.epoch));
        }
        if start.block_tokens == 0 {
            return Err(Rejected::Invalid("block_tokens must be at least 1"));
        }
        start.blocks.validate().map_err(Rejected::BlockList)?;
        start
            .remote_blocks
            .validate()
            .map_err(Rejected::BlockList)?;
        if start.holder.engine == *own {
            return Err(Rejected::Invalid("the holder is this engine"));
        }
        let young = self.ended.written_after(young_cutoff(now, config));
        if self.imports.len() + young >= config.max_tombstones {
            return Err(Rejected::TableFull {
                table: "import tombstones (young)",
                limit: config.max_tombstones,
            });
        }
        let mut start = start;
        if let Some(&ended) = self.ended.get(&start.key) {
            let next = ended.next().ok_or(Rejected::EpochOutOfRange(ended))?;
            self.ended.remove(&start.key);
            start.epoch = start.epoch.max(next);
        }
        Ok(start)
    }

    pub(crate) fn insert(&mut self, common: ImportCommon, config: &Config) {
        let key = common.key.clone();
        self.by_request.insert(common.request.clone(), key.clone());
        self.imports.insert(key, ImportRequest::new(common), config);
    }

    /// Remembers that `key` ended at `epoch` (admission kept room for the record).
    pub(crate) fn remember(&mut self, now: Time, key: PairingKey, epoch: Epoch, config: &Config) {
        assert_old_record_to_evict(&mut self.ended, now, &key, config);
        self.ended.insert(key, epoch, now + config.tombstone_ttl);
    }

    /// Runs one input through the import of `key`, keeping the read index in step; one that
    /// ended leaves the table (its epoch recorded).
    pub(crate) fn step(
        &mut self,
        at: ImportStepAt<'_>,
        key: &PairingKey,
        input: ImportInput,
        fx: &mut Outbox,
    ) -> Option<ImportEnded> {
        let ImportStepAt {
            now,
            own,
            config,
            mutation,
        } = at;
        let before: BTreeSet<WriteId> = self
            .imports
            .get(key)
            .map(|i| i.pending_reads().copied().collect())
            .unwrap_or_default();
        let ctx = ImportCtx {
            now,
            own,
            config,
            next_read: &self.next_read,
            mutation,
        };
        let span = tracing::debug_span!(
            "import",
            key = %key,
            rank = own.rank,
            epoch = tracing::field::Empty,
            trace_id = tracing::field::Empty
        );
        let _entered = span.enter();
        let transition = |import: ImportRequest| {
            let common = import.common();
            super::spans::record_attempt(&span, Some(common.epoch), Some(common.trace));
            match import.handle(&ctx, input, &mut *fx) {
                Step::Live(next) => {
                    let after: BTreeSet<WriteId> = next.pending_reads().copied().collect();
                    (Some(next), (after, None))
                }
                Step::Ended(ended) => (None, (BTreeSet::new(), Some(ended))),
            }
        };
        let (after, ended) = self.imports.step(key, config, transition)?;
        for gone in before.difference(&after) {
            self.by_read.remove(gone);
        }
        for new in after.difference(&before) {
            self.by_read.insert(*new, key.clone());
        }
        let ended = ended?;
        let common = &ended.common;
        tracing::debug!(key = %key, epoch = %common.epoch, outcome = ?ended.outcome, "import ended");
        self.by_request.remove(&common.request);
        self.remember(now, key.clone(), common.epoch, config);
        Some(ended)
    }

    pub(crate) fn check_invariants(&self, config: &Config) {
        assert!(self.imports.len() <= config.max_requests);
        assert_eq!(self.imports.len(), self.by_request.len());
        assert!(self.imports.all_armed(), "every import has a timer");
        let mut reads = 0;
        for (key, import) in self.imports.iter() {
            assert_eq!(&import.common().key, key);
            for read in import.pending_reads() {
                assert_eq!(self.by_read.get(read), Some(key), "every read is indexed");
                reads += 1;
            }
            assert!(
                self.ended.get(key).is_none(),
                "a live key is not tombstoned"
            );
        }
        assert_eq!(
            reads,
            self.by_read.len(),
            "no read is indexed twice or left over"
        );
    }
}
