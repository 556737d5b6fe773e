use super::*;

/// The benchmark shapes committed under configs/ parse, with the parameter counts of the
/// published models.
#[test]
fn committed_benchmark_configs_parse() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    for (file, billions) in [
        ("llama-3.1-8b.json", 8.03),
        ("qwen3-32b.json", 32.76),
        ("llama-3.3-70b.json", 70.55),
        ("qwen3-30b-a3b.json", 30.53),
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let config = ModelConfig::from_json(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        let params = crate::weights::parameter_count(&config) as f64 / 1e9;
        assert!(
            (params - billions).abs() < 0.02,
            "{file}: {params} B parameters"
        );
    }
    // Qwen3-30B-A3B activates 3.3 B of its parameters per token (its model card).
    let text = std::fs::read_to_string(root.join("qwen3-30b-a3b.json")).unwrap();
    let config = ModelConfig::from_json(&text).unwrap();
    let active = crate::weights::active_parameter_count(&config) as f64 / 1e9;
    assert!((active - 3.35).abs() < 0.05, "{active} B active");
    // A step of one token reads the active parameters; of many, nearly every expert; never more.
    let read = |rows| crate::weights::expected_read_parameters(&config, rows) / 1e9;
    assert!((read(1) - active).abs() < 1e-9, "{}", read(1));
    assert!(
        read(8) > read(1) && read(64) > read(8),
        "{} {}",
        read(8),
        read(64)
    );
    assert!(read(4096) <= params(&config) + 1e-6 && read(4096) > 0.99 * params(&config));
    let dense = base_config();
    assert_eq!(
        crate::weights::expected_read_parameters(&dense, 64),
        crate::weights::parameter_count(&dense) as f64
    );
}

fn params(config: &ModelConfig) -> f64 {
    crate::weights::parameter_count(config) as f64 / 1e9
}

fn base_config() -> ModelConfig {
    parse(base()).unwrap()
}

fn base() -> serde_json::Map<String, Value> {
    serde_json::from_str(
        r#"{"architectures":["LlamaForCausalLM"],"vocab_size":320,"hidden_size":64,
        "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
        "num_key_value_heads":2,"max_position_embeddings":256,"rms_norm_eps":1e-5,
        "rope_theta":500000.0,"eos_token_id":[1,2],"bos_token_id":0}"#,
    )
    .unwrap()
}

fn parse(map: serde_json::Map<String, Value>) -> Result<ModelConfig, String> {
    ModelConfig::from_json(&Value::Object(map).to_string())
}

#[test]
fn parses_llama_with_defaults() {
    let c = parse(base()).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(c.head_dim, 16);
    assert_eq!(c.eos_token_ids, vec![1, 2]);
    assert_eq!(c.bos_token_id, Some(0));
    assert!(!c.qkv_bias && !c.qk_norm && !c.tie_word_embeddings);
    assert_eq!(c.kv_bytes_per_token(2.0), (2 * 2 * 32 * 2) as f64);
}

#[test]
fn parses_llama3_rope_scaling_in_both_spellings() {
    let scaling: Value = serde_json::from_str(
        r#"{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
        "original_max_position_embeddings":8192}"#,
    )
    .unwrap();
    let mut classic = base();
    classic.insert("rope_scaling".into(), scaling.clone());
    let mut v5 = base();
    v5.remove("rope_theta");
    let mut params = scaling.as_object().unwrap().clone();
    params.insert("rope_theta".into(), 500000.0.into());
    v5.insert("rope_parameters".into(), Value::Object(params));
    let a = parse(classic).unwrap();
    let b = parse(v5).unwrap();
    assert_eq!(a.rope_scaling, b.rope_scaling);
    assert_eq!(a.rope_theta, b.rope_theta);
    assert!(matches!(
        a.rope_scaling,
        Some(RopeScaling::Llama3 { factor: 8.0, .. })
    ));
}

#[test]
fn qwen_features_follow_the_architecture() {
    let mut m = base();
    m.insert(
        "architectures".into(),
        serde_json::json!(["Qwen2ForCausalLM"]),
    );
    m.insert("sliding_window".into(), 4096.into());
    m.insert("use_sliding_window".into(), false.into());
    let q2 = parse(m.clone()).unwrap();
    assert!(q2.qkv_bias && !q2.o_bias && !q2.qk_norm && q2.sliding_window.is_none());
    m.insert(
        "architectures".into(),
        serde_json::json!(["Qwen3ForCausalLM"]),
    );
    m.insert("head_dim".into(), 32.into());
    let q3 = parse(m).unwrap();
    assert!(!q3.qkv_bias && q3.qk_norm && q3.head_dim == 32);
}

