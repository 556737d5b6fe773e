//! The tensors an architecture expects in a checkpoint: names and shapes in HF layout
//! (`[out_features, in_features]` for projections), and how a tensor-parallel rank slices each.
//!
//! [`LayerSpec`] is the one description of a decoder layer: which tensors the family holds
//! (biases, q/k norms, Gemma 3's sandwich norms), their shapes and their splits. Checkpoint
//! validation, the CPU reference, the CUDA upload and the quantizer all read it; none of them
//! spells a tensor name or a shape of its own.

use crate::config::ModelConfig;

/// Which part of a tensor a tensor-parallel rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norms, o's bias).
    Whole,
    /// The rows of the rank's share.
    Rows(Share),
    /// The columns of the rank's share (the row-parallel o and down projections).
    Cols(Share),
}

/// What a tensor-parallel rank owns of the model (resolved by `TpLayout::part`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// Its query heads' rows of q (and o's columns).
    Heads,
    /// Its kv heads' rows of k and v.
    KvHeads,
    /// Its slice of the MLP's intermediate dimension.
    Intermediate,
    /// Its rows of the vocabulary (embedding, LM head).
    Vocab,
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub split: Split,
}

impl TensorSpec {
    fn new(name: impl Into<String>, shape: &[usize], split: Split) -> Self {
        Self {
            name: name.into(),
            shape: shape.to_vec(),
            split,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// `[rows, columns]` of a matrix.
    pub fn dims(&self) -> [usize; 2] {
        match self.shape[..] {
            [rows, cols] => [rows, cols],
            [len] => [len, 1],
            _ => panic!("{}: a tensor of rank {}", self.name, self.shape.len()),
        }
    }
}

/// The tensors of decoder layer `i` of the family `config` describes.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    pub input_norm: TensorSpec,
    pub q: TensorSpec,
    pub k: TensorSpec,
    pub v: TensorSpec,
    pub o: TensorSpec,
    pub qkv_bias: Option<[TensorSpec; 3]>,
    pub o_bias: Option<TensorSpec>,
    pub qk_norm: Option<[TensorSpec; 2]>,
    /// The norm of the MLP's input: `post_attention_layernorm`, or Gemma 3's
    /// `pre_feedforward_layernorm` (its `post_attention_layernorm` norms the attention output).
    pub mlp_norm: TensorSpec,
    /// Gemma 3's norms of the attention output and of the MLP output.
    pub sandwich: Option<[TensorSpec; 2]>,
    pub mlp: MlpSpec,
}

/// A gated MLP: `down(act(gate · x) ⊙ (up · x))`.
#[derive(Debug, Clone)]
pub struct GatedMlp {
    pub gate: TensorSpec,
    pub up: TensorSpec,
    pub down: TensorSpec,
}

/// A layer's MLP: dense, or a mixture of experts.
#[derive(Debug, Clone)]
pub enum MlpSpec {
    Dense(GatedMlp),
    Sparse(SparseMlp),
}

/// A mixture of experts: the router's `[experts, hidden]` scores, each expert a gated MLP, and
/// Qwen2-MoE's shared expert with its `[1, hidden]` sigmoid gate. Whole on every rank (expert
/// placement across ranks is not built yet).
#[derive(Debug, Clone)]
pub struct SparseMlp {
    pub router: TensorSpec,
    pub experts: Vec<GatedMlp>,
    pub shared: Option<(GatedMlp, TensorSpec)>,
}

impl GatedMlp {
    fn new(names: [String; 3], hidden: usize, inter: usize, split: bool) -> Self {
        let [gate, up, down] = names;
        let (rows, cols) = if split {
            (
                Split::Rows(Share::Intermediate),
                Split::Cols(Share::Intermediate),
            )
        } else {
            (Split::Whole, Split::Whole)
        };
        Self {
            gate: TensorSpec::new(gate, &[inter, hidden], rows),
            up: TensorSpec::new(up, &[inter, hidden], rows),
            down: TensorSpec::new(down, &[hidden, inter], cols),
        }
    }

