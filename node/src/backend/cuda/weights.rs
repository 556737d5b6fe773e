//! The CUDA backend's weights on the device: read from a checkpoint (converted to bf16) or
//! synthesized for benchmarks of shapes without files.

use std::sync::Arc;

use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream};
use strata_model::ModelConfig;
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

fn to_bf16(t: &TensorRef<'_>) -> Vec<bf16> {
    match t.dtype {
        WeightDtype::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]))
            .collect(),
        _ => t.to_f32().into_iter().map(bf16::from_f32).collect(),
    }
}

pub(super) fn upload_checkpoint(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    ckpt: &Checkpoint,
) -> Result<Weights, CudaError> {
    let (h, q, kv, inter, hd) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
        config.head_dim,
    );
    let get = |name: &str, shape: &[usize]| -> Result<CudaSlice<bf16>, CudaError> {
        let t = ckpt.get_shaped(name, shape)?;
        Ok(stream.clone_htod(&to_bf16(&t))?)
    };
    // A progress bar on a terminal (stderr); nothing otherwise.
    let bar = ProgressBar::with_draw_target(
        Some(config.num_layers as u64 + 2),
        ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = ProgressStyle::with_template("uploading weights {bar:30} {pos}/{len}") {
        bar.set_style(style);
    }
    let embed = get(EMBED, &[config.vocab_size, h])?;
    bar.inc(1);
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        bar.inc(1);
        let n = LayerNames::new(i);
        let mut gate_up = to_bf16(&ckpt.get_shaped(&n.gate, &[inter, h])?);
        gate_up.extend(to_bf16(&ckpt.get_shaped(&n.up, &[inter, h])?));
        layers.push(Layer {
            input_norm: get(&n.input_norm, &[h])?,
            q: get(&n.q, &[q, h])?,
            k: get(&n.k, &[kv, h])?,
            v: get(&n.v, &[kv, h])?,
            o: get(&n.o, &[h, q])?,
            qkv_bias: if config.qkv_bias {
                Some([
                    get(&n.q_bias, &[q])?,
                    get(&n.k_bias, &[kv])?,
                    get(&n.v_bias, &[kv])?,
                ])
            } else {
                None
            },
            o_bias: if config.o_bias {
                Some(get(&n.o_bias, &[h])?)
            } else {
                None
            },
            qk_norm: if config.qk_norm {
                Some([get(&n.q_norm, &[hd])?, get(&n.k_norm, &[hd])?])
            } else {
                None
            },
            post_norm: get(&n.post_attention_norm, &[h])?,
            gate_up: stream.clone_htod(&gate_up)?,
            down: get(&n.down, &[h, inter])?,
        });
    }
    let final_norm = get(FINAL_NORM, &[h])?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(get(LM_HEAD, &[config.vocab_size, h])?)
    };
    bar.finish_and_clear();
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
pub(super) fn synthesize(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
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
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
        config.head_dim,
    );
    let embed = matrix(config.vocab_size * h)?;
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
        Some(matrix(config.vocab_size * h)?)
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}
