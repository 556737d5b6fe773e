//! Launchers for `kv_scatter` / `kv_gather` (`cuda/elementwise.cu`): a KV block's parts (one per
//! layer and per K/V, each in its own cache allocation) moved to or from one contiguous staging
//! buffer in a single launch, so that a block crosses PCIe as one copy instead of one per part.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::launch::{aligned16, need_len, stride_blocks, to_u32};
use crate::selftest::{Rng, download, upload};
use crate::{CheckResult, KernelError, Kernels, ensure_shape};

const MODULE: &str = "elementwise";
const THREADS: u32 = 256;

/// Where a block's parts live: `bases[p] + offset` for part p, each `part_bytes` long.
#[derive(Debug, Clone, Copy)]
pub struct KvParts {
    pub parts: usize,
    /// A positive multiple of 16.
    pub part_bytes: usize,
    /// The block's byte offset inside every part's allocation; a multiple of 16.
    pub offset: u64,
}

impl Kernels {
    /// Copies `staging` (`parts × part_bytes`, part after part) to the block's parts.
    ///
    /// # Safety
    /// `bases` holds `parts` device addresses (16-byte aligned) such that every
    /// `bases[p] + offset .. + part_bytes` lies inside a live allocation of this context that no
    /// other work reads or writes while the launch runs (stream order).
    pub unsafe fn kv_scatter(
        &self,
        stream: &Arc<CudaStream>,
        staging: &impl DevicePtr<u8>,
        bases: &impl DevicePtr<u64>,
        block: KvParts,
    ) -> Result<(), KernelError> {
        let (sp, _s) = staging.device_ptr(stream);
        // SAFETY: the caller's contract.
        unsafe { self.kv_copy("kv_scatter", stream, sp, staging.len(), bases, block) }
    }

    /// Copies the block's parts into `staging` (`parts × part_bytes`, part after part).
    ///
    /// # Safety
    /// As [`Kernels::kv_scatter`]; the parts are only read.
    pub unsafe fn kv_gather(
        &self,
        stream: &Arc<CudaStream>,
        staging: &mut impl DevicePtrMut<u8>,
        bases: &impl DevicePtr<u64>,
        block: KvParts,
    ) -> Result<(), KernelError> {
        let len = staging.len();
        let (sp, _s) = staging.device_ptr_mut(stream);
        // SAFETY: the caller's contract.
        unsafe { self.kv_copy("kv_gather", stream, sp, len, bases, block) }
    }

    /// # Safety
    /// As [`Kernels::kv_scatter`].
    unsafe fn kv_copy(
        &self,
        kernel: &'static str,
        stream: &Arc<CudaStream>,
        staging: u64,
        staging_len: usize,
        bases: &impl DevicePtr<u64>,
        block: KvParts,
    ) -> Result<(), KernelError> {
        let KvParts {
            parts,
            part_bytes,
            offset,
        } = block;
        ensure_shape!(
            parts > 0 && part_bytes > 0 && part_bytes.is_multiple_of(16) && offset % 16 == 0,
            kernel,
            "{parts} parts of {part_bytes} bytes at offset {offset}: need at least one part, \
             parts a positive multiple of 16 bytes and a 16-byte aligned offset"
        );
        need_len(kernel, "staging", staging_len, parts * part_bytes)?;
        need_len(kernel, "bases", bases.len(), parts)?;
        aligned16(kernel, "staging", staging)?;
        let f = self.function(MODULE, kernel)?;
        let (bp, _b) = bases.device_ptr(stream);
        let vecs = (part_bytes / 16) as u64;
        let config = LaunchConfig {
            grid_dim: (
                stride_blocks(part_bytes / 16, THREADS).min(64),
                to_u32(kernel, "parts", parts)?,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(f);
        b.arg(&staging).arg(&bp).arg(&offset).arg(&vecs);
        // SAFETY: lengths and alignment checked above; the parts' ranges are the caller's
        // contract.
        unsafe { b.launch(config) }?;
        Ok(())
    }
}

/// Self-test: four "layer" allocations of three blocks each; block 1 scattered from a staging
/// buffer must land in each part (blocks 0 and 2 untouched), and gathered back must equal the
/// staging bytes; the canary compares against the parts in the wrong order.
pub(crate) fn check(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    const K: &str = "kv_scatter/kv_gather";
    let (parts, part_bytes, blocks) = (4usize, 1024usize, 3usize);
    let random = |rng: &mut Rng, n: usize| -> Vec<u8> {
        (0..n).map(|_| (rng.unit() * 256.0) as u8).collect()
    };
    let layers: Vec<Vec<u8>> = (0..parts)
        .map(|_| random(rng, part_bytes * blocks))
        .collect();
    let staging = random(rng, parts * part_bytes);
    let d_layers = layers
        .iter()
        .map(|l| upload(s, l))
        .collect::<Result<Vec<_>, _>>()?;
    let bases: Vec<u64> = d_layers
        .iter()
        .map(|l| {
            let (p, _g) = l.device_ptr(s);
            p
        })
        .collect();
    let d_bases = upload(s, &bases)?;
    let d_staging = upload(s, &staging)?;
    let block = KvParts {
        parts,
        part_bytes,
        offset: part_bytes as u64,
    };
    // SAFETY: every base is a live allocation of three parts' bytes; block 1 is inside it.
    unsafe { k.kv_scatter(s, &d_staging, &d_bases, block)? };
    let mut expected = layers.clone();
    for (p, layer) in expected.iter_mut().enumerate() {
        layer[part_bytes..2 * part_bytes]
            .copy_from_slice(&staging[p * part_bytes..(p + 1) * part_bytes]);
    }
    let mut got = Vec::new();
    for l in &d_layers {
        got.push(download(s, l)?);
    }
    let mut back = upload(s, &vec![0u8; parts * part_bytes])?;
    // SAFETY: as above.
    unsafe { k.kv_gather(s, &mut back, &d_bases, block)? };
    let back = download(s, &back)?;
    let mut swapped = staging.clone();
    swapped.rotate_left(part_bytes);
    let case = format!("{parts} parts of {part_bytes} bytes, block 1 of {blocks}");
    let exact = |ok: bool, canary: bool, detail: &str| {
        CheckResult::compare(
            K,
            case.clone(),
            canary,
            if ok { 0.0 } else { 1.0 },
            0.0,
            true,
            detail.to_string(),
        )
    };
    Ok(vec![
        exact(
            got == expected,
            false,
            "scatter: each part in place, the rest untouched",
        ),
        exact(back == staging, false, "gather: the staging bytes back"),
        exact(
            back == swapped,
            true,
            "against the parts in the wrong order",
        ),
    ])
}
