use std::cell::RefCell;
use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use super::*;
use crate::kv::events::KvReplica;
use crate::kv::prompt_block_hashes;

const BYTES: usize = 24;

/// Device pool in memory: one byte vector per block.
struct FakeIo {
    blocks: Vec<Vec<u8>>,
    /// Deferred mode, like the CUDA backend's queued exports: the destination reads as poison
    /// until a settle writes the bytes (address, bytes, in queue order); an import from an
    /// address with a queued export sees that export's bytes, as the copy stream waits for it.
    queued: Option<RefCell<Vec<QueuedExport>>>,
}

/// A queued export: the destination's address and the bytes a settle writes there.
type QueuedExport = (usize, Vec<u8>);

const POISON: u8 = 0xEE;

impl FakeIo {
    fn new(blocks: usize) -> Self {
        Self {
            blocks: vec![vec![0; BYTES]; blocks],
            queued: None,
        }
    }

    fn deferred(blocks: usize) -> Self {
        Self {
            queued: Some(RefCell::default()),
            ..Self::new(blocks)
        }
    }
}

impl KvBlockIo for FakeIo {
    fn block_bytes(&self) -> usize {
        BYTES
    }
    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        out.copy_from_slice(&self.blocks[id as usize]);
        Ok(())
    }
    fn export_block_queued(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let Some(queued) = &self.queued else {
            return self.export_block(id, out);
        };
        let mut queued = queued.borrow_mut();
        let at = out.as_ptr() as usize;
        queued.retain(|(a, _)| *a != at);
        queued.push((at, self.blocks[id as usize].clone()));
        out.fill(POISON);
        Ok(())
    }
    fn settle(&self) -> Result<(), KvError> {
        let queued: Vec<_> = self
            .queued
            .iter()
            .flat_map(|q| std::mem::take(&mut *q.borrow_mut()))
            .collect();
        for (at, bytes) in queued {
            // SAFETY: `at` is a host tier slot of `BYTES` bytes: the tier's arena is allocated
            // once and outlives this io in every test; nothing else writes the slot meanwhile
            // (a later export into it replaced this entry).
            unsafe { std::slice::from_raw_parts_mut(at as *mut u8, BYTES) }.copy_from_slice(&bytes);
        }
        Ok(())
    }
    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        let at = data.as_ptr() as usize;
        let pending = self.queued.as_ref().and_then(|q| {
            let q = q.borrow();
            q.iter()
                .rev()
                .find(|(a, _)| *a == at)
                .map(|(_, b)| b.clone())
        });
        self.blocks[id as usize].copy_from_slice(pending.as_deref().unwrap_or(data));
        Ok(())
    }
}

#[test]
fn deferred_fake_io_hides_exported_bytes_until_settled() {
    let mut io = FakeIo::deferred(2);
    io.blocks[0] = vec![7; BYTES];
    let mut slot = vec![0u8; BYTES];
    io.export_block_queued(0, &mut slot).unwrap();
    assert_eq!(
        slot,
        vec![POISON; BYTES],
        "read before the settle: not there yet"
    );
    io.import_block(1, &slot).unwrap();
    assert_eq!(
        io.blocks[1],
        vec![7; BYTES],
        "an import waits for the queued export"
    );
    io.settle().unwrap();
    assert_eq!(slot, vec![7; BYTES]);
}

/// The KV bytes a block with this hash holds, distinct per hash.
fn content(hash: BlockHash) -> Vec<u8> {
    let b = hash.0.to_le_bytes();
    (0..BYTES).map(|i| b[i % 16] ^ i as u8).collect()
}

fn manager(device: usize, host: usize, disk: Option<(PathBuf, usize)>) -> BlockManager {
    let config = BlockManagerConfig {
        block_size: 4,
        device_blocks: device,
        host_blocks: host,
        disk,
    };
    BlockManager::new(config, BYTES).unwrap()
}

