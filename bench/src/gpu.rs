//! `strata gpu`: the checks and benchmarks of the CUDA backend that the device battery runs
//! (scripts/device/battery.sh). Each prints a short report and, with `--json FILE`, writes its
//! numbers for the receipt.

mod nccl;
mod sampling;
mod tp;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use strata_model::ModelConfig;
use strata_model::weights::{active_parameter_count, expected_read_parameters, parameter_count};
use strata_node::Engine;
use strata_node::backend::{
    Backend, CudaBackend, CudaOptions, RowSampling, StepOutput, StepSeq, WeightSource,
};
use strata_node::{CudaPlacement, Device, EngineSpec, KvBudget, start_cuda_engine, start_engine};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

#[derive(Subcommand)]
pub enum GpuCommand {
    /// Greedy tokens on the GPU against the CPU reference, on a checkpoint.
    Parity(ParityArgs),
    /// A sequence's greedy tokens alone and inside a batch of staggered arrivals.
    Invariance(InvarianceArgs),
    /// Decode tokens/s of a config.json shape with synthetic weights, or of a checkpoint, at
    /// several batch sizes.
    Decode(DecodeArgs),
    /// Prefill tokens/s of a config.json shape with synthetic weights, for several prompt lengths.
    Prefill(PrefillArgs),
    /// NCCL collectives against the host reference bit for bit, then all-reduce latency.
    Nccl(nccl::NcclArgs),
    /// Tensor-parallel ranks (sharded weights) against one GPU in the shard order, bit for bit.
    Tp(tp::TpArgs),
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
    /// Run the GPU engine as the one rank of an NCCL group (its o and down outputs all-reduced
    /// through NCCL), and also require its tokens to equal the GPU engine without the group.
    #[arg(long)]
    nccl: bool,
    /// The GPU side widens GGUF block weights to bf16 at load (the CPU side is unchanged).
    #[arg(long)]
    widen_gguf: bool,
    /// Both sides keep an FP8 / NVFP4 checkpoint's weights quantized: the GPU in strata's
    /// device blocks (NVFP4 in tiles), the CPU computing the same arithmetic.
    #[arg(long)]
    keep_quantized: bool,
    /// With --keep-quantized: FP8 in tiles too, on both sides.
    #[arg(long, requires = "keep_quantized")]
    fp8_tiles: bool,
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
    /// Every row through the run-order kernels: the staggered arrivals put prompt rows and
    /// decode rows in one GEMM.
    #[arg(long)]
    run_order: bool,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct DecodeArgs {
    /// A HF config.json (the architecture; weights are synthesized on the GPU).
    #[arg(long, required_unless_present = "model", conflicts_with = "model")]
    config: Option<PathBuf>,
    /// A checkpoint (HF directory or GGUF file) instead: its weights as the backend holds them
    /// (GGUF block formats stay quantized unless --widen-gguf).
    #[arg(long)]
    model: Option<PathBuf>,
    /// With --model: widen GGUF block weights to bf16 at load (the comparison arm; the engine's
    /// spelling, `--widen-blocks` still read).
    #[arg(long = "widen-gguf", alias = "widen-blocks")]
    widen_blocks: bool,
    /// With --model: keep an FP8 / NVFP4 checkpoint's weights quantized on the device (widened
    /// to bf16 without it): in fragment-ordered tiles where they hold the layout, unless
    /// --quant-blocks.
    #[arg(long)]
    keep_quantized: bool,
    /// With --keep-quantized: NVFP4 and FP8 in 64-weight blocks (the widened model's bits)
    /// instead of tiles (the comparison arm; `--nvfp4-blocks` the earlier spelling).
    #[arg(long, alias = "nvfp4-blocks", requires = "keep_quantized")]
    quant_blocks: bool,
    /// With --keep-quantized: FP8 (a scale per tensor or per channel) in tiles too.
    #[arg(long, requires = "keep_quantized", conflicts_with = "quant_blocks")]
    fp8_tiles: bool,
    #[arg(long, default_value = "cuda:0", value_parser = crate::cuda_ordinal)]
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
    /// HBM bandwidth (bytes/s) for the roofline [default: measured on this GPU: a device-to-
    /// device copy of 1 GiB, bytes read plus written per second].
    #[arg(long)]
    bandwidth: Option<f64>,
    /// Batch sizes at which graph replay is checked bit for bit against eager launches before
    /// timing (odd sizes exercise the padding rows); the flag with no value skips the check.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1,3,8,33")]
    check_graphs: Vec<usize>,
    /// Also time every batch with graphs off, and print one profiled step per batch by kernel
    /// family.
    #[arg(long)]
    profile: bool,
    /// Compute o and down in the shard order of tensor parallelism (eight K-slice partials).
    #[arg(long)]
    sharded: bool,
    /// Decode rows' projections through the pinned cuBLASLt GEMM prompt rows use, instead of the
    /// tensor-core GEMV (an experiment: batch-invariant too, different bits).
    #[arg(long)]
    decode_gemm: bool,
    /// Every row through the run-order kernels (decode and prompt rows one weight read; other
    /// bits than the default, batch-invariant too).
    #[arg(long, conflicts_with_all = ["decode_gemm", "sharded"])]
    run_order: bool,
    /// A mixture of experts through the grouped launches (routing a warp a token, each chosen
    /// expert's rows read once a step: the same bits, an experiment until the self-test passes).
    #[arg(long)]
    moe_grouped: bool,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct PrefillArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long, default_value = "cuda:0", value_parser = crate::cuda_ordinal)]
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
    /// A mixture of experts through the grouped launches (see `strata gpu decode`).
    #[arg(long)]
    moe_grouped: bool,
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(command: GpuCommand) -> Result<()> {
    match command {
        GpuCommand::Parity(args) => parity(args),
        GpuCommand::Invariance(args) => invariance(args),
        GpuCommand::Decode(args) => decode(args),
        GpuCommand::Prefill(args) => prefill(args),
        GpuCommand::Nccl(args) => nccl::run(args),
        GpuCommand::Tp(args) => tp::run(args),
    }
}

