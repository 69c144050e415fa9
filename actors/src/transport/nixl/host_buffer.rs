//! [`HostBuffer`]: engine-owned host (DRAM) memory that a
//! [`NixlTransport`](super::NixlTransport) can register.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::transport::{AddrRange, TransportError};

/// Alignment of [`HostBuffer::new`] allocations (one page).
pub const HOST_BUFFER_ALIGN: usize = 4096;

/// Host memory for NIXL transfers: a page-aligned, zeroed allocation ([`HostBuffer::new`]) or
/// memory the engine owns elsewhere ([`HostBuffer::from_raw_parts`], e.g. a pinned tensor).
///
/// Clones are handles to the same bytes; the memory is freed when the last handle goes. A
/// [`NixlTransport`](super::NixlTransport) keeps a handle for as long as the buffer is
/// registered (it deregisters before letting go), so dropping the engine's handles never frees
/// registered memory under NIXL.
///
/// # Access
///
/// [`Self::read`], [`Self::write`], [`Self::fill`] and [`Self::to_vec`] copy through raw
/// pointers under a per-buffer lock, so engine-side accesses never race each other. NIXL (its
/// UCX progress thread, or the peer) reads and writes the memory behind that lock: read a
/// transfer's target only after its completion (or its notification) says the bytes landed, and
/// leave a source unchanged until the write's completion (see the
/// [`Transport`](crate::transport::Transport) contract).
#[derive(Clone)]
pub struct HostBuffer {
    inner: Arc<Inner>,
}

struct Inner {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// Serialises engine-side accesses (NIXL's own accesses cannot be serialised).
    access: Mutex<()>,
}

