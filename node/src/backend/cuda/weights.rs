//! The CUDA backend's weights on the device: read from a checkpoint (converted to bf16) or
//! synthesized for benchmarks of shapes without files.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use std::ops::Range;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};

use strata_model::ModelConfig;
use strata_model::cpu::TpLayout;
use strata_model::weights::{
    Checkpoint, EMBED, FINAL_NORM, LM_HEAD, LayerNames, TensorRef, WeightDtype,
};

use super::CudaError;

pub(super) struct Layer {
    pub(super) input_norm: CudaSlice<bf16>,
    pub(super) q: CudaSlice<bf16>,
    pub(super) k: CudaSlice<bf16>,
    pub(super) v: CudaSlice<bf16>,
    pub(super) o: CudaSlice<bf16>,
    pub(super) qkv_bias: Option<[CudaSlice<bf16>; 3]>,
    pub(super) o_bias: Option<CudaSlice<bf16>>,
    pub(super) qk_norm: Option<[CudaSlice<bf16>; 2]>,
    pub(super) post_norm: CudaSlice<bf16>,
    /// gate and up stacked: `[2 * intermediate, hidden]`, so one product gives `[gate | up]`.
    pub(super) gate_up: CudaSlice<bf16>,
    pub(super) down: CudaSlice<bf16>,
}

pub(super) struct Weights {
    pub(super) embed: CudaSlice<bf16>,
    pub(super) layers: Vec<Layer>,
    pub(super) final_norm: CudaSlice<bf16>,
    /// `None` when tied to the embedding.
    pub(super) lm_head: Option<CudaSlice<bf16>>,
}

/// Rows `rows` and columns `cols` of a row-major tensor `width` wide, as bf16, padded with zero
/// rows to `out_rows` rows. Reads only those elements of the mapping, so a tensor-parallel rank
/// touches only its slice of the checkpoint; the conversion is the CPU reference's (exact widening
/// to f32, then round to nearest even), and bf16 is copied as it is.
fn slice_bf16(
    t: &TensorRef<'_>,
    width: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out_rows: usize,
) -> Vec<bf16> {
    let (size, dtype) = (t.dtype.size(), t.dtype);
    let convert = |b: &[u8]| match dtype {
        WeightDtype::BF16 => bf16::from_le_bytes([b[0], b[1]]),
        WeightDtype::F16 | WeightDtype::F32 => bf16::from_f32(dtype.widen(b)),
    };
    let len = out_rows.max(rows.len()) * cols.len();
    let mut out = Vec::with_capacity(len);
    for run in t.runs(width, rows, cols) {
        match as_bf16(dtype, run) {
            Some(values) => out.extend_from_slice(values),
            None => out.extend(run.chunks_exact(size).map(convert)),
        }
    }
    out.resize(len, bf16::ZERO);
    out
}

/// bf16 bytes of the mapping as values, when they can be read in place: bf16 on a little-endian
/// host, 2-byte aligned.
fn as_bf16(dtype: WeightDtype, bytes: &[u8]) -> Option<&[bf16]> {
    (dtype == WeightDtype::BF16 && cfg!(target_endian = "little"))
        .then(|| bytemuck::try_cast_slice::<u8, bf16>(bytes).ok())
        .flatten()
}

/// Values per staging buffer (64 MiB of bf16).
const STAGE_VALUES: usize = 32 << 20;

/// Host-to-device copies through a page-locked staging buffer: each chunk is written into it by
/// all cores at once (page faults of a mapped checkpoint are taken in parallel) and copied by DMA,
/// instead of one thread filling a pageable vector the driver then copies again.
struct Staging {
    stream: Arc<CudaStream>,
    buffer: PinnedHostSlice<bf16>,
    /// Bytes uploaded so far.
    bytes: usize,
}

impl Staging {
    fn new(stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        // SAFETY: plain page-locked memory (not write-combined: written by the host, read by DMA).
        let buffer = unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<bf16>(STAGE_VALUES, 0)
        }?;
        Ok(Self {
            stream: stream.clone(),
            buffer,
            bytes: 0,
        })
    }

    /// A device copy of `source`.
    fn upload(&mut self, source: &[bf16]) -> Result<CudaSlice<bf16>, CudaError> {
        self.upload_parts(&[source])
    }

    /// A device copy of the concatenation of `parts`.
    fn upload_parts(&mut self, parts: &[&[bf16]]) -> Result<CudaSlice<bf16>, CudaError> {
        let len = parts.iter().map(|p| p.len()).sum::<usize>();
        let mut device = self.stream.alloc_zeros::<bf16>(len.max(1))?;
        let mut at = 0;
        for chunk in parts.iter().flat_map(|p| p.chunks(STAGE_VALUES)) {
            let staged = &mut self.buffer.as_mut_slice()?[..chunk.len()];
            staged
                .par_chunks_mut(1 << 16)
                .zip(chunk.par_chunks(1 << 16))
                .for_each(|(to, from)| to.copy_from_slice(from));
            // A slice of the pinned buffer: the driver copies it by DMA, and the copy is waited
            // for before the buffer is written again.
            self.stream
                .memcpy_htod(&*staged, &mut device.slice_mut(at..at + chunk.len()))?;
            at += chunk.len();
        }
        self.bytes += len * 2;
        Ok(device)
    }
}