pub(super) fn write_json(path: Option<&Path>, value: &Value) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Deterministic prompts of varied length over the lower vocabulary.
pub(super) fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    let len = 5 + (i * 7) % 40;
    let span = vocab.clamp(2, 4096) as u64;
    (0..len)
        .map(|j| ((i as u64 * 2654435761 + j as u64 * 40503 + 17) % span) as u32)
        .collect()
}

/// Greedy tokens, and each step's top-2 log-probability margin.
fn generate(engine: &Engine, prompt: Vec<u32>, tokens: u32) -> Result<(Vec<u32>, Vec<f32>)> {
    let mut stream = engine.submit(GenerateRequest {
        resume: None,
        embed: None,
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
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                bail!("generation failed: {message}")
            }
            TokenEvent::Embedding { .. } => {
                bail!("the engine answered a generation with an embedding")
            }
        }
    }
    Ok((ids, margins))
}

fn parity(args: ParityArgs) -> Result<()> {
    let reference_dir = args.reference_model.as_deref().unwrap_or(&args.model);
    // The CPU side computes what the kept weights compute (NVFP4: the tiles' arithmetic).
    let cpu_spec = EngineSpec {
        keep_quantized: args.keep_quantized,
        fp8_tiles: args.fp8_tiles,
        ..fixed_kv(Device::Cpu, 64 << 20)
    };
    let (cpu, _) = start_engine(reference_dir, &cpu_spec)?;
    let gpu_spec = |device| EngineSpec {
        widen_gguf: args.widen_gguf,
        keep_quantized: args.keep_quantized,
        fp8_tiles: args.fp8_tiles,
        ..fixed_kv(device, 256 << 20)
    };
    let gpu = match (args.nccl, args.device) {
        (false, device) => start_engine(&args.model, &gpu_spec(device))?.0,
        (true, Device::Cuda(ordinal)) => {
            let placement = CudaPlacement {
                through_nccl: true,
                ..CudaPlacement::single(ordinal)
            };
            start_cuda_engine(&args.model, &placement, &gpu_spec(Device::Cuda(0)))?.0
        }
        (true, Device::Cpu) => bail!("--nccl needs a CUDA device"),
    };
    // With --nccl, the same GPU without the group: the communicator must change no bit.
    let direct = if args.nccl {
        Some(start_engine(&args.model, &gpu_spec(args.device))?.0)
    } else {
        None
    };
    let vocab = cpu.model_config().vocab_size;
    let (mut exact, mut near_ties, mut failures) = (0usize, Vec::new(), Vec::new());
    let (mut compared, mut direct_differs) = (0usize, Vec::new());
    for i in 0..args.prompts {
        let p = prompt(i, vocab);
        let (want, margins) = generate(&cpu, p.clone(), args.tokens)?;
        let (got, _) = generate(&gpu, p.clone(), args.tokens)?;
        if let Some(direct) = &direct
            && generate(direct, p, args.tokens)?.0 != got
        {
            direct_differs.push(i);
        }
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
    let passed = failures.is_empty() && direct_differs.is_empty();
    println!(
        "parity {}{}: {} prompts, {exact} identical, {} near-tie flips, {} flips beyond a margin \
         of {} ({compared} tokens compared) — {}",
        args.model.display(),
        if args.nccl {
            format!(
                " through a 1-rank NCCL group ({} of {} streams differ from the direct GPU run)",
                direct_differs.len(),
                args.prompts
            )
        } else {
            String::new()
        },
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
        &json!({"model": args.model, "reference": reference_dir, "widen_gguf": args.widen_gguf,
                "prompts": args.prompts,
                "tokens": args.tokens, "identical": exact, "tokens_compared": compared,
                "near_tie_threshold": args.near_tie, "near_ties": near_ties,
                "failures": failures, "nccl": args.nccl,
                "streams_differing_from_direct_gpu": direct_differs, "passed": passed}),
    )?;
    ensure!(
        failures.is_empty(),
        "GPU tokens differ from the reference beyond near ties"
    );
    ensure!(
        direct_differs.is_empty(),
        "the NCCL group changed the GPU's tokens (prompts {direct_differs:?})"
    );
    Ok(())
}

fn invariance(args: InvarianceArgs) -> Result<()> {
    let spec = EngineSpec {
        run_order: args.run_order,
        ..fixed_kv(args.device, 512 << 20)
    };
    let (engine, _) = start_engine(&args.model, &spec)?;
    let vocab = engine.model_config().vocab_size;
    let alone: Vec<Vec<u32>> = (0..args.batch)
        .map(|i| generate(&engine, prompt(i, vocab), args.tokens).map(|(ids, _)| ids))
        .collect::<Result<_>>()?;
    // The same requests together, arriving a few steps apart.
    let mut streams = Vec::new();
    for i in 0..args.batch {
        streams.push(engine.submit(GenerateRequest {
            resume: None,
            embed: None,
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
                TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                    bail!("generation failed: {message}")
                }
                TokenEvent::Embedding { .. } => {
                    bail!("the engine answered a generation with an embedding")
                }
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
                "run_order": args.run_order, "differing": differing, "passed": passed}),
    )?;
    ensure!(passed, "sequences {differing:?} changed when batched");
    Ok(())
}

/// The device's engine with a KV cache of `bytes` (the checks need little).
pub(super) fn fixed_kv(device: Device, bytes: usize) -> EngineSpec {
    EngineSpec {
        kv: KvBudget::Bytes(bytes),
        ..EngineSpec::for_device(device)
    }
}

fn read_config(path: &Path) -> Result<ModelConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    ModelConfig::from_json(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// A backend of `config` with synthesized weights, or the weights of `checkpoint` (GGUF block
/// formats kept unless widened, FP8 / NVFP4 widened unless kept, as `args` say).
fn bench_backend(
    config: &ModelConfig,
    checkpoint: Option<(&strata_model::weights::Checkpoint, &DecodeArgs)>,
    device: usize,
    positions: usize,
    kv_tokens: usize,
    sharded: bool,
) -> Result<CudaBackend> {
    let block_size = 16;
    let kv_bytes =
        kv_tokens.div_ceil(block_size) * block_size * config.num_layers * 2 * config.kv_dim() * 2;
    let options = CudaOptions {
        device,
        block_size,
        kv_cache_bytes: kv_bytes,
        kv_memory_fraction: None,
        kernel_cache: None,
        max_positions: Some(positions),
        graphs: true,
        tp_rank: 0,
        tp_world: 1,
        sharded_reduction: sharded,
        widen_blocks: checkpoint.is_some_and(|(_, h)| h.widen_blocks),
        keep_quantized: checkpoint.is_some_and(|(_, h)| h.keep_quantized),
        quant_blocks: checkpoint.is_some_and(|(_, h)| h.quant_blocks),
        fp8_tiles: checkpoint.is_some_and(|(_, h)| h.fp8_tiles),
        run_order: false,
    };
    let source = match checkpoint {
        Some((ckpt, _)) => WeightSource::Checkpoint(ckpt),
        None => WeightSource::Synthetic { seed: 7 },
    };
    Ok(CudaBackend::new(config, source, &options)?)
}

fn median(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[0], xs[xs.len() / 2], xs[xs.len() - 1])
}

/// Fills each table's sequence with `context` prompt tokens, in 512-token chunks.
fn fill_contexts(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    contexts: &[usize],
    vocab: usize,
) -> Result<()> {
    for (table, &context) in tables.iter().zip(contexts) {
        let prompt: Vec<u32> = (0..context as u32)
            .map(|i| (i * 31 + 7) % vocab as u32)
            .collect();
        for (c, chunk) in prompt.chunks(512).enumerate() {
            backend.step(&[StepSeq {
                tokens: chunk,
                first_position: c * 512,
                prompt_len: context,
                block_table: table,
                logit_rows: 0,
            }])?;
        }
    }
    Ok(())
}

/// One decode step of every sequence at its own position.
pub(super) fn decode_step(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    positions: &[usize],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let tokens: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
    Ok(backend.step(&decode_seqs(tables, positions, &tokens))?)
}

/// [`decode_step`] through [`Backend::step_sampling`]: each row comes back as `sampling` asks.
pub(super) fn decode_sampling(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    positions: &[usize],
    tokens: &[u32],
    sampling: &[RowSampling<'_>],
) -> Result<StepOutput> {
    let tokens: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
    let seqs = decode_seqs(tables, positions, &tokens);
    Ok(backend.step_sampling(&seqs, sampling)?)
}

fn decode_seqs<'a>(
    tables: &'a [Vec<u32>],
    positions: &[usize],
    tokens: &'a [[u32; 1]],
) -> Vec<StepSeq<'a>> {
    tables
        .iter()
        .zip(positions)
        .zip(tokens)
        .map(|((table, &position), token)| StepSeq {
            tokens: token,
            first_position: position,
            prompt_len: position,
            block_table: table,
            logit_rows: 1,
        })
        .collect()
}

