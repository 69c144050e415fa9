//! The ghost ledger: per-block ownership, pins and written-ness of every simulated block,
//! plus the LIFO block allocator of each engine rank and its real bytes.
//!
//! The ledger lives only in the simulator. It never trusts the machines: it learns what each
//! block holds from what the simulated engines allocate and free and from what the simulated
//! NIXL reads and lands, and checks the safety properties against that.

use kvhandoff_protocol::machine::FreeProof;

/// Bytes per simulated block.
pub const BLOCK_BYTES: usize = 64;

/// Bytes a freshly allocated or freed block holds (so that a missing write, or a read of freed
/// blocks, is visible in the bytes, not just in the ledger).
pub const POISON: u8 = 0xEE;

/// Who holds a block: the request index, the attempt's epoch (D) or attempt number (P).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Owner {
    /// Index of the request in the world.
    pub request: usize,
    /// D: the epoch of the lease; P: the prefill attempt.
    pub epoch: u64,
}

/// What the ledger knows about one block.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct BlockState {
    /// The lease holder, if leased.
    pub owner: Option<Owner>,
    /// A write of the owner's (key, epoch) landed completely in this lease.
    pub written: bool,
    /// Posted, not yet terminal transfers that reference the block.
    pub pins: u32,
}

/// One rank's memory, allocator and ledger.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pool {
    free: Vec<u32>,
    blocks: Vec<BlockState>,
    bytes: Vec<[u8; BLOCK_BYTES]>,
}

/// What the ledger knows when D hands an attempt's blocks back: the facts its judgement of the
/// attempt's [`FreeProof`] rests on. Both worlds, seeded and scripted, judge through
/// [`judge_hand_back`], so a proof means the same in both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HandBack {
    /// The proof D gave.
    pub proof: FreeProof,
    /// D sent a `Register` for the attempt (its blocks were exposed).
    pub registered: bool,
    /// Writes into the attempt's blocks that the simulated NIXL may still land.
    pub writes_in_flight: usize,
    /// A live P still holds the attempt's registration, unexpired (it would match the key's
    /// next prefill and write into blocks D is handing back).
    pub p_holds_registration: bool,
}

/// Every way the hand-back breaks safety (empty when it is sound).
pub(crate) fn judge_hand_back(h: &HandBack) -> Vec<String> {
    let mut faults = Vec::new();
    match h.proof {
        FreeProof::NeverExposed => {
            if h.registered {
                faults.push("freed as NeverExposed after a Register was sent".to_string());
            }
        }
        FreeProof::WritesCompleted
        | FreeProof::CancelAcknowledged
        | FreeProof::PeerQuiesced
        | FreeProof::DeadPeerFence
        | FreeProof::Quarantine => {
            if h.writes_in_flight > 0 {
                faults.push(format!(
                    "freed by {:?} while {} write(s) of it may still land",
                    h.proof, h.writes_in_flight
                ));
            }
        }
    }
    if h.p_holds_registration {
        faults.push(format!(
            "freed by {:?} while P still holds its registration",
            h.proof
        ));
    }
    faults
}

