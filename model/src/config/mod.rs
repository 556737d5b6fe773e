//! Model architecture from a Hugging Face `config.json`, and decoding defaults from
//! `generation_config.json`.
//!
//! Parsing is strict about what changes the math: an architecture, activation, rope scaling type or
//! feature flag strata does not implement is an error naming the field, never silently ignored.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// One line naming the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("{}: {problem}", path.display())]
pub struct ConfigError {
    pub path: PathBuf,
    pub problem: String,
}

impl ConfigError {
    pub fn new(path: &Path, problem: impl Into<String>) -> Self {
        Self {
            path: path.to_path_buf(),
            problem: problem.into(),
        }
    }
}

/// The decoder families strata implements. Mistral is Llama with an optional sliding window;
/// Qwen2 adds biases to q/k/v; Qwen3 adds per-head RMSNorm on q and k.
/// Gemma 3 (text) adds sandwich norms around attention and MLP, GELU-tanh, scaled embeddings
/// and interleaved sliding-window / global layers with two rope bases ([`Gemma3`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    Gemma3,
    /// Qwen2's attention with a sparse MLP: top-k experts and a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3's attention (q/k norms) with a sparse MLP of top-k experts.
    Qwen3Moe,
    /// Mistral's attention with a sparse MLP of top-k experts (weights renormalized).
    Mixtral,
}

impl Architecture {
    pub const ALL: [Architecture; 8] = [
        Self::Llama,
        Self::Qwen2,
        Self::Qwen3,
        Self::Mistral,
        Self::Gemma3,
        Self::Qwen2Moe,
        Self::Qwen3Moe,
        Self::Mixtral,
    ];

    /// The `architectures[0]` string of config.json.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Qwen2Moe => "Qwen2MoeForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
        }
    }

    /// The `model_type` string of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mistral => "mistral",
            Self::Gemma3 => "gemma3_text",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
        }
    }

    pub fn from_hf_class(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_class() == name)
    }

    pub fn from_model_type(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == name)
    }

    /// Whether the family's MLPs are mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Self::Qwen2Moe | Self::Qwen3Moe | Self::Mixtral)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_class())
    }
}

/// Rotary embedding frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 / 3.2: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Frequency `i` divided by `factors[i]` (`head_dim / 2` of them): how a GGUF file carries
    /// Llama 3.1-style scaling (the `rope_freqs.weight` tensor, llama.cpp's `freq_factors`).
    Factors(Vec<f64>),
}

/// What Gemma 3 adds to the decoder block. Every layer normalizes the attention output and the
/// MLP output too (sandwich norms), the MLP is GELU-tanh gated, the embedding rows are scaled by
/// `sqrt(hidden_size)`, and layers alternate between a sliding window (`sliding_window`, rope
/// base `rope_local_theta`) and global attention (rope base `rope_theta`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3 {
    /// Queries are scaled by `query_pre_attn_scalar^-1/2` (not `head_dim^-1/2`).
    pub query_pre_attn_scalar: f64,
    /// The rope base of the sliding-window layers.
    pub rope_local_theta: f64,
    /// Per layer: whether it attends through the sliding window.
    pub sliding_layers: Vec<bool>,
    /// Added to every RMSNorm weight at load: Hugging Face checkpoints store `w` and compute
    /// `x · (1 + w)` (1.0); llama.cpp's converter stores `1 + w` already (0.0).
    pub norm_offset: f32,
}

impl Gemma3 {
    /// Gemma 3's layout of `layers` layers: every sixth layer global, the others sliding.
    pub fn sliding_every_sixth(layers: usize) -> Vec<bool> {
        (0..layers).map(|i| (i + 1) % 6 != 0).collect()
    }
}

/// Everything the forward pass needs to know about a checkpoint's architecture.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2 always; Llama/Qwen3 with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` on Llama/Mistral/Qwen3).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before rotary embedding (Qwen3).
    pub qk_norm: bool,
    /// Each query attends to at most this many most recent positions (itself included).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's declared dtype (`torch_dtype` or `dtype`), informational.
    pub declared_dtype: Option<String>,
    /// Gemma 3's additions; `Some` exactly when `architecture` is Gemma3.
    pub gemma3: Option<Gemma3>,
    /// The mixture of experts; `Some` exactly when the architecture is a MoE family.
    pub moe: Option<Moe>,
}

/// The raw fields of config.json that strata reads. Unknown fields are allowed (checkpoints carry
/// many training-only fields); the ones that would change the math are checked in `validate`.
#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    quantization_config: Option<Value>,
    // Gemma 3.
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    rope_local_base_freq: Option<f64>,
    layer_types: Option<Vec<String>>,
    #[serde(alias = "_sliding_window_pattern")]
    sliding_window_pattern: Option<usize>,
    attn_logit_softcapping: Option<Value>,
    final_logit_softcapping: Option<Value>,
    use_bidirectional_attention: Option<bool>,
    // Mixtures of experts.
    #[serde(flatten)]
    moe: moe::RawMoe,
}

