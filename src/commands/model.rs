//! `strata model synth|inspect`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use serde::Deserialize;
use strata_model::config::Architecture;
use strata_model::inspect::Inspection;
use strata_model::synth::{SynthDtype, SynthLlama3Scaling, SynthMoe, SynthSpec, synthesize};

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Write a complete HF-style checkpoint directory with deterministic random weights.
    Synth(Box<SynthArgs>),
    /// Summarise a checkpoint directory: architecture, parameters, dtypes, memory, KV cost.
    Inspect {
        /// Checkpoint directory (config.json + safetensors).
        dir: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ArchArg {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    #[value(name = "qwen2_moe")]
    Qwen2Moe,
    #[value(name = "qwen3_moe")]
    Qwen3Moe,
    Mixtral,
}

impl From<ArchArg> for Architecture {
    fn from(a: ArchArg) -> Self {
        match a {
            ArchArg::Llama => Architecture::Llama,
            ArchArg::Qwen2 => Architecture::Qwen2,
            ArchArg::Qwen3 => Architecture::Qwen3,
            ArchArg::Mistral => Architecture::Mistral,
            ArchArg::Qwen2Moe => Architecture::Qwen2Moe,
            ArchArg::Qwen3Moe => Architecture::Qwen3Moe,
            ArchArg::Mixtral => Architecture::Mixtral,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    Bf16,
    F16,
    F32,
}

#[derive(Args)]
pub struct SynthArgs {
    /// Architecture family (required unless --cases is given).
    #[arg(long, value_enum, required_unless_present = "cases")]
    arch: Option<ArchArg>,
    /// Output directory (with --cases: the parent of one directory per case).
    #[arg(long)]
    out: PathBuf,
    /// Use this tokenizer.json (and the tokenizer_config.json beside it); the vocabulary is sized to it.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    layers: usize,
    #[arg(long, default_value_t = 768)]
    hidden: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, default_value_t = 2048)]
    intermediate: usize,
    /// Per-head dimension (default hidden / heads).
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long, default_value_t = 4096)]
    max_position: usize,
    #[arg(long, default_value_t = 10_000.0)]
    rope_theta: f64,
    /// Llama 3 rope scaling as FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_MAX_POSITION.
    #[arg(long, value_parser = parse_llama3_scaling)]
    rope_scaling_llama3: Option<SynthLlama3Scaling>,
    #[arg(long)]
    tie_embeddings: bool,
    /// Attention window (mistral only).
    #[arg(long)]
    sliding_window: Option<usize>,
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Experts of a MoE family (qwen2_moe, qwen3_moe, mixtral) [default: 8 for those].
    #[arg(long)]
    experts: Option<usize>,
    /// Experts each token uses.
    #[arg(long, default_value_t = 2)]
    experts_per_token: usize,
    /// Each expert's width (Qwen's moe_intermediate_size) [default: --intermediate].
    #[arg(long)]
    expert_intermediate: Option<usize>,
    /// Qwen2-MoE's shared expert width [default: --intermediate].
    #[arg(long)]
    shared_expert_intermediate: Option<usize>,
    /// Qwen's norm_topk_prob: divide the chosen experts' probabilities by their sum.
    #[arg(long)]
    norm_topk_prob: bool,
    /// Qwen's mlp_only_layers: layers whose MLP stays dense, comma separated.
    #[arg(long, value_delimiter = ',')]
    mlp_only_layers: Vec<usize>,
    /// Synthesize every case of an oracle case file (tests/oracle/cases.json) into OUT/<name>.
    #[arg(long, conflicts_with = "arch")]
    cases: Option<PathBuf>,
}

fn parse_llama3_scaling(s: &str) -> Result<SynthLlama3Scaling, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [factor, low, high, original] = parts.as_slice() else {
        return Err(
            "expected FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_MAX_POSITION".into(),
        );
    };
    let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{v:?}: {e}"));
    Ok(SynthLlama3Scaling {
        factor: num(factor)?,
        low_freq_factor: num(low)?,
        high_freq_factor: num(high)?,
        original_max_position_embeddings: original
            .parse()
            .map_err(|e| format!("{original:?}: {e}"))?,
    })
}

pub fn run(cmd: ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Synth(args) => synth(*args),
        ModelCommand::Inspect { dir } => {
            let inspection = Inspection::of(&dir)?;
            print!("{inspection}");
            Ok(())
        }
    }
}

#[derive(Deserialize)]
struct CaseFile {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    spec: SynthSpec,
}

fn synth(args: SynthArgs) -> Result<()> {
    if let Some(cases) = &args.cases {
        return synth_cases(cases, &args.out);
    }
    let Some(arch) = args.arch else {
        bail!("--arch is required")
    };
    let spec = SynthSpec {
        arch: Architecture::from(arch).model_type().to_string(),
        layers: args.layers,
        hidden: args.hidden,
        heads: args.heads,
        kv_heads: args.kv_heads,
        intermediate: args.intermediate,
        head_dim: args.head_dim,
        max_position: args.max_position,
        rope_theta: args.rope_theta,
        rope_scaling: args.rope_scaling_llama3,
        tie_embeddings: args.tie_embeddings,
        sliding_window: args.sliding_window,
        dtype: match args.dtype {
            DtypeArg::Bf16 => SynthDtype::Bf16,
            DtypeArg::F16 => SynthDtype::F16,
            DtypeArg::F32 => SynthDtype::F32,
        },
        seed: args.seed,
        moe: Architecture::from(arch).is_moe().then(|| SynthMoe {
            experts: args.experts.unwrap_or(8),
            experts_per_token: args.experts_per_token,
            expert_intermediate: args.expert_intermediate,
            shared_expert_intermediate: args.shared_expert_intermediate,
            norm_topk_prob: args.norm_topk_prob,
            mlp_only_layers: args.mlp_only_layers.clone(),
            decoder_sparse_step: None,
        }),
    };
    synthesize(&spec, &args.out, args.tokenizer.as_deref())?;
    print!("{}", Inspection::of(&args.out)?);
    println!("written to {}", args.out.display());
    Ok(())
}

fn synth_cases(file: &Path, out: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let cases: CaseFile = serde_json::from_str(&text)
        .with_context(|| format!("{}: malformed case file", file.display()))?;
    for case in cases.cases {
        let dir = out.join(&case.name);
        synthesize(&case.spec, &dir, None).with_context(|| format!("case {}", case.name))?;
        println!("{}", dir.display());
    }
    Ok(())
}
