//! The vocabulary shared by the block manager, the tiers, the events and the backends.

use serde::{Deserialize, Serialize};

use super::KvError;

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

/// What two nodes must share to exchange KV blocks: the same model shape, block size and byte
/// layout. A block's hash names its tokens, not its bytes; this names the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// The backend's [`crate::backend::Backend::kv_layout`].
    pub backend: String,
    pub model_type: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub block_bytes: usize,
}

/// Moves one block's KV bytes between the backend's device pool and the lower tiers. Implemented
/// by each backend (the CPU backend copies memory, the CUDA backend copies over PCIe). A copy
/// can fail ([`KvError::Copy`]): the block manager then loses that cached block or fails the one
/// request that needed it, and the engine goes on serving.
pub trait KvBlockIo {
    /// Bytes of one block (all layers, K and V).
    fn block_bytes(&self) -> usize;
    /// Copies block `id` out into `out` (`block_bytes()` long).
    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError>;
    /// Starts copying block `id` out into `out`, memory from [`KvBlockIo::host_memory`] that
    /// stays valid: `out` holds the bytes once [`KvBlockIo::settle`] returned, and its bytes are
    /// not read on the host before. By default the copy is done before this returns.
    fn export_block_queued(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        self.export_block(id, out)
    }
    /// Waits until every queued export's bytes are in host memory.
    fn settle(&self) -> Result<(), KvError> {
        Ok(())
    }
    /// Overwrites block `id` with `data` (`block_bytes()` long).
    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError>;
    /// The host tier's memory, `bytes` long, allocated once: plain memory by default; the CUDA
    /// backend's is page-locked, so copies between it and the device are DMA, queued on the
    /// device's stream without waiting.
    fn host_memory(&mut self, bytes: usize) -> Result<Box<dyn super::HostMemory>, KvError> {
        Ok(Box::new(vec![0u8; bytes]))
    }
}

/// Hashes a [`BlockHash`] by folding its halves: the key is already the output of xxh3-128, so
/// hashing it again (SipHash by default) only costs time.
#[derive(Default, Clone, Copy)]
pub struct BlockHashHasher(u64);

impl std::hash::Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than BlockHash; fold them in FNV-1a style.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64) ^ ((v >> 64) as u64);
    }
}

/// A map keyed by block hash.
pub type BlockHashMap<V> =
    std::collections::HashMap<BlockHash, V, std::hash::BuildHasherDefault<BlockHashHasher>>;
