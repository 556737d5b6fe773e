//! `strata quantize --calibrate`: static activation scales measured on real text, so engines that
//! quantize activations (FP8 W8A8, NVFP4 W4A4) can run the files without calibrating themselves.
//!
//! The CPU reference runs the text in sequences of a fixed length, each from position 0, and
//! keeps the largest magnitude every Linear input reaches (compressed-tensors' `static_minmax`
//! observer: a running maximum, not an average). The scales follow compressed-tensors' own
//! formulas (`calculate_qparams`, `generate_gparam`), in f32: an FP8 input scale is amax / 448
//! (a zero becomes f32's epsilon), an NVFP4 input global scale is 448 · 6 / amax. strata's own
//! forward pass keeps activations in its precision and sets these scales aside.

use std::collections::HashMap;

use crate::cpu::{CpuModel, ForwardError, LinearInput};

use super::{E2M1_MAX, E4M3_MAX};

/// Each Linear input's largest magnitude over the calibration text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    amax: HashMap<(usize, LinearInput), f32>,
    /// Tokens the model ran, and in how many sequences.
    pub tokens: usize,
    pub sequences: usize,
}

impl Calibration {
    /// Runs each of `sequences` through `model` from position 0, keeping every Linear input's
    /// largest magnitude.
    pub fn measure(model: &CpuModel, sequences: &[Vec<u32>]) -> Result<Self, ForwardError> {
        let mut amax: HashMap<(usize, LinearInput), f32> = HashMap::new();
        for tokens in sequences {
            model.observe_linear_inputs(tokens, &mut |layer, input, rows| {
                let seen = rows.iter().fold(0f32, |m, v| m.max(v.abs()));
                let kept = amax.entry((layer, input)).or_insert(0.0);
                *kept = kept.max(seen);
            })?;
        }
        Ok(Self {
            amax,
            tokens: sequences.iter().map(Vec::len).sum(),
            sequences: sequences.len(),
        })
    }

    /// The largest magnitude `input` of `layer` reached, when it was observed.
    pub fn amax(&self, layer: usize, input: LinearInput) -> Option<f32> {
        self.amax.get(&(layer, input)).copied()
    }
}

/// `tokens` cut into sequences of `context` (the last may be shorter; one of fewer than two
/// tokens is dropped), at most `max` of them.
pub fn sequences(tokens: &[u32], context: usize, max: usize) -> Vec<Vec<u32>> {
    tokens
        .chunks(context.max(1))
        .filter(|c| c.len() >= 2)
        .take(max)
        .map(<[u32]>::to_vec)
        .collect()
}

/// An FP8 (e4m3) static per-tensor input scale for inputs reaching `amax`: compressed-tensors'
/// symmetric `amax / ((448 − (−448)) / 2)`, a zero replaced by f32's epsilon.
pub fn fp8_input_scale(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if scale == 0.0 { f32::EPSILON } else { scale }
}

/// An NVFP4 input global scale for inputs reaching `amax`: compressed-tensors' `448 · 6 / amax`
/// (amax at least f32's smallest normal), 1 where that is not finite.
pub fn nvfp4_input_global_scale(amax: f32) -> f32 {
    let global = E4M3_MAX * E2M1_MAX / amax.max(f32::MIN_POSITIVE);
    if global.is_finite() { global } else { 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_follow_the_library_formulas_at_their_edges() {
        assert_eq!(fp8_input_scale(448.0), 1.0);
        assert_eq!(fp8_input_scale(0.0), f32::EPSILON);
        assert_eq!(nvfp4_input_global_scale(2688.0), 1.0);
        // The smallest normal divides 2688 to infinity: the library's fallback.
        assert_eq!(nvfp4_input_global_scale(0.0), 1.0);
        assert_eq!(nvfp4_input_global_scale(1.0), 2688.0);
    }

    #[test]
    fn sequences_cut_the_text_and_drop_a_single_token_tail() {
        let tokens: Vec<u32> = (0..11).collect();
        let s = sequences(&tokens, 4, 8);
        assert_eq!(s, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 10]]);
        assert_eq!(sequences(&tokens, 5, 8).len(), 2);
        assert_eq!(sequences(&tokens, 4, 1).len(), 1);
    }
}