impl ModelConfig {
    /// Reads `dir/config.json`; or, when `dir` is a GGUF file, that file's metadata.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        if crate::gguf::is_gguf_file(dir) {
            let file =
                crate::gguf::GgufFile::open(dir).map_err(|e| ConfigError::new(dir, e.problem()))?;
            let rope_freqs = file.tensor(crate::gguf::ROPE_FREQS_TENSOR).ok();
            return crate::gguf::model_config_with_rope_freqs(file.header(), rope_freqs)
                .map_err(|e| ConfigError::new(dir, e.to_string()));
        }
        Self::from_file(&dir.join("config.json"))
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(path, format!("cannot read: {e}")))?;
        Self::from_json(&text).map_err(|problem| ConfigError::new(path, problem))
    }

    /// Parses config.json text; the error is the problem alone (the caller adds the file).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
        raw.into_config()
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match &self.gemma3 {
            Some(g) if !g.sliding_layers.get(layer).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `layer` uses the local rope base (Gemma 3's sliding layers).
    pub fn local_rope(&self, layer: usize) -> bool {
        self.gemma3
            .as_ref()
            .is_some_and(|g| g.sliding_layers.get(layer).copied().unwrap_or(false))
    }

    /// The factor attention scores are scaled by.
    pub fn attention_scale(&self) -> f32 {
        match &self.gemma3 {
            // As transformers: a Python float, rounded once to f32.
            Some(g) => (1.0 / g.query_pre_attn_scalar.sqrt()) as f32,
            None => 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K and V for one token across all layers at `bytes_per_element`.
    pub fn kv_bytes_per_token(&self, bytes_per_element: f64) -> f64 {
        (2 * self.num_layers * self.kv_dim()) as f64 * bytes_per_element
    }
}

impl RawConfig {
    fn into_config(self) -> Result<ModelConfig, String> {
        let architecture = self.architecture()?;

        if let Some(q) = &self.quantization_config {
            quantization::check(q)?;
        }
        if let Some(act) = &self.hidden_act
            && act != "silu"
            && architecture != Architecture::Gemma3
        {
            return Err(format!(
                "hidden_act \"{act}\" is not supported (only \"silu\")"
            ));
        }
        if self.mlp_bias == Some(true) {
            return Err("mlp_bias = true is not supported".into());
        }
        let need = |v: Option<usize>, name: &str| -> Result<usize, String> {
            match v {
                Some(0) => Err(format!("{name} must be > 0")),
                Some(n) => Ok(n),
                None => Err(format!("missing required field {name}")),
            }
        };
        let hidden_size = need(self.hidden_size, "hidden_size")?;
        let num_heads = need(self.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(
            self.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(format!(
                "num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => need(Some(d), "head_dim")?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(format!(
                    "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) and head_dim is not given"
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(format!(
                "head_dim ({head_dim}) must be even for rotary embeddings"
            ));
        }
        let num_layers = need(self.num_hidden_layers, "num_hidden_layers")?;
        let (rope_theta, rope_scaling, gemma3) = if architecture == Architecture::Gemma3 {
            self.gemma3(num_layers)?
        } else {
            let (theta, scaling) = self.rope()?;
            (theta, scaling, None)
        };
        let attention_bias = self.attention_bias.unwrap_or(false);
        let intermediate_size = need(self.intermediate_size, "intermediate_size")?;
        let moe = if architecture.is_moe() {
            Some(
                self.moe
                    .parse(architecture, num_layers, intermediate_size)?,
            )
        } else {
            self.moe.refuse_without(architecture)?;
            None
        };
        // Qwen2-MoE spells Qwen2's always-on q/k/v biases as `qkv_bias` (true by default).
        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            Architecture::Qwen2Moe => self.moe.qkv_bias.unwrap_or(true),
            _ => attention_bias,
        };
        Ok(ModelConfig {
            architecture,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: need(self.max_position_embeddings, "max_position_embeddings")?,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias: attention_bias
                && !matches!(architecture, Architecture::Qwen2 | Architecture::Qwen2Moe),
            qk_norm: matches!(
                architecture,
                Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
            ),
            sliding_window: self.sliding_window(architecture)?,
            bos_token_id: token_ids(&self.bos_token_id, "bos_token_id")?
                .first()
                .copied(),
            eos_token_ids: token_ids(&self.eos_token_id, "eos_token_id")?,
            declared_dtype: self.torch_dtype.or(self.dtype),
            gemma3,
            moe,
        })
    }

    fn architecture(&self) -> Result<Architecture, String> {
        match (&self.architectures, &self.model_type) {
            (Some(list), _) if !list.is_empty() => {
                let name = &list[0];
                Architecture::from_hf_class(name).ok_or_else(|| {
                    format!(
                        "architecture \"{name}\" is not supported (supported: {})",
                        supported_list()
                    )
                })
            }
            (_, Some(t)) => Architecture::from_model_type(t).ok_or_else(|| {
                format!(
                    "model_type \"{t}\" is not supported (supported: {})",
                    supported_list()
                )
            }),
            _ => Err("neither architectures nor model_type is given".into()),
        }
    }

    /// Rotary base and scaling, from the classic `rope_theta` + `rope_scaling` fields or the
    /// newer combined `rope_parameters`.
    fn rope(&self) -> Result<(f64, Option<RopeScaling>), String> {
        rope_of(
            self.rope_theta,
            self.rope_parameters.as_ref(),
            self.rope_scaling.as_ref(),
        )
    }

    /// Gemma 3's rope (global base and scaling) and additions. transformers 5 writes
    /// `rope_parameters` keyed by layer type (`full_attention`, `sliding_attention`); earlier
    /// configs `rope_theta` / `rope_scaling` for the global layers and `rope_local_base_freq`.
    fn gemma3(
        &self,
        num_layers: usize,
    ) -> Result<(f64, Option<RopeScaling>, Option<Gemma3>), String> {
        match self
            .hidden_activation
            .as_deref()
            .or(self.hidden_act.as_deref())
        {
            None | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(format!(
                    "hidden_activation \"{other}\" is not supported for Gemma 3 (only \
                     \"gelu_pytorch_tanh\")"
                ));
            }
        }
        for (key, value) in [
            ("attn_logit_softcapping", &self.attn_logit_softcapping),
            ("final_logit_softcapping", &self.final_logit_softcapping),
        ] {
            if value.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(format!("{key} is not supported"));
            }
        }
        if self.use_bidirectional_attention == Some(true) {
            return Err("use_bidirectional_attention = true is not supported".into());
        }
        let query_pre_attn_scalar = self
            .query_pre_attn_scalar
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or("missing or non-positive query_pre_attn_scalar")?;
        let sliding_layers = match (&self.layer_types, self.sliding_window_pattern) {
            (Some(types), _) => {
                if types.len() != num_layers {
                    return Err(format!(
                        "layer_types has {} entries for {num_layers} layers",
                        types.len()
                    ));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(format!("layer_types: unknown layer type \"{other}\"")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            (None, Some(0)) => return Err("sliding_window_pattern must be > 0".into()),
            (None, Some(n)) => (0..num_layers).map(|i| (i + 1) % n != 0).collect(),
            (None, None) => Gemma3::sliding_every_sixth(num_layers),
        };
        let by_type = self
            .rope_parameters
            .as_ref()
            .filter(|p| p.get("full_attention").is_some());
        let (global, local_theta) = match by_type {
            Some(p) => {
                let global = rope_of(None, p.get("full_attention"), None)?;
                let (local, local_scaling) = rope_of(None, p.get("sliding_attention"), None)?;
                if local_scaling.is_some() {
                    return Err("rope scaling of the sliding-window layers is not supported".into());
                }
                (global, local)
            }
            None => (self.rope()?, self.rope_local_base_freq.unwrap_or(10_000.0)),
        };
        if !(local_theta.is_finite() && local_theta > 0.0) {
            return Err(format!(
                "rope_local_base_freq ({local_theta}) must be positive"
            ));
        }
        let gemma3 = Gemma3 {
            query_pre_attn_scalar,
            rope_local_theta: local_theta,
            sliding_layers,
            // transformers stores `w` and computes `x · (1 + w)`.
            norm_offset: 1.0,
        };
        Ok((global.0, global.1, Some(gemma3)))
    }

    fn sliding_window(&self, arch: Architecture) -> Result<Option<usize>, String> {
        let window = match &self.sliding_window {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|w| *w > 0).ok_or_else(|| {
                format!("sliding_window must be a positive integer or null, got {v}")
            })? as usize),
        };
        match arch {
            Architecture::Mistral | Architecture::Mixtral => Ok(window),
            Architecture::Gemma3 => window
                .map(Some)
                .ok_or_else(|| "Gemma 3 needs a sliding_window".to_string()),
            // Qwen configs carry a sliding_window value that only applies with use_sliding_window.
            Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Qwen2Moe
            | Architecture::Qwen3Moe
                if self.use_sliding_window == Some(true) =>
            {
                Err("use_sliding_window = true is not supported for Qwen models".into())
            }
            Architecture::Llama if window.is_some() => {
                Err("sliding_window is not supported for LlamaForCausalLM".into())
            }
            _ => Ok(None),
        }
    }
}

/// The rope base and scaling of `rope_theta` with `rope_scaling`, or of the combined
/// `rope_parameters` (transformers 5).
fn rope_of(
    rope_theta: Option<f64>,
    rope_parameters: Option<&Value>,
    rope_scaling: Option<&Value>,
) -> Result<(f64, Option<RopeScaling>), String> {
    let params = rope_parameters.filter(|v| !v.is_null());
    let scaling = rope_scaling.filter(|v| !v.is_null()).or(params);
    let theta = rope_theta
        .or_else(|| {
            params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(format!("rope_theta ({theta}) must be a positive number"));
    }
    let Some(scaling) = scaling else {
        return Ok((theta, None));
    };
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> Result<f64, String> {
        scaling
            .get(key)
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("rope_scaling type \"{kind}\" needs a positive number {key}"))
    };
    let parsed = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => {
            let s = RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position: num("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = s
                && high_freq_factor <= low_freq_factor
            {
                return Err(format!(
                    "rope_scaling high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                ));
            }
            Some(s)
        }
        other => {
            return Err(format!(
                "rope_scaling type \"{other}\" is not supported (supported: default, linear, llama3)"
            ));
        }
    };
    Ok((theta, parsed))
}

fn supported_list() -> String {
    Architecture::ALL.map(|a| a.hf_class()).join(", ")
}

/// A token id field that may be absent, null, an integer or a list of integers.
fn token_ids(v: &Option<Value>, name: &str) -> Result<Vec<u32>, String> {
    let bad = || format!("{name} must be an integer or a list of integers");
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// Decoding defaults a checkpoint ships in generation_config.json.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

#[derive(Debug, Deserialize)]
struct RawGenerationConfig {
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    do_sample: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
}

/// The sampling a request gets for every field it leaves out, resolved once from the
/// checkpoint's generation_config.json for every API surface (OpenAI, Anthropic, Converse).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl GenerationConfig {
    /// What an omitted field means: the checkpoint's value (temperature 0, greedy, when it
    /// says `do_sample: false`), else the neutral one (temperature 1.0, no top-p, top-k or min-p
    /// cut, no repetition penalty).
    pub fn sampling_defaults(&self) -> SamplingDefaults {
        SamplingDefaults {
            temperature: match self.do_sample {
                Some(false) => 0.0,
                _ => self.temperature.unwrap_or(1.0),
            },
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
        }
    }

    /// Where a GGUF file's generation config is kept: `NAME.generation_config.json` beside
    /// `NAME.gguf` (the file format has no sampling defaults of its own).
    pub fn sidecar(gguf: &Path) -> PathBuf {
        gguf.with_extension("generation_config.json")
    }

    /// Reads `dir/generation_config.json`; a checkpoint without one gets the empty default. A
    /// GGUF file's BOS and end-of-generation tokens are read from it, its sampling defaults from
    /// its [`GenerationConfig::sidecar`] when there is one.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        if crate::gguf::is_gguf_file(dir) {
            let file =
                crate::gguf::GgufFile::open(dir).map_err(|e| ConfigError::new(dir, e.problem()))?;
            let header = file.header();
            let sampling = Self::from_file(&Self::sidecar(dir))?;
            return Ok(Self {
                bos_token_id: header.get_u32("tokenizer.ggml.bos_token_id"),
                eos_token_ids: crate::gguf::end_token_ids(header)
                    .map_err(|e| ConfigError::new(dir, e.to_string()))?,
                ..sampling
            });
        }
        Self::from_file(&dir.join("generation_config.json"))
    }

    /// One generation_config.json; an absent file is the empty default.
    fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(ConfigError::new(path, format!("cannot read: {e}"))),
        };
        let raw: RawGenerationConfig = serde_json::from_str(&text)
            .map_err(|e| ConfigError::new(path, format!("malformed JSON: {e}")))?;
        let bos =
            token_ids(&raw.bos_token_id, "bos_token_id").map_err(|p| ConfigError::new(path, p))?;
        Ok(Self {
            bos_token_id: bos.first().copied(),
            eos_token_ids: token_ids(&raw.eos_token_id, "eos_token_id")
                .map_err(|p| ConfigError::new(path, p))?,
            do_sample: raw.do_sample,
            temperature: raw.temperature,
            top_p: raw.top_p,
            top_k: raw.top_k,
            min_p: raw.min_p,
            repetition_penalty: raw.repetition_penalty,
        })
    }
}

mod moe;
mod pooling;
mod quantization;

pub use moe::Moe;
pub use pooling::EmbeddingConfig;

#[cfg(test)]
mod tests;