fn hashes(tokens: &[u32], salt: u64) -> Vec<BlockHash> {
    prompt_block_hashes(tokens, 4, salt)
}

/// Acquires the cached prefix of `chain`, then computes (allocate + write + commit) the rest.
fn prefill(bm: &mut BlockManager, io: &mut FakeIo, chain: &[BlockHash]) -> Vec<BlockId> {
    let mut ids = bm.acquire_prefix(chain, io).unwrap();
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(io.blocks[id as usize], content(chain[i]), "cached bytes");
    }
    for i in ids.len()..chain.len() {
        let id = bm.allocate(io).unwrap();
        io.blocks[id as usize] = content(chain[i]);
        let parent = i.checked_sub(1).map(|p| chain[p]);
        bm.commit(id, chain[i], parent).unwrap();
        ids.push(id);
    }
    bm.audit().unwrap();
    ids
}

fn release_all(bm: &mut BlockManager, ids: &[BlockId]) {
    for &id in ids {
        bm.release(id).unwrap();
    }
    bm.audit().unwrap();
}

fn drain(rx: &mut broadcast::Receiver<KvEvent>) -> Vec<KvEvent> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

#[test]
fn prefix_hit_after_release() {
    let (mut bm, mut io) = (manager(8, 0, None), FakeIo::new(8));
    let chain = hashes(&(0..12).collect::<Vec<_>>(), 1);
    let first = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &first);
    assert_eq!(bm.referenced_blocks(), 0);
    assert_eq!(bm.available(), 8, "cached blocks count as obtainable");

    let longer = hashes(&(0..16).collect::<Vec<_>>(), 1);
    assert_eq!(
        bm.lookup(&longer),
        PrefixLookup {
            device: 3,
            lower: 0
        }
    );
    let again = bm.acquire_prefix(&longer, &mut io).unwrap();
    assert_eq!(again, first);
    assert!(again.iter().all(|&id| bm.refcount(id) == Some(1)));
    bm.audit().unwrap();
}

#[test]
fn salt_isolates_tenants() {
    let (mut bm, mut io) = (manager(8, 0, None), FakeIo::new(8));
    let tokens: Vec<u32> = (0..8).collect();
    let a = prefill(&mut bm, &mut io, &hashes(&tokens, 1));
    let b = prefill(&mut bm, &mut io, &hashes(&tokens, 2));
    assert!(a.iter().all(|id| !b.contains(id)), "no block is shared");
    release_all(&mut bm, &a);
    release_all(&mut bm, &b);
    assert_eq!(bm.dump().blocks.len(), 4);
}

#[test]
fn canary_wrong_salt_lookup_misses() {
    let (mut bm, mut io) = (manager(4, 0, None), FakeIo::new(4));
    let tokens: Vec<u32> = (0..8).collect();
    let ids = prefill(&mut bm, &mut io, &hashes(&tokens, 42));
    release_all(&mut bm, &ids);
    // The canary: the right salt hits, so a miss below is the salt's doing.
    assert_eq!(bm.lookup(&hashes(&tokens, 42)).device, 2);
    let wrong = hashes(&tokens, 43);
    assert_eq!(bm.lookup(&wrong), PrefixLookup::default());
    assert!(bm.acquire_prefix(&wrong, &mut io).unwrap().is_empty());
}

