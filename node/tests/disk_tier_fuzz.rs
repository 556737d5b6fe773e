//! Damaged disk-tier block files never crash strata and never come back as wrong KV: a bounded,
//! seeded fuzz run. A disk tier of 8 blocks is written, then each case damages one or two of its
//! files — bits flipped or bytes overwritten in the header (magic, parent flag, parent hash,
//! checksum) or in the KV bytes, the file truncated or extended — and reopens the directory as a
//! restarted engine does, then reads every block it took back. Every outcome must be a value or an
//! error (a damaged block is dropped at open or refused at read), never a panic, and every block
//! read must hold exactly the bytes written.

#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use strata_node::kv::{BlockHash, DiskTier};

const SEED: u64 = 0x5eed_d15c;
const MAX_CASES: usize = 10_000;
const BUDGET: Duration = Duration::from_secs(20);
const BLOCK: usize = 256;
const BLOCKS: u128 = 8;

fn bytes_of(hash: BlockHash) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (hash.0 as usize * 31 + i) as u8)
        .collect()
}

/// One campaign of at most `max_cases` cases within `budget`, from `seed`.
fn campaign(seed: u64, max_cases: usize, budget: Duration) -> fuzz::Report {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let hashes: Vec<BlockHash> = (1..=BLOCKS)
        .map(|h| BlockHash(h * 0x1234_5678_9abc))
        .collect();
    {
        let (mut tier, _) = DiskTier::open(&dir, 16, BLOCK).unwrap();
        for (i, &h) in hashes.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            tier.insert(h, parent, &bytes_of(h)).unwrap();
        }
    }
    let originals: Vec<(std::path::PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    assert_eq!(originals.len(), BLOCKS as usize);
    let header = originals[0].1.len() - BLOCK;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let started = Instant::now();
    let (mut cases, mut read_back, mut refused) = (0usize, 0usize, 0usize);
    while cases < max_cases && started.elapsed() < budget {
        cases += 1;
        for (path, bytes) in &originals {
            std::fs::write(path, bytes).unwrap();
        }
        for _ in 0..1 + rng.next_u32() % 2 {
            let (path, original) = &originals[rng.next_u32() as usize % originals.len()];
            let mut b = original.clone();
            let region = if rng.next_u32() % 2 == 0 {
                0..header
            } else {
                0..b.len()
            };
            let i = region.start + rng.next_u32() as usize % region.len();
            match rng.next_u32() % 4 {
                0 => b[i] ^= 1 << (rng.next_u32() % 8),
                1 => b[i] = rng.next_u32() as u8,
                2 => b.truncate(i),
                _ => b.extend_from_slice(&[0xAB; 7]),
            }
            std::fs::write(path, &b).unwrap();
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let (mut tier, _) = DiskTier::open(&dir, 16, BLOCK).expect("the directory opens");
            let (mut ok, mut bad) = (0, 0);
            let mut out = Vec::new();
            for &h in &hashes {
                if !tier.contains(h) {
                    continue;
                }
                match tier.read(h, &mut out) {
                    Ok(()) => {
                        assert_eq!(out, bytes_of(h), "block {h:?} read back other bytes");
                        ok += 1;
                    }
                    Err(_) => bad += 1,
                }
            }
            (ok, bad)
        }));
        match outcome {
            Ok((ok, bad)) => {
                read_back += ok;
                refused += bad;
            }
            Err(_) => panic!("case {cases} (seed {seed:#x}) panicked or misread"),
        }
        // Files the open dropped are written back by the next case.
    }
    let outcomes = [("blocks read back", read_back), ("blocks refused", refused)];
    fuzz::Report::of("disk kv tier", seed, started, cases, &outcomes)
}

#[test]
fn damaged_block_files_are_dropped_or_refused_never_misread() {
    let report = campaign(SEED, MAX_CASES, BUDGET);
    let (cases, read_back) = (report.cases, report.count("blocks read back"));
    assert!(cases >= 100, "too few cases ran ({cases})");
    assert!(read_back > 0, "no block survived: the test reads nothing");
    assert!(
        read_back < cases * BLOCKS as usize,
        "every block survived every case: the damage reached nothing"
    );
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn disk_tier_for_ten_minutes() {
    campaign(SEED + 1, usize::MAX, fuzz::LONG);
}
