//! Synthesized checkpoints: a complete HF-style model directory with deterministic random weights,
//! for tests, oracles and the embedded demo model.
//!
//! Every tensor draws from its own ChaCha stream keyed by (seed, tensor name), so a checkpoint is a
//! pure function of its [`SynthSpec`] — byte-identical across runs and machines.

mod tokenizer;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::config::{Architecture, ModelConfig};
use crate::weights::{TensorSpec, expected_tensors};

pub use tokenizer::{DEFAULT_CHAT_TEMPLATE, byte_level_tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {problem}", path.display())]
    Tokenizer { path: PathBuf, problem: String },
    #[error("invalid synthesized architecture: {0}")]
    Spec(String),
}

/// Element type of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SynthDtype {
    #[default]
    Bf16,
    F16,
    F32,
}

/// Llama 3 rope scaling parameters for a synthesized config.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SynthLlama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// What to synthesize. Serde-readable so oracle cases can be listed in a JSON file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SynthSpec {
    pub arch: String,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_position")]
    pub max_position: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<SynthLlama3Scaling>,
    #[serde(default)]
    pub tie_embeddings: bool,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub dtype: SynthDtype,
    pub seed: u64,
    /// The experts of a MoE family (qwen2_moe, qwen3_moe, mixtral).
    #[serde(default)]
    pub moe: Option<SynthMoe>,
}

/// A mixture of experts to synthesize: `intermediate` is then the width of the dense layers
/// (Qwen's `mlp_only_layers`; Mixtral's experts are `intermediate` wide).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SynthMoe {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Each expert's width (Qwen's `moe_intermediate_size`; Mixtral's is `intermediate`).
    #[serde(default)]
    pub expert_intermediate: Option<usize>,
    /// Qwen2-MoE's shared expert width.
    #[serde(default)]
    pub shared_expert_intermediate: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
}

fn default_max_position() -> usize {
    4096
}

fn default_rope_theta() -> f64 {
    10_000.0
}

impl SynthSpec {
    /// The ~100M-parameter shape of the embedded demo model.
    pub fn demo(arch: Architecture, seed: u64) -> Self {
        Self {
            arch: arch.model_type().to_string(),
            layers: 16,
            hidden: 768,
            heads: 12,
            kv_heads: 4,
            intermediate: 2048,
            head_dim: None,
            max_position: default_max_position(),
            rope_theta: default_rope_theta(),
            rope_scaling: None,
            tie_embeddings: false,
            sliding_window: None,
            dtype: SynthDtype::Bf16,
            seed,
            moe: None,
        }
    }

    /// A two-layer, hidden-64 model: big enough to exercise every code path, small enough that
    /// tests run it thousands of times.
    pub fn tiny(arch: Architecture, seed: u64) -> Self {
        Self {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 96,
            max_position: 256,
            ..Self::demo(arch, seed)
        }
    }

    /// A tiny Qwen3-MoE: three layers (the middle one dense), 8 experts 32 wide, 2 per token,
    /// renormalized.
    pub fn tiny_moe(seed: u64) -> Self {
        Self {
            layers: 3,
            moe: Some(SynthMoe {
                experts: 8,
                experts_per_token: 2,
                expert_intermediate: Some(32),
                shared_expert_intermediate: None,
                norm_topk_prob: true,
                mlp_only_layers: vec![1],
                decoder_sparse_step: None,
            }),
            ..Self::tiny(Architecture::Qwen3Moe, seed)
        }
    }

    pub fn architecture(&self) -> Result<Architecture, SynthError> {
        Architecture::from_model_type(&self.arch).ok_or_else(|| {
            SynthError::Spec(format!(
                "unknown arch \"{}\" (llama, qwen2, qwen3, mistral, qwen2_moe, qwen3_moe, \
                 mixtral)",
                self.arch
            ))
        })
    }

