use super::*;
use crate::gguf::{GgmlType, Gguf, GgufArray, encode_string};
use crate::weights::LayerNames;

type Meta = Vec<(String, GgufValue)>;

/// A GGUF v3 file holding `metadata` and, for each name, a one-element f32 tensor.
fn gguf_bytes(metadata: &[(String, GgufValue)], tensors: &[&str]) -> Vec<u8> {
    const ALIGN: usize = 32;
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        encode_string(&mut out, key);
        out.extend(value.value_type().id().to_le_bytes());
        value.encode(&mut out);
    }
    for (i, name) in tensors.iter().enumerate() {
        encode_string(&mut out, name);
        out.extend(1u32.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        out.extend(GgmlType::F32.id().to_le_bytes());
        out.extend(((i * ALIGN) as u64).to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    out.resize(out.len() + tensors.len() * ALIGN, 0);
    out
}

fn config(meta: &Meta, tensors: &[&str]) -> Result<ModelConfig, GgufConfigError> {
    let bytes = gguf_bytes(meta, tensors);
    let gguf = Gguf::parse(&bytes).expect("the test writer emits well-formed files");
    model_config(gguf.header())
}

fn s(v: &str) -> GgufValue {
    GgufValue::String(v.to_string())
}

/// Sets `key`, replacing an earlier value.
fn with(mut meta: Meta, key: &str, value: GgufValue) -> Meta {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), value));
    meta
}

fn without(mut meta: Meta, key: &str) -> Meta {
    meta.retain(|(k, _)| k != key);
    meta
}

