//! The router's exact prefix index: which node holds which cached block, in which tier, built
//! from each node's numbered KV events (DESIGN.md §6, "cache directory = contents").
//!
//! Block hashes are chained (`h_i` covers every token up to block `i`), so one flat map from hash
//! to holders is a radix tree over prefixes: a request's prefix is cached on a node exactly as far
//! as the node holds `h_1, h_2, …` without a gap. Each entry keeps three 64-bit sets of node
//! slots, one per tier, so a lookup answers for every node at once and an event flips one bit.
//! Keys are xxh3-128 outputs already, so the map does not hash them again.

use strata_engine_api::kv::{BlockHash, BlockHashMap, KvDump, KvEvent, KvEventKind, Tier};

/// Nodes one index tracks: the width of its per-tier node sets.
pub const MAX_NODES: usize = 64;

/// A node's place in the index (`0..MAX_NODES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u8);

impl Slot {
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn bit(self) -> u64 {
        1 << self.0
    }
}

/// Which nodes hold one block, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Holders {
    by_tier: [u64; 3],
}

impl Holders {
    fn any(&self) -> u64 {
        self.by_tier[0] | self.by_tier[1] | self.by_tier[2]
    }
}

fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

/// Why an event was not applied; the node's view must be rebuilt from a dump.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("node slot {0} is not in the index")]
    UnknownSlot(usize),
    #[error("the index is full ({MAX_NODES} nodes)")]
    Full,
    #[error("node slot {slot}: KV event gap, expected seq {expected}, got {got}")]
    Gap {
        slot: usize,
        expected: u64,
        got: u64,
    },
    #[error("node slot {slot}: event {seq} does not match the index ({detail})")]
    Mismatch {
        slot: usize,
        seq: u64,
        detail: &'static str,
    },
}

#[derive(Debug, Clone, Default)]
struct NodeView {
    live: bool,
    /// The last event applied (or the dump's).
    seq: u64,
    /// Blocks this node holds, over all tiers.
    blocks: usize,
}

/// Per node, how far a request's prefix is cached there.
#[derive(Debug, Clone, PartialEq)]
pub struct Overlap {
    /// Leading blocks of the request each node holds without a gap, by slot.
    pub blocks: [u32; MAX_NODES],
    /// The same blocks weighted by tier (`credits[tier]` per block), by slot.
    pub credit: [f32; MAX_NODES],
}

