//! Which activation quantization a quantized checkpoint asks for, per Linear: the
//! `input_activations` of compressed-tensors' config groups (matched to module names by their
//! `targets`, skipping `ignore`), with the static scales the checkpoint stores beside the weights
//! (`input_scale`, `input_global_scale`). strata computes weight-only unless an engine asks for
//! the checkpoint's activation quantization (`CpuModel::quantize_activations`).

use std::collections::HashMap;

use regex::Regex;
use serde_json::Value;

use crate::quantize::ActivationQuant;

/// An input scheme strata computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputKind {
    /// FP8, a static scale per tensor (`input_scale`).
    Fp8Static,
    /// FP8, a dynamic scale per token.
    Fp8Token,
    /// NVFP4: local dynamic e4m3 scales per 16 under a static global scale (`input_global_scale`).
    Nvfp4,
}

/// A config group's `targets` entry.
#[derive(Debug)]
enum Target {
    /// Every Linear module.
    Linear,
    /// `re:` targets: a regular expression matched at the start of the module name.
    Pattern(Regex),
    /// A module's name.
    Name(String),
}

impl Target {
    fn parse(target: &str) -> Result<Self, String> {
        Ok(if target == "Linear" {
            Target::Linear
        } else if let Some(pattern) = target.strip_prefix("re:") {
            Target::Pattern(
                Regex::new(&format!("^(?:{pattern})"))
                    .map_err(|e| format!("target {target:?} is not a regular expression: {e}"))?,
            )
        } else {
            Target::Name(target.to_string())
        })
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            Target::Linear => true,
            Target::Pattern(re) => re.is_match(module),
            Target::Name(name) => name == module,
        }
    }
}

/// The activation schemes of a checkpoint's config, and the static input scales it stores.
#[derive(Debug, Default)]
pub(super) struct ActivationSchemes {
    /// (targets, input kind) of each config group with input activations, in the config's order.
    groups: Vec<(Vec<Target>, InputKind)>,
    ignore: Vec<Target>,
    /// Why this checkpoint's activation quantization cannot be computed (a producer whose
    /// activation arithmetic strata does not implement: ModelOpt, Hugging Face's `fp8`).
    unsupported: Option<String>,
    /// Why its quantization config's activation schemes were refused (for every Linear).
    refused: Option<String>,
    /// `input_scale` and `input_global_scale` values by module name.
    pub(super) input_scale: HashMap<String, f32>,
    pub(super) input_global_scale: HashMap<String, f32>,
}

impl ActivationSchemes {
    /// The schemes `quantization_config` names; a config strata cannot compute is kept as the
    /// refusal every Linear's scheme then answers with (weight-only engines never ask).
    pub(super) fn from_config(q: Option<&Value>) -> Self {
        Self::parse(q).unwrap_or_else(|why| Self {
            refused: Some(why),
            ..Self::default()
        })
    }

