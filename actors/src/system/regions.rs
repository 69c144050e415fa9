//! Memory the engine owns, registered as it is: [`KvRegion`] (the engine's buffer, or a raw
//! pointer to one) and [`AdoptMemory`] (a transport that registers such a region without a
//! copy).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::RegionBytes;
use crate::transport::mem::{MemTransport, RegionMemory};
use crate::transport::{Transport, TransportError};

/// Where a region's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host memory (DRAM, pinned or not).
    Host,
    /// Memory of GPU `device` (a CUDA device ordinal). Typed for the GPU path; no transport
    /// registers it yet ([`AdoptError::Unsupported`]).
    Device {
        /// The device's ordinal.
        device: u32,
    },
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Host => f.write_str("host memory"),
            MemoryLocation::Device { device } => write!(f, "memory of GPU {device}"),
        }
    }
}

/// Why a transport could not take a [`KvRegion`].
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The transport cannot register memory of that kind.
    #[error("the {transport} transport cannot register {location}")]
    Unsupported {
        /// The transport (`"mem"`, `"nixl"`).
        transport: &'static str,
        /// What the region is.
        location: MemoryLocation,
    },
    /// The transport refused the memory.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
}

/// One region of an engine's KV cache, in memory the engine owns: what a rank registers as it
/// is, with no copy.
///
/// - [`KvRegion::new`]: a buffer the engine hands over (`Vec<u8>`, `Box<[u8]>`). The rank keeps
///   it alive; the engine reads and writes it afterwards through the rank's safe handles.
/// - [`KvRegion::from_raw_parts`] (`unsafe`): a pointer and a length, host or device, the way a
///   Python or C++ engine passes its tensors.
///
/// ```
/// use kvhandoff_actors::system::{KvRegion, MemoryLocation};
/// let region = KvRegion::new(vec![0u8; 4096]);
/// assert_eq!(region.len(), 4096);
/// assert_eq!(region.location(), MemoryLocation::Host);
/// ```
pub struct KvRegion {
    memory: Memory,
}

enum Memory {
    /// The engine's buffer, handed over.
    Owned(Vec<u8>),
    /// Memory the engine keeps, by pointer (see [`KvRegion::from_raw_parts`]).
    Raw(RawMemory),
}

impl fmt::Debug for KvRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.memory {
            Memory::Owned(bytes) => write!(f, "KvRegion(owned, {} bytes)", bytes.len()),
            Memory::Raw(raw) => write!(
                f,
                "KvRegion(raw {:p}, {} bytes, {})",
                raw.ptr, raw.len, raw.location
            ),
        }
    }
}

impl KvRegion {
    /// A region made of `bytes`, which the engine allocated and hands over (a `Vec<u8>` or a
    /// `Box<[u8]>`; moved, never copied). The rank keeps it alive as long as it needs it.
    pub fn new(bytes: impl Into<Vec<u8>>) -> KvRegion {
        KvRegion {
            memory: Memory::Owned(bytes.into()),
        }
    }

    /// A region of `len` zeroed bytes of host memory.
    pub fn zeroed(len: usize) -> KvRegion {
        KvRegion::new(vec![0u8; len])
    }

    /// A region of memory the engine keeps: `len` bytes at `ptr`, in host memory or on a GPU.
    /// `owner` is dropped once nothing of kvhandoff will touch the memory again (give it what
    /// keeps the memory alive, e.g. a reference to the tensor, or `()`).
    ///
    /// # Safety
    ///
    /// - `[ptr, ptr + len)` is one allocation at `location`, readable and writable for `len`
    ///   bytes, that stays valid (not freed, not moved, not unmapped) until `owner` is dropped.
    ///   kvhandoff drops `owner` when the rank has stopped (its [`Runtime`](super::Runtime) shut
    ///   down) and no handle to the region is left (the engine's `KvCache` handles included).
    /// - Transfers read and write the memory from other threads (the transport's, or the peer
    ///   over the network) while the engine runs: the engine must not touch a request's blocks
    ///   between handing them to the connector and getting them back in the request's final
    ///   event (the protocol's events say when), and must not write a P request's blocks until
    ///   `BlocksFree`/`ExportEnded` hands them back. Races the engine makes with transfers it
    ///   knows of are its own business, as with any DMA.
    /// - Nothing else in the process writes the memory through Rust references while
    ///   kvhandoff may access it (kvhandoff copies through raw pointers or through slices it
    ///   makes under its own lock).
    ///
    /// Device memory is accepted here and refused by every transport for now
    /// ([`AdoptError::Unsupported`]).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        location: MemoryLocation,
        owner: impl Send + Sync + 'static,
    ) -> KvRegion {
        KvRegion {
            memory: Memory::Raw(RawMemory {
                ptr,
                len,
                location,
                owner: Some(Box::new(owner)),
            }),
        }
    }

    /// Bytes in the region.
    pub fn len(&self) -> u64 {
        match &self.memory {
            Memory::Owned(bytes) => bytes.len() as u64,
            Memory::Raw(raw) => raw.len as u64,
        }
    }

    /// Whether the region has no bytes (a rank refuses it).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the region's memory lives.
    pub fn location(&self) -> MemoryLocation {
        match &self.memory {
            Memory::Owned(_) => MemoryLocation::Host,
            Memory::Raw(raw) => raw.location,
        }
    }

    /// The address of its first byte, in the engine's address space.
    pub fn addr(&self) -> u64 {
        match &self.memory {
            Memory::Owned(bytes) => bytes.as_ptr() as u64,
            Memory::Raw(raw) => raw.ptr.as_ptr() as u64,
        }
    }
}