/// The prefix index over up to [`MAX_NODES`] nodes.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: BlockHashMap<Holders>,
    nodes: Vec<NodeView>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index with room for `blocks` distinct blocks before its map grows (growing rehashes
    /// every entry at once: a pause of tens of milliseconds at a million blocks).
    pub fn with_capacity(blocks: usize) -> Self {
        Self {
            blocks: BlockHashMap::with_capacity_and_hasher(blocks, Default::default()),
            nodes: Vec::new(),
        }
    }

    /// A slot for a new node, starting empty at sequence 0 (a dump or events from 1 follow).
    pub fn add_node(&mut self) -> Result<Slot, IndexError> {
        let index = match self.nodes.iter().position(|n| !n.live) {
            Some(free) => free,
            None if self.nodes.len() < MAX_NODES => {
                self.nodes.push(NodeView::default());
                self.nodes.len() - 1
            }
            None => return Err(IndexError::Full),
        };
        self.nodes[index] = NodeView {
            live: true,
            ..NodeView::default()
        };
        Ok(Slot(index as u8))
    }

    /// Forgets a node and every block it held; its slot is reused by a later [`Self::add_node`].
    pub fn remove_node(&mut self, slot: Slot) -> Result<(), IndexError> {
        self.clear_node(slot)?;
        self.nodes[slot.index()].live = false;
        Ok(())
    }

    /// Cached blocks in the index, over all nodes.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks `slot` holds and the last event applied for it.
    pub fn node_state(&self, slot: Slot) -> Option<(usize, u64)> {
        self.view(slot).ok().map(|n| (n.blocks, n.seq))
    }

    fn view(&self, slot: Slot) -> Result<&NodeView, IndexError> {
        self.nodes
            .get(slot.index())
            .filter(|n| n.live)
            .ok_or(IndexError::UnknownSlot(slot.index()))
    }

    /// Forgets everything about `slot` (its node died or will be re-dumped).
    pub fn clear_node(&mut self, slot: Slot) -> Result<(), IndexError> {
        self.view(slot)?;
        let bit = slot.bit();
        self.blocks.retain(|_, h| {
            for t in &mut h.by_tier {
                *t &= !bit;
            }
            h.any() != 0
        });
        let view = &mut self.nodes[slot.index()];
        view.blocks = 0;
        view.seq = 0;
        Ok(())
    }

    /// Replaces everything known about `slot` by `dump` (after a gap, a reconnect, a restart).
    pub fn load_dump(&mut self, slot: Slot, dump: &KvDump) -> Result<(), IndexError> {
        self.clear_node(slot)?;
        let bit = slot.bit();
        let mut count = 0;
        for &(hash, _, tier) in &dump.blocks {
            let holders = self.blocks.entry(hash).or_default();
            if holders.any() & bit == 0 {
                count += 1;
            }
            for t in &mut holders.by_tier {
                *t &= !bit;
            }
            holders.by_tier[tier_index(tier)] |= bit;
        }
        let view = &mut self.nodes[slot.index()];
        view.blocks = count;
        view.seq = dump.seq;
        Ok(())
    }

    /// Applies `slot`'s next event. Events at or below the node's sequence are already covered
    /// (by a dump) and ignored; a gap or an event that contradicts the index is an error, and the
    /// caller must ask the node for a dump.
    pub fn apply(&mut self, slot: Slot, event: &KvEvent) -> Result<(), IndexError> {
        let view = self.view(slot)?;
        if event.seq <= view.seq {
            return Ok(());
        }
        if event.seq != view.seq + 1 {
            return Err(IndexError::Gap {
                slot: slot.index(),
                expected: view.seq + 1,
                got: event.seq,
            });
        }
        let bit = slot.bit();
        let mismatch = |detail| IndexError::Mismatch {
            slot: slot.index(),
            seq: event.seq,
            detail,
        };
        // The same reading of events as the node's own `KvReplica`: a store of a held block moves
        // it to the stored tier, a removal or move names the block (its `from`/`tier` is
        // informational), and only a block the node does not hold is a contradiction.
        let delta: isize = match event.kind {
            KvEventKind::Stored { hash, tier, .. } => {
                let holders = self.blocks.entry(hash).or_default();
                let new = holders.any() & bit == 0;
                for t in &mut holders.by_tier {
                    *t &= !bit;
                }
                holders.by_tier[tier_index(tier)] |= bit;
                isize::from(new)
            }
            KvEventKind::Removed { hash, .. } => {
                let holders = match self.blocks.get_mut(&hash) {
                    Some(h) if h.any() & bit != 0 => h,
                    _ => return Err(mismatch("removed a block the node does not hold")),
                };
                for t in &mut holders.by_tier {
                    *t &= !bit;
                }
                if holders.any() == 0 {
                    self.blocks.remove(&hash);
                }
                -1
            }
            KvEventKind::TierChanged { hash, to, .. } => {
                let holders = match self.blocks.get_mut(&hash) {
                    Some(h) if h.any() & bit != 0 => h,
                    _ => return Err(mismatch("moved a block the node does not hold")),
                };
                for t in &mut holders.by_tier {
                    *t &= !bit;
                }
                holders.by_tier[tier_index(to)] |= bit;
                0
            }
        };
        let view = &mut self.nodes[slot.index()];
        view.seq = event.seq;
        view.blocks = view.blocks.wrapping_add_signed(delta);
        Ok(())
    }

    /// How far `chain` (a request's block hashes, in order) is cached on each node, and its
    /// credit with `credits` per block for the device, host and disk tiers. Stops at the first
    /// block no node still matching holds.
    pub fn overlap(&self, chain: &[BlockHash], credits: [f32; 3]) -> Overlap {
        /// Lookups issued before any is used: with a million blocks each is a cache miss, and
        /// independent misses overlap (a few lookups past the end of the prefix are wasted).
        const BATCH: usize = 16;
        let mut out = Overlap {
            blocks: [0; MAX_NODES],
            credit: [0.0; MAX_NODES],
        };
        let mut active = u64::MAX;
        for batch in chain.chunks(BATCH) {
            let mut found = [None; BATCH];
            for (at, hash) in found.iter_mut().zip(batch) {
                *at = self.blocks.get(hash).copied();
            }
            for holders in &found[..batch.len()] {
                let Some(holders) = holders else {
                    return out;
                };
                active &= holders.any();
                if active == 0 {
                    return out;
                }
                for (tier, &nodes) in holders.by_tier.iter().enumerate() {
                    let mut set = nodes & active;
                    while set != 0 {
                        let slot = set.trailing_zeros() as usize;
                        set &= set - 1;
                        out.blocks[slot] += 1;
                        out.credit[slot] += credits[tier];
                    }
                }
            }
        }
        out
    }
}
