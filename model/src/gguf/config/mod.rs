//! A [`ModelConfig`] from a GGUF file's metadata and tensor table, and the map from GGUF tensor
//! names to the Hugging Face names the rest of the crate uses.
//!
//! Keys are llama.cpp's (`gguf-py/gguf/constants.py`), prefixed by `general.architecture`:
//! `{arch}.context_length`, `{arch}.embedding_length`, `{arch}.attention.head_count`, and so on.
//! Features that are not metadata are read from the tensor table, as llama.cpp does: an absent
//! `output.weight` means the embedding is tied, `blk.0.attn_q.bias` means q/k/v biases,
//! `blk.0.attn_q_norm.weight` means per-head q/k RMSNorm.
//!
//! As with config.json, whatever would change the math and is not implemented is an error naming
//! the key or tensor, never ignored: a rope scaling type other than none/linear, a partial rotary
//! dimension, value heads wider than key heads, per-frequency rope factors (`rope_freqs.weight`).
//!
//! # Weight layout the loader must undo
//!
//! llama.cpp's converter permutes the rows of `attn_q.weight` and `attn_k.weight` of
//! `llama`-architecture files (Llama and Mistral) so that its interleaved rope pairs dimensions
//! `(2j, 2j+1)` of each head rather than Hugging Face's `(j, j + head_dim/2)`. Per head, with `h`
//! heads (`head_count` for q, `head_count_kv` for k) and `r = rows / h / 2`, it applies
//! `reshape(h, 2, r, cols).swapaxes(1, 2)`; the loader restores the Hugging Face order with
//! `reshape(h, r, 2, cols).swapaxes(1, 2)`. Rows are whole quantization blocks (blocks run along
//! `dims[0]`), so the inverse is a row permutation that works on quantized bytes too. `qwen2` and
//! `qwen3` files use rotate-half rope in llama.cpp and are not permuted.

use crate::config::{Architecture, Gemma3, ModelConfig, RopeScaling};
use crate::weights::{EMBED, FINAL_NORM, LM_HEAD};

use super::{GgmlType, GgufHeader, GgufTensor, GgufValue, GgufValueType};

/// The metadata key naming the architecture, which prefixes every architecture key.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// The vocabulary, whose length is the vocabulary size when `{arch}.vocab_size` is absent.
pub const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
const BOS_KEY: &str = "tokenizer.ggml.bos_token_id";
const EOS_KEY: &str = "tokenizer.ggml.eos_token_id";
/// llama.cpp's default `{arch}.rope.freq_base`.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The tensor that carries per-frequency rope divisors (Llama 3.1-style scaling).
pub const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

/// The `general.architecture` values understood here.
pub const SUPPORTED_ARCHITECTURES: [&str; 6] =
    ["llama", "qwen2", "qwen3", "gemma3", "qwen2moe", "qwen3moe"];
/// llama.cpp's rope base for Gemma 3's sliding-window layers (not in the metadata).
const GEMMA3_LOCAL_ROPE_THETA: f64 = 10_000.0;
/// Gemma 3 27B (62 layers) scales queries by `hidden / heads`, the others by `head_dim`
/// (llama.cpp's rule; `query_pre_attn_scalar` is not in the metadata).
const GEMMA3_27B_LAYERS: usize = 62;

/// Why a GGUF file's metadata does not describe a model strata can run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufConfigError {
    #[error("missing metadata key {key}")]
    MissingKey { key: String },
    #[error("metadata key {key} is a {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: GgufValueType,
    },
    #[error("metadata key {key} is {value}, which is out of range: {why}")]
    OutOfRange {
        key: String,
        value: String,
        why: &'static str,
    },
    #[error(
        "general.architecture \"{name}\" is not supported (supported: {})",
        SUPPORTED_ARCHITECTURES.join(", ")
    )]
    UnsupportedArchitecture { name: String },
    #[error("metadata key {key}: {problem}")]
    Inconsistent { key: String, problem: String },
    #[error("metadata key {key}: {problem}")]
    Unsupported { key: String, problem: String },
    #[error(
        "tensor {ROPE_FREQS_TENSOR} carries per-frequency rope factors (Llama 3.1-style scaling), \
         which the metadata alone cannot give: read the file's tensor data"
    )]
    RopeFreqsTensor,
    #[error("tensor {ROPE_FREQS_TENSOR}: {0}")]
    RopeFreqs(String),
}