#[test]
fn eviction_follows_lru_order() {
    let (mut bm, mut io) = (manager(3, 0, None), FakeIo::new(3));
    let [a, b, c] = [10u32, 20, 30].map(|t| hashes(&[t; 4], 0));
    let ids: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|h| prefill(&mut bm, &mut io, h)[0])
        .collect();
    // Release order b, a, c: b is least recently used.
    for i in [1, 0, 2] {
        bm.release(ids[i]).unwrap();
    }
    // A hit and release makes a the most recently used: b, c, a.
    let hit = bm.acquire_prefix(&a, &mut io).unwrap();
    bm.release(hit[0]).unwrap();
    let mut rx = bm.subscribe();
    let evict_order: Vec<_> = (0..3).map(|_| bm.allocate(&mut io).unwrap()).collect();
    assert_eq!(evict_order, vec![ids[1], ids[2], ids[0]]);
    let removed: Vec<_> = drain(&mut rx)
        .into_iter()
        .map(|e| match e.kind {
            KvEventKind::Removed { hash, tier } => (hash, tier),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let expected = [b[0], c[0], a[0]].map(|h| (h, Tier::Device)).to_vec();
    assert_eq!(removed, expected);
    bm.audit().unwrap();
}

#[test]
fn demotion_to_host_then_disk_and_promotion_restores_bytes() {
    demote_and_promote(FakeIo::new(2));
}

#[test]
fn demotion_and_promotion_restore_bytes_with_queued_exports() {
    demote_and_promote(FakeIo::deferred(2));
}

fn demote_and_promote(mut io: FakeIo) {
    let dir = tempfile::tempdir().unwrap();
    let disk = Some((dir.path().join("kv"), 2));
    let mut bm = manager(2, 1, disk);
    let chain = hashes(&(0..8).collect::<Vec<_>>(), 5);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);

    // Two new blocks evict chain[0] (to host) then chain[1] (to host, pushing chain[0] to disk).
    let scratch = [bm.allocate(&mut io).unwrap(), bm.allocate(&mut io).unwrap()];
    for &id in &scratch {
        io.blocks[id as usize] = vec![0xEE; BYTES];
    }
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Disk));
    assert_eq!(bm.tier_of(chain[1]), Some(Tier::Host));
    let file = dir.path().join("kv").join(format!("{:032x}", chain[0].0));
    let written = std::fs::read(&file).unwrap();
    assert_eq!(
        &written[written.len() - BYTES..],
        content(chain[0]),
        "header, then the bytes"
    );
    assert_eq!(
        bm.lookup(&chain),
        PrefixLookup {
            device: 0,
            lower: 2
        }
    );
    release_all(&mut bm, &scratch);

    // `prefill` asserts the promoted blocks hold exactly the original bytes.
    let back = prefill(&mut bm, &mut io, &chain);
    assert_eq!(
        bm.lookup(&chain),
        PrefixLookup {
            device: 2,
            lower: 0
        }
    );
    assert!(!file.exists(), "a promoted block leaves the disk tier");
    release_all(&mut bm, &back);
    assert_eq!(bm.lower_tier_failures(), 0);
}

#[test]
fn unreadable_disk_block_is_dropped_as_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let (mut bm, mut io) = (manager(1, 0, Some((dir.path().into(), 4))), FakeIo::new(1));
    let chain = hashes(&[7; 4], 0);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);
    let other = bm.allocate(&mut io).unwrap();
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Disk));
    bm.release(other).unwrap();
    std::fs::write(dir.path().join(format!("{:032x}", chain[0].0)), [1, 2]).unwrap();

    assert!(bm.acquire_prefix(&chain, &mut io).unwrap().is_empty());
    assert_eq!(bm.tier_of(chain[0]), None);
    assert_eq!(bm.lower_tier_failures(), 1);
    bm.audit().unwrap();
}

#[test]
fn out_of_blocks_when_everything_is_referenced() {
    let (mut bm, mut io) = (manager(2, 2, None), FakeIo::new(2));
    let chain = hashes(&[1; 4], 0);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);
    let held = [bm.allocate(&mut io).unwrap(), bm.allocate(&mut io).unwrap()];
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Host));
    assert!(matches!(
        bm.allocate(&mut io),
        Err(KvError::OutOfBlocks { needed: 1, free: 0 })
    ));
    // A host hit cannot be promoted without a device block: acquisition stops, no change.
    assert!(bm.acquire_prefix(&chain, &mut io).unwrap().is_empty());
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Host));
    bm.audit().unwrap();
    release_all(&mut bm, &held);
}