fn tables_for(batch: usize, blocks_per_seq: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| ((b * blocks_per_seq) as u32..((b + 1) * blocks_per_seq) as u32).collect())
        .collect()
}

/// Block tables, context lengths and next tokens of a batch of decode rows.
type StaggeredBatch = (Vec<Vec<u32>>, Vec<usize>, Vec<u32>);

/// `batch` sequences of staggered context lengths below `context` (so padded rows, table widths
/// and split counts all vary), their contexts filled, and one next token each.
pub(super) fn staggered_batch(
    backend: &mut CudaBackend,
    batch: usize,
    context: usize,
    blocks_per_seq: usize,
    vocab: usize,
) -> Result<StaggeredBatch> {
    let tables = tables_for(batch, blocks_per_seq);
    let contexts: Vec<usize> = (0..batch).map(|b| 1 + (b * 97 + 13) % context).collect();
    fill_contexts(backend, &tables, &contexts, vocab)?;
    let tokens: Vec<u32> = (0..batch as u32)
        .map(|b| (b * 7919 + 3) % vocab as u32)
        .collect();
    Ok((tables, contexts, tokens))
}

/// Median, min and max seconds per decode step of `tables`, `steps` timed after 8 warm-ups.
/// Every row is sampled greedily on the device, as the engine serves greedy requests.
fn time_decode(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    context: usize,
    steps: usize,
) -> Result<(f64, f64, f64)> {
    let tokens = vec![11u32; tables.len()];
    let greedy = vec![RowSampling::Greedy; tables.len()];
    let mut times = Vec::new();
    for s in 0..steps + 8 {
        let positions = vec![context + s; tables.len()];
        let start = Instant::now();
        decode_sampling(backend, tables, &positions, &tokens, &greedy)?;
        if s >= 8 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// The shape `decode` runs: a checkpoint's (`--model`) or a config's alone (synthesized).
fn decode_source(
    args: &DecodeArgs,
) -> Result<(
    ModelConfig,
    Option<strata_model::weights::Checkpoint>,
    std::path::PathBuf,
)> {
    Ok(match (&args.model, &args.config) {
        (Some(model), _) => {
            let config = ModelConfig::from_dir(model)
                .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
            let ckpt = strata_model::weights::Checkpoint::open(model)?;
            (config, Some(ckpt), model.clone())
        }
        (None, Some(_)) if args.widen_blocks || args.keep_quantized => {
            bail!("--widen-gguf and --keep-quantized need --model")
        }
        (None, Some(path)) => (read_config(path)?, None, path.clone()),
        (None, None) => bail!("give --config or --model"),
    })
}

/// `--profile`: the eager step's time beside the graphs' median `med`, and one profiled step's
/// time per kernel family, printed and added to `result`.
fn profile_step(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    args: &DecodeArgs,
    med: f64,
    result: &mut Value,
) -> Result<()> {
    backend.set_graphs(false);
    let (_, eager, _) = time_decode(backend, tables, args.context, args.steps)?;
    backend.profile_next_step();
    decode_step(
        backend,
        tables,
        &vec![args.context; tables.len()],
        &vec![11; tables.len()],
    )?;
    backend.set_graphs(true);
    let profile = backend
        .take_profile()
        .context("the profiled step left no profile")?;
    let total: f64 = profile.families.iter().map(|f| f.1).sum();
    println!(
        "             eager {:.3} ms (graphs save {:.1} %); profiled step {:.3} ms:",
        eager * 1e3,
        100.0 * (1.0 - med / eager),
        total
    );
    for (family, ms, launches) in &profile.families {
        println!(
            "               {family:<14} {ms:>8.3} ms {:>5.1} % ({launches} launches)",
            100.0 * ms / total
        );
    }
    result["eager_step_ms"] = json!(eager * 1e3);
    result["profile_ms"] = Value::Object(
        profile
            .families
            .iter()
            .map(|(family, ms, launches)| {
                (family.to_string(), json!({"ms": ms, "launches": launches}))
            })
            .collect(),
    );
    Ok(())
}

fn decode(args: DecodeArgs) -> Result<()> {
    let (config, checkpoint, source) = decode_source(&args)?;
    let max_batch = args
        .batch
        .iter()
        .chain(&args.check_graphs)
        .copied()
        .max()
        .unwrap_or(1);
    let positions = args.context + args.steps + 16;
    let blocks_per_seq = positions.div_ceil(16);
    let mut backend = bench_backend(
        &config,
        checkpoint.as_ref().map(|c| (c, &args)),
        args.device,
        positions,
        max_batch * blocks_per_seq * 16, // whole blocks: each table holds blocks_per_seq
        args.sharded,
    )?;
    backend.set_decode_gemm(args.decode_gemm);
    backend.set_run_order(args.run_order)?;
    backend.set_moe_grouped(args.moe_grouped);
    let held = checkpoint
        .as_ref()
        .map(|_| backend.step_weight_bytes() as f64);
    let weight_bytes_at = |batch: usize| step_read_bytes(&config, held, batch);
    let weight_bytes = weight_bytes_at(1);
    let formats: Vec<String> = backend
        .weight_formats()
        .iter()
        .map(|(f, n)| format!("{f} x{n}"))
        .collect();
    let vocab = config.vocab_size;
    let mut results = Vec::new();
    let (bandwidth, bandwidth_source) = roofline_bandwidth(args.bandwidth, backend.stream())?;
    println!(
        "decode {} on {}: {:.2} GB of weights ({}), context {}",
        source.display(),
        backend.device_name(),
        weight_bytes / 1e9,
        formats.join(", "),
        args.context
    );
    let graph_checks = sampling::check_graphs(
        &mut backend,
        &args.check_graphs,
        args.context,
        blocks_per_seq,
        vocab,
    )?;
    let sampling_checks = sampling::check_greedy_sampling(
        &mut backend,
        &args.check_graphs,
        args.context,
        blocks_per_seq,
        vocab,
    )?;
    let seeded_checks = sampling::check_seeded_sampling(
        &mut backend,
        &args.check_graphs,
        args.context,
        blocks_per_seq,
        vocab,
    )?;
    for &batch in &args.batch {
        let tables = tables_for(batch, blocks_per_seq);
        fill_contexts(&mut backend, &tables, &vec![args.context; batch], vocab)?;
        backend.set_graphs(true);
        let (min, med, max) = time_decode(&mut backend, &tables, args.context, args.steps)?;
        let sampled = |backend: &mut CudaBackend, device| {
            sampling::time_sampled(backend, &tables, args.context, args.steps, device)
        };
        let (sampled_device, sampled_host) =
            (sampled(&mut backend, true)?, sampled(&mut backend, false)?);
        println!(
            "             sampled at T 0.8: {:.3} ms a step on the device, {:.3} ms \
             from host logits",
            sampled_device * 1e3,
            sampled_host * 1e3
        );
        let kv_bytes =
            (batch * (args.context + args.steps / 2) * config.num_layers * 2 * config.kv_dim() * 2)
                as f64;
        let ideal = (weight_bytes_at(batch) + kv_bytes) / bandwidth;
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
        let mut result = json!({"batch": batch, "step_ms": {"min": min * 1e3, "median": med * 1e3,
            "max": max * 1e3}, "tokens_per_s": tps, "roofline_ms": ideal * 1e3,
            "roofline_fraction": ideal / med, "weight_bytes": weight_bytes_at(batch),
            "runs": args.steps, "graphs": true,
            "sampled_step_ms": {"device": sampled_device * 1e3, "host": sampled_host * 1e3}});
        if args.profile {
            profile_step(&mut backend, &tables, &args, med, &mut result)?;
        }
        results.push(result);
    }
    write_json(
        args.json.as_deref(),
        &json!({"config": args.config, "model": args.model, "widen_blocks": args.widen_blocks,
                "keep_quantized": args.keep_quantized, "quant_blocks": args.quant_blocks, "fp8_tiles": args.fp8_tiles, "weight_formats": formats, "device": backend.device_name(),
                "weight_bytes": weight_bytes, "context": args.context,
                "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": bandwidth_source,
                "includes": "greedy sampling on the device, token ids copied to the host",
                "sharded_reduction": args.sharded, "decode_gemm": args.decode_gemm,
                "run_order": args.run_order, "moe_grouped": args.moe_grouped,
                "graph_checks": graph_checks, "sampling_checks": sampling_checks,
                "seeded_sampling_checks": seeded_checks, "results": results}),
    )
}

fn prefill(args: PrefillArgs) -> Result<()> {
    let config = read_config(&args.config)?;
    let longest = args.prompt.iter().copied().max().unwrap_or(1);
    let mut backend = bench_backend(
        &config,
        None,
        args.device,
        longest + 16,
        longest + 16,
        false,
    )?;
    backend.set_moe_grouped(args.moe_grouped);
    // A mixture of experts computes with the parameters each token's router chooses.
    let params = active_parameter_count(&config) as f64;
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
                logit_rows: 1,
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
                "peak_flops": args.peak, "moe_grouped": args.moe_grouped, "results": results}),
    )
}