/// The [`ModelConfig`] a GGUF file describes: metadata for the sizes, the tensor table for the
/// optional tensors (tied output, q/k/v biases, q/k norms).
pub fn model_config(header: &GgufHeader) -> Result<ModelConfig, GgufConfigError> {
    build_config(header, None)
}

/// [`model_config`] with the file's `rope_freqs.weight` (when it has one): its per-frequency
/// divisors become [`RopeScaling::Factors`]. They must be `head_dim / 2` finite positive values,
/// and the metadata must not scale the rope as well.
pub fn model_config_with_rope_freqs(
    header: &GgufHeader,
    rope_freqs: Option<GgufTensor<'_>>,
) -> Result<ModelConfig, GgufConfigError> {
    build_config(header, rope_freqs)
}

fn build_config(
    header: &GgufHeader,
    rope_freqs: Option<GgufTensor<'_>>,
) -> Result<ModelConfig, GgufConfigError> {
    let meta = Metadata { header };
    let arch_name = meta
        .string(ARCHITECTURE_KEY)?
        .ok_or_else(|| missing(ARCHITECTURE_KEY))?;
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    let family = family(&meta, arch_name, &key)?;
    let has_tensor = |name: &str| header.tensor_info(name).is_ok();
    let rope_factors = match (has_tensor(ROPE_FREQS_TENSOR), rope_freqs) {
        (false, _) => None,
        (true, None) => return Err(GgufConfigError::RopeFreqsTensor),
        (true, Some(t)) => Some(rope_factors(&t)?),
    };

    let hidden_size = meta.required_size(&key("embedding_length"))?;
    let (num_heads, num_kv_heads) = heads(&meta, &key)?;
    let head_dim = head_dim(&meta, &key, hidden_size, num_heads)?;
    let sliding_window = meta.positive_size(&key("attention.sliding_window"))?;
    let architecture = match (family, sliding_window) {
        (_, None) | (Architecture::Gemma3 | Architecture::Mixtral, _) => family,
        // Mistral is Llama with a window; llama.cpp writes both as `llama`.
        (Architecture::Llama, Some(_)) => Architecture::Mistral,
        (_, Some(_)) => {
            return Err(GgufConfigError::Unsupported {
                key: key("attention.sliding_window"),
                problem: format!("sliding-window attention is not supported for {arch_name}"),
            });
        }
    };
    let layer0 = |suffix: &str| has_tensor(&format!("blk.0.{suffix}"));
    let num_layers = meta.required_size(&key("block_count"))?;
    let intermediate_size = meta.required_size(&key("feed_forward_length"))?;
    let moe = family
        .is_moe()
        .then(|| {
            moe(
                &meta,
                &key,
                family,
                num_layers,
                intermediate_size,
                &has_tensor,
            )
        })
        .transpose()?;
    let gemma3 = (family == Architecture::Gemma3).then(|| Gemma3 {
        query_pre_attn_scalar: if num_layers == GEMMA3_27B_LAYERS {
            (hidden_size / num_heads) as f64
        } else {
            head_dim as f64
        },
        rope_local_theta: GEMMA3_LOCAL_ROPE_THETA,
        sliding_layers: Gemma3::sliding_every_sixth(num_layers),
        // The converter stored `1 + w`.
        norm_offset: 0.0,
    });
    Ok(ModelConfig {
        architecture,
        vocab_size: vocab_size(&meta, &key("vocab_size"))?,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        max_position_embeddings: meta.required_size(&key("context_length"))?,
        rms_norm_eps: meta
            .positive_float(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| missing(&key("attention.layer_norm_rms_epsilon")))?,
        rope_theta: meta
            .positive_float(&key("rope.freq_base"))?
            .unwrap_or(DEFAULT_ROPE_THETA),
        rope_scaling: match (rope_scaling(&meta, &key)?, rope_factors) {
            (scaling, None) => scaling,
            (None, Some(factors)) if factors.len() == head_dim / 2 => {
                Some(RopeScaling::Factors(factors))
            }
            (None, Some(factors)) => {
                return Err(GgufConfigError::RopeFreqs(format!(
                    "{} factors for a head dimension of {head_dim} (needs {})",
                    factors.len(),
                    head_dim / 2
                )));
            }
            (Some(_), Some(_)) => {
                return Err(GgufConfigError::RopeFreqs(format!(
                    "per-frequency factors and {} both scale the rope",
                    key("rope.scaling.type")
                )));
            }
        },
        tie_word_embeddings: !has_tensor("output.weight"),
        qkv_bias: layer0("attn_q.bias"),
        o_bias: layer0("attn_output.bias"),
        qk_norm: layer0("attn_q_norm.weight"),
        sliding_window,
        bos_token_id: meta.token_id(BOS_KEY)?,
        eos_token_ids: meta.token_id(EOS_KEY)?.into_iter().collect(),
        declared_dtype: None,
        gemma3,
        moe,
    })
}

