//! The vocabulary shared by the block manager, the tiers, the events and the backends.

use serde::{Deserialize, Serialize};

/// Index of a block in the backend's device KV pool.
pub type BlockId = u32;

/// Identity of a full block's contents: `h_i = xxh3_128(h_{i-1}, tokens of block i, salt)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u128);

/// What a block hash is salted with: the tenant's cache isolation and anything else that changes
/// the KV bytes for the same tokens (KV format, adapter).
pub type CacheSalt = u64;

/// Where a cached block's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

/// Moves one block's KV bytes between the backend's device pool and the lower tiers. Implemented
/// by each backend (the CPU backend copies memory; the CUDA backend will use pinned host buffers).
pub trait KvBlockIo {
    /// Bytes of one block (all layers, K and V).
    fn block_bytes(&self) -> usize;
    /// Copies block `id` out into `out` (`block_bytes()` long).
    fn export_block(&self, id: BlockId, out: &mut [u8]);
    /// Overwrites block `id` with `data` (`block_bytes()` long).
    fn import_block(&mut self, id: BlockId, data: &[u8]);
}
