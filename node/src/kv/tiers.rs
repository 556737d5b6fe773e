//! The lower KV tiers, both backend-neutral: [`HostTier`] keeps block bytes in memory,
//! [`DiskTier`] keeps one self-describing file per block, found again after a restart. Each is
//! an LRU of bounded capacity; inserting into a full tier evicts (and returns) its
//! least-recently-used block so the caller can demote it.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::hash::{BuildHasherDefault, Hash};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::KvError;
use super::types::BlockHash;
use super::types::{BlockHashHasher, BlockHashMap};

/// Recency order over keys: O(log n) touch, remove and pop-oldest. A tick that only grows keys
/// the BTreeMap, so its first entry is always the least recently used.
#[derive(Debug, Clone)]
pub(crate) struct LruOrder<K> {
    next_tick: u64,
    by_tick: BTreeMap<u64, K>,
    tick_of: HashMap<K, u64, BuildHasherDefault<BlockHashHasher>>,
}

impl<K: Copy + Eq + Hash> LruOrder<K> {
    pub(crate) fn new() -> Self {
        Self {
            next_tick: 0,
            by_tick: BTreeMap::new(),
            tick_of: HashMap::default(),
        }
    }

    /// Inserts `key` as the most recently used, or moves it there.
    pub(crate) fn touch(&mut self, key: K) {
        if let Some(old) = self.tick_of.insert(key, self.next_tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.next_tick, key);
        self.next_tick += 1;
    }

    pub(crate) fn remove(&mut self, key: &K) -> bool {
        match self.tick_of.remove(key) {
            Some(tick) => {
                self.by_tick.remove(&tick);
                true
            }
            None => false,
        }
    }

    pub(crate) fn pop_oldest(&mut self) -> Option<K> {
        let (_, key) = self.by_tick.pop_first()?;
        self.tick_of.remove(&key);
        Some(key)
    }

    /// The least recently used key `evictable` accepts, removed; else the least recently used
    /// key of all when `fall_back`.
    pub(crate) fn pop_oldest_preferring(
        &mut self,
        evictable: impl Fn(&K) -> bool,
        fall_back: bool,
    ) -> Option<K> {
        let found = self.by_tick.iter().find(|(_, k)| evictable(k));
        let tick = match found {
            Some((tick, _)) => *tick,
            None if fall_back => *self.by_tick.first_key_value()?.0,
            None => return None,
        };
        let key = self.by_tick.remove(&tick)?;
        self.tick_of.remove(&key);
        Some(key)
    }

    pub(crate) fn contains(&self, key: &K) -> bool {
        self.tick_of.contains_key(key)
    }

    pub(crate) fn len(&self) -> usize {
        self.tick_of.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tick_of.is_empty()
    }

    /// Keys from least to most recently used.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &K> {
        self.by_tick.values()
    }

    /// The two maps describe the same set.
    pub(crate) fn is_consistent(&self) -> bool {
        self.by_tick.len() == self.tick_of.len()
            && self
                .by_tick
                .iter()
                .all(|(tick, key)| self.tick_of.get(key) == Some(tick))
    }
}

/// The host tier's memory: one arena of `capacity × block_bytes`, allocated up front. Plain
/// memory on the CPU; page-locked on CUDA, so copies between it and the device are DMA and run
/// asynchronously on the device's stream ([`super::KvBlockIo::host_memory`]).
pub trait HostMemory: Send {
    fn as_slice(&self) -> &[u8];
    fn as_mut_slice(&mut self) -> &mut [u8];
}

impl HostMemory for Vec<u8> {
    fn as_slice(&self) -> &[u8] {
        self
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self
    }
}

/// A block evicted from the host tier: its hash and bytes, for the tier below.
pub type Evicted = (BlockHash, Vec<u8>);

/// Blocks in host memory: fixed slots of one arena, an index from hash to slot, and an LRU.
/// A demotion reserves a slot (evicting the least recently used block when full, its bytes
/// handed back for the tier below), has the backend copy the block into it, then commits it;
/// a promotion detaches a slot, has the backend copy from it, then releases it. Slot bytes are
/// only ever written by the backend's copies, which on CUDA run in stream order.
pub struct HostTier {
    capacity: usize,
    block_bytes: usize,
    memory: Box<dyn HostMemory>,
    slot_of: BlockHashMap<u32>,
    free: Vec<u32>,
    lru: LruOrder<BlockHash>,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("capacity", &self.capacity)
            .field("block_bytes", &self.block_bytes)
            .field("len", &self.slot_of.len())
            .finish()
    }
}

