//! Pull between different geometries: D reads, P only exports its blocks.
//!
//! The pair's plan is made for push: P runs its staging jobs (slice heads, regroup, permute)
//! before the wire, the wire moves pieces from P's KV or staging into D's KV or staging, and D
//! runs its own jobs after. In pull P does nothing once its blocks are exported — nothing at all
//! for the request, since no engine step of P's is tied to the read — so every byte D reads
//! comes from P's KV blocks:
//! - a piece the push plan reads from P's KV is read as it is, into the same place of D's memory;
//! - a link whose plan stages on P has the P blocks its staging jobs read (whole kernel blocks of
//!   the link's regions, every head of P's) read into a *mirror* area of D's staging buffer,
//!   after D's own staging; once every read landed, D runs P's jobs of the link on the mirror
//!   and copies their output where the push plan's wire would have put it, then runs its own
//!   jobs as in push.
//!
//! So the plan's transforms all run on D, and a link that P would have sliced moves P's whole
//! blocks (P's heads per rank over the link's, times the bytes). That is the price of a P that
//! does no work for a read; vLLM's pull has the same shape (D reads P's blocks and permutes
//! them itself).

use kvhandoff_protocol::hetero::{SideName, Space};

use super::{slice, slice_mut, Handoff, HandoffError, RunStats};

/// One piece of a pull: `len` bytes from P's KV at `src` into D's `dst_space` at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPiece {
    /// Offset in P's KV memory.
    pub src: u64,
    /// D's memory the piece lands in (the mirror is in D's staging buffer).
    pub dst_space: Space,
    /// Offset there.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// How D reads one link of a request (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullLink {
    /// The link, in the pair's plan.
    pub link: usize,
    /// Every piece of the link's read.
    pub pieces: Vec<ReadPiece>,
    /// Where the link's mirror of P's blocks starts in D's staging memory.
    pub mirror_at: u64,
    /// Its length (0: the link's plan stages nothing on P).
    pub mirror_len: u64,
    /// The P blocks mirrored, in mirror order: (offset in P's KV, bytes).
    mirrored: Vec<(u64, u64)>,
}

impl Handoff {
    /// How D rank `d` (its index in D's side) reads every link into it: the links in plan
    /// order, their mirrors packed after D's own staging arena.
    pub fn pull_links_into(&self, d: usize) -> Vec<PullLink> {
        let mut mirror_at = self.arenas[self.arena(SideName::Decode, d, Space::Staging)]
            .bytes
            .len() as u64;
        let mut out = Vec::new();
        for (l, link) in self.pair.links.iter().enumerate() {
            if link.decode != d {
                continue;
            }
            let mut pieces = Vec::new();
            for t in self.plan.transfers.iter().filter(|t| t.link == l) {
                if t.src_space == Space::Kv {
                    pieces.extend(t.pieces.iter().map(|p| ReadPiece {
                        src: p.src,
                        dst_space: t.dst_space,
                        dst: p.dst,
                        len: p.len,
                    }));
                }
            }
            let mut mirrored = Vec::new();
            let mut mirror_len = 0;
            for job in self.plan.prefill_jobs.iter().filter(|j| j.link == l) {
                let len = job.input.block_len();
                for &addr in &job.input.addrs {
                    pieces.push(ReadPiece {
                        src: addr,
                        dst_space: Space::Staging,
                        dst: mirror_at + mirror_len,
                        len,
                    });
                    mirrored.push((addr, len));
                    mirror_len += len;
                }
            }
            out.push(PullLink {
                link: l,
                pieces,
                mirror_at,
                mirror_len,
                mirrored,
            });
            mirror_at += mirror_len;
        }
        out
    }

    /// Bytes a pull of this request reads (every link's pieces, mirrors included).
    pub fn pull_bytes(&self) -> u64 {
        (0..self.pair.decode.ranks.len())
            .flat_map(|d| self.pull_links_into(d))
            .flat_map(|l| l.pieces)
            .map(|p| p.len)
            .sum()
    }

    /// The staging memory D rank `d` needs for a pull of this request: its staging arena and
    /// every link's mirror.
    pub fn pull_staging_len(&self, d: usize) -> u64 {
        let own = self.arenas[self.arena(SideName::Decode, d, Space::Staging)]
            .bytes
            .len() as u64;
        own + self
            .pull_links_into(d)
            .iter()
            .map(|l| l.mirror_len)
            .sum::<u64>()
    }

