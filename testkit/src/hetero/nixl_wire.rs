//! [`NixlWire`]: the executor's transfers as real NIXL WRITEs between agents over UCX.
//!
//! Every arena gets its own agent (named after the arena) with one registered host buffer, a
//! mirror of the arena: before the WRITEs each arena's bytes are copied into its mirror, after
//! them every destination mirror is copied back. The bytes of a transfer therefore cross UCX
//! between two agents, while the executor keeps plain `Vec<u8>` arenas it can transform and
//! check. Destination arenas are mirrored too, so a stray WRITE outside the request's blocks
//! survives the copy back and the verifier sees it.

use std::collections::BTreeSet;
use std::thread;
use std::time::{Duration, Instant};

use kvhandoff_actors::transport::nixl::{nixl_runtime_available, NixlConfig};
use nixl_sys::{AgentConfig, MemType, XferDescList, XferOp, XferStatus};

use crate::nixl_agent::{connect, nixl_error, RawAgent, RawAgentError};

use super::wire::{check_bounds, Arena, Transfer, Wire, WireError};

/// How long one [`Wire::write_all`] may wait for its WRITEs and notifications.
pub const NIXL_WIRE_TIMEOUT: Duration = Duration::from_secs(20);

/// Real NIXL between one agent per arena (loopback UCX). Agents are created on the first
/// [`Wire::write_all`] and live as long as the wire.
pub struct NixlWire {
    prefix: String,
    config: AgentConfig,
    agents: Vec<RawAgent>,
    connected: BTreeSet<(usize, usize)>,
    calls: u64,
    /// Pieces moved (descriptors posted), over every call.
    pub pieces: u64,
    /// Bytes moved, over every call.
    pub bytes: u64,
}

impl std::fmt::Debug for NixlWire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlWire")
            .field("prefix", &self.prefix)
            .field("agents", &self.agents.len())
            .field("calls", &self.calls)
            .finish()
    }
}

impl From<RawAgentError> for WireError {
    fn from(e: RawAgentError) -> Self {
        WireError::Transport(e.to_string())
    }
}

impl NixlWire {
    /// A wire whose agents are named `"{prefix}-{arena name}"` (agent names must be unique in
    /// the process while they live).
    ///
    /// # Errors
    /// [`WireError::Transport`] when the NIXL runtime cannot be loaded.
    pub fn new(prefix: &str) -> Result<Self, WireError> {
        nixl_runtime_available().map_err(|e| WireError::Transport(e.to_string()))?;
        let nixl = NixlConfig::default();
        Ok(NixlWire {
            prefix: prefix.to_string(),
            config: AgentConfig {
                enable_prog_thread: nixl.progress_thread,
                pthr_delay_us: nixl.pthr_delay_us,
                ..AgentConfig::default()
            },
            agents: Vec::new(),
            connected: BTreeSet::new(),
            calls: 0,
            pieces: 0,
            bytes: 0,
        })
    }

    fn ensure_agents(&mut self, arenas: &[Arena]) -> Result<(), WireError> {
        if !self.agents.is_empty() {
            let same = self.agents.len() == arenas.len()
                && self
                    .agents
                    .iter()
                    .zip(arenas)
                    .all(|(agent, arena)| agent.regions[0].len == arena.bytes.len() as u64);
            return if same {
                Ok(())
            } else {
                Err(WireError::Transport(
                    "the arenas changed since this wire registered them".into(),
                ))
            };
        }
        for (index, arena) in arenas.iter().enumerate() {
            let name = format!("{}-{index}-{}", self.prefix, arena.name.replace(' ', "-"));
            // A zero-length arena still gets an agent (one byte), so indices stay aligned.
            let len = (arena.bytes.len() as u64).max(1);
            self.agents
                .push(RawAgent::new(&name, &self.config, &[(len, 1)])?);
        }
        Ok(())
    }

