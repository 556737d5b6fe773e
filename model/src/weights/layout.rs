//! The tensors an architecture expects in a checkpoint: names and shapes in HF layout
//! (`[out_features, in_features]` for projections).

use crate::config::ModelConfig;

/// One expected tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Names of the tensors of decoder layer `i`.
#[derive(Debug, Clone)]
pub struct LayerNames {
    pub input_norm: String,
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub q_bias: String,
    pub k_bias: String,
    pub v_bias: String,
    pub o_bias: String,
    pub q_norm: String,
    pub k_norm: String,
    pub post_attention_norm: String,
    /// Gemma 3's pre-MLP norm (its `post_attention_layernorm` normalizes the attention output).
    pub pre_feedforward_norm: String,
    /// Gemma 3's norm of the MLP output.
    pub post_feedforward_norm: String,
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl LayerNames {
    pub fn new(i: usize) -> Self {
        let p = format!("model.layers.{i}");
        Self {
            input_norm: format!("{p}.input_layernorm.weight"),
            q: format!("{p}.self_attn.q_proj.weight"),
            k: format!("{p}.self_attn.k_proj.weight"),
            v: format!("{p}.self_attn.v_proj.weight"),
            o: format!("{p}.self_attn.o_proj.weight"),
            q_bias: format!("{p}.self_attn.q_proj.bias"),
            k_bias: format!("{p}.self_attn.k_proj.bias"),
            v_bias: format!("{p}.self_attn.v_proj.bias"),
            o_bias: format!("{p}.self_attn.o_proj.bias"),
            q_norm: format!("{p}.self_attn.q_norm.weight"),
            k_norm: format!("{p}.self_attn.k_norm.weight"),
            post_attention_norm: format!("{p}.post_attention_layernorm.weight"),
            pre_feedforward_norm: format!("{p}.pre_feedforward_layernorm.weight"),
            post_feedforward_norm: format!("{p}.post_feedforward_layernorm.weight"),
            gate: format!("{p}.mlp.gate_proj.weight"),
            up: format!("{p}.mlp.up_proj.weight"),
            down: format!("{p}.mlp.down_proj.weight"),
        }
    }
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// Every tensor the checkpoint of `config` must contain, in a stable order.
pub fn expected_tensors(config: &ModelConfig) -> Vec<TensorSpec> {
    let (h, q, kv, inter, hd) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
        config.head_dim,
    );
    let mut out = vec![TensorSpec::new(EMBED, &[config.vocab_size, h])];
    for i in 0..config.num_layers {
        let n = LayerNames::new(i);
        out.push(TensorSpec::new(n.input_norm, &[h]));
        out.push(TensorSpec::new(n.q, &[q, h]));
        out.push(TensorSpec::new(n.k, &[kv, h]));
        out.push(TensorSpec::new(n.v, &[kv, h]));
        if config.qkv_bias {
            out.push(TensorSpec::new(n.q_bias, &[q]));
            out.push(TensorSpec::new(n.k_bias, &[kv]));
            out.push(TensorSpec::new(n.v_bias, &[kv]));
        }
        out.push(TensorSpec::new(n.o, &[h, q]));
        if config.o_bias {
            out.push(TensorSpec::new(n.o_bias, &[h]));
        }
        if config.qk_norm {
            out.push(TensorSpec::new(n.q_norm, &[hd]));
            out.push(TensorSpec::new(n.k_norm, &[hd]));
        }
        out.push(TensorSpec::new(n.post_attention_norm, &[h]));
        if config.gemma3.is_some() {
            out.push(TensorSpec::new(n.pre_feedforward_norm, &[h]));
            out.push(TensorSpec::new(n.post_feedforward_norm, &[h]));
        }
        out.push(TensorSpec::new(n.gate, &[inter, h]));
        out.push(TensorSpec::new(n.up, &[inter, h]));
        out.push(TensorSpec::new(n.down, &[h, inter]));
    }
    out.push(TensorSpec::new(FINAL_NORM, &[h]));
    if !config.tie_word_embeddings {
        out.push(TensorSpec::new(LM_HEAD, &[config.vocab_size, h]));
    }
    out
}

/// Tensors a checkpoint may carry that strata does not need (rotary caches saved by old exports;
/// an explicit copy of a tied LM head).
pub fn is_ignorable(name: &str, config: &ModelConfig) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || (config.tie_word_embeddings && name == LM_HEAD)
        // A GGUF file's rope factors, already read into the config.
        || (name == crate::gguf::ROPE_FREQS_TENSOR
            && matches!(config.rope_scaling, Some(crate::config::RopeScaling::Factors(_))))
}

/// Parameter count of the architecture (tied embeddings counted once).
pub fn parameter_count(config: &ModelConfig) -> usize {
    expected_tensors(config).iter().map(TensorSpec::numel).sum()
}