#[test]
fn duplicate_commit_keeps_the_first_block() {
    let (mut bm, mut io) = (manager(4, 0, None), FakeIo::new(4));
    let h = hashes(&[3; 4], 0)[0];
    let (x, y) = (bm.allocate(&mut io).unwrap(), bm.allocate(&mut io).unwrap());
    assert_eq!(bm.commit(x, h, None).unwrap(), CommitOutcome::Indexed);
    assert_eq!(bm.commit(y, h, None).unwrap(), CommitOutcome::AlreadyCached);
    assert!(matches!(
        bm.commit(x, h, None),
        Err(KvError::BadCommit { .. })
    ));
    bm.audit().unwrap();
    release_all(&mut bm, &[x, y]);
    assert_eq!(bm.acquire_prefix(&[h], &mut io).unwrap(), vec![x]);
    assert_eq!(bm.dump().blocks.len(), 1);
    // y went back to the free list, not the cache: three blocks are free.
    assert_eq!(bm.available(), 3);
}

#[test]
fn commit_over_a_lower_tier_copy_takes_the_device_block() {
    let (mut bm, mut io) = (manager(1, 1, None), FakeIo::new(1));
    let chain = hashes(&[9; 4], 0);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);
    let id = bm.allocate(&mut io).unwrap();
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Host));
    let mut rx = bm.subscribe();
    assert_eq!(
        bm.commit(id, chain[0], None).unwrap(),
        CommitOutcome::Indexed
    );
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Device));
    let kinds: Vec<_> = drain(&mut rx).into_iter().map(|e| e.kind).collect();
    let moved = KvEventKind::TierChanged {
        hash: chain[0],
        from: Tier::Host,
        to: Tier::Device,
    };
    assert_eq!(kinds, vec![moved]);
    bm.audit().unwrap();
}

#[test]
fn releasing_an_unreferenced_block_is_an_error() {
    let (mut bm, mut io) = (manager(2, 0, None), FakeIo::new(2));
    let id = bm.allocate(&mut io).unwrap();
    bm.release(id).unwrap();
    assert!(matches!(bm.release(id), Err(KvError::NotReferenced { .. })));
    assert!(matches!(bm.release(99), Err(KvError::NoSuchBlock { .. })));
    bm.audit().unwrap();
    assert_eq!(bm.available(), 2);
}

#[test]
fn events_numbered_without_gaps_and_dump_equals_replay() {
    let dir = tempfile::tempdir().unwrap();
    let (mut bm, mut io) = (manager(3, 2, Some((dir.path().into(), 2))), FakeIo::new(3));
    let mut rx = bm.subscribe();
    let mut replica = KvReplica::default();
    for round in 0..6u32 {
        let chain = hashes(&[round; 12], u64::from(round % 2));
        let ids = prefill(&mut bm, &mut io, &chain);
        release_all(&mut bm, &ids);
        for event in drain(&mut rx) {
            replica.apply(&event).unwrap(); // fails on any gap
        }
        assert_eq!(replica.to_dump(), bm.dump(), "round {round}");
    }
    let kinds = replica
        .to_dump()
        .blocks
        .iter()
        .map(|b| b.2)
        .collect::<Vec<_>>();
    assert!(
        kinds.contains(&Tier::Disk),
        "the workload reached every tier"
    );
}

/// A fake sequence: the chain it wants, the blocks it holds for its prefix, and a block being
/// written (allocated, not yet committed).
struct FakeSeq {
    chain: Vec<BlockHash>,
    held: Vec<BlockId>,
    writing: Option<BlockId>,
}

#[test]
fn randomized_workload_keeps_invariants() {
    randomized_workload(FakeIo::new(24));
}

#[test]
fn randomized_workload_keeps_invariants_with_queued_exports() {
    randomized_workload(FakeIo::deferred(24));
}