/// The family of a file of architecture `arch_name`: llama.cpp writes Mixtral as `llama` with
/// experts; experts in another dense family are refused.
fn family(
    meta: &Metadata<'_>,
    arch_name: &str,
    key: &impl Fn(&str) -> String,
) -> Result<Architecture, GgufConfigError> {
    let family = match arch_name {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "gemma3" => Architecture::Gemma3,
        "qwen2moe" => Architecture::Qwen2Moe,
        "qwen3moe" => Architecture::Qwen3Moe,
        other => {
            return Err(GgufConfigError::UnsupportedArchitecture {
                name: other.to_string(),
            });
        }
    };
    let experts = meta.size(&key("expert_count"))?.is_some_and(|n| n > 0);
    match (family, experts) {
        (Architecture::Llama, true) => Ok(Architecture::Mixtral),
        (family, true) if !family.is_moe() => Err(GgufConfigError::Unsupported {
            key: key("expert_count"),
            problem: format!("experts are not supported for {arch_name}"),
        }),
        (family, _) => Ok(family),
    }
}

/// The experts of a `qwen2moe`, `qwen3moe` or Mixtral (`llama` with experts) file: counts and
/// widths from the metadata, which layers are sparse from the tensor table (a router,
/// `blk.N.ffn_gate_inp`, marks one), the renormalization llama.cpp applies per family
/// (`expert_weights_norm` where the file says).
fn moe(
    meta: &Metadata<'_>,
    key: &impl Fn(&str) -> String,
    family: Architecture,
    layers: usize,
    intermediate: usize,
    has_tensor: &impl Fn(&str) -> bool,
) -> Result<crate::config::Moe, GgufConfigError> {
    let experts = meta.required_size(&key("expert_count"))?;
    let experts_per_token = meta.required_size(&key("expert_used_count"))?;
    if experts_per_token > experts {
        return Err(GgufConfigError::Unsupported {
            key: key("expert_used_count"),
            problem: format!("{experts_per_token} exceeds the {experts} experts"),
        });
    }
    for unsupported in [
        "expert_group_count",
        "expert_shared_count",
        "expert_gating_func",
    ] {
        if meta.size(&key(unsupported))?.is_some_and(|n| n > 1) {
            return Err(GgufConfigError::Unsupported {
                key: key(unsupported),
                problem: "only softmax routing over ungrouped experts is supported".into(),
            });
        }
    }
    let expert_intermediate = match family {
        Architecture::Mixtral => intermediate,
        _ => meta.required_size(&key("expert_feed_forward_length"))?,
    };
    let shared_expert_intermediate = match family {
        Architecture::Qwen2Moe => {
            Some(meta.required_size(&key("expert_shared_feed_forward_length"))?)
        }
        _ => None,
    };
    // llama.cpp renormalizes Qwen3-MoE's and Mixtral's chosen weights, not Qwen2-MoE's.
    let norm_topk_prob = match meta.boolean(&key("expert_weights_norm"))? {
        Some(norm) => norm,
        None => family != Architecture::Qwen2Moe,
    };
    Ok(crate::config::Moe {
        experts,
        experts_per_token,
        expert_intermediate,
        norm_topk_prob,
        sparse_layers: (0..layers)
            .map(|i| has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect(),
        shared_expert_intermediate,
    })
}

/// `(head_count, head_count_kv)`; the kv count defaults to the head count, as in llama.cpp.
fn heads(
    meta: &Metadata<'_>,
    key: &impl Fn(&str) -> String,
) -> Result<(usize, usize), GgufConfigError> {
    let num_heads = meta.required_size(&key("attention.head_count"))?;
    let kv_key = key("attention.head_count_kv");
    let num_kv_heads = match meta.size(&kv_key)? {
        None => num_heads,
        Some(0) => return Err(zero(&kv_key)),
        Some(n) => n,
    };
    if !num_heads.is_multiple_of(num_kv_heads) {
        return Err(GgufConfigError::Inconsistent {
            key: kv_key,
            problem: format!(
                "{num_kv_heads} kv heads do not divide the {num_heads} heads of {}",
                key("attention.head_count")
            ),
        });
    }
    Ok((num_heads, num_kv_heads))
}

/// `attention.key_length` when present, else the embedding width over the head count. The value
/// width and the rotary width, when given, must equal it: strata rotates whole heads and keeps
/// K and V the same width.
fn head_dim(
    meta: &Metadata<'_>,
    key: &impl Fn(&str) -> String,
    hidden_size: usize,
    num_heads: usize,
) -> Result<usize, GgufConfigError> {
    let key_length = key("attention.key_length");
    let head_dim = match meta.positive_size(&key_length)? {
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(GgufConfigError::Inconsistent {
                key: key("attention.head_count"),
                problem: format!(
                    "{num_heads} heads do not divide {} ({hidden_size}) and {key_length} is absent",
                    key("embedding_length")
                ),
            });
        }
    };
    if !head_dim.is_multiple_of(2) {
        return Err(GgufConfigError::Inconsistent {
            key: key_length,
            problem: format!("head dimension {head_dim} must be even for rotary embeddings"),
        });
    }
    for (suffix, what) in [
        ("attention.value_length", "value heads"),
        ("rope.dimension_count", "partial rotary embeddings"),
    ] {
        let k = key(suffix);
        if let Some(n) = meta.size(&k)?
            && n != head_dim
        {
            return Err(GgufConfigError::Unsupported {
                key: k,
                problem: format!("{n} differs from the head dimension {head_dim} ({what})"),
            });
        }
    }
    Ok(head_dim)
}

