//! Quantized safetensors checkpoints as the loader holds them: each quantized Linear's stored
//! parts folded into one tensor (dequantized on first use), its activation scales kept aside,
//! and the parts handed as they are to a backend that keeps weights quantized.

use std::sync::OnceLock;

use safetensors::Dtype;
use serde_json::Value;

use super::activations::ActivationSchemes;
use super::quant::{self, QuantizedLinear};
use super::{Checkpoint, TensorData, TensorEntry, WeightError};

impl Checkpoint {
    /// Folds every quantized Linear's stored parts into one tensor under its `…weight` name (see
    /// [`quant`]), as the checkpoint's `quantization_config` (`q`) describes them; its static
    /// input scales are kept for [`Checkpoint::activation_quant`], its KV scales dropped. A part
    /// missing, of the wrong type or shape, or an asymmetric (zero-point) weight is refused
    /// naming the tensor.
    pub(super) fn fold_quantized(&mut self, q: Option<&Value>) -> Result<(), WeightError> {
        self.activations = ActivationSchemes::from_config(q);
        let block = quant_block(q);
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        for name in &names {
            let Some(entry) = self.tensors.get(name) else {
                continue;
            };
            let dtype = match entry.data {
                TensorData::Mapped(dtype) => dtype,
                _ => continue,
            };
            let Some((base, kind, part_names)) = self.quantized_linear_of(name, dtype, block)?
            else {
                continue;
            };
            let zero_point = format!("{base}.weight_zero_point");
            if self.tensors.contains_key(&zero_point) {
                return Err(self.malformed_at(
                    &zero_point,
                    format!(
                        "tensor {zero_point}: asymmetric (zero-point) quantization is not supported"
                    ),
                ));
            }
            let mut parts = Vec::with_capacity(part_names.len());
            for part in &part_names {
                let entry = self.tensors.remove(part).ok_or_else(|| {
                    self.malformed_at(
                        name,
                        format!("tensor {name} is quantized but {part} is missing"),
                    )
                })?;
                let TensorData::Mapped(dtype) = entry.data else {
                    return Err(self
                        .malformed_at(name, format!("tensor {part} cannot be a quantized part")));
                };
                parts.push(quant::Part {
                    file: entry.file,
                    offsets: entry.offsets,
                    dtype,
                    shape: entry.shape,
                    name: part.clone(),
                });
            }
            let rows = parts[0].shape.first().copied().unwrap_or(0);
            let stored_cols = parts[0].shape.get(1).copied().unwrap_or(0);
            let cols = match kind {
                quant::QuantKind::Nvfp4 { .. } => stored_cols * 2,
                quant::QuantKind::Fp8 { .. } => stored_cols,
            };
            if parts[0].shape.len() != 2 {
                return Err(self.malformed_at(
                    name,
                    format!(
                        "quantized tensor {name} has shape {:?}; only matrices are quantized",
                        parts[0].shape
                    ),
                ));
            }
            self.set_aside(&base);
            let (file, offsets) = (parts[0].file, parts[0].offsets);
            self.tensors.insert(
                format!("{base}.weight"),
                TensorEntry {
                    file,
                    shape: vec![rows, cols],
                    offsets,
                    data: TensorData::Dequantized {
                        kind,
                        parts,
                        f32_bytes: OnceLock::new(),
                    },
                },
            );
        }
        // Per-attention KV scales stand beside the projections (`self_attn.k_scale`).
        self.tensors
            .retain(|name, _| !(name.ends_with(".k_scale") || name.ends_with(".v_scale")));
        Ok(())
    }

    /// The quantized Linear `name` (stored as `dtype`) heads, if any: its base name, kind and
    /// the names of its stored parts. An FP8 weight without a scale is refused naming it.
    fn quantized_linear_of(
        &self,
        name: &str,
        dtype: Dtype,
        block: (usize, usize),
    ) -> Result<Option<(String, quant::QuantKind, Vec<String>)>, WeightError> {
        let found = if let Some(base) = name.strip_suffix(".weight_packed") {
            let parts = [
                name.to_string(),
                format!("{base}.weight_scale"),
                format!("{base}.weight_global_scale"),
            ];
            (
                base.to_string(),
                quant::QuantKind::Nvfp4 { divide: true },
                parts.to_vec(),
            )
        } else if let Some(base) = name.strip_suffix(".weight") {
            let scale_2 = format!("{base}.weight_scale_2");
            if dtype == Dtype::U8 && self.tensors.contains_key(&scale_2) {
                let parts = [name.to_string(), format!("{base}.weight_scale"), scale_2];
                (
                    base.to_string(),
                    quant::QuantKind::Nvfp4 { divide: false },
                    parts.to_vec(),
                )
            } else if dtype == Dtype::F8_E4M3 {
                let scale = [
                    format!("{base}.weight_scale"),
                    format!("{base}.weight_scale_inv"),
                ]
                .into_iter()
                .find(|s| self.tensors.contains_key(s))
                .ok_or_else(|| {
                    self.malformed_at(
                        name,
                        format!(
                            "tensor {name} is F8_E4M3 but has no {base}.weight_scale (or \
                             weight_scale_inv) to dequantize it with"
                        ),
                    )
                })?;
                (
                    base.to_string(),
                    quant::QuantKind::Fp8 { block },
                    vec![name.to_string(), scale],
                )
            } else {
                return Ok(None);
            }
        } else {
            return Ok(None);
        };
        Ok(Some(found))
    }

