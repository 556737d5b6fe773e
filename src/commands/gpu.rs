//! `strata gpu`: the checks and benchmarks of the CUDA backend that the device battery runs
//! (scripts/device/battery.sh). Each prints a short report and, with `--json FILE`, writes its
//! numbers for the receipt.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use strata_model::ModelConfig;
use strata_model::weights::parameter_count;
use strata_node::Engine;
use strata_node::backend::{Backend, CudaBackend, CudaOptions, StepSeq, WeightSource};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};
use strata_router::{Device, start_engine_on};

#[derive(Subcommand)]
pub enum GpuCommand {
    /// Greedy tokens on the GPU against the CPU reference, on a checkpoint.
    Parity(ParityArgs),
    /// A sequence's greedy tokens alone and inside a batch of staggered arrivals.
    Invariance(InvarianceArgs),
    /// Decode tokens/s of a config.json shape with synthetic weights, at several batch sizes.
    Decode(DecodeArgs),
    /// Prefill tokens/s of a config.json shape with synthetic weights, for several prompt lengths.
    Prefill(PrefillArgs),
}

#[derive(Args)]
pub struct ParityArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// The CPU side reads this checkpoint instead (the canary: a changed config must fail).
    #[arg(long)]
    reference_model: Option<PathBuf>,
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    #[arg(long, default_value_t = 32)]
    tokens: u32,
    /// A flip is a near tie when the reference's top-2 log-probability margin is below this.
    #[arg(long, default_value_t = 0.1)]
    near_tie: f32,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct InvarianceArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "cuda:0")]
    device: Device,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    #[arg(long, default_value_t = 24)]
    tokens: u32,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct DecodeArgs {
    /// A HF config.json (the architecture; weights are synthesized on the GPU).
    #[arg(long)]
    config: PathBuf,
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Batch sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batch: Vec<usize>,
    /// Tokens already in each sequence's cache when decoding starts.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Timed decode steps per batch size (after 8 warm-up steps).
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Measured HBM bandwidth (bytes/s) for the roofline.
    #[arg(long, default_value_t = 4.22e12)]
    bandwidth: f64,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct PrefillArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Prompt lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    prompt: Vec<usize>,
    /// Timed runs per length (after 2 warm-ups).
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Dense bf16 peak (FLOP/s) for the ratio.
    #[arg(long, default_value_t = 790e12)]
    peak: f64,
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(command: GpuCommand) -> Result<()> {
    match command {
        GpuCommand::Parity(args) => parity(args),
        GpuCommand::Invariance(args) => invariance(args),
        GpuCommand::Decode(args) => decode(args),
        GpuCommand::Prefill(args) => prefill(args),
    }
}

fn write_json(path: Option<&Path>, value: &Value) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Deterministic prompts of varied length over the lower vocabulary.
fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    let len = 5 + (i * 7) % 40;
    let span = vocab.clamp(2, 4096) as u64;
    (0..len)
        .map(|j| ((i as u64 * 2654435761 + j as u64 * 40503 + 17) % span) as u32)
        .collect()
}

/// Greedy tokens, and each step's top-2 log-probability margin.
fn generate(engine: &Engine, prompt: Vec<u32>, tokens: u32) -> Result<(Vec<u32>, Vec<f32>)> {
    let mut stream = engine.submit(GenerateRequest {
        prompt,
        sampling: SamplingParams {
            max_tokens: tokens,
            ignore_eos: true,
            logprobs: Some(2),
            ..SamplingParams::greedy()
        },
        cache_salt: 0,
        deadline: None,
        constraint: None,
    })?;
    let (mut ids, mut margins) = (Vec::new(), Vec::new());
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, logprobs, .. } => {
                ids.push(id);
                let top = logprobs.map(|l| l.top).unwrap_or_default();
                margins.push(match top.as_slice() {
                    [a, b, ..] => a.1 - b.1,
                    _ => f32::INFINITY,
                });
            }
            TokenEvent::Finished { .. } => break,
            TokenEvent::Failed { message } => bail!("generation failed: {message}"),
        }
    }
    Ok((ids, margins))
}

