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

use crate::config::{Architecture, ModelConfig, RopeScaling};
use crate::weights::{EMBED, FINAL_NORM, LM_HEAD};

use super::{GgufHeader, GgufValue, GgufValueType};

/// The metadata key naming the architecture, which prefixes every architecture key.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// The vocabulary, whose length is the vocabulary size when `{arch}.vocab_size` is absent.
pub const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
const BOS_KEY: &str = "tokenizer.ggml.bos_token_id";
const EOS_KEY: &str = "tokenizer.ggml.eos_token_id";
/// llama.cpp's default `{arch}.rope.freq_base`.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The tensor that carries per-frequency rope divisors (Llama 3.1-style scaling).
const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

/// The `general.architecture` values understood here.
pub const SUPPORTED_ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "qwen3"];

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
         which cannot be read from metadata and are not supported from GGUF yet"
    )]
    RopeFreqsTensor,
}

/// The [`ModelConfig`] a GGUF file describes: metadata for the sizes, the tensor table for the
/// optional tensors (tied output, q/k/v biases, q/k norms).
pub fn model_config(header: &GgufHeader) -> Result<ModelConfig, GgufConfigError> {
    let meta = Metadata { header };
    let arch_name = meta
        .string(ARCHITECTURE_KEY)?
        .ok_or_else(|| missing(ARCHITECTURE_KEY))?;
    let family = match arch_name {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        other => {
            return Err(GgufConfigError::UnsupportedArchitecture {
                name: other.to_string(),
            });
        }
    };
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    let has_tensor = |name: &str| header.tensor_info(name).is_ok();
    if has_tensor(ROPE_FREQS_TENSOR) {
        return Err(GgufConfigError::RopeFreqsTensor);
    }

    let hidden_size = meta.required_size(&key("embedding_length"))?;
    let (num_heads, num_kv_heads) = heads(&meta, &key)?;
    let head_dim = head_dim(&meta, &key, hidden_size, num_heads)?;
    let sliding_window = meta.positive_size(&key("attention.sliding_window"))?;
    let architecture = match (family, sliding_window) {
        (_, None) => family,
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
    Ok(ModelConfig {
        architecture,
        vocab_size: vocab_size(&meta, &key("vocab_size"))?,
        hidden_size,
        intermediate_size: meta.required_size(&key("feed_forward_length"))?,
        num_layers: meta.required_size(&key("block_count"))?,
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
        rope_scaling: rope_scaling(&meta, &key)?,
        tie_word_embeddings: !has_tensor("output.weight"),
        qkv_bias: layer0("attn_q.bias"),
        o_bias: layer0("attn_output.bias"),
        qk_norm: layer0("attn_q_norm.weight"),
        sliding_window,
        bos_token_id: meta.token_id(BOS_KEY)?,
        eos_token_ids: meta.token_id(EOS_KEY)?.into_iter().collect(),
        declared_dtype: None,
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

/// The Hugging Face name the crate uses (see [`crate::weights::LayerNames`]) for a llama.cpp
/// tensor name, or `None` for a name with no counterpart (e.g. `rope_freqs.weight`).
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some(EMBED.to_string()),
        "output_norm.weight" => return Some(FINAL_NORM.to_string()),
        "output.weight" => return Some(LM_HEAD.to_string()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, tensor) = rest.split_once('.')?;
    // Only plain decimal layer numbers: `blk.+1.` or `blk.01.` would alias another layer.
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
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
mod tests {
    use super::*;
    use crate::gguf::{GgmlType, Gguf, GgufArray};
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
            put_str(&mut out, key);
            out.extend(value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        for (i, name) in tensors.iter().enumerate() {
            put_str(&mut out, name);
            out.extend(1u32.to_le_bytes());
            out.extend(1u64.to_le_bytes());
            out.extend(GgmlType::F32.id().to_le_bytes());
            out.extend(((i * ALIGN) as u64).to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(ALIGN), 0);
        out.resize(out.len() + tensors.len() * ALIGN, 0);
        out
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn put_value(out: &mut Vec<u8>, value: &GgufValue) {
        match value {
            GgufValue::U8(v) => out.extend(v.to_le_bytes()),
            GgufValue::I8(v) => out.extend(v.to_le_bytes()),
            GgufValue::U16(v) => out.extend(v.to_le_bytes()),
            GgufValue::I16(v) => out.extend(v.to_le_bytes()),
            GgufValue::U32(v) => out.extend(v.to_le_bytes()),
            GgufValue::I32(v) => out.extend(v.to_le_bytes()),
            GgufValue::U64(v) => out.extend(v.to_le_bytes()),
            GgufValue::I64(v) => out.extend(v.to_le_bytes()),
            GgufValue::F32(v) => out.extend(v.to_le_bytes()),
            GgufValue::F64(v) => out.extend(v.to_le_bytes()),
            GgufValue::Bool(v) => out.push(u8::from(*v)),
            GgufValue::String(s) => put_str(out, s),
            GgufValue::Array(a) => {
                out.extend(a.element_type.id().to_le_bytes());
                out.extend((a.values.len() as u64).to_le_bytes());
                for v in &a.values {
                    put_value(out, v);
                }
            }
        }
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
        let meta = renamed(llama(), "gemma3");
        let err = config(&meta, &BASE_TENSORS).unwrap_err();
        assert_eq!(
            err,
            GgufConfigError::UnsupportedArchitecture {
                name: "gemma3".into()
            }
        );
        assert!(err.to_string().contains("\"gemma3\""), "{err}");
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
}
