//! A mixture of experts on the CUDA backend (Qwen2-MoE, Qwen3-MoE, Mixtral): a sparse layer's
//! weights stacked per kind (the router `[experts, hidden]`, every expert's gate/up
//! `[experts][2·inter][hidden]` and down `[experts][hidden][inter]`, Qwen2-MoE's shared expert
//! beside them, all bf16), the step's buffers for routing and expert outputs, and the launches:
//! the router's logits, each token's top-k, the chosen experts' gated MLPs gathered by expert id
//! (one warp per output element over the token's own row, so a token's bits do not depend on the
//! other rows of the step and prompt rows equal decode rows), the sum in ascending expert order
//! and the gated shared expert. Launches only: a decode step with experts is captured into a graph
//! like any other.

use std::sync::Arc;

use half::bf16;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream};
use strata_kernels::{ExpertGroups, ExpertSlots, Kernels};
use strata_model::config::Moe;
use strata_model::weights::{GatedMlp, SparseMlp, TensorSpec};

use super::CudaError;
use super::weights::{Matrix, Upload};

/// A layer's MLP on the device: dense (gate/up stacked, down), or a mixture of experts.
pub(super) enum Mlp {
    Dense([Matrix; 2]),
    Sparse(Experts),
}

impl Mlp {
    /// The dense projections (none for a mixture of experts, whose weights are bf16 stacks).
    pub(super) fn matrices(&self) -> &[Matrix] {
        match self {
            Mlp::Dense(m) => m,
            Mlp::Sparse(_) => &[],
        }
    }
}

/// A sparse layer's weights, every expert stacked in one buffer per kind.
pub(super) struct Experts {
    /// Experts in the stacks, and chosen per token.
    count: usize,
    per_token: usize,
    /// `[experts, hidden]`.
    pub(super) router: CudaSlice<bf16>,
    /// `[experts][2 · inter][hidden]`: each expert's gate rows, then its up rows.
    pub(super) gate_up: CudaSlice<bf16>,
    /// `[experts][hidden][inter]`.
    pub(super) down: CudaSlice<bf16>,
    /// Qwen2-MoE's shared expert: gate/up `[2 · inter][hidden]`, down `[hidden][inter]`, and its
    /// sigmoid gate `[1, hidden]`.
    pub(super) shared: Option<[CudaSlice<bf16>; 3]>,
}

impl Experts {
    /// Bytes one token's step reads: the router, its `k` experts and the shared expert.
    pub(super) fn token_bytes(&self) -> usize {
        let stacked = (self.gate_up.len() + self.down.len()) * 2;
        self.router.len() * 2
            + stacked / self.count * self.per_token
            + self
                .shared
                .as_ref()
                .map_or(0, |s| s.iter().map(|w| w.len() * 2).sum())
    }

    /// Tensors the checkpoint holds for the layer.
    pub(super) fn tensors(&self) -> usize {
        1 + 3 * self.count + self.shared.as_ref().map_or(0, |_| 4)
    }

    /// Random weights of the layer's shapes (benchmarks), each from `matrix(len)`.
    pub(super) fn synthesize(
        moe: &Moe,
        hidden: usize,
        mut matrix: impl FnMut(usize) -> Result<CudaSlice<bf16>, CudaError>,
    ) -> Result<Experts, CudaError> {
        let (e, i) = (moe.experts, moe.expert_intermediate);
        Ok(Experts {
            count: e,
            per_token: moe.experts_per_token,
            router: matrix(e * hidden)?,
            gate_up: matrix(e * 2 * i * hidden)?,
            down: matrix(e * hidden * i)?,
            shared: match moe.shared_expert_intermediate {
                Some(si) => Some([
                    matrix(2 * si * hidden)?,
                    matrix(hidden * si)?,
                    matrix(hidden)?,
                ]),
                None => None,
            },
        })
    }

    /// A sparse layer of the checkpoint: each expert uploaded as the dense path uploads a
    /// gated MLP, then copied into its place in the stacks. Experts must arrive as bf16 (a
    /// block format or tiles is refused by name: the expert kernels read bf16).
    pub(super) fn upload(
        up: &Upload<'_>,
        stream: &Arc<CudaStream>,
        sparse: &SparseMlp,
        moe: &Moe,
        hidden: usize,
    ) -> Result<Experts, CudaError> {
        let (e, i) = (moe.experts, moe.expert_intermediate);
        let mut gate_up = stream.alloc_zeros::<bf16>(e * 2 * i * hidden)?;
        let mut down = stream.alloc_zeros::<bf16>(e * hidden * i)?;
        for (x, expert) in sparse.experts.iter().enumerate() {
            let (gu, d) = gated_bf16(up, expert, i)?;
            let (a, b) = (x * 2 * i * hidden, x * hidden * i);
            stream.memcpy_dtod(&gu, &mut gate_up.slice_mut(a..a + gu.len()))?;
            stream.memcpy_dtod(&d, &mut down.slice_mut(b..b + d.len()))?;
        }
        let shared = match (&sparse.shared, moe.shared_expert_intermediate) {
            (Some((mlp, gate)), Some(si)) => {
                let (gu, d) = gated_bf16(up, mlp, si)?;
                Some([gu, d, bf16_matrix(up, gate, hidden)?])
            }
            _ => None,
        };
        Ok(Experts {
            count: e,
            per_token: moe.experts_per_token,
            router: bf16_matrix(up, &sparse.router, hidden)?,
            gate_up,
            down,
            shared,
        })
    }
}