    /// The config.json this spec produces, for a vocabulary of `vocab_size`.
    fn config_json(
        &self,
        vocab_size: usize,
        bos: Option<u32>,
        eos: &[u32],
    ) -> Result<Value, SynthError> {
        let arch = self.architecture()?;
        if arch == Architecture::Gemma3 {
            return Err(SynthError::Spec(
                "gemma3 checkpoints are not synthesized (Gemma 3 loads from GGUF)".into(),
            ));
        }
        let head_dim = self.head_dim.unwrap_or(self.hidden / self.heads.max(1));
        let mut c = json!({
            "architectures": [arch.hf_class()],
            "model_type": arch.model_type(),
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": false,
            "torch_dtype": match self.dtype {
                SynthDtype::Bf16 => "bfloat16",
                SynthDtype::F16 => "float16",
                SynthDtype::F32 => "float32",
            },
            "bos_token_id": bos,
            "eos_token_id": eos,
            "initializer_range": 0.02,
        });
        let obj = c.as_object_mut().expect("json! object");
        if let Some(s) = self.rope_scaling {
            obj.insert(
                "rope_scaling".into(),
                json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            );
        }
        self.moe_json(arch, obj)?;
        match arch {
            Architecture::Mistral | Architecture::Mixtral => {
                obj.insert("sliding_window".into(), json!(self.sliding_window));
            }
            _ if self.sliding_window.is_some() => {
                return Err(SynthError::Spec(
                    "sliding_window is only synthesized for mistral".into(),
                ));
            }
            Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Qwen2Moe
            | Architecture::Qwen3Moe => {
                obj.insert("use_sliding_window".into(), json!(false));
            }
            Architecture::Llama | Architecture::Gemma3 => {}
        }
        // Round-trip through strata's own parser: a spec that would not load is refused here.
        ModelConfig::from_json(&c.to_string()).map_err(SynthError::Spec)?;
        Ok(c)
    }

    /// The expert fields of a MoE family's config.json (a `moe` spec exactly for those).
    fn moe_json(
        &self,
        arch: Architecture,
        obj: &mut serde_json::Map<String, Value>,
    ) -> Result<(), SynthError> {
        let Some(m) = &self.moe else {
            return match arch.is_moe() {
                true => Err(SynthError::Spec(format!("{arch} needs a moe spec"))),
                false => Ok(()),
            };
        };
        let fields = match arch {
            Architecture::Mixtral => json!({
                "num_local_experts": m.experts,
                "num_experts_per_tok": m.experts_per_token,
                "router_jitter_noise": 0.0,
            }),
            Architecture::Qwen2Moe | Architecture::Qwen3Moe => {
                let mut f = json!({
                    "num_experts": m.experts,
                    "num_experts_per_tok": m.experts_per_token,
                    "moe_intermediate_size": m.expert_intermediate.unwrap_or(self.intermediate),
                    "norm_topk_prob": m.norm_topk_prob,
                    "mlp_only_layers": m.mlp_only_layers,
                    "decoder_sparse_step": m.decoder_sparse_step.unwrap_or(1),
                });
                if arch == Architecture::Qwen2Moe {
                    f["shared_expert_intermediate_size"] =
                        json!(m.shared_expert_intermediate.unwrap_or(self.intermediate));
                    f["qkv_bias"] = json!(true);
                }
                f
            }
            _ => {
                return Err(SynthError::Spec(format!(
                    "{arch} is not a mixture of experts (moe is for qwen2_moe, qwen3_moe, \
                     mixtral)"
                )));
            }
        };
        obj.extend(fields.as_object().expect("json! object").clone());
        Ok(())
    }
}