impl HostTier {
    /// A tier of `capacity` blocks in plain memory.
    pub fn new(capacity: usize, block_bytes: usize) -> Self {
        Self::with_memory(
            capacity,
            block_bytes,
            Box::new(vec![0u8; capacity * block_bytes]),
        )
    }

    /// A tier of `capacity` blocks in `memory` (at least `capacity × block_bytes` long).
    pub fn with_memory(capacity: usize, block_bytes: usize, memory: Box<dyn HostMemory>) -> Self {
        assert!(
            memory.as_slice().len() >= capacity * block_bytes,
            "host tier memory smaller than its capacity"
        );
        Self {
            capacity,
            block_bytes,
            memory,
            slot_of: BlockHashMap::default(),
            free: (0..capacity as u32).rev().collect(),
            lru: LruOrder::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.slot_of.contains_key(&hash)
    }

    fn range(&self, slot: u32) -> std::ops::Range<usize> {
        let at = slot as usize * self.block_bytes;
        at..at + self.block_bytes
    }

    /// The bytes of `slot`.
    pub fn slot(&self, slot: u32) -> &[u8] {
        &self.memory.as_slice()[self.range(slot)]
    }

    /// The bytes of `slot`, to copy a block into.
    pub fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let range = self.range(slot);
        &mut self.memory.as_mut_slice()[range]
    }

    /// A slot for a block about to be copied in: a free one, else that of the least recently
    /// used block `evictable` accepts (pinned blocks go last), whose hash comes back: its bytes
    /// are still in the slot, for the tier below. `None` with a capacity of 0.
    pub fn reserve(
        &mut self,
        evictable: impl Fn(&BlockHash) -> bool,
    ) -> Option<(u32, Option<BlockHash>)> {
        if let Some(slot) = self.free.pop() {
            return Some((slot, None));
        }
        let victim = self.lru.pop_oldest_preferring(evictable, true)?;
        let slot = self.slot_of.remove(&victim)?;
        Some((slot, Some(victim)))
    }

    /// Makes the block copied into `slot` the cached copy of `hash`, most recently used.
    pub fn commit(&mut self, hash: BlockHash, slot: u32) {
        if let Some(old) = self.slot_of.insert(hash, slot) {
            self.free.push(old);
        }
        self.lru.touch(hash);
    }

    /// Returns a reserved or detached slot to the free list.
    pub fn release(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// Takes `hash` out of the tier, keeping its slot (and bytes) until [`HostTier::release`].
    pub fn detach(&mut self, hash: BlockHash) -> Option<u32> {
        self.lru.remove(&hash);
        self.slot_of.remove(&hash)
    }

    /// Stores `bytes` as the most recently used block and returns the block evicted to make room
    /// (with a capacity of 0 that is the block just offered).
    pub fn insert(&mut self, hash: BlockHash, bytes: Vec<u8>) -> Option<Evicted> {
        self.insert_preferring(hash, bytes, |_| true)
    }

    /// [`HostTier::insert`], evicting the least recently used block `evictable` accepts first.
    pub fn insert_preferring(
        &mut self,
        hash: BlockHash,
        bytes: Vec<u8>,
        evictable: impl Fn(&BlockHash) -> bool,
    ) -> Option<Evicted> {
        if let Some(slot) = self.detach(hash) {
            self.release(slot);
        }
        let Some((slot, victim)) = self.reserve(evictable) else {
            return Some((hash, bytes));
        };
        let victim = victim.map(|victim| (victim, self.slot(slot).to_vec()));
        self.slot_mut(slot).copy_from_slice(&bytes);
        self.commit(hash, slot);
        victim
    }

    /// The block's bytes, leaving its recency as it is.
    pub fn peek(&self, hash: BlockHash) -> Option<&[u8]> {
        self.slot_of.get(&hash).map(|&slot| self.slot(slot))
    }

    /// Drops the block; returns whether it was held.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        match self.detach(hash) {
            Some(slot) => {
                self.release(slot);
                true
            }
            None => false,
        }
    }

    /// Hashes from least to most recently used.
    pub fn lru_order(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.lru.iter().copied()
    }

    pub(crate) fn is_consistent(&self) -> bool {
        self.lru.is_consistent()
            && self.lru.len() == self.slot_of.len()
            && self.slot_of.keys().all(|h| self.lru.contains(h))
            && self.slot_of.len() + self.free.len() <= self.capacity
    }
}

