//! `strata eval perplexity`: a model's perplexity on a text, on any backend, computed as
//! llama.cpp's `llama-perplexity` computes it (see `strata_node::eval`); `strata eval compare`:
//! a candidate (a quantized copy, say) against a reference on the same positions — both
//! perplexities, KL divergence and top-1 agreement.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use strata_node::build_backend;
use strata_node::eval::{compare, greedy_agreement, perplexity};

use super::engine_args::EngineSettings;

#[derive(Subcommand)]
pub enum EvalCommand {
    /// Perplexity of a model on a text file: chunks of --context tokens, each scored on its
    /// second half (llama.cpp's method, so the numbers compare).
    Perplexity(PerplexityArgs),
    /// A candidate model against a reference on a text (the positions perplexity scores): both
    /// perplexities, mean and largest KL(reference ‖ candidate), and how often their most likely
    /// next tokens agree (teacher-forced); with --greedy, how far their own greedy continuations
    /// of the same prompts agree.
    Compare(CompareArgs),
}

#[derive(Args)]
pub struct CompareArgs {
    /// The reference checkpoint (an HF directory or a GGUF file).
    #[arg(long)]
    model: PathBuf,
    /// The candidate checkpoint (same tokenizer and vocabulary).
    #[arg(long)]
    candidate: PathBuf,
    /// Also let both models continue prompts greedily for this many tokens each and compare
    /// the continuations (the prompts: the first half of each scored chunk).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=4096))]
    greedy: Option<u16>,
    /// How many chunks' first halves prompt the greedy comparison.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    greedy_prompts: u16,
    #[command(flatten)]
    scoring: Scoring,
}

#[derive(Args)]
pub struct PerplexityArgs {
    /// Checkpoint: an HF directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    scoring: Scoring,
}

/// What both evaluations score, and on which engine.
#[derive(Args)]
struct Scoring {
    /// UTF-8 text to score.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Score only the text's first N chunks.
    #[arg(long)]
    max_chunks: Option<usize>,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineSettings,
}

impl Scoring {
    fn read_text(&self) -> Result<String> {
        std::fs::read_to_string(&self.text)
            .with_context(|| format!("reading {}", self.text.display()))
    }

    /// Writes `json` to `--json`, when given.
    fn write_json(&self, json: &serde_json::Value) -> Result<()> {
        if let Some(path) = &self.json {
            std::fs::write(path, serde_json::to_string_pretty(json)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Perplexity(args) => run_perplexity(args),
        EvalCommand::Compare(args) => run_compare(args),
    }
}

fn run_perplexity(args: PerplexityArgs) -> Result<()> {
    let scoring = &args.scoring;
    let text = scoring.read_text()?;
    let spec = scoring.engine.spec()?;
    let built = build_backend(&args.model, &spec)?;
    let (mut backend, parts) = (built.backend, built.parts);
    // As llama-perplexity: the text with the special tokens the model adds (its BOS), each
    // chunk then starting with BOS.
    let tokens = parts.tokenizer.encode(&text, true)?;
    let bos = parts.tokenizer.added_bos_id();
    let start = Instant::now();
    let result = perplexity(
        backend.as_mut(),
        &tokens,
        scoring.context,
        bos,
        scoring.max_chunks,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    for (i, p) in result.running.iter().enumerate() {
        eprintln!("[{}] {p:.4}", i + 1);
    }
    println!(
        "perplexity {:.4} over {} tokens ({} chunks of {}, second halves scored) in {seconds:.1} s",
        result.value(),
        result.scored,
        result.chunks,
        result.context
    );
    scoring.write_json(&serde_json::json!({
        "model": args.model.display().to_string(),
        "text": scoring.text.display().to_string(),
        "device": spec.device.to_string(),
        "text_tokens": tokens.len(),
        "context": result.context,
        "chunks": result.chunks,
        "scored_tokens": result.scored,
        "mean_nll": result.nll / result.scored as f64,
        "perplexity": result.value(),
        "seconds": seconds,
    }))
}

fn run_compare(args: CompareArgs) -> Result<()> {
    let scoring = &args.scoring;
    let text = scoring.read_text()?;
    let spec = scoring.engine.spec()?;
    let reference = build_backend(&args.model, &spec)?;
    let candidate = build_backend(&args.candidate, &spec)?;
    let (mut a, mut b) = (reference.backend, candidate.backend);
    let tokens = reference.parts.tokenizer.encode(&text, true)?;
    let theirs = candidate.parts.tokenizer.encode(&text, true)?;
    anyhow::ensure!(
        tokens == theirs,
        "the two models tokenize the text differently: compare needs one tokenizer"
    );
    anyhow::ensure!(
        a.model_config().vocab_size == b.model_config().vocab_size,
        "the two models' vocabularies differ ({} and {})",
        a.model_config().vocab_size,
        b.model_config().vocab_size
    );
    let bos = reference.parts.tokenizer.added_bos_id();
    let start = Instant::now();
    let result = compare(
        a.as_mut(),
        b.as_mut(),
        &tokens,
        scoring.context,
        bos,
        scoring.max_chunks,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    let (p, q) = result.perplexities();
    println!(
        "reference perplexity {p:.4}, candidate {q:.4} ({:+.2} %); KL mean {:.5} nats, max {:.4}; \
         top-1 agreement {:.2} % over {} positions in {seconds:.1} s",
        (q / p - 1.0) * 100.0,
        result.mean_kl(),
        result.kl_max,
        result.top1_agreement() * 100.0,
        result.scored
    );
    let greedy = match args.greedy {
        Some(length) => {
            // The prompts are the chunks' first halves, as each chunk is scored (BOS first).
            let context = scoring.context;
            let prompts: Vec<Vec<u32>> = (0..result.chunks.min(usize::from(args.greedy_prompts)))
                .map(|c| {
                    let mut t = tokens[c * context..c * context + context / 2].to_vec();
                    if let Some(bos) = bos {
                        t[0] = bos;
                    }
                    t
                })
                .collect();
            let g = greedy_agreement(a.as_mut(), b.as_mut(), &prompts, usize::from(length))?;
            println!(
                "greedy {length} tokens from {} prompts: {} identical, mean shared prefix {:.1}, \
                 {:.2} % of positions equal; reference margins at divergences {:?}",
                prompts.len(),
                g.identical(),
                g.mean_shared_prefix(),
                g.positional() * 100.0,
                g.divergence_margins
            );
            serde_json::json!({
                "tokens": length,
                "prompts": prompts.len(),
                "prompt_tokens": context / 2,
                "identical": g.identical(),
                "shared_prefix": g.shared_prefix,
                "mean_shared_prefix": g.mean_shared_prefix(),
                "positional_agreement": g.positional(),
                "divergence_margins": g.divergence_margins,
            })
        }
        None => serde_json::Value::Null,
    };
    scoring.write_json(&serde_json::json!({
        "reference": args.model.display().to_string(),
        "candidate": args.candidate.display().to_string(),
        "text": scoring.text.display().to_string(),
        "device": spec.device.to_string(),
        "context": result.context,
        "chunks": result.chunks,
        "scored_tokens": result.scored,
        "reference_perplexity": p,
        "candidate_perplexity": q,
        "mean_kl": result.mean_kl(),
        "max_kl": result.kl_max,
        "top1_agreement": result.top1_agreement(),
        "greedy": greedy,
        "seconds": seconds,
    }))
}
