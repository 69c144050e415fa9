//! What `NativeConnector::new` makes of its Python arguments: the role, listen and peer
//! addresses, the transport and the engine's regions, each checked with a config error that
//! names it. Kept apart so that the constructor reads as the assembly it is.

use std::net::{SocketAddr, ToSocketAddrs};
use std::ptr::NonNull;
use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvhandoff::{KvRegion, MemFabric, MemoryLocation, TransportKind};

use crate::errors::config;

/// The in-memory fabric every `transport="mem"` connector of this process shares.
fn fabric() -> MemFabric {
    static FABRIC: OnceLock<MemFabric> = OnceLock::new();
    FABRIC.get_or_init(MemFabric::new).clone()
}

/// Which side of the handoff a connector is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub(super) fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// A region as Python hands it: address, length, and what keeps the memory alive.
pub(super) type PyRegion = (usize, usize, Py<PyAny>);

pub(super) fn parse_listen(listen: &str) -> PyResult<SocketAddr> {
    listen
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .ok_or_else(|| config(format!("listen must be \"HOST:PORT\" (got {listen:?})")))
}

pub(super) fn parse_role(role: &str) -> PyResult<Role> {
    match role {
        "prefill" | "p" | "kv_producer" => Ok(Role::Prefill),
        "decode" | "d" | "kv_consumer" => Ok(Role::Decode),
        other => Err(config(format!(
            "role must be \"prefill\" or \"decode\" (got {other:?})"
        ))),
    }
}

pub(super) fn transport_kind(name: &str) -> PyResult<TransportKind> {
    match name {
        "mem" => Ok(TransportKind::Mem(fabric())),
        #[cfg(feature = "nixl")]
        "nixl" => Ok(TransportKind::nixl()),
        #[cfg(not(feature = "nixl"))]
        "nixl" => Err(config(
            "transport \"nixl\": this build of kvhandoff has no NIXL (feature `nixl`)",
        )),
        other => Err(config(format!(
            "transport must be \"mem\" or \"nixl\" (got {other:?})"
        ))),
    }
}

/// The engine's regions, each cut to a whole number of blocks (the same for every region).
pub(super) fn adopt_regions(
    regions: Vec<PyRegion>,
    block_bytes: u64,
) -> PyResult<(Vec<KvRegion>, u32)> {
    if regions.is_empty() {
        return Err(config("regions: at least one region is needed"));
    }
    let block = usize::try_from(block_bytes).map_err(|_| config("block_bytes is too large"))?;
    let mut blocks = None;
    let mut adopted = Vec::with_capacity(regions.len());
    for (index, (addr, len, owner)) in regions.into_iter().enumerate() {
        let here = len / block;
        if here == 0 {
            return Err(config(format!(
                "regions[{index}]: {len} bytes hold no block of {block_bytes} bytes"
            )));
        }
        match blocks {
            None => blocks = Some(here),
            Some(first) if first != here => {
                return Err(config(format!(
                "regions[{index}] holds {here} blocks of {block_bytes} bytes, regions[0] {first}: \
                     block b is the b-th slice of every region, so every region holds as many"
            )))
            }
            Some(_) => {}
        }
        let ptr = NonNull::new(addr as *mut u8)
            .ok_or_else(|| config(format!("regions[{index}]: a null address")))?;
        // SAFETY: the Python layer's contract (`kvhandoff.RawRegion`, the buffer protocol, a
        // tensor's storage): `len` bytes of host memory at `addr`, kept valid while `owner`
        // lives; the region holds `owner` until the rank no longer touches the memory.
        adopted.push(unsafe {
            KvRegion::from_raw_parts(ptr, here * block, MemoryLocation::Host, owner)
        });
    }
    let blocks = blocks.unwrap_or(0);
    let blocks = u32::try_from(blocks).map_err(|_| config("more than 2**32 blocks per region"))?;
    Ok((adopted, blocks))
}

/// `peers` as a dict `{engine_id: "host:port"}` or a sequence of such pairs.
pub(super) fn peer_list(peers: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<(String, String)>> {
    let Some(peers) = peers.filter(|p| !p.is_none()) else {
        return Ok(Vec::new());
    };
    if let Ok(dict) = peers.cast::<PyDict>() {
        return dict
            .iter()
            .map(|(k, v)| Ok((k.extract()?, v.extract()?)))
            .collect::<PyResult<_>>()
            .map_err(|_: PyErr| config("peers: a dict of engine_id -> \"host:port\" strings"));
    }
    peers.extract().map_err(|_| {
        config("peers: a dict of engine_id -> \"host:port\", or (engine_id, address) pairs")
    })
}