#[test]
fn rejects_what_would_change_the_math_with_the_field_named() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "architectures",
            serde_json::json!(["GPT2LMHeadModel"]),
            "GPT2LMHeadModel",
        ),
        ("hidden_act", "gelu".into(), "hidden_act"),
        (
            "rope_scaling",
            serde_json::json!({"type":"yarn","factor":4.0}),
            "yarn",
        ),
        ("mlp_bias", true.into(), "mlp_bias"),
        ("num_key_value_heads", 3.into(), "num_key_value_heads"),
        ("hidden_size", 0.into(), "hidden_size"),
        (
            "quantization_config",
            serde_json::json!({"quant_method":"awq"}),
            "awq",
        ),
        ("eos_token_id", "two".into(), "eos_token_id"),
    ];
    for (field, value, needle) in cases {
        let mut m = base();
        m.insert(field.into(), value);
        let err = parse(m).unwrap_err();
        assert!(err.contains(needle), "{field}: {err}");
    }
    let mut m = base();
    m.remove("vocab_size");
    assert!(parse(m).unwrap_err().contains("vocab_size"));
    assert!(
        ModelConfig::from_json("{not json")
            .unwrap_err()
            .contains("malformed JSON")
    );
}

/// Gemma 3 as transformers 5 writes it: rope by layer type, layer_types, the query scalar;
/// what would change the math and is not implemented is refused by name.
#[test]
fn gemma3_config_reads_and_refuses_by_name() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/oracle/gguf/gemma3-270m-config.json");
    let text = std::fs::read_to_string(path).unwrap();
    let c = ModelConfig::from_json(&text).unwrap();
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert!(c.qk_norm && c.tie_word_embeddings);
    assert_eq!((c.rope_theta, c.sliding_window), (1_000_000.0, Some(512)));
    let g = c.gemma3.as_ref().unwrap();
    assert_eq!(
        (g.query_pre_attn_scalar, g.rope_local_theta),
        (256.0, 10_000.0)
    );
    assert_eq!(g.norm_offset, 1.0);
    assert_eq!(g.sliding_layers, Gemma3::sliding_every_sixth(18));
    assert_eq!(c.attention_scale(), 0.0625);

    let json: Value = serde_json::from_str(&text).unwrap();
    let refused = |key: &str, value: Value, needle: &str| {
        let mut j = json.clone();
        j[key] = value;
        let err = ModelConfig::from_json(&j.to_string()).unwrap_err();
        assert!(err.contains(needle), "{key}: {err}");
    };
    refused(
        "hidden_activation",
        "gelu".into(),
        "hidden_activation \"gelu\"",
    );
    refused(
        "final_logit_softcapping",
        30.0.into(),
        "final_logit_softcapping",
    );
    refused(
        "layer_types",
        serde_json::json!(["full_attention"]),
        "layer_types has 1",
    );
    refused(
        "query_pre_attn_scalar",
        Value::Null,
        "query_pre_attn_scalar",
    );
    refused("sliding_window", Value::Null, "sliding_window");
}

#[test]
fn error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), "{\"architectures\": [").unwrap();
    let err = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("malformed JSON"),
        "{err}"
    );
}

/// A GGUF file's `rope_freqs.weight` is part of the checkpoint only once the config holds its
/// factors: then the weight check passes it, otherwise it is an unexpected tensor.
#[test]
fn rope_freqs_is_ignorable_only_with_factors() {
    let name = crate::gguf::ROPE_FREQS_TENSOR;
    let mut c = parse(base()).unwrap();
    assert!(!crate::weights::is_ignorable(name, &c));
    c.rope_scaling = Some(RopeScaling::Factors(vec![1.0; c.head_dim / 2]));
    assert!(crate::weights::is_ignorable(name, &c));
}

#[test]
fn sampling_defaults_take_the_checkpoint_else_neutral_and_greedy_when_it_says_so() {
    let neutral = GenerationConfig::default().sampling_defaults();
    assert_eq!(
        neutral,
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0
        }
    );
    let shipped = GenerationConfig {
        temperature: Some(0.6),
        top_p: Some(0.9),
        top_k: Some(20),
        min_p: Some(0.05),
        repetition_penalty: Some(1.1),
        ..GenerationConfig::default()
    };
    let d = shipped.sampling_defaults();
    assert_eq!((d.temperature, d.top_p, d.top_k), (0.6, 0.9, 20));
    assert_eq!((d.min_p, d.repetition_penalty), (0.05, 1.1));
    let greedy = GenerationConfig {
        do_sample: Some(false),
        ..shipped
    };
    assert_eq!(greedy.sampling_defaults().temperature, 0.0);
}

