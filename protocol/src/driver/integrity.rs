//! Integrity digests in the driver (`Config::integrity_digest`, see [`crate::integrity`]).
//!
//! P's side fills the digests of a write's completion from its own memory just before the
//! write (or a part of a layer-wise write) is posted: the transport contract keeps source
//! memory unchanged until the write's completion, so these are the bytes that travel.
//!
//! D's side remembers the blocks of every registration it sends, and checks them when the
//! completion arrives: a `WriteDone` whose digests do not match its blocks' landed bytes
//! becomes [`NetEvent::DigestMismatch`] (the whole write landed before its notification, so
//! nothing of it is in flight). A layer-wise write is checked part by part; a part that does not
//! match is withheld from the endpoint (so its request cannot become ready), and the mismatch is
//! reported once every layer's part has arrived: not before, since parts still in flight could
//! land in blocks the failure hands back.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use super::PeerInfo;
use crate::integrity::{DigestLayout, IntegrityError, SpanSink};
use crate::machine::{NetEvent, WriteOrder};
use crate::transport::Transport;
use crate::{BlockIds, Epoch, Message, PairingKey, PeerAddr, RegionSpec, MAX_WRITE_LAYERS};

/// This rank's memory as the integrity digests walk it.
pub(super) fn digest_layout<'a>(own: &'a PeerInfo, specs: &'a [RegionSpec]) -> DigestLayout<'a> {
    DigestLayout {
        regions: &own.regions,
        specs,
        kernel_blocks_per_logical: own.geometry.kernel_blocks_per_logical,
    }
}

/// The digest function the shell provides (`kvhandoff_kernels::digest::digest`): the protocol
/// crate decides which bytes are digested, not how.
pub type DigestFn = fn(&[u8]) -> u64;

/// Most registrations D's driver remembers for checking; the oldest is forgotten beyond it (its
/// completion then fails as unverifiable, which is safe).
pub const MAX_TRACKED_REGISTRATIONS: usize = 1 << 17;

type TrackKey = (PairingKey, Epoch, PeerAddr);

/// A registration D sent, until its write's end.
#[derive(Debug)]
struct Tracked {
    blocks: BlockIds,
    /// Layers whose parts arrived (layer-wise writes), one bit each.
    covered: Vec<u64>,
    /// A part did not match.
    corrupt: bool,
}

/// What D's driver does with a received completion.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Hand it to the endpoint.
    Pass,
    /// Withhold it (a part of a write found corrupt, whose other parts are still coming).
    Withhold,
    /// Report the write corrupt instead.
    Mismatch,
}

/// The driver's integrity state: the digest function, a scratch buffer, and (D) the
/// registrations awaiting their completion.
#[derive(Debug)]
pub(super) struct Integrity {
    hash: DigestFn,
    buf: Vec<u8>,
    tracked: BTreeMap<TrackKey, Tracked>,
    order: VecDeque<TrackKey>,
}

/// Reads spans of the transport's memory into the running digest.
struct Reader<'a, T> {
    transport: &'a T,
    buf: &'a mut Vec<u8>,
    hash: DigestFn,
}

impl<T: Transport> SpanSink for Reader<'_, T> {
    fn span(&mut self, addr: u64, len: u64) -> Result<(), IntegrityError> {
        Ok(self.transport.read_local(addr, len, self.buf)?)
    }

    fn finish(&mut self) -> u64 {
        let digest = (self.hash)(self.buf);
        self.buf.clear();
        digest
    }
}

impl Integrity {
    pub(super) fn new(hash: DigestFn) -> Self {
        Integrity {
            hash,
            buf: Vec::new(),
            tracked: BTreeMap::new(),
            order: VecDeque::new(),
        }
    }

    /// The digests of `blocks` over `layers` of this rank's memory.
    pub(super) fn digests<T: Transport>(
        &mut self,
        transport: &T,
        layout: &DigestLayout<'_>,
        blocks: &BlockIds,
        layers: Range<u32>,
    ) -> Result<Vec<u64>, IntegrityError> {
        self.buf.clear();
        let mut reader = Reader {
            transport,
            buf: &mut self.buf,
            hash: self.hash,
        };
        let digests = layout.digests(blocks, layers, &mut reader);
        // The scratch buffer keeps its capacity, not a block's bytes.
        self.buf.clear();
        digests
    }

    /// P: fills the digests of a whole write's `WriteDone`, just before its post (the transport
    /// keeps source memory unchanged until the write's completion, so these are the bytes that
    /// travel).
    pub(super) fn fill_write<T: Transport>(
        &mut self,
        transport: &T,
        layout: &DigestLayout<'_>,
        order: &mut WriteOrder,
    ) -> Result<(), IntegrityError> {
        if let Message::WriteDone(done) = &mut order.notification {
            let all = 0..MAX_WRITE_LAYERS;
            done.digests = self.digests(transport, layout, &order.local, all)?;
        }
        Ok(())
    }

    /// D received `message` from `from`: the event to feed the endpoint (the message, or
    /// [`NetEvent::DigestMismatch`] counted in `mismatches`), or none (withheld).
    pub(super) fn screen<T: Transport>(
        &mut self,
        transport: &T,
        layout: &DigestLayout<'_>,
        from: PeerAddr,
        message: Message,
        mismatches: &mut u64,
    ) -> Option<NetEvent> {
        match self.received(transport, layout, &from, &message) {
            Verdict::Pass => Some(NetEvent::Received { from, message }),
            Verdict::Withhold => None,
            Verdict::Mismatch => {
                *mismatches += 1;
                Self::mismatch_event(from, &message)
            }
        }
    }