    pub fn tensors(&self) -> [&TensorSpec; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

impl LayerSpec {
    pub fn new(config: &ModelConfig, i: usize) -> Self {
        let (h, q, kv, inter, hd) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate_size,
            config.head_dim,
        );
        let n = LayerNames::new(i);
        let whole = |name: String, len: usize| TensorSpec::new(name, &[len], Split::Whole);
        let rows =
            |name: String, shape: &[usize], share| TensorSpec::new(name, shape, Split::Rows(share));
        let (mlp_norm, sandwich) = if config.gemma3.is_some() {
            (
                whole(n.pre_feedforward_norm, h),
                Some([
                    whole(n.post_attention_norm, h),
                    whole(n.post_feedforward_norm, h),
                ]),
            )
        } else {
            (whole(n.post_attention_norm, h), None)
        };
        let mlp = match &config.moe {
            Some(moe) if moe.is_sparse(i) => MlpSpec::Sparse(sparse_mlp(config, moe, i)),
            _ => MlpSpec::Dense(GatedMlp::new([n.gate, n.up, n.down], h, inter, true)),
        };
        Self {
            input_norm: whole(n.input_norm, h),
            q: rows(n.q, &[q, h], Share::Heads),
            k: rows(n.k, &[kv, h], Share::KvHeads),
            v: rows(n.v, &[kv, h], Share::KvHeads),
            o: TensorSpec::new(n.o, &[h, q], Split::Cols(Share::Heads)),
            qkv_bias: config.qkv_bias.then(|| {
                [
                    rows(n.q_bias, &[q], Share::Heads),
                    rows(n.k_bias, &[kv], Share::KvHeads),
                    rows(n.v_bias, &[kv], Share::KvHeads),
                ]
            }),
            o_bias: config.o_bias.then(|| whole(n.o_bias, h)),
            qk_norm: config
                .qk_norm
                .then(|| [whole(n.q_norm, hd), whole(n.k_norm, hd)]),
            mlp_norm,
            sandwich,
            mlp,
        }
    }

    /// The dense MLP; `None` for a mixture of experts.
    pub fn dense_mlp(&self) -> Option<&GatedMlp> {
        match &self.mlp {
            MlpSpec::Dense(mlp) => Some(mlp),
            MlpSpec::Sparse(_) => None,
        }
    }

    /// The seven projections of a dense layer: q, k, v, o, gate, up, down; `None` for a layer
    /// whose MLP is a mixture of experts.
    pub fn projections(&self) -> Option<[&TensorSpec; 7]> {
        let m = self.dense_mlp()?;
        Some([&self.q, &self.k, &self.v, &self.o, &m.gate, &m.up, &m.down])
    }

    /// Every tensor of the layer, in the order checkpoints are validated and synthesized.
    pub fn tensors(&self) -> Vec<&TensorSpec> {
        let mut out = vec![&self.input_norm, &self.q, &self.k, &self.v];
        out.extend(self.qkv_bias.iter().flatten());
        out.push(&self.o);
        out.extend(&self.o_bias);
        out.extend(self.qk_norm.iter().flatten());
        match &self.sandwich {
            Some([attention_out, mlp_out]) => out.extend([attention_out, &self.mlp_norm, mlp_out]),
            None => out.push(&self.mlp_norm),
        }
        match &self.mlp {
            MlpSpec::Dense(mlp) => out.extend(mlp.tensors()),
            MlpSpec::Sparse(moe) => {
                out.push(&moe.router);
                out.extend(moe.experts.iter().flat_map(GatedMlp::tensors));
                if let Some((shared, gate)) = &moe.shared {
                    out.extend(shared.tensors());
                    out.push(gate);
                }
            }
        }
        out
    }
}

/// The sparse MLP of layer `i`, in the checkpoint layout of `config`'s family: Qwen's
/// `mlp.gate` and `mlp.experts.E.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.gate` and
/// `block_sparse_moe.experts.E.{w1,w3,w2}`.
fn sparse_mlp(config: &ModelConfig, moe: &crate::config::Moe, i: usize) -> SparseMlp {
    let h = config.hidden_size;
    let p = format!("model.layers.{i}");
    let mixtral = config.architecture == crate::config::Architecture::Mixtral;
    let block = if mixtral {
        format!("{p}.block_sparse_moe")
    } else {
        format!("{p}.mlp")
    };
    let expert = |e: usize| {
        let x = format!("{block}.experts.{e}");
        let names = if mixtral {
            [
                format!("{x}.w1.weight"),
                format!("{x}.w3.weight"),
                format!("{x}.w2.weight"),
            ]
        } else {
            [
                format!("{x}.gate_proj.weight"),
                format!("{x}.up_proj.weight"),
                format!("{x}.down_proj.weight"),
            ]
        };
        GatedMlp::new(names, h, moe.expert_intermediate, false)
    };
    let shared = moe.shared_expert_intermediate.map(|inter| {
        let x = format!("{block}.shared_expert");
        let names = [
            format!("{x}.gate_proj.weight"),
            format!("{x}.up_proj.weight"),
            format!("{x}.down_proj.weight"),
        ];
        let gate = TensorSpec::new(
            format!("{block}.shared_expert_gate.weight"),
            &[1, h],
            Split::Whole,
        );
        (GatedMlp::new(names, h, inter, false), gate)
    });
    SparseMlp {
        router: TensorSpec::new(
            format!("{block}.gate.weight"),
            &[moe.experts, h],
            Split::Whole,
        ),
        experts: (0..moe.experts).map(expert).collect(),
        shared,
    }
}

/// The embedding: `[vocab, hidden]`, rows by vocabulary.
pub fn embed_spec(config: &ModelConfig) -> TensorSpec {
    TensorSpec::new(
        EMBED,
        &[config.vocab_size, config.hidden_size],
        Split::Rows(Share::Vocab),
    )
}

/// The final norm, whole on every rank.
pub fn final_norm_spec(config: &ModelConfig) -> TensorSpec {
    TensorSpec::new(FINAL_NORM, &[config.hidden_size], Split::Whole)
}

/// The LM head, `None` when it is tied to the embedding.
pub fn lm_head_spec(config: &ModelConfig) -> Option<TensorSpec> {
    (!config.tie_word_embeddings).then(|| {
        TensorSpec::new(
            LM_HEAD,
            &[config.vocab_size, config.hidden_size],
            Split::Rows(Share::Vocab),
        )
    })
}

/// Names of the tensors of decoder layer `i` (what [`LayerSpec`] is made of).
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
    let mut out = vec![embed_spec(config)];
    for i in 0..config.num_layers {
        out.extend(LayerSpec::new(config, i).tensors().into_iter().cloned());
    }
    out.push(final_norm_spec(config));
    out.extend(lm_head_spec(config));
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

/// Parameters one token reads: all of a dense model; of a mixture of experts, every tensor but
/// the experts a token's router does not choose.
pub fn active_parameter_count(config: &ModelConfig) -> usize {
    let Some(moe) = &config.moe else {
        return parameter_count(config);
    };
    let idle_experts = moe.experts - moe.experts_per_token;
    let expert = 3 * config.hidden_size * moe.expert_intermediate;
    let sparse = moe.sparse_layers.iter().filter(|&&s| s).count();
    parameter_count(config) - sparse * idle_experts * expert
}

/// Parameters a step of `rows` tokens reads when each token's experts are drawn uniformly:
/// every dense parameter once and, per sparse layer, the expected number of distinct experts
/// the rows choose, `E · (1 − (1 − k/E)^rows)` (a dense model: every parameter). The byte
/// roofline of an MoE decode step at a batch.
pub fn expected_read_parameters(config: &ModelConfig, rows: usize) -> f64 {
    let Some(moe) = &config.moe else {
        return parameter_count(config) as f64;
    };
    let (e, k) = (moe.experts as f64, moe.experts_per_token as f64);
    let distinct = e * (1.0 - (1.0 - k / e).powi(rows.max(1).min(i32::MAX as usize) as i32));
    let expert = (3 * config.hidden_size * moe.expert_intermediate) as f64;
    let sparse = moe.sparse_layers.iter().filter(|&&s| s).count() as f64;
    active_parameter_count(config) as f64 + sparse * (distinct - k) * expert
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ModelConfig {
        ModelConfig::from_json(text).unwrap()
    }

    fn llama(extra: &str) -> ModelConfig {
        config(&format!(
            r#"{{"architectures":["{extra}"],"vocab_size":320,"hidden_size":64,
            "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"max_position_embeddings":256,"rms_norm_eps":1e-5,
            "rope_theta":500000.0,"eos_token_id":[1,2],"bos_token_id":0}}"#
        ))
    }

