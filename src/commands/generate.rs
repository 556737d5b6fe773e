//! `strata generate`: one prompt through the CPU reference, streamed to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use strata_model::chat::{ChatRequest, ChatTemplate};
use strata_model::cpu::CpuModel;
use strata_model::generate::generate;
use strata_model::synth::ensure_demo_model;
use strata_model::tokenizer::Tokenizer;
use strata_model::{GenerationConfig, ModelConfig};
use strata_protocol::SamplingParams;

#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (HF layout). Default: the embedded demo model, synthesized on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    prompt: String,
    /// Render the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// 0 = greedy. Default: the checkpoint's generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<u32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Where the demo model is kept (default: $XDG_CACHE_HOME/strata or ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("strata")
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let cache = args.cache_dir.clone().unwrap_or_else(default_cache_dir);
            let dir = ensure_demo_model(&cache).context("preparing the demo model")?;
            eprintln!("model: {} (demo model, random weights)", dir.display());
            dir
        }
    };
    let model = CpuModel::load(&dir)?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let generation_config = GenerationConfig::from_dir(&dir)?;
    let prompt = encode_prompt(&args, &dir, &tokenizer)?;
    let params = sampling_params(&args, &generation_config);
    let eos = eos_ids(model.config(), &generation_config, &tokenizer);

    let mut stdout = std::io::stdout().lock();
    let result = generate(&model, &tokenizer, &prompt, &params, &eos, |text| {
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    })?;
    writeln!(stdout)?;
    eprintln!(
        "{} prompt tokens in {:.2} s ({:.1} tok/s); {} generated, decode {:.1} tok/s; finish: {:?}",
        result.prompt_tokens,
        result.prefill_time.as_secs_f64(),
        result.prompt_tokens as f64 / result.prefill_time.as_secs_f64().max(1e-9),
        result.tokens.len(),
        result.decode_tokens_per_second(),
        result.finish,
    );
    Ok(())
}

fn encode_prompt(args: &GenerateArgs, dir: &Path, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    if !args.chat {
        return Ok(tokenizer.encode(&args.prompt, true)?);
    }
    let template = ChatTemplate::from_dir(dir)?
        .with_context(|| format!("{}: the checkpoint has no chat template", dir.display()))?;
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.push(serde_json::json!({"role": "user", "content": args.prompt}));
    let request = ChatRequest {
        messages,
        tools: None,
        add_generation_prompt: true,
        extra: Default::default(),
    };
    let text = template.render(&request)?;
    Ok(tokenizer.encode(&text, false)?)
}

/// Flags first, then the checkpoint's generation_config.json, then greedy.
fn sampling_params(args: &GenerateArgs, g: &GenerationConfig) -> SamplingParams {
    let sampled_by_default = g.do_sample.unwrap_or(false);
    let default_temperature = if sampled_by_default {
        g.temperature.unwrap_or(1.0)
    } else {
        0.0
    };
    SamplingParams {
        temperature: args.temperature.unwrap_or(default_temperature),
        top_p: args.top_p.or(g.top_p).unwrap_or(1.0),
        top_k: args.top_k.or(g.top_k).unwrap_or(0),
        min_p: args.min_p.or(g.min_p).unwrap_or(0.0),
        repetition_penalty: args
            .repetition_penalty
            .or(g.repetition_penalty)
            .unwrap_or(1.0),
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ..SamplingParams::default()
    }
}

/// Every id that ends a sequence: config.json, generation_config.json and the tokenizer's eos.
fn eos_ids(config: &ModelConfig, g: &GenerationConfig, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = config
        .eos_token_ids
        .iter()
        .chain(&g.eos_token_ids)
        .copied()
        .collect();
    ids.extend(tokenizer.eos_token_id());
    ids.sort_unstable();
    ids.dedup();
    ids
}