/// An expert's gate/up and down as bf16 device buffers.
fn gated_bf16(
    up: &Upload<'_>,
    mlp: &GatedMlp,
    inter: usize,
) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>), CudaError> {
    let gate_up = match up.gate_up(mlp)? {
        Matrix::Bf16(m) => m,
        other => return Err(kept(&mlp.gate.name, &other)),
    };
    let down = match up.matrix(&mlp.down, 0, inter)? {
        Matrix::Bf16(m) => m,
        other => return Err(kept(&mlp.down.name, &other)),
    };
    Ok((gate_up, down))
}

fn bf16_matrix(up: &Upload<'_>, t: &TensorSpec, k: usize) -> Result<CudaSlice<bf16>, CudaError> {
    match up.matrix(t, 0, k)? {
        Matrix::Bf16(m) => Ok(m),
        other => Err(kept(&t.name, &other)),
    }
}

fn kept(name: &str, m: &Matrix) -> CudaError {
    CudaError::Unsupported(format!(
        "{name} kept as {} (the CUDA expert kernels read bf16: load the checkpoint widened, \
         without --keep-quantized)",
        m.layout()
    ))
}

/// A step's buffers for its sparse layers (`rows` rows).
pub(super) struct MoeScratch {
    logits: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    /// The experts' gated products, `[rows · k][inter]`, then the shared expert's.
    act: CudaSlice<bf16>,
    /// Each chosen expert's weighted output, `[rows · k][hidden]` f32.
    slots: CudaSlice<f32>,
    /// The shared expert's output `[rows][hidden]` and gate logit `[rows]`.
    shared: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The step's slots grouped by expert.
    groups: ExpertGroups,
}

impl MoeScratch {
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        moe: &Moe,
        hidden: usize,
        rows: usize,
    ) -> Result<Self, CudaError> {
        let (e, k, i) = (moe.experts, moe.experts_per_token, moe.expert_intermediate);
        let act = (k * i).max(moe.shared_expert_intermediate.unwrap_or(0));
        Ok(Self {
            logits: stream.alloc_zeros(rows * e)?,
            ids: stream.alloc_zeros(rows * k)?,
            weights: stream.alloc_zeros(rows * k)?,
            act: stream.alloc_zeros(rows * act)?,
            slots: stream.alloc_zeros(rows * k * hidden)?,
            shared: match moe.shared_expert_intermediate {
                Some(_) => Some((
                    stream.alloc_zeros(rows * hidden)?,
                    stream.alloc_zeros(rows)?,
                )),
                None => None,
            },
            groups: ExpertGroups::new(stream, rows * k, e)?,
        })
    }
}

/// The sparse MLP of the `t` rows of `normed` into `out` (`[t][hidden]` bf16).
pub(super) fn launch(
    k: &Kernels,
    stream: &Arc<CudaStream>,
    (moe, w, grouped): (&Moe, &Experts, bool),
    s: &mut MoeScratch,
    normed: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    (t, hidden): (usize, usize),
) -> Result<(), CudaError> {
    let (e, kk) = (moe.experts, moe.experts_per_token);
    let x = normed.slice(..t * hidden);
    k.moe_logits(stream, &mut s.logits, &x, &w.router, (t, e, hidden))?;
    let chosen = (&mut s.ids, &mut s.weights);
    match grouped {
        true => k.moe_route_warp(stream, chosen, &s.logits, (t, e, kk), moe.norm_topk_prob)?,
        false => k.moe_route(stream, chosen, &s.logits, (t, e, kk), moe.norm_topk_prob)?,
    }
    let routed = ExpertSlots {
        slots: t * kk,
        per_token: kk,
        experts: e,
        hidden,
        inter: moe.expert_intermediate,
    };
    if grouped {
        // Each chosen expert's weights read once a step.
        k.moe_sort(stream, &mut s.groups, &s.ids, (t * kk, e))?;
        k.moe_gate_up_grouped(stream, &mut s.act, &x, &w.gate_up, &s.groups, routed)?;
        let chosen = (&s.groups, &s.weights);
        k.moe_down_grouped(stream, &mut s.slots, &s.act, &w.down, chosen, routed)?;
    } else {
        k.moe_gate_up(stream, &mut s.act, &x, &w.gate_up, Some(&s.ids), routed)?;
        let chosen = (Some(&s.ids), Some(&s.weights));
        k.moe_down(stream, &mut s.slots, &s.act, &w.down, chosen, routed)?;
    }
    let mut y = out.slice_mut(..t * hidden);
    match (&w.shared, &mut s.shared, moe.shared_expert_intermediate) {
        (Some([gu, down, gate]), Some((values, logit)), Some(si)) => {
            let one = ExpertSlots {
                slots: t,
                per_token: 1,
                experts: 1,
                hidden,
                inter: si,
            };
            k.moe_gate_up(stream, &mut s.act, &x, gu, None, one)?;
            k.moe_down(stream, values, &s.act, down, (None, None), one)?;
            k.moe_logits(stream, logit, &x, gate, (t, 1, hidden))?;
            let shared = Some((&*values, &*logit));
            k.moe_combine(stream, &mut y, &s.slots, shared, (t, kk, hidden))?;
        }
        _ => k.moe_combine(stream, &mut y, &s.slots, None, (t, kk, hidden))?,
    }
    Ok(())
}