    /// Layer 1's tensors, by their names' last two parts, in checkpoint order.
    fn layer_one(c: &ModelConfig) -> Vec<String> {
        LayerSpec::new(c, 1)
            .tensors()
            .iter()
            .map(|t| {
                assert!(t.name.starts_with("model.layers.1."), "{}", t.name);
                t.name.splitn(4, '.').nth(3).unwrap().to_string()
            })
            .collect()
    }

    #[test]
    fn each_family_lists_its_layer_in_checkpoint_order() {
        let plain = [
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ];
        assert_eq!(layer_one(&llama("LlamaForCausalLM")), plain);
        let mut qwen2 = plain.to_vec();
        qwen2.splice(
            4..4,
            [
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
            ],
        );
        assert_eq!(layer_one(&llama("Qwen2ForCausalLM")), qwen2);
        let mut qwen3 = plain.to_vec();
        qwen3.splice(5..5, ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]);
        assert_eq!(layer_one(&llama("Qwen3ForCausalLM")), qwen3);

        let gemma = ModelConfig::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/oracle/gguf/gemma3-270m-config.json"),
        )
        .unwrap();
        let mut sandwich = qwen3.clone();
        sandwich.splice(
            8..8,
            [
                "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight",
            ],
        );
        assert_eq!(layer_one(&gemma), sandwich);
        let spec = LayerSpec::new(&gemma, 1);
        assert!(
            spec.mlp_norm
                .name
                .ends_with("pre_feedforward_layernorm.weight")
        );
        let [attention_out, mlp_out] = spec.sandwich.unwrap();
        assert!(
            attention_out
                .name
                .ends_with("post_attention_layernorm.weight")
        );
        assert!(mlp_out.name.ends_with("post_feedforward_layernorm.weight"));
    }

    #[test]
    fn splits_follow_the_tensor_parallel_cut() {
        let c = llama("Qwen2ForCausalLM");
        let spec = LayerSpec::new(&c, 0);
        assert_eq!(spec.q.split, Split::Rows(Share::Heads));
        assert_eq!(spec.k.split, Split::Rows(Share::KvHeads));
        assert_eq!(spec.o.split, Split::Cols(Share::Heads));
        assert_eq!(
            spec.qkv_bias.as_ref().unwrap()[2].split,
            Split::Rows(Share::KvHeads)
        );
        let mlp = spec.dense_mlp().unwrap();
        assert_eq!(mlp.gate.split, Split::Rows(Share::Intermediate));
        assert_eq!(mlp.down.split, Split::Cols(Share::Intermediate));
        assert_eq!(spec.input_norm.split, Split::Whole);
        assert_eq!(embed_spec(&c).split, Split::Rows(Share::Vocab));
        assert_eq!(spec.o.dims(), [64, 64]);
        assert_eq!(mlp.down.dims(), [64, 128]);
        // The whole checkpoint: embedding, two layers, final norm, LM head.
        let all = expected_tensors(&c);
        assert_eq!(all.len(), 1 + 2 * 12 + 2);
        assert_eq!(all[0].name, EMBED);
        assert_eq!(all.last().unwrap().name, LM_HEAD);
    }
}
