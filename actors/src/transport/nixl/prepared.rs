//! Prepared block lists: one block-granular NIXL descriptor list per region table, prepared once
//! (`prepare_xfer_dlist`) and used by index (`make_xfer_req`); see "Coalesced dynamic lists vs
//! prepared block lists" in the module documentation of `nixl`.

use kvhandoff_protocol::RegionDesc;
use nixl_sys::{MemType, XferDescList, XferDlistHandle};

use super::{backend_error, NixlTransport, TransportError, Unshared};
use kvhandoff_protocol::PeerAddr;

/// Most entries one prepared list may have (NIXL indexes them with `i32`). A larger table is
/// refused and its posts take the dynamic path.
pub const MAX_PREPARED_BLOCKS: u64 = 1 << 24;

/// NIXL's `NIXL_INIT_AGENT`: the agent name under which the initiator prepares its own (local
/// side) lists. The C++ constant is the empty string; Python's `"NIXL_INIT_AGENT"` is mapped to
/// it by the Python layer only, so the C API needs `""`.
const NIXL_INIT_AGENT: &str = "";

/// One region of a prepared table.
#[derive(Debug, Clone, Copy)]
struct Span {
    base: u64,
    num_blocks: u64,
    block_len: u64,
    /// Index of the region's block 0 in the prepared list.
    first: u64,
}

/// A region table prepared as one list, entry `first(region) + block` being `block_len` bytes at
/// `base + block * block_len`.
pub(super) struct PreparedBlocks {
    handle: Unshared<XferDlistHandle>,
    /// The table's regions with at least one block, sorted by base.
    spans: Vec<Span>,
}

impl PreparedBlocks {
    /// The entry holding exactly `[addr, addr + len)`, if it is one block of a prepared region.
    pub(super) fn index(&self, addr: u64, len: u64) -> Option<i32> {
        let at = self
            .spans
            .partition_point(|s| s.base <= addr)
            .checked_sub(1)?;
        let s = &self.spans[at];
        let offset = addr - s.base;
        if len != s.block_len || offset % s.block_len != 0 || offset / s.block_len >= s.num_blocks {
            return None;
        }
        i32::try_from(s.first + offset / s.block_len).ok()
    }

    pub(super) fn handle(&self) -> &XferDlistHandle {
        &self.handle.0
    }
}

impl NixlTransport {
    /// Prepares `regions` for `peer` (`None`: this agent); see [`super::Transport::prepare_blocks`].
    pub(super) fn prepare_table(
        &mut self,
        peer: Option<&PeerAddr>,
        regions: &[RegionDesc],
    ) -> Result<(), TransportError> {
        let agent = peer.map(|p| self.loaded_agent(p)).transpose()?;
        // Whatever happens, an older list for the same table is stale.
        match peer {
            Some(p) => {
                self.peer_blocks.remove(p);
            }
            None => self.local_blocks = None,
        }
        if !self.config.prepared_lists {
            // Every post takes the dynamic path ([`super::NixlConfig::prepared_lists`]).
            return Ok(());
        }
        let bad = |why: String| TransportError::Backend {
            reason: format!("cannot prepare region table: {why}"),
        };
        let mut spans = Vec::with_capacity(regions.len());
        let mut total = 0u64;
        for (i, r) in regions.iter().enumerate() {
            if r.num_blocks == 0 {
                continue;
            }
            let blocks_end = u64::from(r.num_blocks)
                .checked_mul(r.block_len)
                .and_then(|bytes| r.base.checked_add(bytes));
            if r.block_len == 0
                || blocks_end.is_none()
                || u64::from(r.num_blocks) * r.block_len > r.len
                || usize::try_from(blocks_end.unwrap_or(u64::MAX)).is_err()
            {
                return Err(bad(format!("region {i} has an inconsistent block layout")));
            }
            spans.push(Span {
                base: r.base,
                num_blocks: u64::from(r.num_blocks),
                block_len: r.block_len,
                first: total,
            });
            total += u64::from(r.num_blocks);
            if total > MAX_PREPARED_BLOCKS {
                return Err(bad(format!(
                    "more than {MAX_PREPARED_BLOCKS} blocks in the table"
                )));
            }
        }
        if spans.is_empty() {
            return Err(bad("no blocks in the table".to_owned()));
        }
        let mut list = XferDescList::new(MemType::Dram)
            .map_err(|e| backend_error("prepared descriptor list", e))?;
        for s in &spans {
            for block in 0..s.num_blocks {
                list.add_desc(
                    (s.base + block * s.block_len) as usize,
                    s.block_len as usize,
                    0,
                );
            }
        }
        spans.sort_by_key(|s| s.base);
        let name = agent.as_ref().map_or(NIXL_INIT_AGENT, |a| a.as_str());
        let handle = self
            .agent
            .prepare_xfer_dlist(name, &list, Some(&self.reg_args.0))
            .map_err(|e| backend_error("prepare_xfer_dlist", e))?;
        let prepared = PreparedBlocks {
            handle: Unshared(handle),
            spans,
        };
        match peer {
            Some(p) => {
                self.peer_blocks.insert(p.clone(), prepared);
            }
            None => self.local_blocks = Some(prepared),
        }
        Ok(())
    }

    /// Posts that went through prepared block lists (`make_xfer_req`).
    pub fn prepared_posts(&self) -> u64 {
        self.prepared_posts
    }

    /// Posts that built their own descriptor lists (`create_xfer_req`).
    pub fn dynamic_posts(&self) -> u64 {
        self.dynamic_posts
    }

    /// Whether a prepared block list is held for `peer` (`None`: for this agent).
    pub fn has_prepared_blocks(&self, peer: Option<&PeerAddr>) -> bool {
        match peer {
            Some(p) => self.peer_blocks.contains_key(p),
            None => self.local_blocks.is_some(),
        }
    }
}