fn parity(args: ParityArgs) -> Result<()> {
    let reference_dir = args.reference_model.as_deref().unwrap_or(&args.model);
    let (cpu, _) = start_engine_on(reference_dir, Device::Cpu, 1, 16, 64 << 20)?;
    let (gpu, _) = start_engine_on(&args.model, args.device, 1, 16, 256 << 20)?;
    let vocab = cpu.model_config().vocab_size;
    let (mut exact, mut near_ties, mut failures) = (0usize, Vec::new(), Vec::new());
    let mut compared = 0usize;
    for i in 0..args.prompts {
        let p = prompt(i, vocab);
        let (want, margins) = generate(&cpu, p.clone(), args.tokens)?;
        let (got, _) = generate(&gpu, p, args.tokens)?;
        match want.iter().zip(&got).position(|(a, b)| a != b) {
            None => {
                exact += 1;
                compared += want.len();
            }
            Some(step) => {
                compared += step + 1;
                let margin = margins[step];
                let flip = json!({"prompt": i, "step": step, "reference_margin": margin,
                                  "reference": want[step], "gpu": got[step]});
                if margin < args.near_tie {
                    near_ties.push(flip);
                } else {
                    failures.push(flip);
                }
            }
        }
    }
    let passed = failures.is_empty();
    println!(
        "parity {}: {} prompts, {exact} identical, {} near-tie flips, {} flips beyond a margin \
         of {} ({compared} tokens compared) — {}",
        args.model.display(),
        args.prompts,
        near_ties.len(),
        failures.len(),
        args.near_tie,
        if passed { "PASS" } else { "FAIL" }
    );
    for f in &failures {
        println!("  flip: {f}");
    }
    write_json(
        args.json.as_deref(),
        &json!({"model": args.model, "reference": reference_dir, "prompts": args.prompts,
                "tokens": args.tokens, "identical": exact, "tokens_compared": compared,
                "near_tie_threshold": args.near_tie, "near_ties": near_ties,
                "failures": failures, "passed": passed}),
    )?;
    ensure!(
        passed,
        "GPU tokens differ from the reference beyond near ties"
    );
    Ok(())
}

fn invariance(args: InvarianceArgs) -> Result<()> {
    let (engine, _) = start_engine_on(&args.model, args.device, 1, 16, 512 << 20)?;
    let vocab = engine.model_config().vocab_size;
    let alone: Vec<Vec<u32>> = (0..args.batch)
        .map(|i| generate(&engine, prompt(i, vocab), args.tokens).map(|(ids, _)| ids))
        .collect::<Result<_>>()?;
    // The same requests together, arriving a few steps apart.
    let mut streams = Vec::new();
    for i in 0..args.batch {
        streams.push(engine.submit(GenerateRequest {
            prompt: prompt(i, vocab),
            sampling: SamplingParams {
                max_tokens: args.tokens,
                ignore_eos: true,
                ..SamplingParams::greedy()
            },
            cache_salt: 1 + i as u64, // no prefix-cache hits from the solo runs
            deadline: None,
            constraint: None,
        })?);
        std::thread::sleep(Duration::from_millis(3));
    }
    let mut differing = Vec::new();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let mut ids = Vec::new();
        while let Some(event) = stream.events.blocking_recv() {
            match event {
                TokenEvent::Token { id, .. } => ids.push(id),
                TokenEvent::Finished { .. } => break,
                TokenEvent::Failed { message } => bail!("generation failed: {message}"),
            }
        }
        if ids != alone[i] {
            differing.push(i);
        }
    }
    let passed = differing.is_empty();
    println!(
        "batch invariance {}: {} sequences alone vs together (staggered), {} differ — {}",
        args.model.display(),
        args.batch,
        differing.len(),
        if passed { "PASS" } else { "FAIL" }
    );
    write_json(
        args.json.as_deref(),
        &json!({"model": args.model, "batch": args.batch, "tokens": args.tokens,
                "differing": differing, "passed": passed}),
    )?;
    ensure!(passed, "sequences {differing:?} changed when batched");
    Ok(())
}

fn read_config(path: &Path) -> Result<ModelConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    ModelConfig::from_json(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn synthetic_backend(
    config: &ModelConfig,
    device: usize,
    positions: usize,
    kv_tokens: usize,
) -> Result<CudaBackend> {
    let block_size = 16;
    let kv_bytes =
        kv_tokens.div_ceil(block_size) * block_size * config.num_layers * 2 * config.kv_dim() * 2;
    let options = CudaOptions {
        device,
        block_size,
        kv_cache_bytes: kv_bytes,
        kernel_cache: None,
        max_positions: Some(positions),
    };
    Ok(CudaBackend::new(
        config,
        WeightSource::Synthetic { seed: 7 },
        &options,
    )?)
}

fn median(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[0], xs[xs.len() / 2], xs[xs.len() - 1])
}

