//! The raw-NIXL reference: two `nixl_sys` agents moving the same bytes with no kvhandoff in
//! between.

use super::*;

/// One raw agent with its memory. Fields drop in order: registrations, arguments, backend,
/// agent, and the memory last (after the agent and its UCX workers are gone).
pub(super) struct RawSide {
    pub(super) handles: Vec<RegistrationHandle>,
    pub(super) args: OptArgs,
    pub(super) notifs: NotificationMap,
    pub(super) _backend: Backend,
    pub(super) agent: Agent,
    pub(super) buffers: Vec<HostBuffer>,
    pub(super) regions: Vec<RegionDesc>,
    pub(super) name: String,
}

impl RawSide {
    pub(super) fn new(
        name: &str,
        config: &AgentConfig,
        region_lens: &[(u64, u32)],
    ) -> Result<Self, TransferBenchError> {
        let agent = Agent::new_configured(name, config).map_err(nixl("create agent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl(
            "UCX plugin parameters (is NIXL_PLUGIN_DIR set? source scripts/nixl-env.sh)",
        ))?;
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(nixl("create UCX backend"))?;
        let mut args = OptArgs::new().map_err(nixl("opt args"))?;
        args.add_backend(&backend)
            .map_err(nixl("opt args: backend"))?;
        let mut side = RawSide {
            handles: Vec::new(),
            args,
            notifs: NotificationMap::new().map_err(nixl("notification map"))?,
            _backend: backend,
            agent,
            buffers: Vec::new(),
            regions: Vec::new(),
            name: name.to_string(),
        };
        for &(len, num_blocks) in region_lens {
            let buffer =
                HostBuffer::new(len).map_err(|e| TransferBenchError::Nixl(e.to_string()))?;
            let handle = side
                .agent
                .register_memory(&buffer, Some(&side.args))
                .map_err(nixl("register_memory"))?;
            side.regions.push(RegionDesc {
                base: buffer.base(),
                len,
                num_blocks,
                block_len: len / u64::from(num_blocks.max(1)),
            });
            side.handles.push(handle);
            side.buffers.push(buffer);
        }
        Ok(side)
    }

    pub(super) fn byte_regions(&self) -> Vec<&dyn RegionBytes> {
        self.buffers.iter().map(|b| b as &dyn RegionBytes).collect()
    }

    pub(super) fn stamp(&self, block_bytes: u64, blocks: &[u32]) -> Result<(), TransferBenchError> {
        stamp(&self.byte_regions(), block_bytes, blocks)
    }

    /// Polls for notifications; true when one equal to `expected` arrived.
    pub(super) fn received(&mut self, expected: &[u8]) -> Result<bool, TransferBenchError> {
        self.agent
            .get_notifications(&mut self.notifs, None)
            .map_err(nixl("get_notifications"))?;
        if self.notifs.is_empty().unwrap_or(true) {
            return Ok(false);
        }
        let mut found = false;
        let senders: Vec<String> = self
            .notifs
            .agents()
            .filter_map(|a| a.ok().map(str::to_owned))
            .collect();
        for sender in senders {
            let count = self.notifs.get_notifications_size(&sender).unwrap_or(0);
            for index in 0..count {
                if let Ok(bytes) = self.notifs.get_notification_bytes(&sender, index) {
                    found |= bytes == expected;
                }
            }
        }
        // NIXL appends to the map; start a fresh one (as `NixlTransport` does).
        self.notifs = NotificationMap::new().map_err(nixl("notification map"))?;
        Ok(found)
    }
}

pub(super) fn connect(a: &RawSide, b: &RawSide) -> Result<(), TransferBenchError> {
    let md_a = a.agent.get_local_md().map_err(nixl("get_local_md"))?;
    let md_b = b.agent.get_local_md().map_err(nixl("get_local_md"))?;
    b.agent
        .load_remote_md(&md_a)
        .map_err(nixl("load_remote_md"))?;
    a.agent
        .load_remote_md(&md_b)
        .map_err(nixl("load_remote_md"))?;
    Ok(())
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
        clear(&self.d.byte_regions(), block_bytes, tables.1)?;
        let sample = self.write(descriptors, note, timeout)?;
        check("raw NIXL", &self.d.byte_regions(), block_bytes, tables)?;
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
