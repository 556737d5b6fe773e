//! Memory after a burst (issue 40): what a burst of requests freed goes back to the operating
//! system once the server is idle. In a process of its own (this test binary holds one test), a
//! burst's worth of request-sized blocks is written and freed below a block still in use, as a
//! server's heap is after a burst: the allocator keeps the freed pages resident (the canary: the
//! retention is there to undo), and `strata_router::memory::trim` — what the server runs when its
//! last generation ends (`IdleTrim`, unit-tested for its timing) — returns them.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use strata_router::memory::trim;

/// Resident memory of this process, in bytes.
fn resident() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

#[test]
fn memory_freed_by_a_burst_goes_back_once_idle() {
    const BLOCK: usize = 64 << 10; // under the allocator's mmap threshold: heap memory
    const BURST: usize = 256 << 20;
    let before = resident();
    let mut blocks: Vec<Vec<u8>> = (0..BURST / BLOCK).map(|i| vec![i as u8; BLOCK]).collect();
    // Still in use above the burst's blocks: the heap's top cannot simply shrink.
    let pinned = vec![1u8; BLOCK];
    let peak = resident();
    assert!(
        peak >= before + BURST * 3 / 4,
        "the burst was not resident: {before} -> {peak}"
    );
    blocks.clear();
    blocks.shrink_to_fit();
    let freed = resident();
    eprintln!(
        "resident: {} MiB before, {} MiB at the peak, {} MiB once freed",
        before >> 20,
        peak >> 20,
        freed >> 20
    );
    // The canary: freeing alone leaves most of the burst resident.
    assert!(
        freed >= before + BURST / 2,
        "the allocator returned the burst by itself ({} MiB resident): nothing here tests trim",
        freed >> 20
    );
    trim();
    let trimmed = resident();
    eprintln!("{} MiB once trimmed", trimmed >> 20);
    assert!(
        trimmed <= before + BURST / 8,
        "{} MiB still resident after the trim ({} MiB before the burst)",
        trimmed >> 20,
        before >> 20
    );
    assert_eq!(pinned[BLOCK - 1], 1);
}
