//! Loopback ports for harnesses that start nodes in other processes.
//!
//! A child process must be told its peer's address before either binds, so the parent picks the
//! ports, checks that it can bind them, and releases them. A port the kernel handed out with
//! `bind(0)` comes from the ephemeral range, the same range from which UCX (inside NIXL) and
//! every outgoing connection of a concurrent test draw their own ports, so it could be taken in
//! the window before the child binds it (seen in CI: "the side channel could not start: Address
//! already in use"). These ports come from below the ephemeral range, which the kernel never
//! hands out by itself; a process-wide counter keeps the picks of concurrent tests apart.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// The lowest port handed out: above the well-known and the usual service ports.
const LOWEST: u16 = 20_000;
/// How many candidate blocks are tried before giving up.
const ATTEMPTS: u32 = 200;

/// Ports this process has taken so far (or skipped), counted from its seed: each call takes
/// the next `N`, so the calls of one process never share a port, whatever their `N`, until the
/// whole range was used.
static TAKEN: AtomicU32 = AtomicU32::new(0);

/// Where this process's picks start in the range. Drawn once per process: a seed drawn per call
/// (as it once was) let two calls pick overlapping ports by chance, a few percent of runs of
/// the test below. It still varies per process, so that a port a crashed child left in
/// TIME_WAIT is not the first pick of the next run.
fn process_seed() -> u32 {
    static SEED: OnceLock<u32> = OnceLock::new();
    *SEED.get_or_init(|| {
        std::process::id()
            ^ SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
    })
}

/// The low end of the kernel's ephemeral port range (Linux); 32768 elsewhere or if unreadable.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// `N` distinct loopback addresses, each bound once here (all at the same time) and released
/// for a child process to bind. Panics, as harness code may, when no block of free ports is
/// found after many tries.
///
/// ```
/// let [p, d] = kvhandoff_testkit::ports::loopback_ports::<2>();
/// assert_ne!(p.port(), d.port());
/// ```
pub fn loopback_ports<const N: usize>() -> [SocketAddr; N] {
    let high = ephemeral_low().max(LOWEST + 1_000);
    let range = u32::from(high - LOWEST);
    let n = N as u32;
    let seed = process_seed() % range.max(1);
    for _ in 0..ATTEMPTS {
        let offset = seed.wrapping_add(TAKEN.fetch_add(n, Ordering::Relaxed)) % range.max(1);
        if offset + n > range {
            continue; // the run would cross the top of the range: take the next one
        }
        let first = u32::from(LOWEST) + offset;
        let held: Vec<TcpListener> = (0..N as u32)
            .filter_map(|i| {
                let port = u16::try_from(first + i).ok()?;
                TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).ok()
            })
            .collect();
        if held.len() == N {
            let addrs: Vec<SocketAddr> = held.iter().filter_map(|l| l.local_addr().ok()).collect();
            if let Ok(addrs) = <[SocketAddr; N]>::try_from(addrs) {
                return addrs;
            }
        }
    }
    panic!("no {N} free loopback ports below the ephemeral range after {ATTEMPTS} tries");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls of one process with different `N` (as a test binary's harnesses make) never hand
    /// out a port twice: with a seed drawn per call and blocks sized by `N`, this failed in a
    /// few percent of runs.
    #[test]
    fn ports_are_distinct_below_the_ephemeral_range_and_bindable() {
        let low = ephemeral_low();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut picked = loopback_ports::<3>().to_vec();
            picked.extend(loopback_ports::<2>());
            for addr in picked {
                assert!(addr.port() >= LOWEST && addr.port() < low.max(LOWEST + 1_000));
                assert!(seen.insert(addr.port()), "{addr} picked twice");
                TcpListener::bind(addr).expect("released for the child");
            }
        }
    }
}
