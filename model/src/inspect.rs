//! A checkpoint summary: architecture, size, dtypes, memory at each weight format, KV cost.

use std::fmt;
use std::path::Path;

use crate::config::ModelConfig;
use crate::cpu::LoadError;
use crate::weights::{Checkpoint, parameter_count};

/// Bytes per weight for the formats strata serves. NVFP4 stores 4-bit values plus one FP8 scale
/// per 16 values (4.5 bits); FP8 adds a per-channel scale, negligible at this precision.
pub const FORMATS: [(&str, f64); 3] = [("bf16", 2.0), ("fp8", 1.0), ("nvfp4", 0.5625)];

#[derive(Debug, Clone)]
pub struct Inspection {
    pub config: ModelConfig,
    pub parameters: usize,
    pub checkpoint_bytes: usize,
    /// Stored type, tensor count, bytes.
    pub dtypes: Vec<(String, usize, usize)>,
    /// Some tensors are stored in a block format (GGUF) and widened when loaded.
    pub widened: bool,
    /// Bytes of the weights as the CUDA backend holds them (block formats its kernels read kept
    /// as stored, the rest bf16).
    pub cuda_bytes: usize,
}

impl Inspection {
    /// Reads config.json and the safetensors headers, or a GGUF file's header (no tensor data),
    /// and validates the layout.
    pub fn of(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        ckpt.validate(&config)?;
        Ok(Self {
            parameters: parameter_count(&config),
            checkpoint_bytes: ckpt.data_bytes(),
            dtypes: ckpt.dtype_histogram(),
            widened: ckpt.widens(),
            cuda_bytes: ckpt.cuda_bytes(),
            config,
        })
    }
}

fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

fn human_count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(f, "architecture     {}", c.architecture)?;
        writeln!(
            f,
            "shape            {} layers, hidden {}, intermediate {}, heads {} (kv {}), head_dim {}",
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        )?;
        writeln!(f, "vocabulary       {}", c.vocab_size)?;
        writeln!(f, "context window   {}", c.max_position_embeddings)?;
        let scaling = match &c.rope_scaling {
            None => String::new(),
            Some(crate::config::RopeScaling::Factors(f)) => format!(
                ", {} per-frequency factors ({:.3} .. {:.3})",
                f.len(),
                f.iter().copied().fold(f64::INFINITY, f64::min),
                f.iter().copied().fold(0.0, f64::max)
            ),
            Some(s) => format!(", scaling {s:?}"),
        };
        writeln!(f, "rope             theta {}{scaling}", c.rope_theta)?;
        let mut features = Vec::new();
        if c.tie_word_embeddings {
            features.push("tied embeddings".to_string());
        }
        if c.qkv_bias {
            features.push("qkv bias".into());
        }
        if c.qk_norm {
            features.push("q/k norm".into());
        }
        if let Some(w) = c.sliding_window {
            features.push(format!("sliding window {w}"));
        }
        if !features.is_empty() {
            writeln!(f, "features         {}", features.join(", "))?;
        }
        writeln!(
            f,
            "parameters       {} ({})",
            human_count(self.parameters),
            self.parameters
        )?;
        if let Some(m) = &c.moe {
            let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
            let shared = m
                .shared_expert_intermediate
                .map_or(String::new(), |w| format!(", a shared expert {w} wide"));
            writeln!(
                f,
                "experts          {} per sparse layer ({sparse} of {} layers), {} per token, {} \
                 wide{shared}; {} parameters active per token",
                m.experts,
                c.num_layers,
                m.experts_per_token,
                m.expert_intermediate,
                human_count(crate::weights::active_parameter_count(c))
            )?;
        }
        let dtypes: Vec<String> = self
            .dtypes
            .iter()
            .map(|(d, n, bytes)| format!("{d} ×{n} ({})", human_bytes(*bytes as f64)))
            .collect();
        writeln!(
            f,
            "checkpoint       {} in {}",
            human_bytes(self.checkpoint_bytes as f64),
            dtypes.join(", ")
        )?;
        if self.widened {
            let (kept, widened): (Vec<&str>, Vec<&str>) = self
                .dtypes
                .iter()
                .map(|(name, _, _)| name.as_str())
                .filter(|name| !matches!(*name, "F32" | "F16" | "BF16"))
                .partition(|name| {
                    crate::gguf::CUDA_BLOCK_TYPES
                        .iter()
                        .any(|t| t.name() == *name)
                });
            let on_cuda = match (kept.is_empty(), widened.is_empty()) {
                (false, true) => format!("{} kept as stored", kept.join(", ")),
                (true, _) => format!("{} widened to bf16", widened.join(", ")),
                (false, false) => format!(
                    "{} kept as stored, {} widened to bf16",
                    kept.join(", "),
                    widened.join(", ")
                ),
            };
            writeln!(
                f,
                "runs as          f32 on the CPU ({}): block types widened at load; on CUDA \
                 ({}): {on_cuda} (matrices)",
                human_bytes(self.parameters as f64 * 4.0),
                human_bytes(self.cuda_bytes as f64),
            )?;
        }
        for (name, bytes) in FORMATS {
            writeln!(
                f,
                "weights @ {name:<6} {}",
                human_bytes(self.parameters as f64 * bytes)
            )?;
        }
        writeln!(
            f,
            "KV per token     {} @ bf16, {} @ fp8",
            human_bytes(c.kv_bytes_per_token(2.0)),
            human_bytes(c.kv_bytes_per_token(1.0))
        )
    }
}
