//! `strata quantize --plan P --model IN --out OUT`: FP8 / NVFP4 checkpoints in compressed-tensors'
//! layout (docs/MODELS.md), with each Linear's reconstruction error printed as it is done.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use strata_model::quantize::{Plan, quantize};

#[derive(Clone, Copy, ValueEnum)]
pub enum PlanArg {
    /// e4m3 weights, a scale per output channel.
    Fp8,
    /// e4m3 weights, a scale per 128x128 block.
    Fp8Block,
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
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    let reports = quantize(&args.model, &args.out, args.plan.into(), |r| {
        println!(
            "{:<48} {:<20} relative RMS error {:.3e}",
            r.name, r.format, r.relative_rms_error
        );
    })?;
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