/// Weight bytes a decode step of `batch` rows reads. Synthesized: the parameters in bf16 (as
/// every earlier receipt counts them); a checkpoint: the bytes the backend holds for a step
/// (`held`); a mixture of experts (bf16 experts): the parameters a step of that many rows reads
/// under uniform routing.
fn step_read_bytes(config: &ModelConfig, held: Option<f64>, batch: usize) -> f64 {
    match (held, &config.moe) {
        (_, Some(_)) => expected_read_parameters(config, batch) * 2.0,
        (None, None) => parameter_count(config) as f64 * 2.0,
        (Some(held), None) => held,
    }
}

/// The roofline's bandwidth: `given` (`--bandwidth`), else [`copy_rate`]; printed, with its source.
fn roofline_bandwidth(
    given: Option<f64>,
    stream: &std::sync::Arc<strata_kernels::cudarc::driver::CudaStream>,
) -> Result<(f64, &'static str)> {
    let (bandwidth, source) = match given {
        Some(b) => (b, "--bandwidth"),
        None => (copy_rate(stream)?, "measured device copy"),
    };
    println!("roofline at {:.2} TB/s ({source})", bandwidth / 1e12);
    Ok((bandwidth, source))
}

/// The GPU's memory bandwidth as a device-to-device copy of 1 GiB measures it: bytes read plus
/// bytes written per second, the best of five copies after one warm-up. What a decode step can
/// reach, on whatever GPU this runs (the roofline of `strata gpu decode`).
fn copy_rate(stream: &std::sync::Arc<strata_kernels::cudarc::driver::CudaStream>) -> Result<f64> {
    const BYTES: usize = 1 << 30;
    let src = stream.alloc_zeros::<u8>(BYTES)?;
    let mut dst = stream.alloc_zeros::<u8>(BYTES)?;
    let mut best = f64::INFINITY;
    for i in 0..6 {
        stream.synchronize()?;
        let start = Instant::now();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        if i > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * BYTES as f64 / best)
}