    /// D sends `message` to `to`: remember a registration's blocks for its completion.
    pub(super) fn sending(&mut self, to: &PeerAddr, message: &Message) {
        let Message::Register(register) = message else {
            return;
        };
        let key = (register.key.clone(), register.epoch, to.clone());
        let tracked = Tracked {
            blocks: register.blocks.clone(),
            covered: Vec::new(),
            corrupt: false,
        };
        // A resent registration names the same blocks: keep what its parts covered.
        if self.tracked.contains_key(&key) {
            return;
        }
        self.tracked.insert(key.clone(), tracked);
        self.order.push_back(key);
        while self.tracked.len() > MAX_TRACKED_REGISTRATIONS {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if self.tracked.remove(&oldest).is_some() {
                tracing::warn!(key = %oldest.0, "integrity: registration forgotten at capacity");
            }
        }
        // Keys of ended registrations linger in `order` until compacted.
        if self.order.len() > 2 * MAX_TRACKED_REGISTRATIONS {
            let tracked = &self.tracked;
            self.order.retain(|k| tracked.contains_key(k));
        }
    }

    /// Forgets the registrations sent to `peer` (invalidated: its completions will not come).
    pub(super) fn forget_peer(&mut self, peer: &PeerAddr) {
        self.tracked.retain(|(_, _, to), _| to != peer);
    }

    /// D received `message` from `from`: what to do with it (see [`Verdict`]).
    fn received<T: Transport>(
        &mut self,
        transport: &T,
        layout: &DigestLayout<'_>,
        from: &PeerAddr,
        message: &Message,
    ) -> Verdict {
        match message {
            Message::WriteDone(done) => {
                let key = (done.key.clone(), done.epoch, from.clone());
                let Some(tracked) = self.tracked.remove(&key) else {
                    tracing::warn!(peer = %from, key = %done.key, "integrity: completion of an unknown registration");
                    return Verdict::Mismatch;
                };
                let all = 0..MAX_WRITE_LAYERS;
                self.check(transport, layout, &tracked.blocks, all, &done.digests)
            }
            Message::WritePartDone(part) => {
                let key = (part.key.clone(), part.epoch, from.clone());
                let Some(mut tracked) = self.tracked.remove(&key) else {
                    // Other parts may still be in flight: never report before the last.
                    tracing::warn!(peer = %from, key = %part.key, "integrity: part of an unknown registration");
                    return Verdict::Withhold;
                };
                // Validated on decode: `first + count <= of <= MAX_WRITE_LAYERS`.
                let layers = part.first..part.first + part.count;
                let verdict = if tracked.corrupt {
                    Verdict::Withhold
                } else {
                    self.check(
                        transport,
                        layout,
                        &tracked.blocks,
                        layers.clone(),
                        &part.digests,
                    )
                };
                if verdict != Verdict::Pass {
                    tracked.corrupt = true;
                }
                let words = (part.of as usize).div_ceil(64);
                tracked.covered.resize(words.max(tracked.covered.len()), 0);
                for layer in layers {
                    tracked.covered[layer as usize / 64] |= 1 << (layer % 64);
                }
                let done =
                    (0..part.of).all(|l| tracked.covered[l as usize / 64] & (1 << (l % 64)) != 0);
                match (done, tracked.corrupt) {
                    (true, true) => Verdict::Mismatch,
                    (true, false) => Verdict::Pass,
                    (false, corrupt) => {
                        self.tracked.insert(key, tracked);
                        if corrupt {
                            Verdict::Withhold
                        } else {
                            Verdict::Pass
                        }
                    }
                }
            }
            Message::WriteFailed(m) => {
                self.tracked.remove(&(m.key.clone(), m.epoch, from.clone()));
                Verdict::Pass
            }
            Message::CancelAck(m) => {
                self.tracked.remove(&(m.key.clone(), m.epoch, from.clone()));
                Verdict::Pass
            }
            _ => Verdict::Pass,
        }
    }

    /// Whether `blocks`' landed bytes over `layers` match `digests`.
    fn check<T: Transport>(
        &mut self,
        transport: &T,
        layout: &DigestLayout<'_>,
        blocks: &BlockIds,
        layers: Range<u32>,
        digests: &[u64],
    ) -> Verdict {
        match self.digests(transport, layout, blocks, layers) {
            Ok(landed) if landed == digests => Verdict::Pass,
            Ok(landed) => {
                let first = landed
                    .iter()
                    .zip(digests)
                    .position(|(a, b)| a != b)
                    .unwrap_or(landed.len().min(digests.len()));
                tracing::warn!(
                    expected = digests.len(),
                    computed = landed.len(),
                    first_bad = first,
                    "integrity: landed bytes differ from P's digests"
                );
                Verdict::Mismatch
            }
            Err(error) => {
                tracing::warn!(%error, "integrity: landed bytes could not be digested");
                Verdict::Mismatch
            }
        }
    }

    /// The event that reports `message`'s write corrupt.
    fn mismatch_event(from: PeerAddr, message: &Message) -> Option<NetEvent> {
        let (key, epoch, prefill_rank) = match message {
            Message::WriteDone(m) => (m.key.clone(), m.epoch, m.prefill_rank),
            Message::WritePartDone(m) => (m.key.clone(), m.epoch, m.prefill_rank),
            _ => return None,
        };
        Some(NetEvent::DigestMismatch {
            from,
            key,
            epoch,
            prefill_rank,
        })
    }
}