fn randomized_workload(mut io: FakeIo) {
    let dir = tempfile::tempdir().unwrap();
    let mut bm = manager(24, 8, Some((dir.path().into(), 8)));
    let mut rng = ChaCha8Rng::seed_from_u64(0x5742_7a7a);
    let mut rx = bm.subscribe();
    let mut replica = KvReplica::default();
    let mut seqs: Vec<FakeSeq> = Vec::new();
    let mut moves = HashMap::new();
    let mut pick = |n: usize| (rng.next_u32() as usize) % n.max(1);

    for step in 0..10_000 {
        match pick(5) {
            0 if seqs.len() < 8 => {
                // Prompts from a few families share prefixes; two salts never share.
                let family = pick(4) as u32;
                let len = 4 * (1 + pick(8));
                let tokens: Vec<u32> = (0..len as u32).map(|i| family * 1000 + i).collect();
                let chain = hashes(&tokens, pick(2) as u64);
                let held = bm.acquire_prefix(&chain, &mut io).unwrap();
                for (i, &id) in held.iter().enumerate() {
                    assert_eq!(io.blocks[id as usize], content(chain[i]), "step {step}");
                }
                seqs.push(FakeSeq {
                    chain,
                    held,
                    writing: None,
                });
            }
            1 if !seqs.is_empty() => {
                let i = pick(seqs.len());
                let s = &mut seqs[i];
                if s.writing.is_none() && s.held.len() < s.chain.len() {
                    match bm.allocate(&mut io) {
                        Ok(id) => s.writing = Some(id),
                        Err(KvError::OutOfBlocks { .. }) => assert_eq!(bm.available(), 0),
                        Err(e) => panic!("step {step}: {e}"),
                    }
                }
            }
            2 if !seqs.is_empty() => {
                let i = pick(seqs.len());
                let s = &mut seqs[i];
                if let Some(id) = s.writing.take() {
                    let i = s.held.len();
                    io.blocks[id as usize] = content(s.chain[i]);
                    let parent = i.checked_sub(1).map(|p| s.chain[p]);
                    bm.commit(id, s.chain[i], parent).unwrap();
                    s.held.push(id);
                }
            }
            3 if !seqs.is_empty() => {
                // Finish: release everything, newest block first.
                let s = seqs.swap_remove(pick(seqs.len()));
                for &id in s.held.iter().rev() {
                    bm.release(id).unwrap();
                }
                if let Some(id) = s.writing {
                    bm.release(id).unwrap();
                }
            }
            4 if !seqs.is_empty() => {
                // Cancel: release in arbitrary order, the half-written block included.
                let mut s = seqs.swap_remove(pick(seqs.len()));
                s.held.extend(s.writing);
                while !s.held.is_empty() {
                    let id = s.held.swap_remove(pick(s.held.len()));
                    bm.release(id).unwrap();
                }
            }
            _ => {}
        }
        if let Err(broken) = bm.audit() {
            panic!("step {step}: {broken}");
        }
        for event in drain(&mut rx) {
            if let KvEventKind::TierChanged { from, to, .. } = event.kind {
                *moves.entry((from, to)).or_insert(0u32) += 1;
            }
            replica.apply(&event).unwrap();
        }
    }
    for s in seqs.drain(..) {
        for id in s.held.into_iter().chain(s.writing) {
            bm.release(id).unwrap();
        }
    }
    bm.audit().unwrap();
    assert_eq!(bm.referenced_blocks(), 0);
    assert_eq!(bm.available(), bm.device_blocks());
    assert_eq!(replica.to_dump(), bm.dump());
    assert!(bm.dump().seq > 1000, "the workload exercised the cache");
    assert_eq!(bm.lower_tier_failures(), 0);
    use Tier::{Device, Disk, Host};
    for path in [(Device, Host), (Host, Disk), (Host, Device), (Disk, Device)] {
        assert!(
            moves.get(&path).is_some_and(|&n| n > 0),
            "{path:?} never happened"
        );
    }
}