/// `{arch}.vocab_size`, else the length of the token list.
fn vocab_size(meta: &Metadata<'_>, vocab_key: &str) -> Result<usize, GgufConfigError> {
    if let Some(n) = meta.positive_size(vocab_key)? {
        return Ok(n);
    }
    match meta.header.metadata(TOKENS_KEY) {
        None => Err(GgufConfigError::MissingKey {
            key: format!("{vocab_key} (or {TOKENS_KEY})"),
        }),
        Some(GgufValue::Array(tokens)) if tokens.values.is_empty() => Err(zero(TOKENS_KEY)),
        Some(GgufValue::Array(tokens)) => Ok(tokens.values.len()),
        Some(other) => Err(wrong_type(TOKENS_KEY, "an array of strings", other)),
    }
}

/// The divisors of `rope_freqs.weight`: F32 or F16, one dimension, finite and positive.
fn rope_factors(t: &GgufTensor<'_>) -> Result<Vec<f64>, GgufConfigError> {
    let bad = |problem: String| GgufConfigError::RopeFreqs(problem);
    if t.dims().len() != 1 || !matches!(t.ty(), GgmlType::F32 | GgmlType::F16) {
        return Err(bad(format!(
            "expected a vector of F32 or F16, found {} of dims {:?}",
            t.ty().name(),
            t.dims()
        )));
    }
    let values = crate::gguf::dequantize(t.ty(), t.bytes(), t.n_elements())
        .map_err(|e| bad(e.to_string()))?;
    match values.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        Some(v) => Err(bad(format!("factor {v} is not a positive number"))),
        None => Ok(values.into_iter().map(f64::from).collect()),
    }
}

