//! `strata quantize --plan P --model IN --out OUT`: FP8 / NVFP4 checkpoints in compressed-tensors'
//! layout (docs/MODELS.md), with each Linear's reconstruction error printed as it is done.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use strata_model::cpu::CpuModel;
use strata_model::quantize::{Calibration, Plan, quantize, sequences};
use strata_model::tokenizer::Tokenizer;

#[derive(Clone, Copy, ValueEnum)]
pub enum PlanArg {
    /// e4m3 weights, a scale per output channel.
    Fp8,
    /// e4m3 weights, a scale per 128x128 block.
    Fp8Block,
    /// e4m3 weights per output channel, activations quantized to FP8 per token at run time
    /// (W8A8, no calibration).
    Fp8Dynamic,
    /// e2m1 weights, an e4m3 scale per 16 (group max → 6), an f32 tensor scale.
    Nvfp4,
    /// NVFP4 whose group scales map each group's max to 4 or to 6, whichever errs less.
    Nvfp4_4o6,
    /// Attention projections FP8 per channel, MLP projections NVFP4 4o6.
    Mixed,
}

impl From<PlanArg> for Plan {
    fn from(p: PlanArg) -> Self {
        match p {
            PlanArg::Fp8 => Plan::Fp8,
            PlanArg::Fp8Block => Plan::Fp8Block,
            PlanArg::Fp8Dynamic => Plan::Fp8Dynamic,
            PlanArg::Nvfp4 => Plan::Nvfp4,
            PlanArg::Nvfp4_4o6 => Plan::Nvfp4FourOverSix,
            PlanArg::Mixed => Plan::Mixed,
        }
    }
}

#[derive(Args)]
pub struct QuantizeArgs {
    /// The quantization plan.
    #[arg(long, value_enum)]
    plan: PlanArg,
    /// A Hugging Face checkpoint directory (bf16, f16 or f32).
    #[arg(long)]
    model: PathBuf,
    /// The directory to write (config.json with its quantization_config, model.safetensors, the
    /// tokenizer and generation files).
    #[arg(long)]
    out: PathBuf,
    /// UTF-8 text to calibrate activation scales on: the CPU reference runs it and each Linear
    /// input's largest magnitude sets a static FP8 input scale (per tensor) or an NVFP4 input
    /// global scale, written with the weights for engines that quantize activations (W8A8,
    /// W4A4). Not for `fp8-block`, whose activations engines quantize at run time.
    #[arg(long)]
    calibrate: Option<PathBuf>,
    /// Tokens per calibration sequence (each starts at position 0).
    #[arg(long, default_value_t = 512, requires = "calibrate")]
    calibration_context: usize,
    /// Calibration sequences at most: the text's first N.
    #[arg(long, default_value_t = 16, requires = "calibrate")]
    calibration_sequences: usize,
}

/// Activation ranges of the checkpoint at `args.model` over the `--calibrate` text.
fn calibrate(args: &QuantizeArgs, text: &std::path::Path) -> Result<Calibration> {
    let text = std::fs::read_to_string(text)
        .with_context(|| format!("reading the calibration text {}", text.display()))?;
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let tokens = tokenizer.encode(&text, true)?;
    let runs = sequences(
        &tokens,
        args.calibration_context,
        args.calibration_sequences,
    );
    anyhow::ensure!(
        !runs.is_empty(),
        "the calibration text is {} tokens: nothing to calibrate on",
        tokens.len()
    );
    let model = CpuModel::load(&args.model)?;
    let started = std::time::Instant::now();
    let calibration = Calibration::measure(&model, &runs)?;
    println!(
        "calibrated on {} tokens in {} sequences ({:.1} s, CPU reference)",
        calibration.tokens,
        calibration.sequences,
        started.elapsed().as_secs_f64()
    );
    Ok(calibration)
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let calibration = match &args.calibrate {
        Some(text) => Some(calibrate(&args, text)?),
        None => None,
    };
    let reports = quantize(
        &args.model,
        &args.out,
        args.plan.into(),
        calibration.as_ref(),
        |r| {
            let input = r
                .input_amax
                .map(|a| format!("  input amax {a:.4}"))
                .unwrap_or_default();
            println!(
                "{:<48} {:<20} relative RMS error {:.3e}{input}",
                r.name, r.format, r.relative_rms_error
            );
        },
    )?;
    let worst = reports
        .iter()
        .map(|r| r.relative_rms_error)
        .fold(0.0f64, f64::max);
    let mean =
        reports.iter().map(|r| r.relative_rms_error).sum::<f64>() / reports.len().max(1) as f64;
    println!(
        "wrote {}: {} Linear projections quantized (relative RMS error mean {mean:.3e}, worst {worst:.3e})",
        args.out.display(),
        reports.len()
    );
    Ok(())
}