/// Writes a complete checkpoint directory for `spec` into `out` (created if needed). With
/// `tokenizer`, that tokenizer.json (and the tokenizer_config.json beside it) is used and the
/// vocabulary sized to it; otherwise a byte-level BPE tokenizer with a ChatML template is made.
pub fn synthesize(
    spec: &SynthSpec,
    out: &Path,
    tokenizer: Option<&Path>,
) -> Result<ModelConfig, SynthError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SynthError::Io { path, source }
    };
    std::fs::create_dir_all(out).map_err(io(out))?;
    let vocab = tokenizer::write_tokenizer(out, tokenizer)?;
    let config_json = spec.config_json(vocab.size, vocab.bos, &vocab.eos)?;
    let config = ModelConfig::from_json(&config_json.to_string()).map_err(SynthError::Spec)?;

    let write_json = |name: &str, value: &Value| -> Result<(), SynthError> {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(value).expect("serialising a json Value");
        std::fs::write(&path, text + "\n").map_err(io(&path))
    };
    write_json("config.json", &config_json)?;
    write_json(
        "generation_config.json",
        &json!({"bos_token_id": vocab.bos, "eos_token_id": vocab.eos, "do_sample": false}),
    )?;

    // Each tensor draws from its own seeded stream, so generating them in parallel gives the
    // same bytes (an 8B shape takes seconds instead of minutes).
    let tensors: Vec<SynthTensor> = expected_tensors(&config)
        .into_par_iter()
        .map(|spec_t| SynthTensor::generate(spec_t, spec, &config))
        .collect();
    let path = out.join(crate::weights::SINGLE_FILE);
    let metadata = Some(
        [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect(),
    );
    safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.clone(), t)), metadata, &path)
        .map_err(|e| SynthError::Io {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
    Ok(config)
}

/// One generated tensor, already encoded in the checkpoint dtype.
struct SynthTensor {
    name: String,
    shape: Vec<usize>,
    dtype: SynthDtype,
    bytes: Vec<u8>,
}

impl SynthTensor {
    fn generate(t: TensorSpec, spec: &SynthSpec, config: &ModelConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(stream_seed(spec.seed, &t.name));
        let mut uniform = move || (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
        let is_norm = t.shape.len() == 1 && t.name.ends_with("norm.weight");
        // Scales keep activations and logits in a realistic range: projections ~ 1/sqrt(fan_in),
        // embeddings and LM head give logits with a spread of a few units, norms near 1.
        let values: Vec<f32> = if is_norm {
            (0..t.numel()).map(|_| 1.0 + 0.25 * uniform()).collect()
        } else {
            let fan_in = if t.shape.len() == 2 {
                t.shape[1]
            } else {
                config.hidden_size
            };
            let std = if t.name.contains("embed_tokens") || t.name.starts_with("lm_head") {
                2.0 / (config.hidden_size as f32).sqrt()
            } else if t.shape.len() == 1 {
                0.1
            } else {
                1.0 / (fan_in as f32).sqrt()
            };
            let amplitude = std * 3f32.sqrt();
            (0..t.numel()).map(|_| amplitude * uniform()).collect()
        };
        let bytes = match spec.dtype {
            SynthDtype::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            SynthDtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            SynthDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        Self {
            name: t.name,
            shape: t.shape,
            dtype: spec.dtype,
            bytes,
        }
    }
}

/// A per-tensor seed: FNV-1a of the name folded into the spec's seed.
fn stream_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl safetensors::View for &SynthTensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            SynthDtype::Bf16 => safetensors::Dtype::BF16,
            SynthDtype::F16 => safetensors::Dtype::F16,
            SynthDtype::F32 => safetensors::Dtype::F32,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests;

/// Name of the embedded demo model: a ~100M-parameter Llama-shaped model with random weights.
/// It produces gibberish by design; it exists so every command runs on a fresh machine.
pub const DEMO_MODEL_NAME: &str = "strata-demo-llama-100m-random";
const DEMO_SEED: u64 = 2026;

/// The demo checkpoint under `cache_root`, synthesized on first use (written to a temporary
/// directory, then renamed, so a half-written model is never picked up).
pub fn ensure_demo_model(cache_root: &Path) -> Result<PathBuf, SynthError> {
    let dir = cache_root.join("models").join(DEMO_MODEL_NAME);
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    let parent = cache_root.join("models");
    std::fs::create_dir_all(&parent).map_err(|source| SynthError::Io {
        path: parent.clone(),
        source,
    })?;
    let tmp = parent.join(format!(".{DEMO_MODEL_NAME}.{}", std::process::id()));
    synthesize(&SynthSpec::demo(Architecture::Llama, DEMO_SEED), &tmp, None)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process finished first: keep theirs.
        Err(_) if dir.join("config.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(source) => Err(SynthError::Io { path: dir, source }),
    }
}