/// llama.cpp's reading: the type defaults to `linear`, and a factor that is absent, 0 or 1 means
/// no scaling.
fn rope_scaling(
    meta: &Metadata<'_>,
    key: &impl Fn(&str) -> String,
) -> Result<Option<RopeScaling>, GgufConfigError> {
    let type_key = key("rope.scaling.type");
    let kind = meta.string(&type_key)?.unwrap_or("linear");
    let factor = match meta.float(&key("rope.scaling.factor"))? {
        Some(f) if f == 0.0 || f == 1.0 => None,
        Some(f) if f.is_finite() && f > 0.0 => Some(f),
        Some(f) => {
            return Err(GgufConfigError::OutOfRange {
                key: key("rope.scaling.factor"),
                value: f.to_string(),
                why: "a scaling factor must be a positive number",
            });
        }
        None => None,
    };
    match kind {
        "none" => Ok(None),
        "linear" => Ok(factor.map(|factor| RopeScaling::Linear { factor })),
        other => Err(GgufConfigError::Unsupported {
            key: type_key,
            problem: format!("rope scaling \"{other}\" is not supported (supported: none, linear)"),
        }),
    }
}

/// [`hf_tensor_name`] for a file of architecture `arch` (`general.architecture`): Gemma 3's
/// norms sit elsewhere in the block, so `ffn_norm` is its pre-MLP norm and `post_attention_norm`
/// and `post_ffw_norm` normalize the attention and MLP outputs.
/// `arch` is `mixtral` for a `llama` file with experts (its tensors take Mixtral's names).
pub fn hf_tensor_name_in(arch: &str, gguf_name: &str) -> Option<String> {
    if let Some((layer, tensor)) = layer_tensor(gguf_name) {
        let block = if arch == "mixtral" {
            "block_sparse_moe"
        } else {
            "mlp"
        };
        let hf = match tensor {
            "ffn_gate_inp.weight" => Some("gate.weight"),
            "ffn_gate_inp_shexp.weight" => Some("shared_expert_gate.weight"),
            "ffn_gate_shexp.weight" => Some("shared_expert.gate_proj.weight"),
            "ffn_up_shexp.weight" => Some("shared_expert.up_proj.weight"),
            "ffn_down_shexp.weight" => Some("shared_expert.down_proj.weight"),
            _ => None,
        };
        if let Some(hf) = hf {
            return Some(format!("model.layers.{layer}.{block}.{hf}"));
        }
    }
    if arch == "gemma3"
        && let Some(rest) = gguf_name.strip_prefix("blk.")
        && let Some((layer, tensor)) = rest.split_once('.')
    {
        let hf = match tensor {
            "ffn_norm.weight" => Some("pre_feedforward_layernorm.weight"),
            "post_attention_norm.weight" => Some("post_attention_layernorm.weight"),
            "post_ffw_norm.weight" => Some("post_feedforward_layernorm.weight"),
            _ => None,
        };
        if let Some(hf) = hf {
            // The layer number is checked as for every other name.
            return hf_tensor_name(&format!("blk.{layer}.attn_norm.weight"))
                .map(|n| n.replace("input_layernorm.weight", hf));
        }
    }
    hf_tensor_name(gguf_name)
}

/// The Hugging Face names of the experts a stacked llama.cpp expert tensor
/// (`blk.N.ffn_{gate,up,down}_exps.weight`, `experts` matrices one after the other) holds, in
/// order; `None` for any other name. `arch` as for [`hf_tensor_name_in`].
pub fn hf_expert_names(arch: &str, gguf_name: &str, experts: usize) -> Option<Vec<String>> {
    let (layer, tensor) = layer_tensor(gguf_name)?;
    let which = [
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
    ]
    .iter()
    .position(|t| *t == tensor)?;
    let name = |e: usize| {
        if arch == "mixtral" {
            let w = ["w1", "w3", "w2"][which];
            format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight")
        } else {
            let proj = ["gate_proj", "up_proj", "down_proj"][which];
            format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
        }
    };
    Some((0..experts).map(name).collect())
}

