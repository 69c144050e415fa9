//! Metadata: magic, fabric id, incarnation, agent name, registered regions; little endian.

use kvhandoff_protocol::AgentName;

use super::{AddrRange, TransportError, METADATA_MAGIC};

pub(super) struct DecodedMd {
    pub(super) fabric: u64,
    pub(super) agent: AgentName,
    pub(super) incarnation: u64,
    pub(super) regions: Vec<AddrRange>,
}

pub(super) fn encode_metadata(
    fabric: u64,
    agent: &AgentName,
    incarnation: u64,
    regions: &[AddrRange],
) -> Vec<u8> {
    let name = agent.as_str().as_bytes();
    let mut out = Vec::with_capacity(32 + name.len() + 16 * regions.len());
    out.extend_from_slice(&METADATA_MAGIC);
    out.extend_from_slice(&fabric.to_le_bytes());
    out.extend_from_slice(&incarnation.to_le_bytes());
    // Agent names are at most `MAX_ID_LEN` bytes and regions at most `max_regions`.
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        out.extend_from_slice(&r.base.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
    }
    out
}

pub(super) fn decode_metadata(
    bytes: &[u8],
    max_regions: usize,
) -> Result<DecodedMd, TransportError> {
    let bad = |why| TransportError::BadMetadata { why };
    let mut cur = Cursor { bytes };
    if cur.take(METADATA_MAGIC.len())? != METADATA_MAGIC {
        return Err(bad("bad magic"));
    }
    let fabric = cur.u64()?;
    let incarnation = cur.u64()?;
    let name_len = cur.u32()? as usize;
    let name =
        std::str::from_utf8(cur.take(name_len)?).map_err(|_| bad("agent name is not UTF-8"))?;
    let agent = AgentName::new(name).map_err(|_| bad("invalid agent name"))?;
    let count = cur.u32()? as usize;
    if count > max_regions {
        return Err(bad("too many regions"));
    }
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        let range = AddrRange {
            base: cur.u64()?,
            len: cur.u64()?,
        };
        regions.push(range);
    }
    if !cur.bytes.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok(DecodedMd {
        fabric,
        agent,
        incarnation,
        regions,
    })
}

struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TransportError> {
        if self.bytes.len() < n {
            return Err(TransportError::BadMetadata { why: "truncated" });
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, TransportError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, TransportError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
}