    /// The schemes `quantization_config` names (none for a checkpoint without one).
    fn parse(q: Option<&Value>) -> Result<Self, String> {
        let mut schemes = Self::default();
        let Some(q) = q else {
            return Ok(schemes);
        };
        match q.get("quant_method").and_then(Value::as_str) {
            Some("compressed-tensors") => {}
            Some(method) => {
                schemes.unsupported = Some(format!(
                    "{method} checkpoints' activation quantization is not computed (only \
                     compressed-tensors')"
                ));
                return Ok(schemes);
            }
            None => return Ok(schemes),
        }
        let targets = |v: Option<&Value>| -> Result<Vec<Target>, String> {
            v.and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(Target::parse)
                        .collect()
                })
                .unwrap_or_else(|| Ok(Vec::new()))
        };
        schemes.ignore = targets(q.get("ignore"))?;
        let groups = q.get("config_groups").and_then(Value::as_object);
        for (name, group) in groups.into_iter().flatten() {
            let Some(inputs) = group.get("input_activations").filter(|v| !v.is_null()) else {
                continue;
            };
            let field = |k: &str| inputs.get(k).cloned().unwrap_or(Value::Null);
            let kind = match (
                field("type").as_str(),
                field("num_bits").as_u64(),
                field("strategy").as_str(),
                &field("dynamic"),
            ) {
                (Some("float"), Some(8), Some("tensor"), Value::Bool(false)) => {
                    InputKind::Fp8Static
                }
                (Some("float"), Some(8), Some("token"), Value::Bool(true)) => InputKind::Fp8Token,
                (Some("float"), Some(4), Some("tensor_group"), d)
                    if d.as_str() == Some("local")
                        && field("group_size").as_u64() == Some(16)
                        && field("scale_dtype").as_str() == Some("torch.float8_e4m3fn") =>
                {
                    InputKind::Nvfp4
                }
                _ => {
                    return Err(format!(
                        "config_groups.{name}.input_activations ({inputs}) is not an activation \
                         scheme strata computes: FP8 per tensor (static) or per token (dynamic), \
                         NVFP4 in groups of 16 with e4m3 scales"
                    ));
                }
            };
            schemes.groups.push((targets(group.get("targets"))?, kind));
        }
        Ok(schemes)
    }

    /// How the Linear `module` (its name without `.weight`) quantizes its input; `None` for
    /// weight-only. A scheme whose static scale is missing or not a positive finite value is
    /// refused naming the tensor.
    pub(super) fn of(&self, module: &str) -> Result<Option<ActivationQuant>, String> {
        if let Some(why) = &self.refused {
            return Err(why.clone());
        }
        if self.ignore.iter().any(|t| t.matches(module)) {
            return Ok(None);
        }
        if let Some(why) = &self.unsupported {
            return Err(format!("{module}: {why}"));
        }
        let Some((_, kind)) = self
            .groups
            .iter()
            .find(|(targets, _)| targets.iter().any(|t| t.matches(module)))
        else {
            return Ok(None);
        };
        let scale = |map: &HashMap<String, f32>, suffix: &str| {
            let value = map
                .get(module)
                .copied()
                .ok_or_else(|| format!("{module}.{suffix} is missing (a static input scheme)"))?;
            if value.is_finite() && value > 0.0 {
                Ok(value)
            } else {
                Err(format!(
                    "{module}.{suffix} is {value}; a scale must be positive and finite"
                ))
            }
        };
        Ok(Some(match kind {
            InputKind::Fp8Static => ActivationQuant::Fp8Static {
                scale: scale(&self.input_scale, "input_scale")?,
            },
            InputKind::Fp8Token => ActivationQuant::Fp8Token,
            InputKind::Nvfp4 => ActivationQuant::Nvfp4 {
                global: scale(&self.input_global_scale, "input_global_scale")?,
            },
        }))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn groups_match_their_targets_and_name_what_they_lack() {
        let q = json!({
            "quant_method": "compressed-tensors",
            "ignore": ["lm_head"],
            "config_groups": {
                "attention": {"targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"],
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": false}},
                "mlp": {"targets": ["Linear"],
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": true}},
            }
        });
        let mut s = ActivationSchemes::parse(Some(&q)).unwrap();
        s.input_scale
            .insert("model.layers.0.self_attn.q_proj".into(), 0.5);
        assert_eq!(
            s.of("model.layers.0.self_attn.q_proj").unwrap(),
            Some(ActivationQuant::Fp8Static { scale: 0.5 })
        );
        assert_eq!(
            s.of("model.layers.0.mlp.down_proj").unwrap(),
            Some(ActivationQuant::Fp8Token)
        );
        assert_eq!(s.of("lm_head").unwrap(), None);
        let err = s.of("model.layers.0.self_attn.k_proj").unwrap_err();
        assert!(err.contains("k_proj.input_scale is missing"), "{err}");
        s.input_scale
            .insert("model.layers.0.self_attn.k_proj".into(), f32::NAN);
        let err = s.of("model.layers.0.self_attn.k_proj").unwrap_err();
        assert!(err.contains("positive and finite"), "{err}");
        // An integer scheme is refused by name.
        let int8 = json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"],
            "input_activations": {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": true}}}});
        let err = ActivationSchemes::parse(Some(&int8)).unwrap_err();
        assert!(err.contains("config_groups.g.input_activations"), "{err}");
        // Another producer's activation arithmetic is refused by name, scales or not.
        let modelopt = json!({"quant_method": "modelopt", "quant_algo": "FP8"});
        let err = ActivationSchemes::parse(Some(&modelopt))
            .unwrap()
            .of("model.layers.0.mlp.up_proj")
            .unwrap_err();
        assert!(err.contains("modelopt"), "{err}");
        // Weight-only configs ask for nothing.
        let weight_only = json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "input_activations": null}}});
        let s = ActivationSchemes::parse(Some(&weight_only)).unwrap();
        assert_eq!(s.of("model.layers.0.mlp.up_proj").unwrap(), None);
    }
}
