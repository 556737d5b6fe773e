//! The reference's mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral), in transformers' order
//! of operations: per token the router's softmax in f32, the top-k experts, their probabilities
//! renormalized where the family does, each chosen expert's gated MLP scaled by its
//! probability, summed in ascending expert order from zero, then Qwen2-MoE's shared expert
//! scaled by its sigmoid gate. A token's arithmetic is its own: the rows gathered for an expert
//! go through the same row-invariant products as a row alone, so the result does not depend on
//! which other tokens share the step.

use super::Group;
use super::ops::{self, Matrix, linear};
use super::weights::GatedWeights;
use crate::config::Moe;

/// A sparse layer's weights as a rank holds them: the router and the shared expert whole, the
/// experts it holds (`None` for those another rank holds).
pub(crate) struct SparseWeights<'a> {
    pub router: &'a Matrix,
    pub experts: &'a [Option<GatedWeights>],
    pub shared: Option<&'a (GatedWeights, Matrix)>,
}

/// The mixture over the rows of `x` (`n × hidden`), written into `out` (`n × hidden`). Each
/// chosen expert's weighted output fills its slot (a token's `k` slots in ascending expert
/// order); the ranks holding other experts fill theirs ([`Group::expert_outputs`]); then every
/// token adds its slots in order into zero.
pub(crate) fn sparse_mlp<E>(
    moe: &Moe,
    w: &SparseWeights<'_>,
    x: &[f32],
    hidden: usize,
    group: &dyn Group<E>,
    out: &mut [f32],
) -> Result<(), E> {
    let n = x.len() / hidden;
    let k = moe.experts_per_token;
    let mut logits = vec![0.0; n * moe.experts];
    linear(x, w.router, None, hidden, &mut logits);
    let choices: Vec<Vec<(usize, f32)>> = logits
        .chunks_exact(moe.experts)
        .map(|row| route(row, k, moe.norm_topk_prob))
        .collect();
    let mut slots = vec![-0.0f32; n * k * hidden];
    for (e, expert) in w.experts.iter().enumerate() {
        let Some(expert) = expert else { continue };
        // (token, its slot for this expert, the expert's weight) of every token that chose it.
        let tokens: Vec<(usize, usize, f32)> = choices
            .iter()
            .enumerate()
            .filter_map(|(t, chosen)| {
                let j = chosen.iter().position(|(c, _)| *c == e)?;
                Some((t, j, chosen[j].1))
            })
            .collect();
        if tokens.is_empty() {
            continue;
        }
        let rows: Vec<f32> = tokens
            .iter()
            .flat_map(|&(t, _, _)| &x[t * hidden..(t + 1) * hidden])
            .copied()
            .collect();
        let y = gated_mlp(expert, &rows, hidden, moe.expert_intermediate);
        for (&(t, j, weight), y) in tokens.iter().zip(y.chunks_exact(hidden)) {
            let slot = &mut slots[(t * k + j) * hidden..(t * k + j + 1) * hidden];
            slot.iter_mut().zip(y).for_each(|(s, v)| *s = v * weight);
        }
    }
    group.expert_outputs(&mut slots)?;
    out.fill(0.0);
    for (acc, token) in out
        .chunks_exact_mut(hidden)
        .zip(slots.chunks_exact(k * hidden))
    {
        for slot in token.chunks_exact(hidden) {
            ops::add_in_place(acc, slot);
        }
    }
    if let Some((expert, gate)) = w.shared {
        let inter = expert.gate.len() / hidden;
        let y = gated_mlp(expert, x, hidden, inter);
        let mut g = vec![0.0; n];
        linear(x, gate, None, hidden, &mut g);
        for ((acc, y), g) in out
            .chunks_exact_mut(hidden)
            .zip(y.chunks_exact(hidden))
            .zip(g)
        {
            let scale = 1.0 / (1.0 + (-g).exp());
            acc.iter_mut().zip(y).for_each(|(a, v)| *a += scale * v);
        }
    }
    Ok(())
}

/// `down(silu(gate · x) ⊙ (up · x))` over the rows of `x`.
fn gated_mlp(w: &GatedWeights, x: &[f32], hidden: usize, inter: usize) -> Vec<f32> {
    let n = x.len() / hidden;
    let mut gate = vec![0.0; n * inter];
    let mut up = vec![0.0; n * inter];
    linear(x, &w.gate, None, hidden, &mut gate);
    linear(x, &w.up, None, hidden, &mut up);
    ops::silu_mul(&mut gate, &up);
    let mut y = vec![0.0; n * hidden];
    linear(&gate, &w.down, None, inter, &mut y);
    y
}

/// One token's experts and weights, by ascending expert: the softmax of its router logits in
/// f32 (less the maximum, as torch), the `k` largest (ties to the lower index), divided by
/// their sum (summed from the largest) when `normalize`.
pub(crate) fn route(logits: &[f32], k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable: equal probabilities keep ascending indices.
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
    let mut chosen: Vec<(usize, f32)> = order[..k].iter().map(|&e| (e, exps[e] / sum)).collect();
    if normalize {
        let total: f32 = chosen.iter().map(|&(_, p)| p).sum();
        chosen.iter_mut().for_each(|(_, p)| *p /= total);
    }
    chosen.sort_by_key(|&(e, _)| e);
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keeps_the_top_k_by_probability_in_expert_order() {
        let chosen = route(&[0.0, 2.0, 1.0, 3.0], 2, false);
        let e: Vec<usize> = chosen.iter().map(|c| c.0).collect();
        assert_eq!(e, [1, 3]);
        let z: f32 = [0.0f32, 2.0, 1.0, 3.0]
            .iter()
            .map(|l| (l - 3.0).exp())
            .sum();
        assert_eq!(chosen[1].1, 1.0 / z);
        assert_eq!(chosen[0].1, (-1.0f32).exp() / z);
        let normalized = route(&[0.0, 2.0, 1.0, 3.0], 2, true);
        let total: f32 = normalized.iter().map(|c| c.1).sum();
        assert!((total - 1.0).abs() < 1e-6, "{normalized:?}");
        // Ties go to the lower index.
        assert_eq!(
            route(&[1.0, 1.0, 1.0], 2, false)
                .iter()
                .map(|c| c.0)
                .collect::<Vec<_>>(),
            [0, 1]
        );
    }
}
