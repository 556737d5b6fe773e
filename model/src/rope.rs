//! Rotary position embedding: the inverse frequencies of a config (with Llama 3 / linear scaling)
//! and their application in the "rotate half" layout HF checkpoints use (pairs `i` and `i + d/2`).
//!
//! Frequencies and angles are computed in f64 and rounded once to f32, so every backend that asks
//! for the same position gets the same cos/sin bits.

use crate::config::{ModelConfig, RopeScaling};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    pub fn new(config: &ModelConfig) -> Self {
        Self::with_theta(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling.as_ref(),
        )
    }

    pub fn with_theta(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Self {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                let base = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
                scaled(base, i, scaling)
            })
            .collect();
        Self { inv_freq }
    }

    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Fills `cos` and `sin` (each `head_dim / 2` long) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((f, c), s) in self.inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
            let angle = position as f64 * f;
            *c = angle.cos() as f32;
            *s = angle.sin() as f32;
        }
    }

    /// Rotates every head in `x` (`heads * head_dim` values of one token) in place.
    pub fn apply(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// Applies a scaling rule to inverse frequency `i` (Llama 3: low frequencies slowed by `factor`,
/// high ones untouched, a linear ramp in wavelength space between).
fn scaled(inv_freq: f64, i: usize, scaling: Option<&RopeScaling>) -> f64 {
    match scaling {
        None => inv_freq,
        Some(RopeScaling::Linear { factor }) => inv_freq / factor,
        Some(RopeScaling::Factors(factors)) => inv_freq / factors[i],
        Some(&RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        }) => {
            let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
            let low_freq_wavelen = original_max_position / low_freq_factor;
            let high_freq_wavelen = original_max_position / high_freq_factor;
            if wavelen < high_freq_wavelen {
                inv_freq
            } else if wavelen > low_freq_wavelen {
                inv_freq / factor
            } else {
                let smooth = (original_max_position / wavelen - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::with_theta(8, 10_000.0, None);
        let (mut c, mut s) = ([0.0; 4], [0.0; 4]);
        rope.cos_sin(0, &mut c, &mut s);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let before = x;
        Rope::apply(&mut x, 8, &c, &s);
        assert_eq!(x, before);
    }

    #[test]
    fn rotation_preserves_pair_norms() {
        let rope = Rope::with_theta(4, 10_000.0, None);
        let (mut c, mut s) = ([0.0; 2], [0.0; 2]);
        rope.cos_sin(17, &mut c, &mut s);
        let mut x = [3.0f32, 1.0, 4.0, 2.0];
        Rope::apply(&mut x, 4, &c, &s);
        assert!(((x[0] * x[0] + x[2] * x[2]) - 25.0).abs() < 1e-4);
        assert!(((x[1] * x[1] + x[3] * x[3]) - 5.0).abs() < 1e-4);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_slows_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192.0,
        };
        let plain = Rope::with_theta(128, 500_000.0, None);
        let scaled = Rope::with_theta(128, 500_000.0, Some(&scaling));
        assert_eq!(plain.inv_freq()[0], scaled.inv_freq()[0]);
        let last = plain.inv_freq().len() - 1;
        assert!((plain.inv_freq()[last] / 8.0 - scaled.inv_freq()[last]).abs() < 1e-18);
        // Some frequencies sit on the ramp, strictly between the two rules.
        let ramp = plain
            .inv_freq()
            .iter()
            .zip(scaled.inv_freq())
            .filter(|(p, s)| **s < **p && **s > **p / 8.0)
            .count();
        assert!(ramp > 0);
    }
}
