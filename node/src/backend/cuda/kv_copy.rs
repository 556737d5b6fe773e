//! Whole KV blocks between the device caches and host memory. A block's bytes are
//! `[layer][k|v][slot][kv_dim]` bf16, little-endian: 2 × layers parts, each in its own cache
//! allocation. Copying part by part costs the driver's per-call overhead 2 × layers times per block
//! (64 copies of 32 KiB for a Llama-3.1-8B block: about 5 GB/s, docs/DECISIONS.md), so a block
//! crosses PCIe as one copy into a device staging buffer, and one launch scatters it to the caches
//! (`kv_scatter`); export gathers into the staging buffer (`kv_gather`) and copies out once.
//!
//! The staging buffer is reused block after block in stream order: a copy into it is queued after
//! the launch that read it before. An import returns without waiting: from page-locked memory (the
//! host tier's slots) the copy is DMA and `data` must stay as it is until it ran, which the host
//! tier guarantees (a slot is written again only by a later copy on this stream); from pageable
//! memory the driver stages the bytes before the call returns. An export waits for its copy.

use std::sync::{Arc, Mutex, PoisonError};

use half::bf16;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use strata_kernels::{Kernels, KvParts};

use super::CudaError;
use crate::kv::{BlockId, KvError};

pub(super) struct BlockCopy {
    staging: Mutex<CudaSlice<u8>>,
    /// The device address of every part's cache, in block order (k0, v0, k1, v1, ...).
    bases: CudaSlice<u64>,
    parts: usize,
    part_bytes: usize,
    /// Blocks each cache allocation holds.
    allocated: usize,
}

impl BlockCopy {
    /// For caches of `allocated` blocks of `block_values` bf16 per part.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        k_cache: &[CudaSlice<bf16>],
        v_cache: &[CudaSlice<bf16>],
        block_values: usize,
        allocated: usize,
    ) -> Result<Self, CudaError> {
        let bases: Vec<u64> = k_cache
            .iter()
            .zip(v_cache)
            .flat_map(|(k, v)| [k, v])
            .map(|cache| cache.device_ptr(stream).0)
            .collect();
        let part_bytes = block_values * 2;
        let staging = stream.alloc_zeros::<u8>(bases.len() * part_bytes)?;
        Ok(Self {
            parts: bases.len(),
            bases: stream.clone_htod(&bases)?,
            staging: Mutex::new(staging),
            part_bytes,
            allocated,
        })
    }

    fn block(&self, id: BlockId, len: usize) -> Result<KvParts, String> {
        if (id as usize) >= self.allocated {
            return Err(format!(
                "block {id} is outside the cache's {} blocks",
                self.allocated
            ));
        }
        if len != self.parts * self.part_bytes {
            return Err(format!(
                "{len} bytes given for a block of {}",
                self.parts * self.part_bytes
            ));
        }
        Ok(KvParts {
            parts: self.parts,
            part_bytes: self.part_bytes,
            offset: id as u64 * self.part_bytes as u64,
        })
    }

    pub(super) fn import(
        &self,
        kernels: &Kernels,
        stream: &Arc<CudaStream>,
        id: BlockId,
        data: &[u8],
    ) -> Result<(), KvError> {
        let failed = |detail: String| KvError::Copy {
            id,
            detail: format!("host to device: {detail}"),
        };
        let block = self.block(id, data.len()).map_err(failed)?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        stream
            .memcpy_htod(data, &mut *staging)
            .map_err(|e| failed(e.to_string()))?;
        // SAFETY: every base is a live cache allocation of `allocated` blocks of `part_bytes`,
        // and `block` checked `id < allocated`; the launch is ordered on the caches' stream.
        unsafe { kernels.kv_scatter(stream, &*staging, &self.bases, block) }
            .map_err(|e| failed(e.to_string()))
    }

    pub(super) fn export(
        &self,
        kernels: &Kernels,
        stream: &Arc<CudaStream>,
        id: BlockId,
        out: &mut [u8],
    ) -> Result<(), KvError> {
        let failed = |detail: String| KvError::Copy {
            id,
            detail: format!("device to host: {detail}"),
        };
        let block = self.block(id, out.len()).map_err(failed)?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: as in `import`; the parts are only read.
        unsafe { kernels.kv_gather(stream, &mut *staging, &self.bases, block) }
            .map_err(|e| failed(e.to_string()))?;
        stream
            .memcpy_dtoh(&*staging, out)
            .map_err(|e| failed(e.to_string()))?;
        stream.synchronize().map_err(|e| failed(e.to_string()))
    }
}