    fn ensure_connected(&mut self, src: usize, dst: usize) -> Result<(), WireError> {
        let pair = (src.min(dst), src.max(dst));
        if self.connected.insert(pair) {
            connect(&self.agents[pair.0], &self.agents[pair.1])?;
        }
        Ok(())
    }
}

impl Wire for NixlWire {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn write_all(&mut self, arenas: &mut [Arena], transfers: &[Transfer]) -> Result<(), WireError> {
        check_bounds(arenas, transfers)?;
        self.ensure_agents(arenas)?;
        for t in transfers {
            self.ensure_connected(t.src, t.dst)?;
        }
        // Mirror every arena a transfer touches (sources: what to send; destinations: what a
        // stray WRITE would overwrite).
        let touched: BTreeSet<usize> = transfers.iter().flat_map(|t| [t.src, t.dst]).collect();
        for &index in &touched {
            self.agents[index].buffers[0]
                .write(0, &arenas[index].bytes)
                .map_err(|e| WireError::Transport(e.to_string()))?;
        }
        self.calls += 1;
        let started = Instant::now();
        let mut pending = Vec::new();
        for (index, t) in transfers.iter().enumerate() {
            if t.pieces.is_empty() {
                continue;
            }
            let (dst_name, dst_base) = {
                let dst = &self.agents[t.dst];
                (dst.name.clone(), dst.regions[0].base)
            };
            let src = &mut self.agents[t.src];
            let mut local = XferDescList::new(MemType::Dram).map_err(nixl_error("desc list"))?;
            let mut remote = XferDescList::new(MemType::Dram).map_err(nixl_error("desc list"))?;
            for p in &t.pieces {
                // In bounds of both mirrors (checked above; mirrors are the arenas' sizes).
                local.add_desc(
                    (src.regions[0].base + p.src_offset) as usize,
                    p.len as usize,
                    0,
                );
                remote.add_desc((dst_base + p.dst_offset) as usize, p.len as usize, 0);
                self.pieces += 1;
                self.bytes += p.len;
            }
            let note = format!("hetero-{}-{index}", self.calls).into_bytes();
            src.args
                .set_has_notification(true)
                .map_err(nixl_error("opt args"))?;
            src.args
                .set_notification_message(&note)
                .map_err(nixl_error("opt args"))?;
            let req = src
                .agent
                .create_xfer_req(XferOp::Write, &local, &remote, &dst_name, Some(&src.args))
                .map_err(nixl_error("create_xfer_req"))?;
            let in_progress = src
                .agent
                .post_xfer_req(&req, None)
                .map_err(nixl_error("post_xfer_req"))?;
            pending.push((t.src, t.dst, req, !in_progress, note));
        }
        // Wait for every WRITE's completion at its source and its notification at its target.
        let mut notes: BTreeSet<Vec<u8>> = BTreeSet::new();
        loop {
            let mut all_done = true;
            for (src, dst, req, done, note) in &mut pending {
                if !*done {
                    *done = matches!(
                        self.agents[*src]
                            .agent
                            .get_xfer_status(req)
                            .map_err(nixl_error("get_xfer_status"))?,
                        XferStatus::Success
                    );
                }
                if !notes.contains(note.as_slice()) {
                    for (_, bytes) in self.agents[*dst].drain_notifications()? {
                        notes.insert(bytes);
                    }
                }
                all_done &= *done && notes.contains(note.as_slice());
            }
            if all_done {
                break;
            }
            if started.elapsed() > NIXL_WIRE_TIMEOUT {
                return Err(WireError::Transport(format!(
                    "{} WRITEs not complete and notified after {NIXL_WIRE_TIMEOUT:?}",
                    pending.len()
                )));
            }
            thread::yield_now();
        }
        drop(pending);
        for t in transfers {
            let mirror = &self.agents[t.dst].buffers[0];
            mirror
                .read(0, &mut arenas[t.dst].bytes)
                .map_err(|e| WireError::Transport(e.to_string()))?;
        }
        Ok(())
    }
}