fn moe(arch: &str, fields: Value) -> Result<ModelConfig, String> {
    let mut map = base();
    map.insert("architectures".into(), serde_json::json!([arch]));
    map.extend(fields.as_object().unwrap().clone());
    parse(map)
}

#[test]
fn mixtures_of_experts_read_their_layers_and_routing() {
    let c = moe(
        "Qwen3MoeForCausalLM",
        serde_json::json!({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "norm_topk_prob": true, "mlp_only_layers": [0],
            "decoder_sparse_step": 1}),
    )
    .unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!(
        (m.experts, m.experts_per_token, m.expert_intermediate),
        (8, 2, 32)
    );
    assert_eq!(m.sparse_layers, [false, true, true, true]);
    assert!(m.norm_topk_prob && m.shared_expert_intermediate.is_none());
    assert!(c.qk_norm && !c.qkv_bias);
    // Qwen2-MoE: every second layer sparse, q/k/v biases by default, a shared expert.
    let c = moe(
        "Qwen2MoeForCausalLM",
        serde_json::json!({"num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 4,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2}),
    )
    .unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!(m.sparse_layers, [false, true, false, true]);
    assert_eq!(m.shared_expert_intermediate, Some(48));
    assert!(!m.norm_topk_prob && c.qkv_bias && !c.o_bias);
    // Mixtral: every layer sparse, experts as wide as intermediate_size, always renormalized.
    let c = moe(
        "MixtralForCausalLM",
        serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2}),
    )
    .unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.expert_intermediate), (8, 128));
    assert!(m.norm_topk_prob && m.sparse_layers.iter().all(|&s| s));
    // The sparse layers' tensors: a router, the experts, no dense MLP.
    let spec = crate::weights::LayerSpec::new(&c, 1);
    assert!(spec.dense_mlp().is_none() && spec.projections().is_none());
    let names: Vec<&str> = spec.tensors().iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"model.layers.1.block_sparse_moe.gate.weight"));
    assert!(names.contains(&"model.layers.1.block_sparse_moe.experts.7.w2.weight"));
}

#[test]
fn expert_configs_that_would_compute_something_else_are_refused_by_name() {
    let qwen = |extra: Value| {
        let mut fields = serde_json::json!({"num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32});
        fields
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        moe("Qwen3MoeForCausalLM", fields).unwrap_err()
    };
    for (extra, named) in [
        (
            serde_json::json!({"num_experts_per_tok": 9}),
            "num_experts_per_tok",
        ),
        (
            serde_json::json!({"mlp_only_layers": [2]}),
            "mlp_only_layers",
        ),
        (serde_json::json!({"n_group": 4}), "n_group"),
        (
            serde_json::json!({"scoring_func": "sigmoid"}),
            "scoring_func",
        ),
        (
            serde_json::json!({"topk_method": "noaux_tc"}),
            "topk_method",
        ),
        (
            serde_json::json!({"shared_expert_intermediate_size": 64}),
            "shared_expert",
        ),
        (serde_json::json!({"num_experts": 0}), "num_experts"),
    ] {
        let err = qwen(extra.clone());
        assert!(err.contains(named), "{extra}: {err}");
    }
    assert!(
        moe(
            "Qwen3MoeForCausalLM",
            serde_json::json!({"num_experts_per_tok": 2})
        )
        .unwrap_err()
        .contains("num_experts")
    );
    // A dense family carrying experts is refused, not run dense.
    let err = moe(
        "LlamaForCausalLM",
        serde_json::json!({"num_local_experts": 8}),
    )
    .unwrap_err();
    assert!(err.contains("MixtralForCausalLM"), "{err}");
}

/// A GGUF file's sampling defaults come from `NAME.generation_config.json` beside it; its token
/// ids stay the file's. Without the file the neutral defaults apply.
#[test]
fn a_gguf_files_generation_config_sits_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("m.gguf");
    std::fs::copy(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/oracle/gguf_moe/qwen3moe-q4k-q8.gguf"),
        &gguf,
    )
    .unwrap();
    let bare = GenerationConfig::from_dir(&gguf).unwrap();
    assert_eq!(bare.sampling_defaults().temperature, 1.0);
    std::fs::write(
        GenerationConfig::sidecar(&gguf),
        r#"{"do_sample": true, "temperature": 0.2, "top_p": 0.9, "eos_token_id": 77}"#,
    )
    .unwrap();
    let beside = GenerationConfig::from_dir(&gguf).unwrap();
    let d = beside.sampling_defaults();
    assert_eq!((d.temperature, d.top_p), (0.2, 0.9));
    assert_eq!(
        beside.eos_token_ids, bare.eos_token_ids,
        "the file's ids stay"
    );
    assert_eq!(
        dir.path().join("m.generation_config.json"),
        GenerationConfig::sidecar(&gguf)
    );
}