/// One file per block in a directory the tier owns, named by the hash in hex. Each file starts
/// with a header naming the block's parent in its hash chain and a checksum of its bytes, so the
/// tier outlives the process: [`DiskTier::open`] finds the blocks a previous process left and
/// hands them back to be indexed again (least recently written first). A file that is not a
/// whole block (a torn write, another format) is removed at open; one whose bytes no longer
/// match their checksum is refused when read.
///
/// One file per block rather than per context: a block of a real model is megabytes (2 MiB for
/// Llama-3.1-8B at 16 tokens), a large sequential write and read, and a file per block keeps
/// eviction exact with no compaction (docs/DECISIONS.md).
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    capacity: usize,
    block_bytes: usize,
    lru: LruOrder<BlockHash>,
}

const TEMP_SUFFIX: &str = ".tmp";
/// Block file header: magic, a has-parent flag, the parent hash, the xxh3-64 of the bytes.
const MAGIC: &[u8; 8] = b"STKVBLK1";
const HEADER_BYTES: usize = 8 + 8 + 16 + 8;

fn is_block_file_name(name: &str) -> bool {
    let stem = name.strip_suffix(TEMP_SUFFIX).unwrap_or(name);
    stem.len() == 32 && stem.bytes().all(|b| b.is_ascii_hexdigit())
}

fn header(parent: Option<BlockHash>, bytes: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(MAGIC);
    h[8] = u8::from(parent.is_some());
    h[16..32].copy_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
    h[32..40].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(bytes).to_le_bytes());
    h
}

/// The parent a header names and the checksum it records; `None` if it is not a header.
fn parse_header(h: &[u8]) -> Option<(Option<BlockHash>, u64)> {
    if h.len() < HEADER_BYTES || &h[..8] != MAGIC || h[8] > 1 {
        return None;
    }
    let parent = u128::from_le_bytes(h[16..32].try_into().ok()?);
    let checksum = u64::from_le_bytes(h[32..40].try_into().ok()?);
    Some(((h[8] == 1).then_some(BlockHash(parent)), checksum))
}

