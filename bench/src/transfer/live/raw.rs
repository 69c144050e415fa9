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

/// Block-granular lists of both raw agents' regions, prepared once (`prepare_xfer_dlist`) on
/// P's agent, as [`NixlTransport`](kvhandoff_actors::transport::nixl::NixlTransport) prepares
/// them: entry `i * num_blocks + b` is block `b` of region `i`.
pub(super) struct PreparedRaw {
    local: XferDlistHandle,
    remote: XferDlistHandle,
    /// Each side's region indices by base address, for the lookup.
    local_order: Vec<usize>,
    remote_order: Vec<usize>,
}

/// The indices of `regions`, sorted by base.
fn by_base(regions: &[RegionDesc]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_by_key(|&i| regions[i].base);
    order
}

/// What it costs to create the request of one post, without posting it (µs, one sample).
pub(super) struct CreateSample {
    /// Two `XferDescList`s + `create_xfer_req` (the dynamic path).
    pub(super) create_us: f64,
    /// Block indices + `make_xfer_req` on the prepared lists.
    pub(super) make_us: f64,
    /// Block indices of the prepared request (a descriptor of `k` blocks is `k` entries).
    pub(super) entries: usize,
}

pub(super) struct RawPair {
    /// Declared first: released before the agents.
    pub(super) prepared: Option<PreparedRaw>,
    pub(super) p: RawSide,
    pub(super) d: RawSide,
}

/// The block indices of `descriptors` in a table prepared from `regions`, a descriptor of `k`
/// whole blocks giving `k` entries; `None` if one is not made of whole blocks.
fn block_indices(
    regions: &[RegionDesc],
    order: &[usize],
    descriptors: &[Descriptor],
    addr: impl Fn(&Descriptor) -> u64,
    out: &mut Vec<i32>,
) -> Option<()> {
    out.clear();
    // A binary search per descriptor, as the transport's lookup.
    for d in descriptors {
        let a = addr(d);
        let at = order
            .partition_point(|&i| regions[i].base <= a)
            .checked_sub(1)?;
        let i = order[at];
        let r = &regions[i];
        if a >= r.base + r.len {
            return None;
        }
        let offset = a - r.base;
        if offset % r.block_len != 0 || d.len % r.block_len != 0 {
            return None;
        }
        let first = i as u64 * u64::from(r.num_blocks) + offset / r.block_len;
        for b in first..first + d.len / r.block_len {
            out.push(i32::try_from(b).ok()?);
        }
    }
    Some(())
}

impl RawPair {
    /// P's WRITE request from `local` to D's `remote`, with P's optional arguments.
    fn create_write(
        &self,
        local: &XferDescList,
        remote: &XferDescList,
    ) -> Result<nixl_sys::XferRequest, TransferBenchError> {
        self.p
            .agent
            .create_xfer_req(
                XferOp::Write,
                local,
                remote,
                &self.d.name,
                Some(&self.p.args),
            )
            .map_err(nixl("create_xfer_req"))
    }

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
        let list = |side: &RawSide| -> Result<XferDescList, TransferBenchError> {
            let mut list = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
            for r in &side.regions {
                for b in 0..u64::from(r.num_blocks) {
                    list.add_desc((r.base + b * r.block_len) as usize, r.block_len as usize, 0);
                }
            }
            Ok(list)
        };
        let (local, remote) = (list(&p)?, list(&d)?);
        let prepared = PreparedRaw {
            // "": NIXL_INIT_AGENT, the initiator's own side.
            local: p
                .agent
                .prepare_xfer_dlist("", &local, Some(&p.args))
                .map_err(nixl("prepare_xfer_dlist (local)"))?,
            remote: p
                .agent
                .prepare_xfer_dlist(&d.name, &remote, Some(&p.args))
                .map_err(nixl("prepare_xfer_dlist (remote)"))?,
            local_order: by_base(&p.regions),
            remote_order: by_base(&d.regions),
        };
        Ok(RawPair {
            prepared: Some(prepared),
            p,
            d,
        })
    }

    /// Creates (and releases, unposted) the request of `descriptors` both ways: dynamic lists +
    /// `create_xfer_req`, and block indices + `make_xfer_req` on the prepared lists.
    pub(super) fn create_only(
        &mut self,
        descriptors: &[Descriptor],
        note: &[u8],
    ) -> Result<CreateSample, TransferBenchError> {
        let args = &mut self.p.args;
        args.set_has_notification(true).map_err(nixl("opt args"))?;
        args.set_notification_message(note)
            .map_err(nixl("opt args"))?;
        let start = Instant::now();
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(nixl("descriptor list"))?;
        for d in descriptors {
            local.add_desc(d.local_addr as usize, d.len as usize, 0);
            remote.add_desc(d.remote_addr as usize, d.len as usize, 0);
        }
        let req = self.create_write(&local, &remote)?;
        let created = Instant::now();
        drop(req);
        let prepared = self
            .prepared
            .as_ref()
            .ok_or_else(|| run_error("no prepared lists"))?;
        let start_make = Instant::now();
        let (mut local_idx, mut remote_idx) = (Vec::new(), Vec::new());
        block_indices(
            &self.p.regions,
            &prepared.local_order,
            descriptors,
            |d| d.local_addr,
            &mut local_idx,
        )
        .zip(block_indices(
            &self.d.regions,
            &prepared.remote_order,
            descriptors,
            |d| d.remote_addr,
            &mut remote_idx,
        ))
        .ok_or_else(|| run_error("descriptors not made of whole blocks"))?;
        let req = self
            .p
            .agent
            .make_xfer_req(
                XferOp::Write,
                &prepared.local,
                &local_idx,
                &prepared.remote,
                &remote_idx,
                Some(&self.p.args),
            )
            .map_err(nixl("make_xfer_req"))?;
        let made = Instant::now();
        drop(req);
        Ok(CreateSample {
            create_us: us(created - start),
            make_us: us(made - start_make),
            entries: local_idx.len(),
        })
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
        let req = self.create_write(&local, &remote)?;
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
