//! The reference backend's copy of the weights: projection matrices as [`Matrix`] (bf16 kept,
//! f16/f32 widened), vectors (norms, biases) widened to f32. Every widening is exact, so the
//! arithmetic is that of the checkpoint's values in f32. A tensor-parallel rank loads only its
//! slices ([`TpLayout`]), read straight from the mapping.

use std::ops::Range;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::ops::Matrix;
use super::tp::TpLayout;
use crate::config::ModelConfig;
use crate::quantize::ActivationQuant;
use crate::weights::{
    Checkpoint, GatedMlp, LM_HEAD, LayerSpec, MlpSpec, TensorRef, TensorSpec, WeightDtype,
    WeightError, embed_spec, final_norm_spec, lm_head_spec,
};

pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    pub o_bias: Option<Vec<f32>>,
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// The norm before the MLP (Gemma 3's `pre_feedforward_layernorm`).
    pub post_attention_norm: Vec<f32>,
    /// Gemma 3's norms of the attention output and of the MLP output.
    pub sandwich: Option<[Vec<f32>; 2]>,
    pub mlp: MlpWeights,
    /// How each projection's input is quantized before its product (q, k, v, o, gate, up,
    /// down): all `None` (weight-only) unless [`CpuWeights::quantize_activations`] set them.
    pub activations: [Option<ActivationQuant>; 7],
}

/// A gated MLP's three matrices.
pub struct GatedWeights {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// A layer's MLP: dense, or a mixture of experts.
pub enum MlpWeights {
    Dense(GatedWeights),
    Sparse {
        /// `[experts, hidden]`: each expert's score of a token.
        router: Matrix,
        /// The experts this rank holds; `None` for those another rank holds.
        experts: Vec<Option<GatedWeights>>,
        /// Qwen2-MoE's shared expert and its `[1, hidden]` gate.
        shared: Option<(GatedWeights, Matrix)>,
    },
}

impl MlpWeights {
    /// The dense MLP; `None` for a mixture of experts.
    pub fn dense(&self) -> Option<&GatedWeights> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Sparse { .. } => None,
        }
    }

    pub fn dense_mut(&mut self) -> Option<&mut GatedWeights> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Sparse { .. } => None,
        }
    }
}

pub struct CpuWeights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the LM head is tied to the embedding.
    pub lm_head: Option<Matrix>,
}

impl CpuWeights {
    /// Validates the checkpoint against `config`, then widens every tensor. Shows a progress bar
    /// when stderr is a terminal.
    pub fn load(config: &ModelConfig, ckpt: &Checkpoint) -> Result<Self, WeightError> {
        Self::load_part(config, ckpt, None)
    }