/// Reads the block file at `path` (a header, then `block_bytes` bytes) into `out`: a missing
/// file is an `Io` error (NotFound); a file of the wrong length is `ShortBlock`; bytes that do
/// not match their checksum are `Corrupt`.
pub(crate) fn read_block_file(
    path: &Path,
    block_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<(), KvError> {
    let io = |source| KvError::Io {
        path: path.to_path_buf(),
        source,
    };
    let short = |actual: u64| KvError::ShortBlock {
        path: path.to_path_buf(),
        expected: HEADER_BYTES + block_bytes,
        actual,
    };
    // Header and bytes read into their own buffers: no copy to strip the header after, and the
    // block's buffer is not zeroed first.
    let mut file = fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len != (HEADER_BYTES + block_bytes) as u64 {
        return Err(short(len));
    }
    let mut header = [0u8; HEADER_BYTES];
    file.read_exact(&mut header).map_err(io)?;
    out.clear();
    out.reserve_exact(block_bytes);
    let read = file.take(block_bytes as u64).read_to_end(out).map_err(io)?;
    if read != block_bytes {
        return Err(short((HEADER_BYTES + read) as u64));
    }
    let checksum = parse_header(&header).map(|(_, c)| c);
    if checksum != Some(xxhash_rust::xxh3::xxh3_64(out)) {
        return Err(KvError::Corrupt {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

/// A block the disk tier found at open: its hash and its parent in the chain.
pub type RestoredBlock = (BlockHash, Option<BlockHash>);

impl DiskTier {
    /// Opens (creating it if needed) `dir` for blocks of `block_bytes` bytes and takes back the
    /// whole blocks a previous process left there, returned least recently written first;
    /// temporary files and block files that are not whole blocks of this size are removed, and
    /// the oldest beyond `capacity`. Files that are not block files are left alone.
    pub fn open(
        dir: &Path,
        capacity: usize,
        block_bytes: usize,
    ) -> Result<(Self, Vec<RestoredBlock>), KvError> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| KvError::Io { path, source }
        };
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let path = entry.path();
            if !is_block_file_name(&name) || !entry.file_type().map_err(io_err(&path))?.is_file() {
                continue;
            }
            let whole = if name.ends_with(TEMP_SUFFIX) {
                None
            } else {
                Self::whole_block(&path, block_bytes)
            };
            match whole {
                Some((parent, written)) => {
                    let hash = BlockHash(u128::from_str_radix(&name, 16).unwrap_or_default());
                    found.push((written, hash, parent));
                }
                None => fs::remove_file(&path).map_err(io_err(&path))?,
            }
        }
        found.sort();
        let mut tier = Self {
            dir: dir.to_path_buf(),
            capacity,
            block_bytes,
            lru: LruOrder::new(),
        };
        let excess = found.len().saturating_sub(capacity);
        for (_, hash, _) in &found[..excess] {
            let path = tier.block_path(*hash);
            fs::remove_file(&path).map_err(io_err(&path))?;
        }
        let restored: Vec<RestoredBlock> = found[excess..]
            .iter()
            .map(|(_, hash, parent)| (*hash, *parent))
            .collect();
        for (hash, _) in &restored {
            tier.lru.touch(*hash);
        }
        Ok((tier, restored))
    }

    /// The parent and modification time of a block file holding a whole block of
    /// `block_bytes`; `None` for anything else.
    fn whole_block(path: &Path, block_bytes: usize) -> Option<(Option<BlockHash>, SystemTime)> {
        let mut file = fs::File::open(path).ok()?;
        let meta = file.metadata().ok()?;
        if meta.len() != (HEADER_BYTES + block_bytes) as u64 {
            return None;
        }
        let mut h = [0u8; HEADER_BYTES];
        file.read_exact(&mut h).ok()?;
        let (parent, _) = parse_header(&h)?;
        Some((parent, meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.lru.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.lru.contains(&hash)
    }

    /// Path of the file holding `hash`.
    pub fn block_path(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{:032x}", hash.0))
    }

    /// Writes the block (header and bytes, one sequential write) atomically, temp file then
    /// rename, as the most recently used, and returns the block evicted to make room (with a
    /// capacity of 0, the block just offered, unwritten). On an error the tier is unchanged
    /// apart from a possibly leftover temp file.
    pub fn insert(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        bytes: &[u8],
    ) -> Result<Option<BlockHash>, KvError> {
        self.insert_preferring(hash, parent, bytes, |_| true)
    }

    /// [`DiskTier::insert`], evicting the least recently used block `evictable` accepts first
    /// (pinned blocks go last).
    pub fn insert_preferring(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        bytes: &[u8],
        evictable: impl Fn(&BlockHash) -> bool,
    ) -> Result<Option<BlockHash>, KvError> {
        if self.capacity == 0 {
            return Ok(Some(hash));
        }
        debug_assert_eq!(bytes.len(), self.block_bytes);
        let path = self.block_path(hash);
        let temp = self.dir.join(format!("{:032x}{TEMP_SUFFIX}", hash.0));
        let write = || -> std::io::Result<()> {
            let mut file = fs::File::create(&temp)?;
            let mut whole = Vec::with_capacity(HEADER_BYTES + bytes.len());
            whole.extend_from_slice(&header(parent, bytes));
            whole.extend_from_slice(bytes);
            file.write_all(&whole)?;
            drop(file);
            fs::rename(&temp, &path)
        };
        write().map_err(|source| KvError::Io {
            path: path.clone(),
            source,
        })?;
        self.lru.touch(hash);
        if self.lru.len() <= self.capacity {
            return Ok(None);
        }
        let victim = self.lru.pop_oldest_preferring(evictable, true);
        if let Some(victim) = victim {
            // A file that cannot be deleted is only wasted space: nothing indexes it any more,
            // and it is the oldest when the next open trims to capacity.
            let _ = fs::remove_file(self.block_path(victim));
        }
        Ok(victim)
    }

    /// Reads the block into `out` (`block_bytes` long), marking it most recently used. A missing
    /// file is an `Io` error (NotFound); a file of the wrong length is `ShortBlock`; bytes that
    /// do not match their checksum are `Corrupt`.
    pub fn read(&mut self, hash: BlockHash, out: &mut Vec<u8>) -> Result<(), KvError> {
        self.read_only(hash, out)?;
        if self.lru.contains(&hash) {
            self.lru.touch(hash);
        }
        Ok(())
    }

    /// Reads the block into `out` like [`DiskTier::read`], leaving its recency as it is.
    pub fn read_only(&self, hash: BlockHash, out: &mut Vec<u8>) -> Result<(), KvError> {
        read_block_file(&self.block_path(hash), self.block_bytes, out)
    }

    /// Forgets the block and deletes its file; returns whether it was held.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let held = self.lru.remove(&hash);
        if held {
            // See `insert`: an undeletable file is harmless.
            let _ = fs::remove_file(self.block_path(hash));
        }
        held
    }

    /// Hashes from least to most recently used.
    pub fn lru_order(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.lru.iter().copied()
    }

    pub(crate) fn is_consistent(&self) -> bool {
        self.lru.is_consistent() && self.lru.len() <= self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn lru_order_pops_least_recent_first() {
        let mut lru = LruOrder::new();
        for k in [1, 2, 3] {
            lru.touch(k);
        }
        lru.touch(1);
        assert!(lru.remove(&3));
        assert!(!lru.remove(&3));
        assert_eq!(lru.pop_oldest(), Some(2));
        assert_eq!(lru.pop_oldest(), Some(1));
        assert_eq!(lru.pop_oldest(), None);
        assert!(lru.is_consistent());
    }

    #[test]
    fn host_tier_evicts_least_recently_used_from_its_arena() {
        let mut host = HostTier::new(2, 1);
        assert_eq!(host.insert(h(1), vec![1]), None);
        assert_eq!(host.insert(h(2), vec![2]), None);
        assert_eq!(host.insert(h(1), vec![1]), None); // 2 is now the oldest
        assert_eq!(host.insert(h(3), vec![3]), Some((h(2), vec![2])));
        assert_eq!(host.lru_order().collect::<Vec<_>>(), vec![h(1), h(3)]);
        assert_eq!(host.peek(h(3)), Some(&[3u8][..]));
        // A detached slot keeps its bytes and stays taken until released.
        let slot = host.detach(h(1)).unwrap();
        assert_eq!(host.slot(slot), [1]);
        let made_room = host.insert(h(4), vec![4]);
        assert_eq!(
            made_room,
            Some((h(3), vec![3])),
            "the held slot is not free"
        );
        assert_eq!(host.slot(slot), [1], "a held slot is not reused");
        host.release(slot);
        assert!(host.remove(h(4)));
        assert!(!host.remove(h(4)));
        assert!(host.is_consistent());
        let mut none = HostTier::new(0, 1);
        assert_eq!(none.insert(h(9), vec![9]), Some((h(9), vec![9])));
        assert!(none.is_empty());
    }

    #[test]
    fn disk_tier_round_trips_and_evicts() {
        let dir = tempfile::tempdir().unwrap();
        let (mut disk, restored) = DiskTier::open(dir.path(), 2, 4).unwrap();
        assert!(restored.is_empty());
        assert_eq!(disk.insert(h(1), None, &[1; 4]).unwrap(), None);
        assert_eq!(disk.insert(h(2), Some(h(1)), &[2; 4]).unwrap(), None);
        let mut out = Vec::new();
        disk.read(h(1), &mut out).unwrap();
        assert_eq!(out, [1; 4]);
        assert_eq!(disk.insert(h(3), Some(h(1)), &[3; 4]).unwrap(), Some(h(2)));
        assert!(!disk.block_path(h(2)).exists(), "evicted file is deleted");
        assert!(disk.block_path(h(3)).exists());
        assert!(disk.remove(h(3)));
        assert!(!disk.block_path(h(3)).exists());
        assert!(disk.is_consistent());
    }

    #[test]
    fn disk_tier_reports_missing_short_and_corrupt_files() {
        let dir = tempfile::tempdir().unwrap();
        let (mut disk, _) = DiskTier::open(dir.path(), 4, 8).unwrap();
        for x in 1..=3 {
            disk.insert(h(x), None, &[7; 8]).unwrap();
        }
        fs::write(disk.block_path(h(1)), [7; 3]).unwrap();
        fs::remove_file(disk.block_path(h(2))).unwrap();
        let mut flipped = fs::read(disk.block_path(h(3))).unwrap();
        *flipped.last_mut().unwrap() ^= 1;
        fs::write(disk.block_path(h(3)), flipped).unwrap();
        let mut out = Vec::new();
        let short = disk.read(h(1), &mut out).unwrap_err();
        assert!(
            matches!(short, KvError::ShortBlock { actual: 3, .. }),
            "{short}"
        );
        match disk.read(h(2), &mut out).unwrap_err() {
            KvError::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
            other => panic!("expected NotFound, got {other}"),
        }
        let corrupt = disk.read(h(3), &mut out).unwrap_err();
        assert!(matches!(corrupt, KvError::Corrupt { .. }), "{corrupt}");
    }

    #[test]
    fn disk_tier_takes_back_what_an_earlier_process_wrote() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut disk, _) = DiskTier::open(dir.path(), 8, 4).unwrap();
            disk.insert(h(1), None, &[1; 4]).unwrap();
            disk.insert(h(2), Some(h(1)), &[2; 4]).unwrap();
            disk.insert(h(3), Some(h(2)), &[3; 4]).unwrap();
        }
        let (mut disk, restored) = DiskTier::open(dir.path(), 8, 4).unwrap();
        let mut found: Vec<RestoredBlock> = restored.clone();
        found.sort();
        assert_eq!(
            found,
            vec![(h(1), None), (h(2), Some(h(1))), (h(3), Some(h(2)))]
        );
        assert_eq!(disk.len(), 3);
        let mut out = Vec::new();
        disk.read(h(2), &mut out).unwrap();
        assert_eq!(out, [2; 4]);
        assert!(disk.is_consistent());
    }

    #[test]
    fn disk_tier_open_keeps_the_newest_within_capacity_and_removes_what_is_not_a_block() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut disk, _) = DiskTier::open(dir.path(), 8, 4).unwrap();
            for x in 1..=3 {
                disk.insert(h(x), None, &[x as u8; 4]).unwrap();
            }
            // Block 2 was written last, then 3, then 1.
            for (x, age) in [(1, 10), (3, 20), (2, 30)] {
                let file = fs::File::options()
                    .write(true)
                    .open(disk.block_path(h(x)))
                    .unwrap();
                let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + age);
                file.set_modified(at).unwrap();
            }
        }
        let torn = dir.path().join(format!("{:032x}", 5u128));
        let temp = dir.path().join(format!("{:032x}.tmp", 6u128));
        let other_format = dir.path().join(format!("{:032x}", 7u128));
        let other = dir.path().join("README");
        fs::write(&torn, [0; HEADER_BYTES + 3]).unwrap();
        fs::write(&temp, b"x").unwrap();
        fs::write(&other_format, [0; HEADER_BYTES + 4]).unwrap();
        fs::write(&other, b"x").unwrap();
        let (disk, restored) = DiskTier::open(dir.path(), 2, 4).unwrap();
        assert_eq!(
            restored,
            vec![(h(3), None), (h(2), None)],
            "newest two, oldest first"
        );
        assert_eq!(disk.lru_order().collect::<Vec<_>>(), vec![h(3), h(2)]);
        assert!(!disk.block_path(h(1)).exists(), "trimmed to capacity");
        assert!(!torn.exists() && !temp.exists() && !other_format.exists());
        assert!(
            other.exists(),
            "files that are not block files are not ours to delete"
        );
    }
}
