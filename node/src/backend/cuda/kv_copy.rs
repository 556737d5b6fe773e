//! Whole KV blocks between the device caches and host memory. A block's bytes are
//! `[layer][k|v][slot][kv_dim]` bf16, little-endian: 2 × layers parts, each in its own cache
//! allocation. Copying part by part costs the driver's per-call overhead 2 × layers times per block
//! (64 copies of 32 KiB for a Llama-3.1-8B block: about 5 GB/s, docs/DECISIONS.md), so a block
//! crosses PCIe as one copy through a device staging buffer, and one launch on the compute stream
//! scatters it to the caches (`kv_scatter`) or gathers it from them (`kv_gather`).
//!
//! The two directions run on their own copy streams, so a restore that evicts (one block out, one
//! in) keeps both directions of the link busy at once instead of taking turns on the compute
//! stream. Each direction has a ring of staging buffers; events order every hand-over and nothing
//! waits on the host:
//! - export: the compute stream waits until the ring buffer's last copy out ran, gathers into it;
//!   the outgoing stream waits for the gather (and for every import queued before, which may
//!   still read the host memory being written), then copies out;
//! - import: the incoming stream waits until the ring buffer's last scatter ran (and for the last
//!   export into the same host memory, if one may still be running), then copies in; the compute
//!   stream waits for that copy and scatters.
//!
//! Host memory a queued copy reads or writes must stay valid until the copy ran: page-locked
//! memory (the host tier's slots) is DMA, its bytes hold an export's result only after
//! [`BlockCopy::settle`]; from or to pageable memory the driver stages the bytes before the call
//! returns (and [`BlockCopy::export`] settles before it returns).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use half::bf16;
use strata_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use strata_kernels::{Kernels, KvParts};

use super::CudaError;
use crate::kv::{BlockId, KvError};

/// Staging buffers per direction: enough for a copy to run while the previous block is scattered
/// (or gathered) and the next one is queued.
const RING: usize = 4;

pub(super) struct BlockCopy {
    /// The device address of every part's cache, in block order (k0, v0, k1, v1, ...).
    bases: CudaSlice<u64>,
    parts: usize,
    part_bytes: usize,
    /// Blocks each cache allocation holds.
    allocated: usize,
    outgoing: Arc<CudaStream>,
    incoming: Arc<CudaStream>,
    state: Mutex<State>,
}

struct State {
    exports: u64,
    imports: u64,
    out_buffers: Vec<CudaSlice<u8>>,
    /// Recorded on the outgoing stream after the copy out of `out_buffers[r]`.
    copied_out: Vec<CudaEvent>,
    /// Recorded on the compute stream after the latest gather.
    gathered: CudaEvent,
    in_buffers: Vec<CudaSlice<u8>>,
    /// Recorded on the compute stream after the scatter from `in_buffers[r]`.
    scattered: Vec<CudaEvent>,
    /// Recorded on the incoming stream after the latest copy in.
    copied_in: CudaEvent,
    /// Host addresses exports were queued into since the last settle, with the ring buffer whose
    /// `copied_out` event covers them (a later record of that event is a later copy on the same
    /// stream, so waiting for it never waits too little).
    written: HashMap<usize, usize>,
}