    /// Like [`load`](Self::load), keeping only `rank`'s slices when given: the rows of q/k/v
    /// (and their biases) of its heads, of gate/up of its intermediate slice, the matching
    /// columns of o and down, its vocabulary rows of the embedding and LM head; norms and the o
    /// bias whole. Nothing outside the slices is read.
    pub(super) fn load_part(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        rank: Option<&TpLayout>,
    ) -> Result<Self, WeightError> {
        ckpt.validate(config)?;
        let bar = ProgressBar::with_draw_target(
            Some(config.num_layers as u64 + 2),
            ProgressDrawTarget::stderr(),
        );
        if let Ok(style) =
            ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} {msg}")
        {
            bar.set_style(style);
        }
        let get = |name: &str, shape: &[usize]| ckpt.get_shaped(name, shape).map(|t| t.to_f32());
        // RMSNorm weights, with Gemma 3's `1 + w` where the checkpoint stores `w`.
        let offset = config.gemma3.as_ref().map_or(0.0, |g| g.norm_offset);
        let norm = |t: &TensorSpec| {
            get(&t.name, &t.shape).map(|mut w| {
                if offset != 0.0 {
                    w.iter_mut().for_each(|v| *v += offset);
                }
                w
            })
        };
        // Vectors (biases) are short: read whole, keep the rank's rows.
        let vector = |t: &TensorSpec| {
            let (rows, _) = TpLayout::slice(rank, t);
            get(&t.name, &t.shape).map(|v| v[rows].to_vec())
        };
        // The rank's rows and columns of a matrix.
        let mat = |t: &TensorSpec| {
            let (rows, cols) = TpLayout::slice(rank, t);
            ckpt.get_shaped(&t.name, &t.shape)
                .map(|r| matrix(&r, t.dims()[1], rows, cols))
        };
        let gated = |m: &GatedMlp| {
            Ok::<_, WeightError>(GatedWeights {
                gate: mat(&m.gate)?,
                up: mat(&m.up)?,
                down: mat(&m.down)?,
            })
        };
        let embed = mat(&embed_spec(config))?;
        bar.inc(1);
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let spec = LayerSpec::new(config, i);
            let norms = |pair: &Option<[TensorSpec; 2]>| {
                pair.as_ref()
                    .map(|[a, b]| Ok::<_, WeightError>([norm(a)?, norm(b)?]))
                    .transpose()
            };
            layers.push(LayerWeights {
                input_norm: norm(&spec.input_norm)?,
                q: mat(&spec.q)?,
                k: mat(&spec.k)?,
                v: mat(&spec.v)?,
                o: mat(&spec.o)?,
                qkv_bias: spec
                    .qkv_bias
                    .as_ref()
                    .map(|[q, k, v]| Ok::<_, WeightError>([vector(q)?, vector(k)?, vector(v)?]))
                    .transpose()?,
                o_bias: spec.o_bias.as_ref().map(vector).transpose()?,
                qk_norm: norms(&spec.qk_norm)?,
                post_attention_norm: norm(&spec.mlp_norm)?,
                sandwich: norms(&spec.sandwich)?,
                mlp: match &spec.mlp {
                    MlpSpec::Dense(m) => MlpWeights::Dense(gated(m)?),
                    MlpSpec::Sparse(moe) => MlpWeights::Sparse {
                        router: mat(&moe.router)?,
                        // A rank holds its experts whole (expert parallel).
                        experts: (moe.experts.iter().enumerate())
                            .map(|(e, m)| {
                                let held = rank.is_none_or(|l| l.experts.contains(&e));
                                held.then(|| gated(m)).transpose()
                            })
                            .collect::<Result<_, _>>()?,
                        shared: moe
                            .shared
                            .as_ref()
                            .map(|(m, gate)| Ok::<_, WeightError>((gated(m)?, mat(gate)?)))
                            .transpose()?,
                    },
                },
                activations: [None; 7],
            });
            bar.inc(1);
        }
        let final_norm = norm(&final_norm_spec(config))?;
        let lm_head = lm_head_spec(config).map(|t| mat(&t)).transpose()?;
        bar.inc(1);
        bar.finish_and_clear();
        Ok(Self {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Quantizes each projection's input as `ckpt`'s quantization config asks (W8A8 / W4A4
    /// arithmetic instead of weight-only); returns how many projections quantize their input.
    /// A scheme strata does not compute, or a static scale missing or not positive, is refused
    /// naming it.
    pub fn quantize_activations(
        &mut self,
        config: &ModelConfig,
        ckpt: &Checkpoint,
    ) -> Result<usize, WeightError> {
        let mut count = 0;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let spec = LayerSpec::new(config, i);
            let Some(projections) = spec.projections() else {
                // A sparse layer's expert inputs are not quantized: a checkpoint asking for
                // it is refused rather than computed weight-only.
                for t in spec.tensors() {
                    if ckpt.activation_quant(&t.name)?.is_some() {
                        return Err(WeightError::Malformed {
                            path: ckpt.dir().to_path_buf(),
                            problem: format!(
                                "tensor {}: quantized activations in a mixture of experts are \
                                 not supported",
                                t.name
                            ),
                        });
                    }
                }
                continue;
            };
            for (slot, t) in layer.activations.iter_mut().zip(projections) {
                *slot = ckpt.activation_quant(&t.name)?;
                count += usize::from(slot.is_some());
            }
        }
        Ok(count)
    }

    /// Computes kept NVFP4's arithmetic, and with `fp8` kept FP8's (the CUDA backend's tiles),
    /// for each such projection of `ckpt` instead of the widened weights: NVFP4 as `bf16(code ×
    /// group scale × 2^-7)` and the tensor scale once per output, FP8 as its e4m3 values and the
    /// row's scale once per output ([`Matrix::Scaled`]), where the tiles hold it: `k` a multiple of 64, FP8
    /// scales per tensor or per row, gate and up only both together and with a multiple of 16
    /// rows (elsewhere the CUDA backend keeps blocks or widens, the widened weights' bits). Whole
    /// tensors only (one rank); returns how many projections changed. A negative or NaN group
    /// scale and a NaN weight are refused naming the tensor.
    pub fn keep_tiled(
        &mut self,
        config: &ModelConfig,
        ckpt: &Checkpoint,
        fp8: bool,
    ) -> Result<usize, WeightError> {
        // A projection's kept weights and scales, and its rows, where the tiles hold it.
        let kept = |name: &str| -> Result<Option<(Matrix, usize)>, WeightError> {
            let Some(q) = ckpt
                .quantized(name)?
                .filter(|q| fp8 || !matches!(q, crate::weights::QuantizedLinear::Fp8 { .. }))
            else {
                return Ok(None);
            };
            let [rows, cols] = q.shape();
            let kept = q.kept().map_err(|problem| WeightError::Malformed {
                path: ckpt.dir().to_path_buf(),
                problem: format!("tensor {name}: {problem}"),
            })?;
            Ok(kept
                .filter(|_| cols.is_multiple_of(64))
                .map(|(weights, scales)| (Matrix::Scaled { weights, scales }, rows)))
        };
        let mut count = 0;
        let mut set = |matrix: &mut Matrix, scaled: Matrix| {
            debug_assert_eq!(scaled.len(), matrix.len());
            *matrix = scaled;
            count += 1;
        };
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let n = LayerSpec::new(config, i);
            // The tiles hold dense layers (a mixture of experts keeps its widened weights).
            let (Some(m), Some(w)) = (n.dense_mlp(), layer.mlp.dense_mut()) else {
                continue;
            };
            let single = [
                (&mut layer.q, &n.q.name),
                (&mut layer.k, &n.k.name),
                (&mut layer.v, &n.v.name),
                (&mut layer.o, &n.o.name),
                (&mut w.down, &m.down.name),
            ];
            for (matrix, name) in single {
                if let Some((scaled, _)) = kept(name)? {
                    set(matrix, scaled);
                }
            }
            // Gate and up are one tiled matrix on the GPU: whole 16-row bands, both or neither.
            if let (Some((gate, rows)), Some((up, _))) = (kept(&m.gate.name)?, kept(&m.up.name)?)
                && rows.is_multiple_of(16)
            {
                set(&mut w.gate, gate);
                set(&mut w.up, up);
            }
        }
        if let Some(head) = &mut self.lm_head
            && let Some((scaled, _)) = kept(LM_HEAD)?
        {
            set(head, scaled);
        }
        Ok(count)
    }

    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Rows `rows`, columns `cols` of `t` read as `[_, width]`: bf16 stays bf16 (read directly by
/// the dot product); f16 and f32 become f32.
fn matrix(t: &TensorRef<'_>, width: usize, rows: Range<usize>, cols: Range<usize>) -> Matrix {
    let runs = t.runs(width, rows, cols);
    let dtype = t.dtype;
    match dtype {
        WeightDtype::BF16 => Matrix::Bf16(
            runs.flat_map(|run| run.chunks_exact(2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
        WeightDtype::F16 | WeightDtype::F32 => Matrix::F32(
            runs.flat_map(|run| run.chunks_exact(dtype.size()))
                .map(|b| dtype.widen(b))
                .collect(),
        ),
    }
}