/// A small Llama 3-shaped file: 8 heads of 8 over a 64-wide embedding, 2 kv heads.
fn llama() -> Meta {
    [
        ("general.architecture", s("llama")),
        ("llama.context_length", GgufValue::U32(8192)),
        ("llama.embedding_length", GgufValue::U32(64)),
        ("llama.block_count", GgufValue::U32(2)),
        ("llama.feed_forward_length", GgufValue::U32(128)),
        ("llama.attention.head_count", GgufValue::U32(8)),
        ("llama.attention.head_count_kv", GgufValue::U32(2)),
        ("llama.rope.freq_base", GgufValue::F32(500_000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        ),
        ("llama.vocab_size", GgufValue::U32(1000)),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The same shape under another architecture prefix.
fn renamed(meta: Meta, arch: &str) -> Meta {
    meta.into_iter()
        .map(|(k, v)| match k.strip_prefix("llama.") {
            Some(rest) => (format!("{arch}.{rest}"), v),
            None if k == ARCHITECTURE_KEY => (k, s(arch)),
            None => (k, v),
        })
        .collect()
}

const BASE_TENSORS: [&str; 12] = [
    "token_embd.weight",
    "output_norm.weight",
    "output.weight",
    "blk.0.attn_norm.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.0.attn_output.weight",
    "blk.0.ffn_norm.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
];

fn tensors_plus(extra: &[&'static str]) -> Vec<&'static str> {
    BASE_TENSORS.iter().chain(extra).copied().collect()
}

#[test]
fn llama_untied_reads_every_field() {
    let c = config(&llama(), &BASE_TENSORS).unwrap();
    assert_eq!(
        c,
        ModelConfig {
            architecture: Architecture::Llama,
            vocab_size: 1000,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 8,
            max_position_embeddings: 8192,
            rms_norm_eps: f64::from(1e-5f32),
            rope_theta: 500_000.0,
            rope_scaling: None,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            declared_dtype: None,
            gemma3: None,
            moe: None,
        }
    );
}

#[test]
fn llama_without_output_weight_is_tied() {
    let tensors: Vec<&str> = BASE_TENSORS
        .into_iter()
        .filter(|n| *n != "output.weight")
        .collect();
    assert!(config(&llama(), &tensors).unwrap().tie_word_embeddings);
}

#[test]
fn rope_scaling_linear_none_and_unit_factor() {
    let linear = with(llama(), "llama.rope.scaling.type", s("linear"));
    let linear = with(linear, "llama.rope.scaling.factor", GgufValue::F32(4.0));
    assert_eq!(
        config(&linear, &BASE_TENSORS).unwrap().rope_scaling,
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    // llama.cpp's default type is linear.
    let untyped = without(linear.clone(), "llama.rope.scaling.type");
    assert_eq!(
        config(&untyped, &BASE_TENSORS).unwrap().rope_scaling,
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    let none = with(linear.clone(), "llama.rope.scaling.type", s("none"));
    assert_eq!(config(&none, &BASE_TENSORS).unwrap().rope_scaling, None);
    let unit = with(linear, "llama.rope.scaling.factor", GgufValue::F32(1.0));
    assert_eq!(config(&unit, &BASE_TENSORS).unwrap().rope_scaling, None);
}

#[test]
fn llama3_rope_freqs_tensor_is_refused_by_name() {
    let err = config(&llama(), &tensors_plus(&["rope_freqs.weight"])).unwrap_err();
    assert_eq!(err, GgufConfigError::RopeFreqsTensor);
    assert!(err.to_string().contains("rope_freqs.weight"), "{err}");
}

/// `gguf_bytes` plus one F32 vector `name` holding `values`, written after the others.
fn gguf_bytes_with_vector(meta: &Meta, tensors: &[&str], name: &str, values: &[f32]) -> Vec<u8> {
    const ALIGN: usize = 32;
    let mut all: Vec<&str> = tensors.to_vec();
    all.push(name);
    let mut out = gguf_bytes(meta, &all);
    // Patch the last tensor info's dims (1 -> len) and append its data past the others.
    let header_end = out.len() - all.len() * ALIGN;
    let info = out[..header_end]
        .windows(name.len())
        .rposition(|w| w == name.as_bytes())
        .expect("the tensor info was written")
        + name.len();
    out[info + 4..info + 12].copy_from_slice(&(values.len() as u64).to_le_bytes());
    out.truncate(header_end + tensors.len() * ALIGN);
    for v in values {
        out.extend(v.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    out
}

fn config_with_factors(meta: &Meta, values: &[f32]) -> Result<ModelConfig, GgufConfigError> {
    let bytes = gguf_bytes_with_vector(meta, &BASE_TENSORS, ROPE_FREQS_TENSOR, values);
    let gguf = Gguf::parse(&bytes).expect("the test writer emits well-formed files");
    let tensor = gguf.tensor(ROPE_FREQS_TENSOR).expect("the factors tensor");
    assert_eq!(tensor.n_elements(), values.len() as u64);
    model_config_with_rope_freqs(gguf.header(), Some(tensor))
}

/// Llama 3.1 as llama.cpp's converter writes it: `rope_freqs.weight` holds, per frequency, the
/// base frequency over Hugging Face's llama3-scaled one (in f32). Read with the file's data, the
/// config's frequencies are HF's within f32 rounding; a wrong count, a non-positive factor or a
/// second scaling in the metadata is refused by name.
#[test]
fn llama3_rope_freqs_become_the_configs_frequencies() {
    use crate::rope::Rope;
    let hf = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192.0,
    };
    // head_dim 8 at base 500 000: frequencies kept, kept, on the ramp, divided by 8.
    let plain = Rope::with_theta(8, 500_000.0, None);
    let scaled = Rope::with_theta(8, 500_000.0, Some(&hf));
    let factors: Vec<f32> = plain
        .inv_freq()
        .iter()
        .zip(scaled.inv_freq())
        .map(|(p, s)| (p / s) as f32)
        .collect();
    assert!(factors[0] == 1.0 && factors[2] > 1.0 && factors[2] < 8.0 && factors[3] == 8.0);
    let config = config_with_factors(&llama(), &factors).unwrap();
    assert!(matches!(config.rope_scaling, Some(RopeScaling::Factors(ref f)) if f.len() == 4));
    for (ours, theirs) in Rope::new(&config).inv_freq().iter().zip(scaled.inv_freq()) {
        assert!((ours / theirs - 1.0).abs() < 1e-6, "{ours} vs {theirs}");
    }
    let err = |values: &[f32], meta: &Meta| config_with_factors(meta, values).unwrap_err();
    assert!(
        matches!(err(&factors[..3], &llama()), GgufConfigError::RopeFreqs(m) if m.contains("needs 4"))
    );
    assert!(
        matches!(err(&[1.0, 0.0, 1.0, 1.0], &llama()), GgufConfigError::RopeFreqs(m) if m.contains("not a positive"))
    );
    let linear = with(llama(), "llama.rope.scaling.type", s("linear"));
    let linear = with(linear, "llama.rope.scaling.factor", GgufValue::F32(2.0));
    assert!(
        matches!(err(&factors, &linear), GgufConfigError::RopeFreqs(m) if m.contains("both scale"))
    );
}

#[test]
fn yarn_scaling_is_refused_naming_the_key() {
    let meta = with(llama(), "llama.rope.scaling.type", s("yarn"));
    let meta = with(meta, "llama.rope.scaling.factor", GgufValue::F32(4.0));
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert!(
        matches!(&err, GgufConfigError::Unsupported { key, .. } if key == "llama.rope.scaling.type"),
        "{err}"
    );
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn llama_with_sliding_window_is_mistral() {
    let meta = with(
        llama(),
        "llama.attention.sliding_window",
        GgufValue::U32(4096),
    );
    let c = config(&meta, &BASE_TENSORS).unwrap();
    assert_eq!(c.architecture, Architecture::Mistral);
    assert_eq!(c.sliding_window, Some(4096));
}

#[test]
fn qwen2_has_qkv_biases_and_vocab_from_tokens() {
    let meta = without(renamed(llama(), "qwen2"), "qwen2.vocab_size");
    let tokens = GgufValue::Array(GgufArray {
        element_type: GgufValueType::String,
        values: (0..37).map(|i| s(&format!("t{i}"))).collect(),
    });
    let meta = with(meta, TOKENS_KEY, tokens);
    let tensors = tensors_plus(&[
        "blk.0.attn_q.bias",
        "blk.0.attn_k.bias",
        "blk.0.attn_v.bias",
    ]);
    let c = config(&meta, &tensors).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    assert_eq!(c.vocab_size, 37);
    // The same file without bias tensors has none: the table decides, not the name.
    assert!(!config(&meta, &BASE_TENSORS).unwrap().qkv_bias);
}

#[test]
fn qwen3_has_qk_norms_and_an_explicit_head_dim() {
    let meta = with(
        renamed(llama(), "qwen3"),
        "qwen3.attention.key_length",
        GgufValue::U32(128),
    );
    let meta = with(meta, "qwen3.attention.value_length", GgufValue::U32(128));
    let tensors = tensors_plus(&["blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"]);
    let c = config(&meta, &tensors).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert!(c.qk_norm && !c.qkv_bias);
    assert_eq!((c.hidden_size, c.num_heads, c.head_dim), (64, 8, 128));
    assert_eq!(c.q_dim(), 1024);
}

#[test]
fn qwen_sliding_window_is_refused() {
    let meta = with(
        renamed(llama(), "qwen2"),
        "qwen2.attention.sliding_window",
        GgufValue::U32(4096),
    );
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert!(
        err.to_string().contains("qwen2.attention.sliding_window"),
        "{err}"
    );
}

#[test]
fn missing_keys_are_named() {
    for key in [
        "general.architecture",
        "llama.block_count",
        "llama.embedding_length",
        "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon",
    ] {
        let err = config(&without(llama(), key), &BASE_TENSORS).unwrap_err();
        assert_eq!(err, missing(key));
        assert_eq!(err.to_string(), format!("missing metadata key {key}"));
    }
    let err = config(&without(llama(), "llama.vocab_size"), &BASE_TENSORS).unwrap_err();
    assert!(
        err.to_string().contains("llama.vocab_size") && err.to_string().contains(TOKENS_KEY),
        "{err}"
    );
}

#[test]
fn wrong_types_are_named() {
    let meta = with(llama(), "llama.block_count", s("two"));
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert_eq!(
        err,
        GgufConfigError::WrongType {
            key: "llama.block_count".into(),
            expected: "an integer",
            found: GgufValueType::String,
        }
    );
    assert!(err.to_string().contains("llama.block_count"), "{err}");
    let meta = with(
        llama(),
        "llama.attention.layer_norm_rms_epsilon",
        GgufValue::U32(1),
    );
    assert!(matches!(
        config(&meta, &BASE_TENSORS).unwrap_err(),
        GgufConfigError::WrongType {
            found: GgufValueType::U32,
            ..
        }
    ));
    let meta = with(llama(), "general.architecture", GgufValue::U32(1));
    assert!(matches!(
        config(&meta, &BASE_TENSORS).unwrap_err(),
        GgufConfigError::WrongType { key, .. } if key == "general.architecture"
    ));
}

#[test]
fn other_integer_types_are_accepted_and_negatives_refused() {
    let meta = with(llama(), "llama.block_count", GgufValue::U64(3));
    assert_eq!(config(&meta, &BASE_TENSORS).unwrap().num_layers, 3);
    let meta = with(llama(), "llama.block_count", GgufValue::I32(-3));
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert!(
        matches!(&err, GgufConfigError::OutOfRange { key, .. } if key == "llama.block_count"),
        "{err}"
    );
}

#[test]
fn zero_sizes_are_refused() {
    for key in ["llama.embedding_length", "llama.attention.head_count_kv"] {
        let err = config(&with(llama(), key, GgufValue::U32(0)), &BASE_TENSORS).unwrap_err();
        assert_eq!(err, zero(key));
    }
}

#[test]
fn unsupported_architecture_is_named() {
    let meta = renamed(llama(), "phi3");
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert_eq!(
        err,
        GgufConfigError::UnsupportedArchitecture {
            name: "phi3".into()
        }
    );
    assert!(err.to_string().contains("\"phi3\""), "{err}");
}

#[test]
fn inconsistent_heads_are_refused() {
    let meta = with(llama(), "llama.attention.head_count", GgufValue::U32(6));
    let meta = with(meta, "llama.attention.head_count_kv", GgufValue::U32(6));
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert!(
        matches!(&err, GgufConfigError::Inconsistent { key, .. } if key == "llama.attention.head_count"),
        "{err}"
    );
    assert!(
        err.to_string().contains("llama.attention.key_length"),
        "{err}"
    );
    // With an explicit head dimension, heads need not divide the embedding.
    let meta = with(meta, "llama.attention.key_length", GgufValue::U32(16));
    assert_eq!(config(&meta, &BASE_TENSORS).unwrap().head_dim, 16);

    let meta = with(llama(), "llama.attention.head_count_kv", GgufValue::U32(3));
    let err = config(&meta, &BASE_TENSORS).unwrap_err();
    assert!(
        matches!(&err, GgufConfigError::Inconsistent { key, .. } if key == "llama.attention.head_count_kv"),
        "{err}"
    );
}

#[test]
fn value_and_rotary_widths_must_match_the_head_dim() {
    for key in ["llama.attention.value_length", "llama.rope.dimension_count"] {
        let err = config(&with(llama(), key, GgufValue::U32(4)), &BASE_TENSORS).unwrap_err();
        assert!(
            matches!(&err, GgufConfigError::Unsupported { key: k, .. } if k == key),
            "{err}"
        );
    }
    let meta = with(llama(), "llama.rope.dimension_count", GgufValue::U32(8));
    assert!(config(&meta, &BASE_TENSORS).is_ok());
}

#[test]
fn tensor_names_map_to_the_crate_names() {
    let hf = LayerNames::new(13);
    let pairs = [
        ("attn_norm.weight", &hf.input_norm),
        ("attn_q.weight", &hf.q),
        ("attn_k.weight", &hf.k),
        ("attn_v.weight", &hf.v),
        ("attn_output.weight", &hf.o),
        ("attn_q.bias", &hf.q_bias),
        ("attn_k.bias", &hf.k_bias),
        ("attn_v.bias", &hf.v_bias),
        ("attn_output.bias", &hf.o_bias),
        ("attn_q_norm.weight", &hf.q_norm),
        ("attn_k_norm.weight", &hf.k_norm),
        ("ffn_norm.weight", &hf.post_attention_norm),
        ("ffn_gate.weight", &hf.gate),
        ("ffn_up.weight", &hf.up),
        ("ffn_down.weight", &hf.down),
    ];
    for (gguf, expected) in pairs {
        assert_eq!(
            hf_tensor_name(&format!("blk.13.{gguf}")).as_ref(),
            Some(expected)
        );
    }
    assert_eq!(hf_tensor_name("token_embd.weight").as_deref(), Some(EMBED));
    assert_eq!(
        hf_tensor_name("output_norm.weight").as_deref(),
        Some(FINAL_NORM)
    );
    assert_eq!(hf_tensor_name("output.weight").as_deref(), Some(LM_HEAD));
    for unknown in [
        "rope_freqs.weight",
        "blk.0.attn_qkv.weight",
        "blk..attn_q.weight",
        "blk.x.attn_q.weight",
        "blk.01.attn_q.weight",
        "blk.+1.attn_q.weight",
        "blk.0",
        "model.embed_tokens.weight",
    ] {
        assert_eq!(hf_tensor_name(unknown), None, "{unknown}");
    }
    assert_eq!(
        hf_tensor_name("blk.0.attn_q.weight").as_deref(),
        Some("model.layers.0.self_attn.q_proj.weight")
    );
}

/// A `gemma3` file: head width from `key_length`, every sixth layer global, llama.cpp's local
/// rope base, queries scaled by the head width, norm weights already shifted by the converter.
#[test]
fn gemma3_reads_its_layout() {
    let meta = with(
        with(
            renamed(llama(), "gemma3"),
            "gemma3.attention.key_length",
            GgufValue::U32(32),
        ),
        "gemma3.attention.sliding_window",
        GgufValue::U32(512),
    );
    let meta = with(meta, "gemma3.block_count", GgufValue::U32(12));
    let c = config(&meta, &BASE_TENSORS).unwrap();
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!(c.head_dim, 32);
    assert_eq!(c.sliding_window, Some(512));
    let g = c.gemma3.as_ref().expect("gemma3 parameters");
    assert_eq!(g.query_pre_attn_scalar, 32.0);
    assert_eq!(g.rope_local_theta, 10_000.0);
    assert_eq!(g.norm_offset, 0.0);
    let globals: Vec<usize> = (0..12).filter(|&i| c.layer_window(i).is_none()).collect();
    assert_eq!(globals, [5, 11]);
    assert!(c.local_rope(0) && !c.local_rope(5));
}

#[test]
fn experts_read_as_the_families_llama_cpp_writes() {
    let routers = ["blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"];
    // Mixtral is `llama` with experts: every layer sparse, experts as wide as the MLP, renormalized.
    let mixtral = with(
        with(llama(), "llama.expert_count", GgufValue::U32(8)),
        "llama.expert_used_count",
        GgufValue::U32(2),
    );
    let c = config(&mixtral, &tensors_plus(&routers)).unwrap();
    assert_eq!(c.architecture, Architecture::Mixtral);
    let m = c.moe.unwrap();
    assert_eq!(
        (m.experts, m.experts_per_token, m.expert_intermediate),
        (8, 2, 128)
    );
    assert!(m.norm_topk_prob && m.sparse_layers == [true, true]);
    // Qwen2-MoE: a shared expert, no renormalization unless the file says; a layer without a
    // router is dense.
    let qwen2 = [
        ("qwen2moe.expert_count", GgufValue::U32(4)),
        ("qwen2moe.expert_used_count", GgufValue::U32(4)),
        ("qwen2moe.expert_feed_forward_length", GgufValue::U32(32)),
        (
            "qwen2moe.expert_shared_feed_forward_length",
            GgufValue::U32(96),
        ),
    ]
    .into_iter()
    .fold(renamed(llama(), "qwen2moe"), |m, (k, v)| with(m, k, v));
    let c = config(&qwen2, &tensors_plus(&routers[1..])).unwrap();
    let m = c.moe.unwrap();
    assert_eq!(c.architecture, Architecture::Qwen2Moe);
    assert_eq!(
        (m.expert_intermediate, m.shared_expert_intermediate),
        (32, Some(96))
    );
    assert!(!m.norm_topk_prob && m.sparse_layers == [false, true]);
    let normed = with(qwen2, "qwen2moe.expert_weights_norm", GgufValue::Bool(true));
    assert!(
        config(&normed, &BASE_TENSORS)
            .unwrap()
            .moe
            .unwrap()
            .norm_topk_prob
    );
    // Grouped routing, and experts in a family without them, are refused by name.
    let grouped = with(
        mixtral.clone(),
        "llama.expert_group_count",
        GgufValue::U32(4),
    );
    assert!(
        config(&grouped, &BASE_TENSORS)
            .unwrap_err()
            .to_string()
            .contains("expert_group_count")
    );
    let qwen3 = with(
        renamed(llama(), "qwen3"),
        "qwen3.expert_count",
        GgufValue::U32(4),
    );
    assert!(
        config(&qwen3, &BASE_TENSORS)
            .unwrap_err()
            .to_string()
            .contains("qwen3.expert_count")
    );
    // Stacked expert tensors name one matrix per expert, Mixtral's way or Qwen's.
    let names = hf_expert_names("mixtral", "blk.3.ffn_up_exps.weight", 2).unwrap();
    assert_eq!(
        names[1],
        "model.layers.3.block_sparse_moe.experts.1.w3.weight"
    );
    let names = hf_expert_names("qwen3moe", "blk.0.ffn_down_exps.weight", 4).unwrap();
    assert_eq!(names[3], "model.layers.0.mlp.experts.3.down_proj.weight");
    assert!(hf_expert_names("qwen3moe", "blk.01.ffn_down_exps.weight", 4).is_none());
    assert_eq!(
        hf_tensor_name_in("mixtral", "blk.2.ffn_gate_inp.weight").unwrap(),
        "model.layers.2.block_sparse_moe.gate.weight"
    );
}