#[test]
fn audit_detects_corruption() {
    let (mut bm, mut io) = (manager(4, 0, None), FakeIo::new(4));
    let chain = hashes(&[5; 8], 0);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);
    bm.audit().unwrap();
    // Canary: each corruption below must be caught.
    let mut leaked = manager(2, 0, None);
    leaked.free.pop();
    assert!(leaked.audit().unwrap_err().contains("leaked"));
    bm.blocks[ids[0] as usize].hash = None;
    assert!(bm.audit().is_err());
}

/// Blocks cached on one node, in any tier, arrive on another as device blocks of the same
/// bytes, indexed and announced, and the next request there acquires them like its own.
#[test]
fn export_import_moves_a_prefix_between_nodes() {
    let dir = tempfile::tempdir().unwrap();
    // The source holds 6 blocks: the oldest go down to host, then disk.
    let (mut src, mut src_io) = (
        manager(2, 2, Some((dir.path().to_path_buf(), 8))),
        FakeIo::new(2),
    );
    let chain = hashes(&(0..24).collect::<Vec<_>>(), 3);
    for (i, &hash) in chain.iter().enumerate() {
        let id = src.allocate(&mut src_io).unwrap();
        src_io.blocks[id as usize] = content(hash);
        src.commit(id, hash, i.checked_sub(1).map(|p| chain[p]))
            .unwrap();
        src.release(id).unwrap();
    }
    let tiers: Vec<_> = chain.iter().map(|&h| src.tier_of(h).unwrap()).collect();
    for tier in [Tier::Device, Tier::Host, Tier::Disk] {
        assert!(tiers.contains(&tier), "{tier:?} is exercised: {tiers:?}");
    }
    let before = src.dump();
    let exported = src.export_prefix(&chain, &src_io);
    assert_eq!(exported.len(), 6);
    for (hash, bytes) in &exported {
        assert_eq!(bytes, &content(*hash));
    }
    assert_eq!(src.dump(), before, "exporting changes nothing");
    src.audit().unwrap();

    let (mut dst, mut dst_io) = (manager(8, 0, None), FakeIo::new(8));
    let mut rx = dst.subscribe();
    // The destination computed the first block itself; it imports the rest after it.
    let first = prefill(&mut dst, &mut dst_io, &chain[..1]);
    release_all(&mut dst, &first);
    drain(&mut rx);
    assert_eq!(
        dst.import_prefix(Some(chain[0]), &exported[1..], &mut dst_io),
        5
    );
    dst.audit().unwrap();
    let stored: Vec<_> = drain(&mut rx)
        .into_iter()
        .map(|e| match e.kind {
            KvEventKind::Stored { hash, parent, tier } => (hash, parent, tier),
            other => panic!("unexpected event {other:?}"),
        })
        .collect();
    let want: Vec<_> = (1..6)
        .map(|i| (chain[i], Some(chain[i - 1]), Tier::Device))
        .collect();
    assert_eq!(stored, want);
    assert_eq!(dst.lookup(&chain).device, 6);
    // `prefill` checks the bytes of every acquired block.
    let ids = prefill(&mut dst, &mut dst_io, &chain);
    release_all(&mut dst, &ids);
    // Importing again changes nothing: every block is cached already.
    let seq = dst.dump().seq;
    assert_eq!(dst.import_prefix(None, &exported, &mut dst_io), 6);
    assert_eq!(dst.dump().seq, seq);
}