/// Memory behind a raw pointer (see [`KvRegion::from_raw_parts`] for its contract).
struct RawMemory {
    ptr: NonNull<u8>,
    len: usize,
    location: MemoryLocation,
    /// Dropped when the memory is let go (with this value); only held for its drop.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the pointer is to memory that `from_raw_parts`'s caller promised stays valid until
// `owner` goes and is not accessed through Rust references meanwhile; every access from here is
// made under the owner's lock (the mem fabric's, or `HostBuffer`'s), so moving and sharing the
// handle between threads is sound.
unsafe impl Send for RawMemory {}
// SAFETY: as above.
unsafe impl Sync for RawMemory {}

impl RawMemory {
    /// Panics unless `[offset, offset + len)` is inside the memory (the fabric checks first).
    fn check(&self, offset: usize, len: usize) {
        let end = offset.checked_add(len);
        assert!(
            end.is_some_and(|end| end <= self.len),
            "span {offset}+{len} outside {} bytes",
            self.len
        );
    }
}

impl RegionMemory for RawMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) {
        self.check(offset, buf.len());
        // SAFETY: `from_raw_parts`'s contract: `[ptr, ptr + len)` is readable host memory, valid
        // until `owner` is dropped (after the fabric releases this value); the span is inside it
        // (checked above) and `buf`, a Rust slice, cannot overlap it. Only the span is touched.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            );
        }
    }

    fn write_at(&mut self, offset: usize, bytes: &[u8]) {
        self.check(offset, bytes.len());
        // SAFETY: as in `read_at`, for writable memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset),
                bytes.len(),
            );
        }
    }
}

/// A transport that registers memory the engine owns, as it is ([`KvRegion`]).
pub trait AdoptMemory: Transport + Sized {
    /// The transport's name in errors (`"mem"`, `"nixl"`).
    const NAME: &'static str;

    /// Whether the transport can register memory at `location`.
    fn supports(location: MemoryLocation) -> bool;

    /// Makes `region` one of this transport's regions (not yet registered), without a copy;
    /// returns the transport's handle (to register) and the engine's byte access.
    ///
    /// # Errors
    /// [`AdoptError::Unsupported`] for memory the transport cannot register; a transport
    /// refusal (an empty region, ...).
    fn adopt(
        &mut self,
        region: KvRegion,
    ) -> Result<(Self::Region, Arc<dyn RegionBytes>), AdoptError>;
}

fn unsupported<T: AdoptMemory>(location: MemoryLocation) -> AdoptError {
    AdoptError::Unsupported {
        transport: T::NAME,
        location,
    }
}

impl AdoptMemory for MemTransport {
    const NAME: &'static str = "mem";

    fn supports(location: MemoryLocation) -> bool {
        location == MemoryLocation::Host
    }

    fn adopt(
        &mut self,
        region: KvRegion,
    ) -> Result<(Self::Region, Arc<dyn RegionBytes>), AdoptError> {
        let location = region.location();
        if !Self::supports(location) {
            return Err(unsupported::<Self>(location));
        }
        let memory: Box<dyn RegionMemory> = match region.memory {
            Memory::Owned(bytes) => Box::new(bytes),
            Memory::Raw(raw) => Box::new(raw),
        };
        let handle = self.adopt_region(memory)?;
        Ok((handle.clone(), Arc::new(handle)))
    }
}

#[cfg(feature = "nixl")]
impl AdoptMemory for crate::transport::nixl::NixlTransport {
    const NAME: &'static str = "nixl";

    fn supports(location: MemoryLocation) -> bool {
        location == MemoryLocation::Host
    }

    fn adopt(
        &mut self,
        region: KvRegion,
    ) -> Result<(Self::Region, Arc<dyn RegionBytes>), AdoptError> {
        use crate::transport::nixl::HostBuffer;
        let location = region.location();
        if !Self::supports(location) {
            return Err(unsupported::<Self>(location));
        }
        let buffer = match region.memory {
            Memory::Owned(bytes) => HostBuffer::from_vec(bytes)?,
            Memory::Raw(mut raw) => {
                let (ptr, len) = (raw.ptr, raw.len);
                let owner = raw.owner.take();
                // SAFETY: `KvRegion::from_raw_parts`'s contract is `HostBuffer::from_raw_parts`'s:
                // one readable and writable host allocation, valid until `owner` is dropped
                // (the buffer drops it with its last handle), not accessed by Rust references
                // while transfers or the buffer's accesses may touch it.
                unsafe { HostBuffer::from_raw_parts(ptr, len, owner)? }
            }
        };
        Ok((buffer.clone(), Arc::new(buffer)))
    }
}