    /// Takes the tensors stored beside the Linear `base` out of the checkpoint, keeping its
    /// static input scales for [`Checkpoint::activation_quant`].
    fn set_aside(&mut self, base: &str) {
        for aside in quant::SET_ASIDE {
            let Some(entry) = self.tensors.remove(&format!("{base}{aside}")) else {
                continue;
            };
            // Static input scales are kept for an engine that quantizes activations.
            if !matches!(aside, ".input_scale" | ".input_global_scale") {
                continue;
            }
            let part = quant::Part {
                file: entry.file,
                offsets: entry.offsets,
                dtype: match entry.data {
                    TensorData::Mapped(dtype) => dtype,
                    _ => continue,
                },
                shape: entry.shape,
                name: format!("{base}{aside}"),
            };
            let bytes = self.files[part.file].data(part.offsets);
            // A weight-only engine never reads it: a bad one is refused only when asked
            // for (`activation_quant`), as not positive and finite.
            let value = quant::scale_value(&part, bytes).unwrap_or(f32::NAN);
            let kept = if aside == ".input_scale" {
                &mut self.activations.input_scale
            } else {
                &mut self.activations.input_global_scale
            };
            kept.insert(base.to_string(), value);
        }
    }

    /// A malformed checkpoint error naming `name`'s file (the directory when it has none).
    fn malformed_at(&self, name: &str, problem: String) -> WeightError {
        let path = self
            .tensors
            .get(name)
            .map_or_else(|| self.dir.clone(), |t| self.files[t.file].path.clone());
        WeightError::Malformed { path, problem }
    }

    /// The tensor called `name` as its stored quantized parts, when it is a quantized Linear of a
    /// safetensors checkpoint (`None` for any other tensor, which [`Checkpoint::get`] reads):
    /// for a backend that keeps FP8 and NVFP4 weights quantized. Its values are those
    /// [`Checkpoint::get`] dequantizes to.
    pub fn quantized(&self, name: &str) -> Result<Option<QuantizedLinear<'_>>, WeightError> {
        let entry = self.tensors.get(name).ok_or_else(|| WeightError::Missing {
            dir: self.dir.clone(),
            name: name.to_string(),
        })?;
        let TensorData::Dequantized { kind, parts, .. } = &entry.data else {
            return Ok(None);
        };
        let bytes: Vec<&[u8]> = parts
            .iter()
            .map(|p| self.files[p.file].data(p.offsets))
            .collect();
        quant::describe(kind, (entry.shape[0], entry.shape[1]), parts, &bytes)
            .map(Some)
            .map_err(|problem| WeightError::Malformed {
                path: self.files[entry.file].path.clone(),
                problem: format!("tensor {name}: {problem}"),
            })
    }

    /// How the Linear whose weight is `name` quantizes its input, as the checkpoint's
    /// quantization config says (`None`: weight-only): for an engine computing the
    /// checkpoint's activation quantization (W8A8, W4A4) rather than strata's weight-only
    /// default.
    pub fn activation_quant(
        &self,
        name: &str,
    ) -> Result<Option<crate::quantize::ActivationQuant>, WeightError> {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        self.activations
            .of(module)
            .map_err(|problem| WeightError::Malformed {
                path: self.dir.clone(),
                problem,
            })
    }
}

/// The FP8 block a checkpoint's `quantization_config` (`q`) names (compressed-tensors' `block_structure`,
/// Hugging Face fp8's `weight_block_size`), else [`quant::DEFAULT_BLOCK`].
fn quant_block(q: Option<&Value>) -> (usize, usize) {
    let pair = |v: &Value| -> Option<(usize, usize)> {
        let a = v.as_array()?;
        Some((a.first()?.as_u64()? as usize, a.get(1)?.as_u64()? as usize))
    };
    let from_groups = q
        .and_then(|q| q.get("config_groups"))
        .and_then(|g| g.as_object())
        .and_then(|groups| {
            groups
                .values()
                .find_map(|g| g.get("weights")?.get("block_structure").and_then(pair))
        });
    from_groups
        .or_else(|| q.and_then(|q| q.get("weight_block_size")).and_then(pair))
        .filter(|&(h, w)| h > 0 && w > 0)
        .unwrap_or(quant::DEFAULT_BLOCK)
}