impl BlockCopy {
    /// For caches of `allocated` blocks of `block_values` bf16 per part, used on `stream`.
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
        let block_bytes = bases.len() * part_bytes;
        let ctx = stream.context();
        let buffers = || -> Result<Vec<CudaSlice<u8>>, DriverError> {
            (0..RING)
                .map(|_| stream.alloc_zeros::<u8>(block_bytes))
                .collect()
        };
        let events = || -> Result<Vec<CudaEvent>, DriverError> {
            (0..RING).map(|_| ctx.new_event(None)).collect()
        };
        let state = State {
            exports: 0,
            imports: 0,
            out_buffers: buffers()?,
            copied_out: events()?,
            gathered: ctx.new_event(None)?,
            in_buffers: buffers()?,
            scattered: events()?,
            copied_in: ctx.new_event(None)?,
            written: HashMap::new(),
        };
        // The staging buffers were zeroed on `stream`; the copy streams must not overtake that.
        stream.synchronize()?;
        Ok(Self {
            parts: bases.len(),
            bases: stream.clone_htod(&bases)?,
            part_bytes,
            allocated,
            outgoing: ctx.new_stream()?,
            incoming: ctx.new_stream()?,
            state: Mutex::new(state),
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

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues block `id`'s copy into the device caches from `data` and returns: the compute
    /// stream's next work sees the block. Page-locked `data` must stay as it is until the copy
    /// ran (the host tier writes a slot again only through a later export, which waits for it).
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
        let mut state = self.state();
        let state = &mut *state;
        let r = (state.imports % RING as u64) as usize;
        state.imports += 1;
        let mut queued = || -> Result<(), String> {
            let incoming = &self.incoming;
            incoming.wait(&state.scattered[r]).map_err(text)?;
            if let Some(w) = state.written.remove(&(data.as_ptr() as usize)) {
                incoming.wait(&state.copied_out[w]).map_err(text)?;
            }
            incoming
                .memcpy_htod(data, &mut state.in_buffers[r])
                .map_err(text)?;
            state.copied_in.record(incoming).map_err(text)?;
            stream.wait(&state.copied_in).map_err(text)?;
            // SAFETY: every base is a live cache allocation of `allocated` blocks of
            // `part_bytes`, `block` checked `id < allocated`, and the launch follows the copy
            // into the staging buffer in stream order (the wait above).
            unsafe { kernels.kv_scatter(stream, &state.in_buffers[r], &self.bases, block) }
                .map_err(|e| e.to_string())?;
            state.scattered[r].record(stream).map_err(text)
        };
        queued().map_err(failed)
    }

    /// Queues block `id`'s copy out into `out` and returns; `out` holds the bytes after
    /// [`BlockCopy::settle`]. `out` must be page-locked memory that stays valid until then, or
    /// pageable memory (then the driver copies before returning).
    pub(super) fn export_queued(
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
        let mut state = self.state();
        let state = &mut *state;
        let r = (state.exports % RING as u64) as usize;
        state.exports += 1;
        let mut queued = || -> Result<(), String> {
            stream.wait(&state.copied_out[r]).map_err(text)?;
            // SAFETY: as in `import`; the parts are only read, and the buffer's previous copy
            // out ran (the wait above).
            unsafe { kernels.kv_gather(stream, &mut state.out_buffers[r], &self.bases, block) }
                .map_err(|e| e.to_string())?;
            state.gathered.record(stream).map_err(text)?;
            let outgoing = &self.outgoing;
            outgoing.wait(&state.gathered).map_err(text)?;
            outgoing.wait(&state.copied_in).map_err(text)?;
            outgoing
                .memcpy_dtoh(&state.out_buffers[r], out)
                .map_err(text)?;
            state.copied_out[r].record(outgoing).map_err(text)
        };
        queued().map_err(failed)?;
        state.written.insert(out.as_ptr() as usize, r);
        Ok(())
    }

    /// Waits until every queued export's bytes are in host memory.
    pub(super) fn settle(&self) -> Result<(), KvError> {
        let mut state = self.state();
        self.outgoing
            .synchronize()
            .map_err(|e| KvError::Settle(e.to_string()))?;
        state.written.clear();
        Ok(())
    }

    /// Copies block `id` out into `out` and waits for it.
    pub(super) fn export(
        &self,
        kernels: &Kernels,
        stream: &Arc<CudaStream>,
        id: BlockId,
        out: &mut [u8],
    ) -> Result<(), KvError> {
        self.export_queued(kernels, stream, id, out)?;
        self.settle().map_err(|e| KvError::Copy {
            id,
            detail: e.to_string(),
        })
    }
}

fn text(e: DriverError) -> String {
    e.to_string()
}