/// An import takes only the room there is (never evicting its own blocks) and stops at a block
/// of the wrong length.
#[test]
fn import_is_bounded_and_checked() {
    let chain = hashes(&(0..20).collect::<Vec<_>>(), 0);
    let blocks: Vec<_> = chain.iter().map(|&h| (h, content(h))).collect();
    let (mut bm, mut io) = (manager(3, 0, None), FakeIo::new(3));
    assert_eq!(bm.import_prefix(None, &blocks, &mut io), 3);
    bm.audit().unwrap();
    assert_eq!(
        bm.lookup(&chain).device,
        3,
        "the first three, not the last three"
    );
    // The pool held one referenced block: two are imported.
    let (mut bm, mut io) = (manager(3, 0, None), FakeIo::new(3));
    let held = bm.allocate(&mut io).unwrap();
    assert_eq!(bm.import_prefix(None, &blocks, &mut io), 2);
    bm.release(held).unwrap();
    bm.audit().unwrap();
    // Canary: a short block ends the run there.
    let (mut bm, mut io) = (manager(8, 0, None), FakeIo::new(8));
    let mut bad = blocks.clone();
    bad[2].1.pop();
    assert_eq!(bm.import_prefix(None, &bad, &mut io), 2);
    assert_eq!(bm.lookup(&chain).device, 2);
    bm.audit().unwrap();
}

/// A pinned prefix outlives traffic that evicts everything else: on a device alone it is never
/// evicted (and pins are refused beyond half the device); with a host tier it is demoted after
/// every unpinned block and never dropped; unpinned or expired, it is evicted like any other.
#[test]
fn pinned_prefixes_are_evicted_last_and_never_dropped() {
    let (mut bm, mut io) = (manager(6, 0, None), FakeIo::new(6));
    let context = hashes(&(0..12).collect::<Vec<_>>(), 0);
    let ids = prefill(&mut bm, &mut io, &context);
    release_all(&mut bm, &ids);
    let status = bm.pin("doc", &context, None).unwrap();
    assert_eq!((status.blocks, status.device), (3, 3));
    // A longer pin than half the device is refused by name; the first pin stays.
    let other = hashes(&(100..112).collect::<Vec<_>>(), 0);
    let ids = prefill(&mut bm, &mut io, &other);
    release_all(&mut bm, &ids);
    let refused = bm.pin("other", &other, None).unwrap_err();
    assert!(
        matches!(refused, KvError::PinCapacity { needed: 6, room: 3 }),
        "{refused}"
    );
    // Traffic twice the device's size: the pinned blocks stay on the device.
    for t in 0..4u32 {
        let chain = hashes(&(200 + 12 * t..212 + 12 * t).collect::<Vec<_>>(), 0);
        let ids = prefill(&mut bm, &mut io, &chain);
        release_all(&mut bm, &ids);
    }
    assert_eq!(bm.pin_status("doc").unwrap().device, 3);
    assert_eq!(bm.lookup(&context).device, 3);
    // The canary: unpinned, the same traffic evicts it.
    assert!(bm.unpin("doc"));
    for t in 0..4u32 {
        let chain = hashes(&(300 + 12 * t..312 + 12 * t).collect::<Vec<_>>(), 0);
        let ids = prefill(&mut bm, &mut io, &chain);
        release_all(&mut bm, &ids);
    }
    assert_eq!(bm.lookup(&context), PrefixLookup::default());

    // With a host tier of 4: pinned blocks leave the device after the unpinned ones and stay
    // in host memory while unpinned traffic passes through it.
    let (mut bm, mut io) = (manager(4, 4, None), FakeIo::new(4));
    let ids = prefill(&mut bm, &mut io, &context);
    release_all(&mut bm, &ids);
    let expires = std::time::Instant::now() + std::time::Duration::from_secs(3600);
    bm.pin("doc", &context, Some(expires)).unwrap();
    assert_eq!(bm.pin_room(), 4);
    for t in 0..6u32 {
        let chain = hashes(&(400 + 12 * t..412 + 12 * t).collect::<Vec<_>>(), 0);
        let ids = prefill(&mut bm, &mut io, &chain);
        release_all(&mut bm, &ids);
    }
    let status = bm.pin_status("doc").unwrap();
    assert_eq!(status.device + status.host, 3, "{status:?}");
    let again = bm.acquire_prefix(&context, &mut io).unwrap();
    assert_eq!(again.len(), 3, "restored from host");
    for (id, hash) in again.iter().zip(&context) {
        assert_eq!(io.blocks[*id as usize], content(*hash));
    }
    release_all(&mut bm, &again);
    // Expired, the pin is gone.
    bm.expire_pins(expires);
    assert!(bm.pin_status("doc").is_none());
    assert!(bm.pin_statuses().is_empty());
}