    /// D's half of a pulled link whose pieces landed (D's arenas hold what the reads brought,
    /// `mirror` the bytes of the link's mirror area): P's staging jobs of the link, run over
    /// the mirror, and their output copied where the push plan's wire would have written it.
    /// P's own arenas are left as they were.
    ///
    /// # Errors
    /// A [`HandoffError`] when the mirror is short or a job or a range fails.
    pub fn land_pulled_link(
        &mut self,
        pulled: &PullLink,
        mirror: &[u8],
    ) -> Result<(), HandoffError> {
        if pulled.mirror_len == 0 {
            return Ok(());
        }
        if (mirror.len() as u64) < pulled.mirror_len {
            return Err(HandoffError::Shape(format!(
                "link {}'s mirror has {} bytes, its read brought {}",
                pulled.link,
                pulled.mirror_len,
                mirror.len()
            )));
        }
        let link = self.pair.links[pulled.link].clone();
        let kv = self.arena(SideName::Prefill, link.prefill, Space::Kv);
        let staging = self.arena(SideName::Prefill, link.prefill, Space::Staging);
        // P's arenas stand in for the mirror while P's jobs run, and come back after.
        let kv_len = self.arenas[kv].bytes.len();
        let staging_len = self.arenas[staging].bytes.len();
        let real_kv = std::mem::replace(&mut self.arenas[kv].bytes, vec![0; kv_len]);
        let real_staging = std::mem::replace(&mut self.arenas[staging].bytes, vec![0; staging_len]);
        let result = self.stage_mirror(pulled, mirror, kv, staging);
        self.arenas[kv].bytes = real_kv;
        self.arenas[staging].bytes = real_staging;
        result
    }

    fn stage_mirror(
        &mut self,
        pulled: &PullLink,
        mirror: &[u8],
        kv: usize,
        staging: usize,
    ) -> Result<(), HandoffError> {
        let mut at = 0usize;
        for &(addr, len) in &pulled.mirrored {
            let bytes = mirror
                .get(at..at + len as usize)
                .ok_or_else(|| HandoffError::Shape("a mirrored block past the mirror".into()))?;
            slice_mut(&mut self.arenas[kv], "a mirrored P block", addr, len)?
                .copy_from_slice(bytes);
            at += len as usize;
        }
        self.run_prefill_jobs_of_link(pulled.link)?;
        let d = self.pair.links[pulled.link].decode;
        let transfers: Vec<_> = self
            .plan
            .transfers
            .iter()
            .filter(|t| t.link == pulled.link && t.src_space == Space::Staging)
            .cloned()
            .collect();
        for t in transfers {
            let dst = self.arena(SideName::Decode, d, t.dst_space);
            for p in &t.pieces {
                let bytes = slice(&self.arenas[staging], "a staged piece", p.src, p.len)?.to_vec();
                slice_mut(
                    &mut self.arenas[dst],
                    "a staged piece's place",
                    p.dst,
                    p.len,
                )?
                .copy_from_slice(&bytes);
            }
        }
        Ok(())
    }

    /// The whole request as a pull in memory: every link's reads from P's KV (into D's arenas
    /// and a mirror), P's jobs run on D over the mirrors, then D's jobs and tail zeroing. What
    /// the runtime's pull does, without a transport: the check that the pull plan itself is
    /// right for a pair.
    ///
    /// # Errors
    /// A [`HandoffError`] when a job or a range fails; the arenas may then hold anything.
    pub fn run_pull(&mut self) -> Result<RunStats, HandoffError> {
        for d in 0..self.pair.decode.ranks.len() {
            for pulled in self.pull_links_into(d) {
                let p = self.pair.links[pulled.link].prefill;
                let src = self.arena(SideName::Prefill, p, Space::Kv);
                let mut mirror = vec![0u8; pulled.mirror_len as usize];
                let own_staging = pulled.mirror_at;
                for piece in &pulled.pieces {
                    let bytes =
                        slice(&self.arenas[src], "a read piece", piece.src, piece.len)?.to_vec();
                    let dst = self.arena(SideName::Decode, d, piece.dst_space);
                    let len = self.arenas[dst].bytes.len() as u64;
                    if piece.dst_space == Space::Staging && piece.dst >= len {
                        let at = (piece.dst - own_staging) as usize;
                        mirror[at..at + piece.len as usize].copy_from_slice(&bytes);
                    } else {
                        slice_mut(
                            &mut self.arenas[dst],
                            "a read piece's place",
                            piece.dst,
                            piece.len,
                        )?
                        .copy_from_slice(&bytes);
                    }
                }
                self.land_pulled_link(&pulled, &mirror)?;
            }
        }
        self.run_decode_side()
    }
}

#[cfg(test)]
mod tests;
