//! The device block pool with its prefix cache and lower tiers.
//!
//! Every device block is in exactly one state: free (on `free`), cached (indexed, unreferenced,
//! on the `cached` LRU, still findable by hash), or referenced (refcount > 0, owned by one or
//! more sequences; indexed once committed). The prefix index maps a block hash to where its bytes
//! live: a device block, the host tier or the disk tier. Evicting a cached device block demotes
//! its bytes down the tiers; a hit in a lower tier promotes them back by copy. Every index change
//! is published as a numbered [`KvEvent`].

use std::collections::HashMap;
use std::path::PathBuf;

use tokio::sync::broadcast;

use super::KvError;
use super::events::{KvDump, KvEvent, KvEventKind, KvEventLog};
use super::read_ahead::{Fetch, with_read_ahead};
use super::tiers::{DiskTier, HostMemory, HostTier, LruOrder};
use super::types::{BlockHash, BlockHashMap, BlockId, KvBlockIo, Tier};

/// How many events a subscriber may fall behind before it must resynchronise from a dump.
const EVENT_CHANNEL_CAPACITY: usize = 4096;

/// Sizes of the pool and its tiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockManagerConfig {
    /// Tokens per block.
    pub block_size: usize,
    pub device_blocks: usize,
    /// 0 disables the host tier.
    pub host_blocks: usize,
    /// Directory and capacity in blocks of the disk tier; `None` disables it.
    pub disk: Option<(PathBuf, usize)>,
}

/// Block movements between the device and the lower tiers so far, per lower tier
/// (`[host, disk]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierTraffic {
    /// Blocks copied back to the device from each tier.
    pub restored: [u64; 2],
    /// Time spent restoring from each tier (reading, copying to the device), in nanoseconds.
    pub restore_ns: [u64; 2],
    /// Blocks written into each tier (evicted from the one above).
    pub demoted: [u64; 2],
}

/// How much of a hash chain is cached. `device` is the leading run already on device; `lower`
/// counts the blocks after it that are cached too, at least the first of them in host or disk
/// (so `device + lower` blocks can be acquired if enough device blocks are obtainable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixLookup {
    pub device: usize,
    pub lower: usize,
}

/// What [`BlockManager::commit`] did with the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The block is now the cached copy of its hash (any host/disk copy was dropped for it).
    Indexed,
    /// Another device block already holds this hash; this block stays unindexed and returns to
    /// the free list on its last release.
    AlreadyCached,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Location {
    Device(BlockId),
    Host,
    Disk,
}

impl Location {
    fn tier(self) -> Tier {
        match self {
            Location::Device(_) => Tier::Device,
            Location::Host => Tier::Host,
            Location::Disk => Tier::Disk,
        }
    }
}

/// Where a promoted block's bytes come from.
enum Source {
    Slot(u32),
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone, Copy)]
struct IndexEntry {
    parent: Option<BlockHash>,
    location: Location,
}

#[derive(Debug, Clone, Copy, Default)]
struct DeviceBlock {
    refcount: u32,
    /// The hash this block is indexed under; `None` while being written, or for a committed
    /// duplicate of a block cached elsewhere.
    hash: Option<BlockHash>,
}

/// Reference-counted device blocks, the prefix index over them and the lower tiers.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    block_bytes: usize,
    blocks: Vec<DeviceBlock>,
    free: Vec<BlockId>,
    cached: LruOrder<BlockId>,
    index: BlockHashMap<IndexEntry>,
    host: HostTier,
    disk: Option<DiskTier>,
    events: KvEventLog,
    lower_tier_failures: u64,
    traffic: TierTraffic,
    restore: restore::Chooser,
    pins: HashMap<String, Pin>,
    /// How many pins hold each pinned hash.
    pinned: BlockHashMap<u32>,
}

impl BlockManager {
    /// `block_bytes` is the backend's [`KvBlockIo::block_bytes`]. Opening the disk tier takes
    /// back the blocks a previous process left in its directory: they are indexed on disk and
    /// published as `Stored`, so routers learn of them like of new ones.
    pub fn new(config: BlockManagerConfig, block_bytes: usize) -> Result<Self, KvError> {
        let memory = Box::new(vec![0u8; config.host_blocks * block_bytes]);
        Self::with_host_memory(config, block_bytes, memory)
    }

