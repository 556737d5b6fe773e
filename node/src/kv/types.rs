//! The vocabulary shared by the block manager, the tiers, the events and the backends.

use super::KvError;

pub use strata_engine_api::kv::{
    BlockHash, BlockHashHasher, BlockHashMap, CacheSalt, KvLayout, Tier,
};

/// Index of a block in the backend's device KV pool.
pub type BlockId = u32;

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