/// The byte a P block holds at `byte` for request `request`, cache group `group` and
/// logical block index `index` (its position in P's list). D checks the same pattern.
pub fn pattern(request: usize, group: usize, index: usize, byte: usize) -> u8 {
    let x = (request as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((group as u64) << 40)
        .wrapping_add((index as u64) << 20)
        .wrapping_add(byte as u64)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let v = (x >> 29) as u8;
    if v == POISON {
        0
    } else {
        v
    }
}

impl Pool {
    /// A pool of `total` free blocks.
    pub fn new(total: u32) -> Pool {
        Pool {
            // Popped from the back: block 0 first.
            free: (0..total).rev().collect(),
            blocks: vec![BlockState::default(); total as usize],
            bytes: vec![[0; BLOCK_BYTES]; total as usize],
        }
    }

    /// Leases `n` blocks to `owner`, most recently freed first (so stale writes hit other
    /// requests), poisoning their bytes. `None` if too few are free.
    pub fn allocate(&mut self, n: usize, owner: Owner) -> Option<Vec<u32>> {
        if self.free.len() < n {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free.pop().expect("counted above");
            let state = &mut self.blocks[id as usize];
            assert!(state.owner.is_none(), "a free block has no owner");
            *state = BlockState {
                owner: Some(owner),
                written: false,
                pins: state.pins,
            };
            self.bytes[id as usize] = [POISON; BLOCK_BYTES];
            ids.push(id);
        }
        Some(ids)
    }

    /// Hands `ids` back from `owner`. Returns one message per broken rule (S2, S3).
    pub fn free(&mut self, ids: &[u32], owner: Owner) -> Vec<String> {
        let mut errors = Vec::new();
        for &id in ids {
            let Some(state) = self.blocks.get_mut(id as usize) else {
                errors.push(format!("S3: freed block {id} does not exist"));
                continue;
            };
            if state.owner != Some(owner) {
                errors.push(format!(
                    "S3: block {id} freed by {owner:?} but leased to {:?} (double or foreign free)",
                    state.owner
                ));
                continue;
            }
            if state.pins > 0 {
                errors.push(format!(
                    "S2: block {id} of {owner:?} freed while {} transfer(s) reference it",
                    state.pins
                ));
            }
            state.owner = None;
            state.written = false;
            // A freed block's bytes are gone at once, as if another request already wrote it:
            // a read or a trusted report that relied on freed blocks shows in the bytes, not
            // only when the seed happens to reuse them.
            self.bytes[id as usize] = [POISON; BLOCK_BYTES];
            self.free.push(id);
        }
        errors
    }

    /// The ledger entry of block `id`.
    pub fn state(&self, id: u32) -> Option<&BlockState> {
        self.blocks.get(id as usize)
    }

    /// Whether every one of `ids` is leased to `request` (whatever the attempt).
    pub fn all_leased_to(&self, ids: &[u32], request: usize) -> bool {
        ids.iter().all(|&id| {
            self.state(id)
                .and_then(|s| s.owner)
                .is_some_and(|o| o.request == request)
        })
    }

    /// Pins (`+1`) or unpins (`-1`) blocks for a transfer.
    pub fn pin(&mut self, ids: &[u32], delta: i32) {
        for &id in ids {
            if let Some(state) = self.blocks.get_mut(id as usize) {
                let pins = i64::from(state.pins) + i64::from(delta);
                state.pins = u32::try_from(pins).expect("pins never go negative");
            }
        }
    }

    /// The bytes of block `id`.
    pub fn bytes(&self, id: u32) -> Option<&[u8; BLOCK_BYTES]> {
        self.bytes.get(id as usize)
    }

    /// Fills block `id` with P's pattern for (`request`, `group`, `index`).
    pub fn fill(&mut self, id: u32, request: usize, group: usize, index: usize) {
        let block = &mut self.bytes[id as usize];
        for (b, byte) in block.iter_mut().enumerate() {
            *byte = pattern(request, group, index, b);
        }
    }

    /// Writes `bytes[range]` into block `id` (a landing: `whole` if it is all the transfer
    /// carries for the block, else partial) and says whether the block was leased to `owner`
    /// (S1).
    pub fn land(
        &mut self,
        id: u32,
        data: &[u8; BLOCK_BYTES],
        range: std::ops::Range<usize>,
        whole: bool,
        owner: Owner,
    ) -> Result<(), String> {
        let Some(state) = self.blocks.get_mut(id as usize) else {
            return Err(format!("S1: write landed in nonexistent block {id}"));
        };
        self.bytes[id as usize][range.clone()].copy_from_slice(&data[range]);
        if state.owner != Some(owner) {
            return Err(format!(
                "S1: write of {owner:?} landed in block {id} leased to {:?}",
                state.owner
            ));
        }
        if whole {
            state.written = true;
        }
        Ok(())
    }

    /// Allocator conservation and ledger agreement (S3). O(blocks).
    pub fn check(&self) -> Result<(), String> {
        let leased = self.blocks.iter().filter(|b| b.owner.is_some()).count();
        if leased + self.free.len() != self.blocks.len() {
            return Err(format!(
                "S3: {leased} leased + {} free != {} blocks",
                self.free.len(),
                self.blocks.len()
            ));
        }
        for &id in &self.free {
            if self.blocks[id as usize].owner.is_some() {
                return Err(format!("S3: block {id} is both free and leased"));
            }
        }
        Ok(())
    }

    /// Every leased block and its owner, in block order.
    pub fn leased_blocks(&self) -> impl Iterator<Item = (u32, Owner)> + '_ {
        self.blocks
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some((i as u32, b.owner?)))
    }

    /// Blocks still leased (a leak once everything ended).
    pub fn leased(&self) -> usize {
        self.blocks.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifo_reuse_and_double_free() {
        let mut pool = Pool::new(4);
        let a = Owner {
            request: 1,
            epoch: 1,
        };
        let b = Owner {
            request: 2,
            epoch: 1,
        };
        let ids = pool.allocate(2, a).unwrap();
        assert_eq!(ids, vec![0, 1]);
        assert!(pool.free(&ids, a).is_empty());
        // Freed last, handed out first.
        assert_eq!(pool.allocate(1, b).unwrap(), vec![1]);
        assert!(!pool.free(&[1], a).is_empty(), "a foreign free is caught");
        pool.check().unwrap();
        pool.pin(&[1], 1);
        assert!(pool.free(&[1], b)[0].starts_with("S2"));
    }

    #[test]
    fn pattern_is_never_poison() {
        for b in 0..BLOCK_BYTES {
            assert_ne!(pattern(3, 0, 2, b), POISON);
        }
    }
}
