//! Which `quantization_config`s a checkpoint may carry: the FP8 and NVFP4 weight formats the
//! loader reads ([`crate::weights`]' quant module), from compressed-tensors, NVIDIA ModelOpt and
//! Hugging Face's `fp8`. Anything else is refused naming what it asks for.

use serde_json::Value;

/// Checks `q` (config.json's `quantization_config`); the reason it cannot be loaded otherwise.
pub(super) fn check(q: &Value) -> Result<(), String> {
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    match method {
        "compressed-tensors" => compressed_tensors(q),
        "modelopt" => modelopt(q),
        "fp8" => {
            let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
            if fmt != "e4m3" {
                return Err(format!(
                    "quantization_config fmt \"{fmt}\" (only e4m3 FP8 is read)"
                ));
            }
            Ok(())
        }
        other => Err(format!(
            "quantization_config (quant_method \"{other}\") is not supported: strata reads \
             compressed-tensors, modelopt and fp8 checkpoints in FP8 or NVFP4"
        )),
    }
}

fn compressed_tensors(q: &Value) -> Result<(), String> {
    const FORMATS: [&str; 3] = ["float-quantized", "naive-quantized", "nvfp4-pack-quantized"];
    let format_ok = |f: Option<&str>| f.is_none_or(|f| FORMATS.contains(&f));
    let top = q.get("format").and_then(Value::as_str);
    if top != Some("mixed-precision") && !format_ok(top) {
        return Err(format!(
            "compressed-tensors format \"{}\" is not supported (only {})",
            top.unwrap_or_default(),
            FORMATS.join(", ")
        ));
    }
    if q.get("kv_cache_scheme").is_some_and(|k| !k.is_null()) {
        return Err(
            "compressed-tensors kv_cache_scheme (a quantized KV cache) is not supported".into(),
        );
    }
    if q.get("sparsity_config")
        .is_some_and(|s| s.as_object().is_some_and(|o| !o.is_empty()))
    {
        return Err("compressed-tensors sparsity_config is not supported".into());
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .ok_or("compressed-tensors quantization_config has no config_groups")?;
    for (name, group) in groups {
        let format = group.get("format").and_then(Value::as_str);
        if !format_ok(format) {
            return Err(format!(
                "compressed-tensors config_groups.{name}.format \"{}\" is not supported",
                format.unwrap_or_default()
            ));
        }
        let Some(w) = group.get("weights").filter(|w| !w.is_null()) else {
            return Err(format!(
                "compressed-tensors config_groups.{name} quantizes no weights"
            ));
        };
        let field = |k: &str| w.get(k).cloned().unwrap_or(Value::Null);
        let kind = field("type");
        let bits = field("num_bits").as_u64();
        let strategy = field("strategy");
        let strategy = strategy.as_str().unwrap_or("tensor");
        let fp8 = bits == Some(8) && matches!(strategy, "tensor" | "channel" | "block");
        let nvfp4 = bits == Some(4)
            && field("group_size").as_u64() == Some(16)
            && matches!(strategy, "tensor_group" | "group");
        if kind.as_str() != Some("float") || !(fp8 || nvfp4) {
            return Err(format!(
                "compressed-tensors config_groups.{name}.weights ({kind} {} bits, strategy \
                 {strategy}) is not supported: FP8 per tensor / channel / block, or NVFP4 in \
                 groups of 16",
                bits.map_or("?".to_string(), |b| b.to_string())
            ));
        }
        if field("symmetric") == Value::Bool(false) {
            return Err(format!(
                "compressed-tensors config_groups.{name}.weights is asymmetric; only symmetric weights are read"
            ));
        }
    }
    Ok(())
}

fn modelopt(q: &Value) -> Result<(), String> {
    const ALGOS: [&str; 3] = ["FP8", "NVFP4", "MIXED_PRECISION"];
    let algo = q
        .get("quant_algo")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    if !ALGOS.contains(&algo) {
        return Err(format!(
            "modelopt quant_algo \"{algo}\" is not supported (only FP8, NVFP4 and mixed plans of them)"
        ));
    }
    if let Some(layers) = q.get("quantized_layers").and_then(Value::as_object) {
        for (layer, plan) in layers {
            let algo = plan
                .get("quant_algo")
                .and_then(Value::as_str)
                .unwrap_or("unknown");
            if !matches!(algo, "FP8" | "NVFP4") {
                return Err(format!(
                    "modelopt quantized_layers.{layer}.quant_algo \"{algo}\" is not supported"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn supported_formats_pass_and_others_are_named() {
        let fp8 = json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true}}}});
        assert_eq!(check(&fp8), Ok(()));
        let nvfp4 = json!({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}});
        assert_eq!(check(&nvfp4), Ok(()));
        assert_eq!(
            check(&json!({"quant_method": "modelopt", "quant_algo": "NVFP4"})),
            Ok(())
        );
        assert_eq!(
            check(&json!({"quant_method": "fp8", "weight_block_size": [128, 128]})),
            Ok(())
        );
        for (bad, words) in [
            (json!({"quant_method": "gptq"}), "gptq"),
            (
                json!({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}),
                "W4A8_AWQ",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}),
                "pack-quantized",
            ),
            (
                json!({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}),
                "config_groups.g.weights",
            ),
            (
                json!({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}, "config_groups": {}}),
                "kv_cache_scheme",
            ),
        ] {
            let err = check(&bad).unwrap_err();
            assert!(err.contains(words), "{err}");
        }
    }
}