enum Backing {
    /// Allocated by [`HostBuffer::new`] with this layout.
    Owned(Layout),
    /// A vector handed over by [`HostBuffer::from_vec`], with its capacity (rebuilt and dropped
    /// with the last handle).
    Vec(usize),
    /// Owned by the engine; dropping the value releases it.
    External(#[allow(dead_code)] Box<dyn Send + Sync>),
}

// SAFETY: the memory is plain host memory owned (or kept alive) by `Inner`; every access from
// Rust goes through raw-pointer copies under `access`, so sharing handles between threads is
// sound. The external owner is `Send + Sync` by its bound.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Backing::Owned(layout) = self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` in `HostBuffer::new` and is
            // freed exactly once, here, when the last handle goes.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        if let Backing::Vec(capacity) = self.backing {
            // SAFETY: `ptr`, `len` and `capacity` are those of the vector `HostBuffer::from_vec`
            // took apart (and never dropped); it is rebuilt exactly once, here.
            drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, capacity) });
        }
        // `Backing::External` drops its owner, which releases the engine's memory.
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({:#x}+{})", self.base(), self.inner.len)
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes, aligned to [`HOST_BUFFER_ALIGN`].
    ///
    /// # Errors
    /// [`TransportError::BadRegionLen`] for zero bytes or more than an allocation can hold;
    /// [`TransportError::OutOfMemory`] when the allocator refuses.
    pub fn new(len: u64) -> Result<Self, TransportError> {
        let bad = || TransportError::BadRegionLen { len };
        let size = usize::try_from(len).map_err(|_| bad())?;
        if size == 0 {
            return Err(bad());
        }
        let layout = Layout::from_size_align(size, HOST_BUFFER_ALIGN).map_err(|_| bad())?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(TransportError::OutOfMemory {
            requested: len,
            available: 0,
        })?;
        Ok(Self::from_inner(ptr, size, Backing::Owned(layout)))
    }

    /// Takes `bytes`, which the engine allocated, as the buffer itself: no copy, no `unsafe`.
    /// The engine reaches them afterwards through the buffer's handles ([`Self::read`],
    /// [`Self::write`]); they are freed when the last handle goes.
    ///
    /// # Errors
    /// [`TransportError::BadRegionLen`] for an empty vector.
    pub fn from_vec(bytes: Vec<u8>) -> Result<Self, TransportError> {
        if bytes.is_empty() {
            return Err(TransportError::BadRegionLen { len: 0 });
        }
        let mut bytes = std::mem::ManuallyDrop::new(bytes);
        let (len, capacity) = (bytes.len(), bytes.capacity());
        let ptr =
            NonNull::new(bytes.as_mut_ptr()).ok_or(TransportError::BadRegionLen { len: 0 })?;
        Ok(Self::from_inner(ptr, len, Backing::Vec(capacity)))
    }

    /// Wraps host memory the engine owns (e.g. a pinned KV-cache tensor). `owner` is dropped
    /// when the last handle goes; it should keep the memory alive until then.
    ///
    /// # Errors
    /// [`TransportError::BadRegionLen`] for zero bytes.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be one host allocation, readable and writable, that stays valid
    /// (not freed, not moved) until `owner` is dropped, and that Rust code outside this handle
    /// does not access while a transfer or an access through this handle may touch it.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        owner: impl Send + Sync + 'static,
    ) -> Result<Self, TransportError> {
        if len == 0 {
            return Err(TransportError::BadRegionLen { len: 0 });
        }
        Ok(Self::from_inner(
            ptr,
            len,
            Backing::External(Box::new(owner)),
        ))
    }

    fn from_inner(ptr: NonNull<u8>, len: usize, backing: Backing) -> Self {
        Self {
            inner: Arc::new(Inner {
                ptr,
                len,
                backing,
                access: Mutex::new(()),
            }),
        }
    }

    /// The first byte's address (what descriptors and [`AddrRange`]s use).
    pub fn base(&self) -> u64 {
        self.inner.ptr.as_ptr() as u64
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> u64 {
        self.inner.len as u64
    }

    /// Always `false`: buffers are never empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The buffer's address range.
    pub fn range(&self) -> AddrRange {
        AddrRange {
            base: self.base(),
            len: self.len(),
        }
    }

    /// Whether `other` is a handle to the same memory.
    pub fn same(&self, other: &HostBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Copies `bytes` into the buffer at `offset`.
    ///
    /// # Errors
    /// [`TransportError::RegionOutOfBounds`] when the span leaves the buffer.
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), TransportError> {
        let start = self.span(offset, bytes.len())?;
        let _guard = self.lock();
        // SAFETY: `span` proved `[start, start + bytes.len())` lies inside the allocation; the
        // source is a distinct Rust slice, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.inner.ptr.as_ptr().add(start),
                bytes.len(),
            );
        }
        Ok(())
    }

    /// Copies bytes at `offset` into `buf` (filling it).
    ///
    /// # Errors
    /// [`TransportError::RegionOutOfBounds`] when the span leaves the buffer.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), TransportError> {
        let start = self.span(offset, buf.len())?;
        let _guard = self.lock();
        // SAFETY: as in `write`, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.inner.ptr.as_ptr().add(start),
                buf.as_mut_ptr(),
                buf.len(),
            );
        }
        Ok(())
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.inner.len];
        self.read(0, &mut out)
            .expect("invariant: the whole buffer is in bounds");
        out
    }

    /// Sets every byte of the buffer to `byte`.
    pub fn fill(&self, byte: u8) {
        let _guard = self.lock();
        // SAFETY: the whole allocation is writable.
        unsafe { std::ptr::write_bytes(self.inner.ptr.as_ptr(), byte, self.inner.len) };
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.inner
            .access
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The start offset of `[offset, offset + len)` if it lies inside the buffer.
    fn span(&self, offset: u64, len: usize) -> Result<usize, TransportError> {
        let out = || TransportError::RegionOutOfBounds {
            base: self.base(),
            offset,
            len: len as u64,
        };
        let end = offset.checked_add(len as u64).ok_or_else(out)?;
        if end > self.len() {
            return Err(out());
        }
        // `offset <= end <= len`, which is a `usize`.
        Ok(offset as usize)
    }
}

impl MemoryRegion for HostBuffer {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.inner.ptr.as_ptr()
    }

    fn size(&self) -> usize {
        self.inner.len
    }
}

impl NixlDescriptor for HostBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}
