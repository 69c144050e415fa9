//! The raw-NIXL reference: two `nixl_sys` agents moving the same bytes with no kvhandoff in
//! between.

use super::*;

pub(super) use kvhandoff_testkit::nixl_agent::{connect, RawAgent as RawSide};

impl From<kvhandoff_testkit::nixl_agent::RawAgentError> for TransferBenchError {
    fn from(e: kvhandoff_testkit::nixl_agent::RawAgentError) -> Self {
        TransferBenchError::Nixl(e.to_string())
    }
}

/// The byte view of a raw agent's buffers, for stamping and checking.
pub(super) fn byte_regions(side: &RawSide) -> Vec<&dyn RegionBytes> {
    side.buffers.iter().map(|b| b as &dyn RegionBytes).collect()
}

pub(super) struct RawSample {
    pub(super) build_us: f64,
    pub(super) post_us: f64,
    pub(super) complete_us: f64,
    pub(super) total_us: f64,
    pub(super) done_in_post: bool,
}

pub(super) struct RawPair {
    pub(super) p: RawSide,
    pub(super) d: RawSide,
}

impl RawPair {
    pub(super) fn new(
        config: &AgentConfig,
        specs: &[RegionSpec],
        pool_blocks: u32,
        prefix: &str,
    ) -> Result<Self, TransferBenchError> {
        let lens: Vec<(u64, u32)> = specs
            .iter()
            .map(|s| (s.block_len * u64::from(pool_blocks), pool_blocks))
            .collect();
        let p = RawSide::new(&format!("{prefix}-prefill"), config, &lens)?;
        let d = RawSide::new(&format!("{prefix}-decode"), config, &lens)?;
        connect(&p, &d)?;
        Ok(RawPair { p, d })
    }

    /// One WRITE of `descriptors` from P to D with notification `note`; waits for P's
    /// completion and D's notification, polling both (so it also works without a progress
    /// thread), and checks the stamps.
    pub(super) fn once(
        &mut self,
        descriptors: &[Descriptor],
        note: &[u8],
        block_bytes: u64,
        tables: (&[u32], &[u32]),
        timeout: Duration,
    ) -> Result<RawSample, TransferBenchError> {
        clear(&byte_regions(&self.d), block_bytes, tables.1).map_err(run_error)?;
        let sample = self.write(descriptors, note, timeout)?;
        check("raw NIXL", &byte_regions(&self.d), block_bytes, tables).map_err(run_error)?;
        Ok(sample)
    }

    pub(super) fn write(
        &mut self,
        descriptors: &[Descriptor],
        note: &[u8],
        timeout: Duration,
    ) -> Result<RawSample, TransferBenchError> {
        let start = Instant::now();
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        for d in descriptors {
            local.add_desc(d.local_addr as usize, d.len as usize, 0);
            remote.add_desc(d.remote_addr as usize, d.len as usize, 0);
        }
        self.p
            .args
            .set_has_notification(true)
            .map_err(nixl("opt args"))?;
        self.p
            .args
            .set_notification_message(note)
            .map_err(nixl("opt args"))?;
        let built = Instant::now();
        let req = self
            .p
            .agent
            .create_xfer_req(
                XferOp::Write,
                &local,
                &remote,
                &self.d.name,
                Some(&self.p.args),
            )
            .map_err(nixl("create_xfer_req"))?;
        let in_progress = self
            .p
            .agent
            .post_xfer_req(&req, None)
            .map_err(nixl("post_xfer_req"))?;
        let posted = Instant::now();
        let mut complete = (!in_progress).then_some(posted);
        let mut notified = None;
        let deadline = start + timeout;
        while complete.is_none() || notified.is_none() {
            if complete.is_none() {
                match self
                    .p
                    .agent
                    .get_xfer_status(&req)
                    .map_err(nixl("get_xfer_status"))?
                {
                    XferStatus::Success => complete = Some(Instant::now()),
                    XferStatus::InProgress => {}
                }
            }
            if notified.is_none() && self.d.received(note)? {
                notified = Some(Instant::now());
            }
            if Instant::now() > deadline {
                return Err(run_error(format!(
                    "raw WRITE of {} descriptors: no completion/notification in {timeout:?}",
                    descriptors.len()
                )));
            }
            thread::yield_now();
        }
        drop(req);
        let (complete, notified) = (complete.unwrap_or(posted), notified.unwrap_or(posted));
        Ok(RawSample {
            build_us: us(built - start),
            post_us: us(posted - built),
            complete_us: us(complete - start),
            total_us: us(notified - start),
            done_in_post: !in_progress,
        })
    }
}
