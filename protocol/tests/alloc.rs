//! How much memory `wire::decode` allocates for hostile frames, measured with a counting global
//! allocator (this test binary only). Length prefixes may claim anything up to 2^64; the decoder
//! must not allocate what they claim.
//!
//! The bounds: a string's length is checked against bincode's decode limit (`MAX_PAYLOAD_LEN`
//! bytes of *decoded* size) before its buffer is allocated; a list preallocates at most 1 MiB
//! (serde's cautious size hint) and grows only as elements are actually decoded, each of which
//! costs at least one input byte and some of the decode limit. So the peak stays a small multiple
//! of `MAX_PAYLOAD_LEN` whatever the frame says.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvhandoff_protocol::wire::{self, HEADER_LEN, MAGIC, MAX_PAYLOAD_LEN};
use kvhandoff_protocol::{MessageKind, PROTOCOL_VERSION};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Count the moment both blocks may exist.
            let now = CURRENT.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(now, Ordering::Relaxed);
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated at the peak of `decode(bytes)`, beyond what was live before; and whether it
/// was refused.
fn peak_of_decode(bytes: &[u8]) -> (usize, bool) {
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let refused = wire::decode(bytes).is_err();
    (PEAK.load(Ordering::Relaxed) - before, refused)
}

fn frame(kind: MessageKind, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + payload.len());
    f.extend_from_slice(&MAGIC);
    f.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    f.push(kind as u8);
    f.push(0);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn varint_u64(value: u64) -> Vec<u8> {
    let mut v = vec![253];
    v.extend_from_slice(&value.to_le_bytes());
    v
}

fn varint_u32(value: u32) -> Vec<u8> {
    let mut v = vec![252];
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// A payload: `prefix`, then `count` copies of `element`, padded with zeros to exactly
/// `MAX_PAYLOAD_LEN` bytes (so the frame is as large as the header allows).
fn list_payload(prefix: &[u8], count: u32, element: &[u8]) -> Vec<u8> {
    let mut p = prefix.to_vec();
    p.extend(varint_u32(count));
    while p.len() + element.len() <= MAX_PAYLOAD_LEN {
        p.extend_from_slice(element);
    }
    p.resize(MAX_PAYLOAD_LEN, 0);
    p
}

// One test only: the counters are global, so nothing else may run beside it.
#[test]
fn hostile_frames_allocate_a_bounded_amount() {
    let huge = varint_u64(1 << 60);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "handshake agent_metadata claims 2^60 bytes",
            frame(
                MessageKind::Handshake,
                &[&[1u8, 1, b'e', 1, b'a'][..], &huge, &[0; 64]].concat(),
            ),
        ),
        (
            "string claims 2^60 bytes",
            frame(MessageKind::Cancel, &[&huge[..], &[b'k'; 64]].concat()),
        ),
        (
            "string claims just under the limit, 10 bytes present",
            frame(
                MessageKind::Cancel,
                &[&varint_u32(MAX_PAYLOAD_LEN as u32 - 64)[..], &[b'k'; 10]].concat(),
            ),
        ),
        (
            "register: a 2 MiB frame of empty block-id groups",
            frame(
                MessageKind::Register,
                &list_payload(&[1, b'k', 1, 1, b'd', 1, b'r', 0], u32::MAX, &[0]),
            ),
        ),
        (
            "register: one group of 2 MiB of one-byte block ids",
            frame(
                MessageKind::Register,
                &list_payload(&[1, b'k', 1, 1, b'd', 1, b'r', 0, 1], u32::MAX, &[7]),
            ),
        ),
        (
            "heartbeat: a 2 MiB frame of minimal leases",
            frame(
                MessageKind::Heartbeat,
                &list_payload(&[1, b'e'], u32::MAX, &[0, 1]),
            ),
        ),
        (
            "handshake: a 2 MiB frame of minimal regions",
            frame(
                MessageKind::Handshake,
                &list_payload(&[1, 1, b'e', 1, b'a', 0], u32::MAX, &[0, 0, 0, 1]),
            ),
        ),
        (
            "handshake: a 2 MiB agent_metadata",
            frame(
                MessageKind::Handshake,
                &list_payload(&[1, 1, b'e', 1, b'a'], u32::MAX, &[0xab]),
            ),
        ),
    ];
    let bound = 8 * MAX_PAYLOAD_LEN;
    let mut report = String::new();
    for (name, bytes) in &cases {
        let (peak, refused) = peak_of_decode(bytes);
        report.push_str(&format!(
            "{name}: peak {peak} bytes ({:.2} x MAX_PAYLOAD_LEN)\n",
            peak as f64 / MAX_PAYLOAD_LEN as f64
        ));
        assert!(refused, "{name} was accepted");
        assert!(peak <= bound, "{name}: {peak} bytes allocated\n{report}");
    }
    println!("{report}");
}
