//! The `Reading` state of an import: the grant came and the reads are posted; the request
//! waits for every chunk's end (or the deadline) before it says what landed and lets the
//! holder go.

use super::{
    DropReason, ImportCtx, ImportEnded, ImportFailure, ImportInput, ImportOutcome, ImportRequest,
    ImportStep, Mutation, Outbox, Output, Reading, ReleaseReason, Step,
};

impl Reading {
    pub(super) fn handle(
        mut self,
        ctx: &ImportCtx<'_>,
        input: ImportInput,
        fx: &mut Outbox,
    ) -> ImportStep {
        match input {
            ImportInput::ReadDone { read }
                if ctx.now > self.trusted_until
                    && self.pending.contains_key(&read)
                    && !ctx.mutation.is(Mutation::TrustLateReads) =>
            {
                // Reported after the fabric's bound: only a stall of this process explains it,
                // and the holder's fence may have handed the blocks to another request before
                // the bytes were read. Its blocks count as not arrived.
                fx.counters.late_reads_distrusted += 1;
                if let Some(first) = self.pending.remove(&read) {
                    let lowest = self.first_failed_block.map_or(first, |f| f.min(first));
                    self.first_failed_block = Some(lowest);
                    self.failure.get_or_insert(ImportFailure::LateRead);
                }
            }
            ImportInput::ReadDone { read } => {
                if self.pending.remove(&read).is_none() {
                    fx.drop_input(DropReason::UnknownWrite);
                } else if ctx.mutation.is(Mutation::ReleaseBeforeReadsEnd) {
                    // The deliberate bug: one completion taken for all.
                    self.pending.clear();
                }
            }
            ImportInput::ReadFailed { read } => match self.pending.remove(&read) {
                Some(first) => {
                    fx.counters.reads_failed += 1;
                    let lowest = self.first_failed_block.map_or(first, |f| f.min(first));
                    self.first_failed_block = Some(lowest);
                }
                None => fx.drop_input(DropReason::UnknownWrite),
            },
            ImportInput::PeerDead => {
                // Its reads end on their own (a read from a dead agent fails): wait for them.
                self.failure.get_or_insert(ImportFailure::PeerDead);
            }
            ImportInput::Abort => {
                self.failure = Some(ImportFailure::Aborted);
            }
            ImportInput::Shutdown => {
                self.failure = Some(ImportFailure::Shutdown);
            }
            ImportInput::Timeout
                if ctx.now >= self.reads_end_by
                    && ctx.mutation.is(Mutation::ReturnBlocksAtReadBound) =>
            {
                // The deliberate bug: trusts the fabric's bound on a read whatever happened to
                // this process, so a read frozen by a stall lands in blocks handed back.
                if let Some(&first) = self.pending.values().min() {
                    let lowest = self.first_failed_block.map_or(first, |f| f.min(first));
                    self.first_failed_block = Some(lowest);
                    self.failure.get_or_insert(ImportFailure::Deadline);
                }
                self.pending.clear();
            }
            ImportInput::Timeout if ctx.now >= self.reads_end_by && !self.abandoned => {
                // Past the fabric's bound every read of a running process has ended; one not
                // reported yet was frozen by a stall of this process (measured: it moves again
                // on the resume), or its report is lost. Whatever arrives now is not trusted;
                // the blocks wait for the transport to say each read is over.
                if let Some(&first) = self.pending.values().min() {
                    let lowest = self.first_failed_block.map_or(first, |f| f.min(first));
                    self.first_failed_block = Some(lowest);
                    self.failure.get_or_insert(ImportFailure::Deadline);
                }
                for &read in self.pending.keys() {
                    fx.emit(Output::AbandonWrite { write: read });
                    fx.counters.reads_abandoned += 1;
                }
                self.abandoned = true;
                self.reads_end_by = ctx.now + ctx.config.abandon_timeout;
            }
            ImportInput::Timeout if ctx.now >= self.reads_end_by => {
                // The transport has not confirmed the abandons: the reads may still land. The
                // blocks stay with the import until it reports them (no deadline frees them,
                // as none frees a write's source blocks on P).
                fx.counters.stuck_reads += 1;
                tracing::warn!(key = %self.common.key, epoch = %self.common.epoch,
                    pending = self.pending.len(), "abandoned reads not confirmed; the blocks stay held");
                self.reads_end_by = ctx.now + ctx.config.max_write_life;
            }
            ImportInput::Timeout | ImportInput::PeerConnected | ImportInput::PeerConnectFailed => {}
            // The answer to a copy of the ask, after the grant in force (which stands): counted.
            ImportInput::Refused { .. } => fx.drop_input(DropReason::Unexpected),
            ImportInput::Grant { .. } => fx.drop_input(DropReason::Duplicate),
        }
        if self.pending.is_empty() {
            return self.finish();
        }
        Step::Live(ImportRequest::Reading(self))
    }

    /// Every read has ended: release the holder's blocks and say what arrived.
    fn finish(self) -> ImportStep {
        let Reading {
            common,
            first_failed_block,
            failure,
            ..
        } = self;
        let (outcome, release) = match (first_failed_block, failure) {
            (None, None) => (ImportOutcome::Loaded, ReleaseReason::ReadDone),
            (Some(first), failure) => {
                let failure = failure.unwrap_or(ImportFailure::ReadFailed);
                let valid = first as u64 * u64::from(common.block_tokens);
                (common.outcome_of(failure, valid), ReleaseReason::ReadFailed)
            }
            (None, Some(failure @ (ImportFailure::Aborted | ImportFailure::Shutdown))) => {
                // Every block arrived, but the engine gave up on the request meanwhile.
                (ImportOutcome::Failed(failure), ReleaseReason::Aborted)
            }
            // Every read completed: the bytes are in our blocks, whatever befell the holder
            // after.
            (None, Some(_)) => (ImportOutcome::Loaded, ReleaseReason::ReadDone),
        };
        let release = match failure {
            // A dead holder needs no release (and a restarted one never granted this).
            Some(ImportFailure::PeerDead) => None,
            _ => Some(release),
        };
        Step::Ended(ImportEnded {
            common,
            outcome,
            release,
            read: true,
        })
    }
}
