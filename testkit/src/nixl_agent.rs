//! One bare `nixl_sys` agent with a UCX backend and its own registered host memory: the
//! raw-NIXL reference of `bench transfer` and the NIXL wire of the heterogeneous executor
//! ([`crate::hetero::wire`]). No kvhandoff code runs between two of these agents.

use kvhandoff_actors::transport::nixl::HostBuffer;
use kvhandoff_protocol::RegionDesc;
use nixl_sys::{
    Agent, AgentConfig, Backend, NixlError, NotificationMap, OptArgs, RegistrationHandle,
};

/// A NIXL call that failed, with what was being done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {why}")]
pub struct RawAgentError {
    /// The call.
    pub what: String,
    /// NIXL's (or the allocator's) message.
    pub why: String,
}

pub(crate) fn nixl_error(what: &str) -> impl Fn(NixlError) -> RawAgentError + '_ {
    move |e| RawAgentError {
        what: what.to_string(),
        why: e.to_string(),
    }
}

/// One raw agent with its memory. Fields drop in order: registrations, arguments, backend,
/// agent, and the memory last (after the agent and its UCX workers are gone).
pub struct RawAgent {
    /// The registrations of [`RawAgent::buffers`] (dropping them deregisters).
    pub handles: Vec<RegistrationHandle>,
    /// The agent's optional arguments (its backend).
    pub args: OptArgs,
    notifs: NotificationMap,
    _backend: Backend,
    /// The NIXL agent.
    pub agent: Agent,
    /// The host memory it registered.
    pub buffers: Vec<HostBuffer>,
    /// Where each buffer lies.
    pub regions: Vec<RegionDesc>,
    /// The agent's name.
    pub name: String,
}

impl RawAgent {
    /// Creates agent `name` and registers one zeroed host buffer per `(len, num_blocks)`.
    ///
    /// # Errors
    /// [`RawAgentError`] naming the NIXL call that failed (the UCX plugin not found included:
    /// `source scripts/nixl-env.sh`).
    pub fn new(
        name: &str,
        config: &AgentConfig,
        region_lens: &[(u64, u32)],
    ) -> Result<Self, RawAgentError> {
        let agent = Agent::new_configured(name, config).map_err(nixl_error("create agent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl_error(
            "UCX plugin parameters (is NIXL_PLUGIN_DIR set? source scripts/nixl-env.sh)",
        ))?;
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(nixl_error("create UCX backend"))?;
        let mut args = OptArgs::new().map_err(nixl_error("opt args"))?;
        args.add_backend(&backend)
            .map_err(nixl_error("opt args: backend"))?;
        let mut side = RawAgent {
            handles: Vec::new(),
            args,
            notifs: NotificationMap::new().map_err(nixl_error("notification map"))?,
            _backend: backend,
            agent,
            buffers: Vec::new(),
            regions: Vec::new(),
            name: name.to_string(),
        };
        for &(len, num_blocks) in region_lens {
            let buffer = HostBuffer::new(len).map_err(|e| RawAgentError {
                what: "allocate host buffer".into(),
                why: e.to_string(),
            })?;
            let handle = side
                .agent
                .register_memory(&buffer, Some(&side.args))
                .map_err(nixl_error("register_memory"))?;
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

    /// Every notification that arrived since the last call, as `(sender, bytes)`.
    ///
    /// # Errors
    /// [`RawAgentError`] if NIXL fails.
    pub fn drain_notifications(&mut self) -> Result<Vec<(String, Vec<u8>)>, RawAgentError> {
        self.agent
            .get_notifications(&mut self.notifs, None)
            .map_err(nixl_error("get_notifications"))?;
        if self.notifs.is_empty().unwrap_or(true) {
            return Ok(Vec::new());
        }
        let senders: Vec<String> = self
            .notifs
            .agents()
            .filter_map(|a| a.ok().map(str::to_owned))
            .collect();
        let mut all = Vec::new();
        for sender in senders {
            let count = self.notifs.get_notifications_size(&sender).unwrap_or(0);
            for index in 0..count {
                if let Ok(bytes) = self.notifs.get_notification_bytes(&sender, index) {
                    all.push((sender.clone(), bytes.to_vec()));
                }
            }
        }
        // NIXL appends to the map; start a fresh one (as `NixlTransport` does).
        self.notifs = NotificationMap::new().map_err(nixl_error("notification map"))?;
        Ok(all)
    }

    /// Polls for notifications; true when one equal to `expected` arrived (others are dropped).
    ///
    /// # Errors
    /// [`RawAgentError`] if NIXL fails.
    pub fn received(&mut self, expected: &[u8]) -> Result<bool, RawAgentError> {
        Ok(self
            .drain_notifications()?
            .iter()
            .any(|(_, bytes)| bytes == expected))
    }
}

/// Loads each agent's metadata into the other, so either can write to the other.
///
/// # Errors
/// [`RawAgentError`] if NIXL refuses.
pub fn connect(a: &RawAgent, b: &RawAgent) -> Result<(), RawAgentError> {
    let md_a = a.agent.get_local_md().map_err(nixl_error("get_local_md"))?;
    let md_b = b.agent.get_local_md().map_err(nixl_error("get_local_md"))?;
    b.agent
        .load_remote_md(&md_a)
        .map_err(nixl_error("load_remote_md"))?;
    a.agent
        .load_remote_md(&md_b)
        .map_err(nixl_error("load_remote_md"))?;
    Ok(())
}