/// Uploads rank `shard.rank`'s slices of the checkpoint (the whole model at TP = 1): q/k/v rows
/// of its heads, gate/up rows of its intermediate slice, the matching o/down columns, its
/// vocabulary rows of the embedding and LM head (padded with zero rows to `vocab_per_rank`);
/// norms and the o bias whole.
pub(super) fn upload_checkpoint(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    ckpt: &Checkpoint,
    shard: &TpLayout,
) -> Result<Weights, CudaError> {
    let (h, q, kv, inter, hd) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
        config.head_dim,
    );
    // Rows `rows` of a `[n, width]` tensor, every column.
    let rows = |name: &str, shape: [usize; 2], rows: Range<usize>, out_rows: usize| {
        let t = ckpt.get_shaped(name, &shape)?;
        Ok::<_, CudaError>(slice_bf16(&t, shape[1], rows, 0..shape[1], out_rows))
    };
    // Columns `cols` of a `[n, width]` tensor, every row.
    let columns = |name: &str, shape: [usize; 2], cols: Range<usize>| {
        let t = ckpt.get_shaped(name, &shape)?;
        Ok::<_, CudaError>(slice_bf16(&t, shape[1], 0..shape[0], cols, shape[0]))
    };
    let vector = |name: &str, len: usize, part: Range<usize>| {
        let t = ckpt.get_shaped(name, &[len])?;
        Ok::<_, CudaError>(stream.clone_htod(&slice_bf16(&t, len, 0..1, part, 1))?)
    };
    let started = Instant::now();
    let staging = RefCell::new(Staging::new(stream)?);
    let up = |host: Vec<bf16>| staging.borrow_mut().upload(&host);
    // A whole bf16 tensor goes from the mapping to the staging buffer without a vector between.
    let whole = |name: &str, shape: [usize; 2]| {
        let t = ckpt.get_shaped(name, &shape)?;
        match as_bf16(t.dtype, t.bytes) {
            Some(values) => staging.borrow_mut().upload(values),
            None => up(slice_bf16(&t, shape[1], 0..shape[0], 0..shape[1], 0)),
        }
    };
    let full = |rows: &Range<usize>, n: usize| rows.start == 0 && rows.end == n;
    // A progress bar on a terminal (stderr); nothing otherwise.
    let bar = ProgressBar::with_draw_target(
        Some(config.num_layers as u64 + 2),
        ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = ProgressStyle::with_template("uploading weights {bar:30} {pos}/{len}") {
        bar.set_style(style);
    }
    let v = config.vocab_size;
    let per = shard.vocab_per_rank;
    let embed = if full(&shard.vocab, v) && per == v {
        whole(EMBED, [v, h])?
    } else {
        up(rows(EMBED, [v, h], shard.vocab.clone(), per)?)?
    };
    bar.inc(1);
    let (qr, kvr, ir) = (
        shard.q_rows.clone(),
        shard.kv_rows.clone(),
        shard.inter_rows.clone(),
    );
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        bar.inc(1);
        let n = LayerNames::new(i);
        let gate = ckpt.get_shaped(&n.gate, &[inter, h])?;
        let up_proj = ckpt.get_shaped(&n.up, &[inter, h])?;
        let gate_up = match (
            as_bf16(gate.dtype, gate.bytes),
            as_bf16(up_proj.dtype, up_proj.bytes),
        ) {
            (Some(g), Some(u)) if full(&ir, inter) => staging.borrow_mut().upload_parts(&[g, u])?,
            _ => {
                let mut host = rows(&n.gate, [inter, h], ir.clone(), 0)?;
                host.extend(rows(&n.up, [inter, h], ir.clone(), 0)?);
                up(host)?
            }
        };
        layers.push(Layer {
            input_norm: vector(&n.input_norm, h, 0..h)?,
            q: if full(&qr, q) {
                whole(&n.q, [q, h])?
            } else {
                up(rows(&n.q, [q, h], qr.clone(), 0)?)?
            },
            k: if full(&kvr, kv) {
                whole(&n.k, [kv, h])?
            } else {
                up(rows(&n.k, [kv, h], kvr.clone(), 0)?)?
            },
            v: if full(&kvr, kv) {
                whole(&n.v, [kv, h])?
            } else {
                up(rows(&n.v, [kv, h], kvr.clone(), 0)?)?
            },
            o: if full(&qr, q) {
                whole(&n.o, [h, q])?
            } else {
                up(columns(&n.o, [h, q], qr.clone())?)?
            },
            qkv_bias: if config.qkv_bias {
                Some([
                    vector(&n.q_bias, q, qr.clone())?,
                    vector(&n.k_bias, kv, kvr.clone())?,
                    vector(&n.v_bias, kv, kvr.clone())?,
                ])
            } else {
                None
            },
            o_bias: if config.o_bias {
                Some(vector(&n.o_bias, h, 0..h)?)
            } else {
                None
            },
            qk_norm: if config.qk_norm {
                Some([vector(&n.q_norm, hd, 0..hd)?, vector(&n.k_norm, hd, 0..hd)?])
            } else {
                None
            },
            post_norm: vector(&n.post_attention_norm, h, 0..h)?,
            gate_up,
            down: if full(&ir, inter) {
                whole(&n.down, [h, inter])?
            } else {
                up(columns(&n.down, [h, inter], ir.clone())?)?
            },
        });
    }
    let final_norm = vector(FINAL_NORM, h, 0..h)?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(if full(&shard.vocab, v) && per == v {
            whole(LM_HEAD, [v, h])?
        } else {
            up(rows(LM_HEAD, [v, h], shard.vocab.clone(), per)?)?
        })
    };
    bar.finish_and_clear();
    let (bytes, seconds) = (staging.borrow().bytes, started.elapsed().as_secs_f64());
    tracing::info!(
        "uploaded {:.2} GB of weights in {seconds:.2} s ({:.2} GB/s)",
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / seconds
    );
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// Random weights for benchmarks: every projection is a window of one device pool of
/// N(0, 0.02²) bf16 values (a different offset per tensor), so nothing is zero and nothing is
/// drawn twice in a row; norms are ones.
///
/// A tensor-parallel rank synthesizes weights of its slices' shapes (not slices of one model:
/// benchmarks only need the shapes).
pub(super) fn synthesize(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    shard: &TpLayout,
    seed: u64,
) -> Result<Weights, CudaError> {
    const POOL: usize = 1 << 26; // 64 Mi values, 128 MiB
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let pool_host: Vec<bf16> = (0..POOL)
        .map(|_| {
            // Sum of four uniforms: near-normal, mean 0, variance 4/12; scaled to σ = 0.02.
            let u: f32 = (0..4)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .sum();
            bf16::from_f32(u * 0.02 / (1.0f32 / 3.0).sqrt())
        })
        .collect();
    let pool = stream.clone_htod(&pool_host)?;
    let mut offset = (next() as usize) % POOL;
    let mut matrix = |len: usize| -> Result<CudaSlice<bf16>, CudaError> {
        let mut out = stream.alloc_zeros::<bf16>(len)?;
        let mut done = 0;
        while done < len {
            let take = (len - done).min(POOL - offset);
            stream.memcpy_dtod(
                &pool.slice(offset..offset + take),
                &mut out.slice_mut(done..done + take),
            )?;
            done += take;
            offset = (offset + take + 7919) % POOL;
        }
        Ok(out)
    };
    let ones = |len: usize| stream.clone_htod(&vec![bf16::ONE; len]);
    let (h, q, kv, inter, hd) = (
        config.hidden_size,
        shard.q_rows.len(),
        shard.kv_rows.len(),
        shard.inter_rows.len(),
        config.head_dim,
    );
    let embed = matrix(shard.vocab_per_rank * h)?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for _ in 0..config.num_layers {
        layers.push(Layer {
            input_norm: ones(h)?,
            q: matrix(q * h)?,
            k: matrix(kv * h)?,
            v: matrix(kv * h)?,
            o: matrix(h * q)?,
            qkv_bias: if config.qkv_bias {
                Some([matrix(q)?, matrix(kv)?, matrix(kv)?])
            } else {
                None
            },
            o_bias: if config.o_bias {
                Some(matrix(h)?)
            } else {
                None
            },
            qk_norm: if config.qk_norm {
                Some([ones(hd)?, ones(hd)?])
            } else {
                None
            },
            post_norm: ones(h)?,
            gate_up: matrix(2 * inter * h)?,
            down: matrix(h * inter)?,
        });
    }
    let final_norm = ones(h)?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(matrix(shard.vocab_per_rank * h)?)
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor<'a>(dtype: WeightDtype, shape: &'a [usize], bytes: &'a [u8]) -> TensorRef<'a> {
        TensorRef {
            name: "t",
            path: std::path::Path::new("t.safetensors"),
            dtype,
            shape,
            bytes,
        }
    }

    #[test]
    fn a_slice_reads_its_rows_and_columns_and_pads_with_zero_rows() {
        // A [3, 4] f32 tensor holding 0..12.
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = tensor(WeightDtype::F32, &[3, 4], &bytes);
        let got: Vec<f32> = slice_bf16(&t, 4, 1..3, 1..3, 3)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_eq!(got, vec![5.0, 6.0, 9.0, 10.0, 0.0, 0.0]);
        // bf16 is copied bit for bit, f16 widened exactly then rounded like the reference.
        let b: Vec<u8> = [bf16::from_f32(1.5), bf16::from_f32(-3.0)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = tensor(WeightDtype::BF16, &[2], &b);
        assert_eq!(slice_bf16(&t, 2, 0..1, 1..2, 1), vec![bf16::from_f32(-3.0)]);
        let h: Vec<u8> = half::f16::from_f32(0.1).to_le_bytes().to_vec();
        let t = tensor(WeightDtype::F16, &[1], &h);
        assert_eq!(
            slice_bf16(&t, 1, 0..1, 0..1, 1),
            vec![bf16::from_f32(half::f16::from_f32(0.1).to_f32())]
        );
    }
}