/// chain[0] on disk, chain[1] in host memory, nothing on the device (as `demote_and_promote`
/// leaves them), with restore times measured as given (per block: host, disk) and a compute
/// rate of 1 ms a block.
fn parked(dir: &std::path::Path, restore_s: [f64; 2]) -> (BlockManager, FakeIo, Vec<BlockHash>) {
    let mut io = FakeIo::new(2);
    let mut bm = manager(2, 1, Some((dir.join("kv"), 2)));
    let chain = hashes(&(0..8).collect::<Vec<_>>(), 5);
    let ids = prefill(&mut bm, &mut io, &chain);
    release_all(&mut bm, &ids);
    let scratch = [bm.allocate(&mut io).unwrap(), bm.allocate(&mut io).unwrap()];
    release_all(&mut bm, &scratch);
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Disk));
    assert_eq!(bm.tier_of(chain[1]), Some(Tier::Host));
    bm.traffic.restored = [10, 10];
    bm.traffic.restore_ns = restore_s.map(|s| (s * 10.0 * 1e9) as u64);
    bm.set_compute_rate(4_000); // 4-token blocks: 1 ms each
    (bm, io, chain)
}

#[test]
fn a_tier_slower_than_recomputing_is_not_restored_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    // Disk 5 ms a block against 1 ms to recompute: restoring the disk block (and the host block
    // behind it) costs 5 ms, recomputing both 2 ms.
    let (mut bm, mut io, chain) = parked(dir.path(), [1e-6, 5e-3]);
    let ids = bm.acquire_prefix(&chain, &mut io).unwrap();
    assert!(ids.is_empty(), "recomputed, not restored: {ids:?}");
    assert_eq!(bm.declined_restores(), [1, 1]);
    assert_eq!(bm.tier_of(chain[0]), Some(Tier::Disk), "left where it was");
    // The canary: forced to restore, the same request takes both blocks back (the slower way).
    bm.set_restore_policy(RestorePolicy::Always);
    let ids = bm.acquire_prefix(&chain, &mut io).unwrap();
    assert_eq!(ids.len(), 2);
    release_all(&mut bm, &ids);
}

#[test]
fn a_tier_faster_than_recomputing_is_restored() {
    let dir = tempfile::tempdir().unwrap();
    // Disk 0.1 ms a block: restoring both costs about 0.1 ms against 2 ms of compute.
    let (mut bm, mut io, chain) = parked(dir.path(), [1e-6, 1e-4]);
    let ids = bm.acquire_prefix(&chain, &mut io).unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(bm.declined_restores(), [0, 0]);
    release_all(&mut bm, &ids);
    // Before the engine has timed a prefill every tier is restored (and so measured).
    let dir = tempfile::tempdir().unwrap();
    let (mut bm, mut io, chain) = parked(dir.path(), [1e-6, 5e-3]);
    bm.set_compute_rate(0);
    assert_eq!(bm.acquire_prefix(&chain, &mut io).unwrap().len(), 2);
}

#[test]
fn restore_policies_parse_by_name() {
    assert_eq!("auto".parse::<RestorePolicy>(), Ok(RestorePolicy::Auto));
    assert_eq!("always".parse::<RestorePolicy>(), Ok(RestorePolicy::Always));
    assert!(
        "never"
            .parse::<RestorePolicy>()
            .unwrap_err()
            .contains("auto or always")
    );
}