    /// [`BlockManager::new`] with the host tier in `memory` (at least `host_blocks ×
    /// block_bytes`; the backend's [`KvBlockIo::host_memory`], page-locked on CUDA).
    pub fn with_host_memory(
        config: BlockManagerConfig,
        block_bytes: usize,
        memory: Box<dyn HostMemory>,
    ) -> Result<Self, KvError> {
        if config.block_size == 0 {
            return Err(KvError::Config(
                "block_size must be at least 1 token".into(),
            ));
        }
        let max = BlockId::MAX as usize;
        if config.device_blocks > max {
            return Err(KvError::Config(format!(
                "device_blocks {} exceeds the block id range ({max})",
                config.device_blocks
            )));
        }
        let (disk, restored) = match &config.disk {
            Some((dir, blocks)) => {
                let (disk, restored) = DiskTier::open(dir, *blocks, block_bytes)?;
                (Some(disk), restored)
            }
            None => (None, Vec::new()),
        };
        let mut manager = Self {
            block_size: config.block_size,
            block_bytes,
            blocks: vec![DeviceBlock::default(); config.device_blocks],
            // Reversed so blocks are handed out from id 0 upwards.
            free: (0..config.device_blocks as BlockId).rev().collect(),
            cached: LruOrder::new(),
            index: BlockHashMap::default(),
            host: HostTier::with_memory(config.host_blocks, block_bytes, memory),
            disk,
            events: KvEventLog::new(EVENT_CHANNEL_CAPACITY),
            lower_tier_failures: 0,
            traffic: TierTraffic::default(),
            restore: restore::Chooser::default(),
            pins: HashMap::new(),
            pinned: BlockHashMap::default(),
        };
        // What the disk kept from an earlier process is cached again, announced like new.
        for (hash, parent) in restored {
            manager.index.insert(
                hash,
                IndexEntry {
                    parent,
                    location: Location::Disk,
                },
            );
            manager.events.publish(KvEventKind::Stored {
                hash,
                parent,
                tier: Tier::Disk,
            });
        }
        Ok(manager)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block, all layers.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn device_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Device blocks free or cached-unreferenced (pinned ones included).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Cached device blocks no sequence holds that a pin keeps there for good: with no lower
    /// tier to take them they are never evicted, so no sequence can have them.
    pub fn held_by_pins(&self) -> usize {
        if self.host.capacity() > 0 || self.disk.as_ref().is_some_and(|d| d.capacity() > 0) {
            return 0;
        }
        self.pinned
            .keys()
            .filter(|h| match self.index.get(*h).map(|e| e.location) {
                Some(Location::Device(id)) => self.blocks[id as usize].refcount == 0,
                _ => false,
            })
            .count()
    }

    /// Device blocks a sequence can obtain now: [`BlockManager::available`] less those
    /// [`BlockManager::held_by_pins`].
    pub fn obtainable(&self) -> usize {
        self.available() - self.held_by_pins()
    }

    /// Cached blocks on each tier: device blocks no sequence holds, host and disk blocks.
    pub fn cached_by_tier(&self) -> [usize; 3] {
        [
            self.cached.len(),
            self.host.len(),
            self.disk.as_ref().map_or(0, DiskTier::len),
        ]
    }

    /// Device blocks with refcount > 0.
    pub fn referenced_blocks(&self) -> usize {
        self.blocks.len() - self.available()
    }

    /// Refcount of block `id`; `None` if there is no such block.
    pub fn refcount(&self, id: BlockId) -> Option<u32> {
        self.blocks.get(id as usize).map(|b| b.refcount)
    }

    /// Where the cached copy of `hash` lives, if any.
    pub fn tier_of(&self, hash: BlockHash) -> Option<Tier> {
        self.index.get(&hash).map(|e| e.location.tier())
    }

    /// Copies between tiers that failed (disk I/O, or a backend's block copy); each one cost a
    /// cached block, or failed the one request that needed it, never correctness.
    pub fn lower_tier_failures(&self) -> u64 {
        self.lower_tier_failures
    }

    /// Writes every cached block of the device and the host tier to the disk tier (host blocks
    /// first, the device's last: they are the most recently used), for a process about to stop;
    /// referenced blocks stay where they are. Returns how many blocks were written; 0 without a
    /// disk tier.
    pub fn park_on_disk(&mut self, io: &mut dyn KvBlockIo) -> usize {
        if self.disk.as_ref().is_none_or(|d| d.capacity() == 0) {
            return 0;
        }
        let before = self.traffic.demoted[1];
        if io.settle().is_err() {
            self.lower_tier_failures += 1;
            return 0;
        }
        let hosted: Vec<BlockHash> = self.host.lru_order().collect();
        for hash in hosted {
            if let Some(slot) = self.host.detach(hash) {
                let bytes = self.host.slot(slot).to_vec();
                self.host.release(slot);
                self.demote(hash, Tier::Host, bytes);
            }
        }
        while let Some(id) = self.cached.pop_oldest() {
            if let Some(hash) = self.blocks[id as usize].hash.take() {
                self.demote_past_host(hash, id, io);
            }
            self.free.push(id);
        }
        (self.traffic.demoted[1] - before) as usize
    }

    /// Blocks moved between the device and the lower tiers so far.
    pub fn tier_traffic(&self) -> TierTraffic {
        self.traffic
    }

    /// Capacity of the host and disk tiers in blocks (0 where there is none).
    pub fn lower_capacity(&self) -> (usize, usize) {
        (
            self.host.capacity(),
            self.disk.as_ref().map_or(0, DiskTier::capacity),
        )
    }

    /// For admission: how many leading blocks of `hashes` are on the device and referenced
    /// already (taking them costs no obtainable block), and how many leading blocks are cached
    /// in any tier.
    pub fn admission_view(&self, hashes: &[BlockHash]) -> (usize, usize) {
        let found = self.lookup(hashes);
        let shared = hashes[..found.device]
            .iter()
            .filter(|h| match self.index.get(h).map(|e| e.location) {
                Some(Location::Device(id)) => self.blocks[id as usize].refcount > 0,
                _ => false,
            })
            .count();
        (shared, found.device + found.lower)
    }

    /// Longest cached prefix of `hashes`; no side effects (recency is not touched).
    pub fn lookup(&self, hashes: &[BlockHash]) -> PrefixLookup {
        let mut found = PrefixLookup::default();
        for hash in hashes {
            match self.index.get(hash).map(|e| e.location) {
                None => break,
                Some(Location::Device(_)) if found.lower == 0 => found.device += 1,
                Some(_) => found.lower += 1,
            }
        }
        found
    }

    /// References the longest cached prefix of `hashes`, promoting host/disk hits to device.
    /// Stops at the first miss, or where no device block can be obtained for a promotion; the
    /// caller owns one reference on each returned block. A promotion whose copy to the device
    /// fails is an error ([`KvError::Copy`]) with nothing left referenced: the block is dropped
    /// from the cache and the request that needed it fails.
    pub fn acquire_prefix(
        &mut self,
        hashes: &[BlockHash],
        io: &mut dyn KvBlockIo,
    ) -> Result<Vec<BlockId>, KvError> {
        let hashes = &hashes[..self.restore_cut(hashes)];
        let files = self.disk_run(hashes);
        let block_bytes = self.block_bytes;
        with_read_ahead(files, block_bytes, |fetch| {
            self.acquire_with(hashes, io, fetch)
        })
    }

    fn acquire_with(
        &mut self,
        hashes: &[BlockHash],
        io: &mut dyn KvBlockIo,
        fetch: &mut Fetch<'_>,
    ) -> Result<Vec<BlockId>, KvError> {
        let mut acquired = Vec::new();
        for &hash in hashes {
            let id = match self.index.get(&hash).map(|e| e.location) {
                None => None,
                Some(Location::Device(id)) => {
                    self.reference(id);
                    Some(id)
                }
                Some(lower) => match self.promote(hash, lower.tier(), io, fetch) {
                    Ok(id) => id,
                    Err(e) => {
                        for id in acquired {
                            self.release(id)?;
                        }
                        return Err(e);
                    }
                },
            };
            match id {
                Some(id) => acquired.push(id),
                None => break,
            }
        }
        Ok(acquired)
    }

    /// The disk blocks of the leading cached run of `hashes`, in order, with their files.
    fn disk_run(&self, hashes: &[BlockHash]) -> Vec<(BlockHash, PathBuf)> {
        let Some(disk) = self.disk.as_ref() else {
            return Vec::new();
        };
        hashes
            .iter()
            .map_while(|h| self.index.get(h).map(|e| (*h, e.location)))
            .filter(|(_, location)| *location == Location::Disk)
            .map(|(h, _)| (h, disk.block_path(h)))
            .collect()
    }

    /// A block with refcount 1 to write new KV into: a free one, else the least recently used
    /// cached block, whose bytes are demoted to the lower tiers first.
    pub fn allocate(&mut self, io: &mut dyn KvBlockIo) -> Result<BlockId, KvError> {
        let id = self
            .obtain_block(io)
            .ok_or(KvError::OutOfBlocks { needed: 1, free: 0 })?;
        self.blocks[id as usize].refcount = 1;
        Ok(id)
    }

    /// Registers the full, written block `id` as the cached copy of `hash`.
    ///
    /// Dedup: if another device block already holds `hash`, that one stays indexed and `id`
    /// remains unindexed ([`CommitOutcome::AlreadyCached`]). If only a host/disk copy exists, the
    /// device block wins: the lower copy is dropped and the move is published as
    /// `TierChanged { from: lower, to: Device }`, which saves a later promotion.
    pub fn commit(
        &mut self,
        id: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
    ) -> Result<CommitOutcome, KvError> {
        let block = self.block(id)?;
        if block.refcount == 0 {
            return Err(KvError::BadCommit {
                id,
                reason: "the block is not referenced",
            });
        }
        if block.hash.is_some() {
            return Err(KvError::BadCommit {
                id,
                reason: "the block is already indexed",
            });
        }
        let kind = match self.index.get(&hash).map(|e| e.location) {
            Some(Location::Device(_)) => return Ok(CommitOutcome::AlreadyCached),
            Some(Location::Host) => {
                self.host.remove(hash);
                KvEventKind::TierChanged {
                    hash,
                    from: Tier::Host,
                    to: Tier::Device,
                }
            }
            Some(Location::Disk) => {
                if let Some(disk) = &mut self.disk {
                    disk.remove(hash);
                }
                KvEventKind::TierChanged {
                    hash,
                    from: Tier::Disk,
                    to: Tier::Device,
                }
            }
            None => KvEventKind::Stored {
                hash,
                parent,
                tier: Tier::Device,
            },
        };
        let entry = self.index.entry(hash).or_insert(IndexEntry {
            parent,
            location: Location::Device(id),
        });
        entry.location = Location::Device(id);
        self.blocks[id as usize].hash = Some(hash);
        self.events.publish(kind);
        Ok(CommitOutcome::Indexed)
    }

    /// Drops one reference. At zero an indexed block becomes cached (most recently used) and an
    /// unindexed one becomes free.
    pub fn release(&mut self, id: BlockId) -> Result<(), KvError> {
        let block = self.block(id)?;
        if block.refcount == 0 {
            return Err(KvError::NotReferenced { id });
        }
        let block = &mut self.blocks[id as usize];
        block.refcount -= 1;
        if block.refcount == 0 {
            match block.hash {
                Some(_) => self.cached.touch(id),
                None => self.free.push(id),
            }
        }
        Ok(())
    }

    /// The bytes of the leading run of `hashes` that is cached, in any tier, for another node to
    /// import ([`BlockManager::import_prefix`]). Nothing moves between tiers and recency is not
    /// touched; an unreadable disk block ends the run.
    pub fn export_prefix(
        &self,
        hashes: &[BlockHash],
        io: &dyn KvBlockIo,
    ) -> Vec<(BlockHash, Vec<u8>)> {
        let mut out = Vec::new();
        // Host slots are read below: queued copies into them must have landed.
        if io.settle().is_err() {
            return out;
        }
        for &hash in hashes {
            let bytes = match self.index.get(&hash).map(|e| e.location) {
                None => break,
                Some(Location::Device(id)) => {
                    let mut bytes = vec![0; self.block_bytes];
                    if io.export_block(id, &mut bytes).is_err() {
                        break;
                    }
                    bytes
                }
                Some(Location::Host) => match self.host.peek(hash) {
                    Some(bytes) => bytes.to_vec(),
                    None => break,
                },
                Some(Location::Disk) => {
                    let mut bytes = Vec::new();
                    match self.disk.as_ref().map(|d| d.read_only(hash, &mut bytes)) {
                        Some(Ok(())) => bytes,
                        _ => break,
                    }
                }
            };
            out.push((hash, bytes));
        }
        out
    }

    /// Caches blocks computed elsewhere: `blocks` is a run of a hash chain whose first block's
    /// parent is `parent`, each with its bytes. Each block not cached here already goes into a
    /// device block and is indexed (published as `Stored` on device), unreferenced and most
    /// recently used, so the next request with this prefix acquires it like one computed here.
    /// Never evicts a block imported by the same call: at most [`BlockManager::available`]
    /// blocks are taken. Returns how many leading blocks of `blocks` are now cached here (those
    /// imported and those that already were); a block of the wrong length ends the run.
    pub fn import_prefix(
        &mut self,
        parent: Option<BlockHash>,
        blocks: &[(BlockHash, Vec<u8>)],
        io: &mut dyn KvBlockIo,
    ) -> usize {
        let mut room = self.available();
        let mut parent = parent;
        let mut cached = 0;
        for (hash, bytes) in blocks {
            let hash = *hash;
            if !self.index.contains_key(&hash) {
                if room == 0 || bytes.len() != self.block_bytes {
                    break;
                }
                let Some(id) = self.obtain_block(io) else {
                    break;
                };
                room -= 1;
                if io.import_block(id, bytes).is_err() {
                    self.lower_tier_failures += 1;
                    self.free.push(id);
                    break;
                }
                self.blocks[id as usize] = DeviceBlock {
                    refcount: 0,
                    hash: Some(hash),
                };
                self.cached.touch(id);
                self.index.insert(
                    hash,
                    IndexEntry {
                        parent,
                        location: Location::Device(id),
                    },
                );
                self.events.publish(KvEventKind::Stored {
                    hash,
                    parent,
                    tier: Tier::Device,
                });
            }
            parent = Some(hash);
            cached += 1;
        }
        cached
    }

    /// For subscribing from other threads while the manager lives in the engine's.
    pub fn event_sender(&self) -> broadcast::Sender<KvEvent> {
        self.events.sender()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<KvEvent> {
        self.events.subscribe()
    }

    /// Every cached block (sorted by hash) as of the last published event.
    pub fn dump(&self) -> KvDump {
        let mut blocks: Vec<_> = self
            .index
            .iter()
            .map(|(&h, e)| (h, e.parent, e.location.tier()))
            .collect();
        blocks.sort_unstable_by_key(|&(h, _, _)| h);
        KvDump {
            seq: self.events.last_seq(),
            blocks,
        }
    }

    /// Checks every invariant; the message names the first one broken.
    pub fn audit(&self) -> Result<(), String> {
        const UNSEEN: u8 = 0;
        const FREE: u8 = 1;
        const CACHED: u8 = 2;
        let n = self.blocks.len();
        let mut state = vec![UNSEEN; n];
        let lists = self.free.iter().map(|&id| (id, FREE));
        for (id, kind) in lists.chain(self.cached.iter().map(|&id| (id, CACHED))) {
            let slot = state
                .get_mut(id as usize)
                .ok_or(format!("block {id} out of range"))?;
            if *slot != UNSEEN {
                return Err(format!("block {id} is listed twice among free/cached"));
            }
            *slot = kind;
            let b = self.blocks[id as usize];
            if b.refcount != 0 {
                return Err(format!("listed block {id} has refcount {}", b.refcount));
            }
            if (kind == FREE) != b.hash.is_none() {
                return Err(format!("block {id}: free iff unindexed is broken ({b:?})"));
            }
        }
        for (id, b) in self.blocks.iter().enumerate() {
            if b.refcount == 0 && state[id] == UNSEEN {
                return Err(format!(
                    "block {id} leaked: unreferenced, neither free nor cached"
                ));
            }
            if let Some(h) = b.hash {
                let at = self.index.get(&h).map(|e| e.location);
                if at != Some(Location::Device(id as BlockId)) {
                    return Err(format!("block {id} holds {h:?} but the index says {at:?}"));
                }
            }
        }
        if !self.cached.is_consistent() {
            return Err("cached LRU maps disagree".into());
        }
        let (mut on_host, mut on_disk) = (0, 0);
        for (&h, e) in &self.index {
            let ok = match e.location {
                Location::Device(id) => {
                    self.blocks.get(id as usize).and_then(|b| b.hash) == Some(h)
                }
                Location::Host => {
                    on_host += 1;
                    self.host.contains(h)
                }
                Location::Disk => {
                    on_disk += 1;
                    self.disk.as_ref().is_some_and(|d| d.contains(h))
                }
            };
            if !ok {
                return Err(format!(
                    "index entry {h:?} -> {:?} is not held there",
                    e.location
                ));
            }
        }
        if self.host.len() != on_host || !self.host.is_consistent() {
            return Err(format!(
                "host tier holds {} blocks, index {on_host}",
                self.host.len()
            ));
        }
        let disk_len = self.disk.as_ref().map_or(0, |d| d.len());
        if disk_len != on_disk || !self.disk.as_ref().is_none_or(|d| d.is_consistent()) {
            return Err(format!(
                "disk tier holds {disk_len} blocks, index {on_disk}"
            ));
        }
        Ok(())
    }

    fn block(&self, id: BlockId) -> Result<DeviceBlock, KvError> {
        self.blocks
            .get(id as usize)
            .copied()
            .ok_or(KvError::NoSuchBlock {
                id,
                blocks: self.blocks.len(),
            })
    }

    fn reference(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if block.refcount == 0 {
            self.cached.remove(&id);
        }
        block.refcount += 1;
    }

    /// A block for writing, refcount still 0 and unindexed: free list first, else evict.
    fn obtain_block(&mut self, io: &mut dyn KvBlockIo) -> Option<BlockId> {
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        // Pinned blocks last; with no lower tier to take them, never.
        let lower =
            self.host.capacity() > 0 || self.disk.as_ref().is_some_and(|d| d.capacity() > 0);
        let (blocks, pinned) = (&self.blocks, &self.pinned);
        let unpinned = |id: &BlockId| {
            blocks[*id as usize]
                .hash
                .is_none_or(|h| !pinned.contains_key(&h))
        };
        let id = if pinned.is_empty() {
            self.cached.pop_oldest()?
        } else {
            self.cached.pop_oldest_preferring(unpinned, lower)?
        };
        // Cached blocks are indexed (audit: free iff unindexed).
        if let Some(hash) = self.blocks[id as usize].hash.take() {
            if self.host.capacity() > 0 {
                self.demote_to_host(hash, id, io);
            } else {
                self.demote_past_host(hash, id, io);
            }
        }
        Some(id)
    }

    /// Copies device block `id` (cached as `hash`) out and sends it to disk, or drops it; a
    /// failed copy loses the block.
    fn demote_past_host(&mut self, hash: BlockHash, id: BlockId, io: &mut dyn KvBlockIo) {
        let mut bytes = vec![0; self.block_bytes];
        match io.export_block(id, &mut bytes) {
            Ok(()) => self.demote(hash, Tier::Device, bytes),
            Err(_) => {
                self.lower_tier_failures += 1;
                self.forget(hash, Tier::Device);
            }
        }
    }

    /// Copies device block `id` (cached as `hash`) straight into a host slot; the block the
    /// slot held before, if any, goes on down.
    fn demote_to_host(&mut self, hash: BlockHash, id: BlockId, io: &mut dyn KvBlockIo) {
        let pinned = &self.pinned;
        let Some((slot, victim)) = self.host.reserve(|h| !pinned.contains_key(h)) else {
            self.forget(hash, Tier::Device);
            return;
        };
        // The victim's bytes go on to the disk tier, read on the host: queued copies into the
        // tier's slots must have landed first. Without a disk tier they are dropped unread.
        if let Some(victim) = victim {
            let to_disk = self.disk.as_ref().is_some_and(|d| d.capacity() > 0);
            if to_disk && io.settle().is_ok() {
                let bytes = self.host.slot(slot).to_vec();
                self.demote(victim, Tier::Host, bytes);
            } else {
                self.lower_tier_failures += u64::from(to_disk);
                self.forget(victim, Tier::Host);
            }
        }
        // Queued: the slot's bytes are read on the host only after a settle (above, and before
        // every other read of the tier's slots); an import from the slot waits for the copy.
        match io.export_block_queued(id, self.host.slot_mut(slot)) {
            Ok(()) => {
                self.host.commit(hash, slot);
                self.traffic.demoted[0] += 1;
                self.relocate(hash, Tier::Device, Location::Host);
            }
            Err(_) => {
                self.host.release(slot);
                self.lower_tier_failures += 1;
                self.forget(hash, Tier::Device);
            }
        }
    }

    /// Moves `hash`'s bytes (leaving tier `from`, device only when there is no host tier) to
    /// disk, or drops them.
    fn demote(&mut self, hash: BlockHash, from: Tier, bytes: Vec<u8>) {
        let parent = self.index.get(&hash).and_then(|e| e.parent);
        let pinned = &self.pinned;
        if let Some(disk) = self.disk.as_mut().filter(|d| d.capacity() > 0) {
            match disk.insert_preferring(hash, parent, &bytes, |h| !pinned.contains_key(h)) {
                Ok(overflow) => {
                    self.traffic.demoted[1] += 1;
                    self.relocate(hash, from, Location::Disk);
                    if let Some(victim) = overflow {
                        self.forget(victim, Tier::Disk);
                    }
                    return;
                }
                Err(_) => self.lower_tier_failures += 1,
            }
        }
        self.forget(hash, from);
    }

    /// Copies a host/disk block into a fresh device block. `None` when no device block is
    /// obtainable or the disk copy is unreadable (then it is dropped from the cache); an error
    /// when the copy to the device failed (the block is dropped from the cache too).
    fn promote(
        &mut self,
        hash: BlockHash,
        from: Tier,
        io: &mut dyn KvBlockIo,
        fetch: &mut Fetch<'_>,
    ) -> Result<Option<BlockId>, KvError> {
        if self.available() == 0 {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        // Take the bytes out before obtaining a block: the eviction that may follow cascades
        // through the same tiers and could otherwise push this very block further down. A host
        // block keeps its slot (detached) until the copy from it is queued.
        let source = match from {
            Tier::Host => self.host.detach(hash).map(Source::Slot),
            Tier::Disk => self.disk.as_mut().and_then(|disk| {
                let read = fetch(hash).unwrap_or_else(|| {
                    let mut bytes = Vec::new();
                    disk.read_only(hash, &mut bytes).map(|()| bytes)
                });
                disk.remove(hash);
                read.ok().map(Source::Bytes)
            }),
            Tier::Device => None,
        };
        let Some(source) = source else {
            self.lower_tier_failures += 1;
            self.forget(hash, from);
            return Ok(None);
        };
        // Cannot fail (`available() > 0` was checked), but never leave the index dangling.
        let Some(id) = self.obtain_block(io) else {
            if let Source::Slot(slot) = source {
                self.host.release(slot);
            }
            self.forget(hash, from);
            return Ok(None);
        };
        // On CUDA a copy from a (page-locked) slot is queued on the device's stream; the slot
        // is written again only by a later copy on the same stream, so releasing it now is safe.
        let imported = match &source {
            Source::Slot(slot) => io.import_block(id, self.host.slot(*slot)),
            Source::Bytes(bytes) => io.import_block(id, bytes),
        };
        if let Source::Slot(slot) = source {
            self.host.release(slot);
        }
        if let Err(e) = imported {
            self.lower_tier_failures += 1;
            self.free.push(id);
            self.forget(hash, from);
            return Err(e);
        }
        self.blocks[id as usize] = DeviceBlock {
            refcount: 1,
            hash: Some(hash),
        };
        self.relocate(hash, from, Location::Device(id));
        if let Some(i) = lower_index(from) {
            self.traffic.restored[i] += 1;
            self.traffic.restore_ns[i] += u64::try_from(started.elapsed().as_nanos()).unwrap_or(0);
        }
        Ok(Some(id))
    }

    fn relocate(&mut self, hash: BlockHash, from: Tier, to: Location) {
        if let Some(entry) = self.index.get_mut(&hash) {
            entry.location = to;
            self.events.publish(KvEventKind::TierChanged {
                hash,
                from,
                to: to.tier(),
            });
        }
    }

    fn forget(&mut self, hash: BlockHash, tier: Tier) {
        if self.index.remove(&hash).is_some() {
            self.events.publish(KvEventKind::Removed { hash, tier });
        }
    }
}

mod pins;
mod restore;

use pins::Pin;
pub use pins::PinStatus;
pub use restore::RestorePolicy;
use restore::lower_index;

#[cfg(test)]
mod tests;