/// `(layer, tensor)` of a `blk.N.tensor` name with a plain decimal layer number (`blk.+1.` or
/// `blk.01.` would alias another layer).
fn layer_tensor(gguf_name: &str) -> Option<(&str, &str)> {
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let plain = !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && !(layer.len() > 1 && layer.starts_with('0'));
    plain.then_some((layer, tensor))
}

/// The Hugging Face name the crate uses (see [`crate::weights::LayerNames`]) for a llama.cpp
/// tensor name, or `None` for a name with no counterpart (e.g. `rope_freqs.weight`).
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some(EMBED.to_string()),
        "output_norm.weight" => return Some(FINAL_NORM.to_string()),
        "output.weight" => return Some(LM_HEAD.to_string()),
        _ => {}
    }
    let (layer, tensor) = layer_tensor(gguf_name)?;
    let hf = match tensor {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "attn_output.bias" => "self_attn.o_proj.bias",
        "attn_q_norm.weight" => "self_attn.q_norm.weight",
        "attn_k_norm.weight" => "self_attn.k_norm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Typed metadata lookups whose errors name the key. `Ok(None)` is an absent key; a present key
/// of the wrong type is an error, never treated as absent.
struct Metadata<'a> {
    header: &'a GgufHeader,
}

impl<'a> Metadata<'a> {
    fn boolean(&self, key: &str) -> Result<Option<bool>, GgufConfigError> {
        match self.header.metadata(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(key, "a boolean", other)),
        }
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, GgufConfigError> {
        match self.header.metadata(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong_type(key, "a string", other)),
        }
    }

    /// Any integer type, as long as the value is non-negative and fits `usize`.
    fn size(&self, key: &str) -> Result<Option<usize>, GgufConfigError> {
        let Some(value) = self.header.metadata(key) else {
            return Ok(None);
        };
        let wide: i128 = match *value {
            GgufValue::U8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            ref other => return Err(wrong_type(key, "an integer", other)),
        };
        usize::try_from(wide)
            .map(Some)
            .map_err(|_| GgufConfigError::OutOfRange {
                key: key.to_string(),
                value: wide.to_string(),
                why: "a size must be a non-negative integer",
            })
    }

    fn positive_size(&self, key: &str) -> Result<Option<usize>, GgufConfigError> {
        match self.size(key)? {
            Some(0) => Err(zero(key)),
            other => Ok(other),
        }
    }

    fn required_size(&self, key: &str) -> Result<usize, GgufConfigError> {
        self.positive_size(key)?.ok_or_else(|| missing(key))
    }

    fn float(&self, key: &str) -> Result<Option<f64>, GgufConfigError> {
        match self.header.metadata(key) {
            None => Ok(None),
            Some(GgufValue::F32(v)) => Ok(Some(f64::from(*v))),
            Some(GgufValue::F64(v)) => Ok(Some(*v)),
            Some(other) => Err(wrong_type(key, "a float", other)),
        }
    }

    fn positive_float(&self, key: &str) -> Result<Option<f64>, GgufConfigError> {
        match self.float(key)? {
            Some(v) if !(v.is_finite() && v > 0.0) => Err(GgufConfigError::OutOfRange {
                key: key.to_string(),
                value: v.to_string(),
                why: "it must be a positive number",
            }),
            other => Ok(other),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>, GgufConfigError> {
        self.size(key)?
            .map(|id| {
                u32::try_from(id).map_err(|_| GgufConfigError::OutOfRange {
                    key: key.to_string(),
                    value: id.to_string(),
                    why: "a token id must fit in 32 bits",
                })
            })
            .transpose()
    }
}

fn missing(key: &str) -> GgufConfigError {
    GgufConfigError::MissingKey {
        key: key.to_string(),
    }
}

fn zero(key: &str) -> GgufConfigError {
    GgufConfigError::OutOfRange {
        key: key.to_string(),
        value: "0".to_string(),
        why: "it must be greater than zero",
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &GgufValue) -> GgufConfigError {
    GgufConfigError::WrongType {
        key: key.to_string(),
        expected,
        found: found.value_type(),
    }
}

#[cfg(test)]
mod tests;
