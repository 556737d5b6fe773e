//! Activations quantized before a Linear's product, as compressed-tensors' forward does it
//! (`forward_quantize`): the reference arithmetic of W8A8 and W4A4 checkpoints. Each input row
//! is quantized, then dequantized back to f32, and the product runs on those values.
//!
//! - FP8, static: `e4m3(x / s) · s` with the checkpoint's `input_scale` s (saturating at ±448,
//!   to nearest, ties to even).
//! - FP8, per token: the same with s = the row's largest magnitude / 448 (f32's epsilon for a row
//!   of zeros).
//! - NVFP4: per group of 16, `s8 = e4m3(g · amax / 6)` (0.125 where that is zero) under the
//!   static global scale g (`input_global_scale`), then `e2m1(x / (s8 / g)) · (s8 / g)`.
//!
//! Bit for bit compressed-tensors' own outputs: `tests/oracle/quant/make_activations.py`.

use crate::weights::{e2m1_to_f32, e4m3_to_f32};

use super::{E2M1_MAX, E4M3_MAX, f32_to_e2m1, f32_to_e4m3};

/// How a Linear's input is quantized before its product.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActivationQuant {
    /// FP8 (e4m3) with the checkpoint's per-tensor scale.
    Fp8Static { scale: f32 },
    /// FP8 (e4m3) with a scale per token from its largest magnitude.
    Fp8Token,
    /// NVFP4: e2m1 in groups of 16, each group's e4m3 scale under the static global scale.
    Nvfp4 { global: f32 },
}

/// e4m3's smallest step at 1, compressed-tensors' stand-in for a zero e4m3 scale.
const E4M3_EPS: f32 = 0.125;

impl ActivationQuant {
    /// `x`, rows of `width` values, quantized and dequantized.
    pub fn apply(&self, x: &[f32], width: usize) -> Vec<f32> {
        let fp8 = |v: f32, s: f32| e4m3_to_f32(f32_to_e4m3(v / s)) * s;
        match *self {
            ActivationQuant::Fp8Static { scale } => x.iter().map(|&v| fp8(v, scale)).collect(),
            ActivationQuant::Fp8Token => x
                .chunks(width.max(1))
                .flat_map(|row| {
                    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let s = amax / E4M3_MAX;
                    let s = if s == 0.0 { f32::EPSILON } else { s };
                    row.iter().map(move |&v| fp8(v, s))
                })
                .collect(),
            ActivationQuant::Nvfp4 { global } => x
                .chunks(16)
                .flat_map(|group| {
                    let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let s8 = e4m3_to_f32(f32_to_e4m3(global * (amax / E2M1_MAX)));
                    let s8 = if s8 == 0.0 { E4M3_EPS } else { s8 };
                    let s = s8 / global;
                    group
                        .iter()
                        .map(move |&v| e2m1_to_f32(f32_to_e2m1(v / s)) * s)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressed_tensors_forward_is_reproduced_bit_for_bit() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/oracle/quant/activations.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let width = fixture["width"].as_u64().unwrap() as usize;
        let flat = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .flat_map(|row| row.as_array().unwrap().iter())
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        let x = flat(&fixture["input"]);
        let param =
            |case: &str, key: &str| fixture["cases"][case]["params"][key].as_f64().unwrap() as f32;
        let schemes = [
            (
                "fp8_static",
                ActivationQuant::Fp8Static {
                    scale: param("fp8_static", "input_scale"),
                },
            ),
            ("fp8_static_unit", ActivationQuant::Fp8Static { scale: 1.0 }),
            ("fp8_token", ActivationQuant::Fp8Token),
            (
                "nvfp4",
                ActivationQuant::Nvfp4 {
                    global: param("nvfp4", "input_global_scale"),
                },
            ),
        ];
        for (name, scheme) in schemes {
            let want = flat(&fixture["cases"][name]["output"]);
            let got = scheme.apply(&x, width);
            assert_eq!(got.len(), want.len(), "{name}");
            let differing: Vec<(usize, f32, f32)> = got
                .iter()
                .zip(&want)
                .enumerate()
                .filter(|(_, (a, b))| a.to_bits() != b.to_bits() && !(**a == 0.0 && **b == 0.0))
                .map(|(i, (a, b))| (i, *a, *b))
                .take(5)
                .collect();
            assert!(differing.is_empty(), "{name}: {differing:?}");
            // The canary: the static scale nudged by one ulp changes outputs.
            if let ActivationQuant::Fp8Static { scale } = scheme {
                let nudged = ActivationQuant::Fp8Static {
                    scale: f32::from_bits(scale.to_bits() + 1),
                };
                assert_ne!(nudged.apply(&x, width), want, "{name}");
            }
        }
    }
}