fn decode(args: DecodeArgs) -> Result<()> {
    let config = read_config(&args.config)?;
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let positions = args.context + args.steps + 16;
    let blocks_per_seq = positions.div_ceil(16);
    let mut backend = synthetic_backend(&config, args.device, positions, max_batch * positions)?;
    let weight_bytes = parameter_count(&config) as f64 * 2.0;
    let vocab = config.vocab_size;
    let mut results = Vec::new();
    println!(
        "decode {} on {}: {:.2} GB of weights, context {}",
        args.config.display(),
        backend.device_name(),
        weight_bytes / 1e9,
        args.context
    );
    for &batch in &args.batch {
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|b| ((b * blocks_per_seq) as u32..((b + 1) * blocks_per_seq) as u32).collect())
            .collect();
        // Fill each sequence's cache with a prompt of `context` tokens, in chunks.
        let prompt: Vec<u32> = (0..args.context as u32)
            .map(|i| (i * 31 + 7) % vocab as u32)
            .collect();
        for table in &tables {
            for (c, chunk) in prompt.chunks(512).enumerate() {
                backend.step(&[StepSeq {
                    tokens: chunk,
                    first_position: c * 512,
                    prompt_len: args.context,
                    block_table: table,
                    want_logits: false,
                }])?;
            }
        }
        let token = [11u32];
        let mut times = Vec::new();
        for s in 0..args.steps + 8 {
            let seqs: Vec<StepSeq<'_>> = tables
                .iter()
                .map(|table| StepSeq {
                    tokens: &token,
                    first_position: args.context + s,
                    prompt_len: args.context,
                    block_table: table,
                    want_logits: true,
                })
                .collect();
            let start = Instant::now();
            backend.step(&seqs)?;
            if s >= 8 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        let (min, med, max) = median(times);
        let kv_bytes =
            (batch * (args.context + args.steps / 2) * config.num_layers * 2 * config.kv_dim() * 2)
                as f64;
        let ideal = (weight_bytes + kv_bytes) / args.bandwidth;
        let tps = batch as f64 / med;
        println!(
            "  batch {batch:>3}: step {:.3} ms (min {:.3}, max {:.3}), {tps:.0} tok/s, \
             roofline {:.3} ms → {:.1} %",
            med * 1e3,
            min * 1e3,
            max * 1e3,
            ideal * 1e3,
            100.0 * ideal / med
        );
        results.push(
            json!({"batch": batch, "step_ms": {"min": min * 1e3, "median": med * 1e3,
            "max": max * 1e3}, "tokens_per_s": tps, "roofline_ms": ideal * 1e3,
            "roofline_fraction": ideal / med, "runs": args.steps}),
        );
    }
    write_json(
        args.json.as_deref(),
        &json!({"config": args.config, "device": backend.device_name(),
                "weight_bytes": weight_bytes, "context": args.context,
                "bandwidth_bytes_per_s": args.bandwidth, "includes": "host copy of f32 logits each step",
                "results": results}),
    )
}

fn prefill(args: PrefillArgs) -> Result<()> {
    let config = read_config(&args.config)?;
    let longest = args.prompt.iter().copied().max().unwrap_or(1);
    let mut backend = synthetic_backend(&config, args.device, longest + 16, longest + 16)?;
    let params = parameter_count(&config) as f64;
    let vocab = config.vocab_size as u32;
    let table: Vec<u32> = (0..(longest + 16).div_ceil(16) as u32).collect();
    let mut results = Vec::new();
    println!(
        "prefill {} on {}",
        args.config.display(),
        backend.device_name()
    );
    for &n in &args.prompt {
        let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % vocab).collect();
        let mut times = Vec::new();
        for r in 0..args.runs + 2 {
            let start = Instant::now();
            backend.step(&[StepSeq {
                tokens: &prompt,
                first_position: 0,
                prompt_len: n,
                block_table: &table,
                want_logits: true,
            }])?;
            if r >= 2 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        let (min, med, max) = median(times);
        // Linear layers (2 FLOPs per weight per token, embeddings excluded) plus causal attention
        // (QKᵀ and PV: 2 × 2 × n²/2 × q_dim per layer).
        let linear = 2.0 * (params - (config.vocab_size * config.hidden_size) as f64) * n as f64;
        let attention = 2.0 * (n * n) as f64 * config.q_dim() as f64 * config.num_layers as f64;
        let flops = linear + attention;
        let tps = n as f64 / med;
        println!(
            "  prompt {n:>5}: {:.2} ms (min {:.2}, max {:.2}), {tps:.0} tok/s, {:.1} TFLOP/s \
             = {:.1} % of peak",
            med * 1e3,
            min * 1e3,
            max * 1e3,
            flops / med / 1e12,
            100.0 * flops / med / args.peak
        );
        results.push(
            json!({"prompt": n, "ms": {"min": min * 1e3, "median": med * 1e3,
            "max": max * 1e3}, "tokens_per_s": tps, "tflops": flops / med / 1e12,
            "peak_fraction": flops / med / args.peak, "runs": args.runs}),
        );
    }
    write_json(
        args.json.as_deref(),
        &json!({"config": args.config, "device": backend.device_name(),
                "peak_flops": args.peak, "results": results}),
    )
}
