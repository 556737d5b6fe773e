//! `strata gpu tp`: tensor-parallel CUDA ranks, each holding its slices of a checkpoint, against
//! one GPU holding all of it in the shard order — the same greedy tokens and the same
//! log-probability bits, for a batch of staggered requests (DESIGN.md §7, TP-N vs TP-1). A
//! canary (ranks that skip the all-gather of the row-parallel partials) must differ.
//!
//! On a one-GPU machine the ranks share the GPU through the host-staged communicator; with
//! `--devices` naming distinct GPUs they run over NCCL.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use clap::Args;
use serde_json::json;
use strata_model::cpu::PartialsFault;
use strata_node::Engine;
use strata_node::backend::TpTransport;
use strata_node::{CudaPlacement, Device, start_cuda_engine};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

use super::fixed_kv;

use super::{prompt, write_json};

#[derive(Args)]
pub struct TpArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// The GPU of the one-GPU reference (and of every rank unless --devices is given).
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// TP degrees to check, comma separated; each runs its ranks on --device (host-staged).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    tp: Vec<usize>,
    /// Also run one group over these distinct GPUs through NCCL, comma separated.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One request's greedy tokens and, per token, the bits of its top-2 log-probabilities.
type Stream = (Vec<u32>, Vec<[u32; 2]>);

/// The prompts submitted a few milliseconds apart (so steps mix prompt and decode rows).
fn run_batch(engine: &Engine, prompts: usize, tokens: u32) -> Result<Vec<Stream>> {
    let vocab = engine.model_config().vocab_size;
    let mut streams = Vec::new();
    for i in 0..prompts {
        streams.push(engine.submit(GenerateRequest {
            resume: None,
            embed: None,
            prompt: prompt(i, vocab),
            sampling: SamplingParams {
                max_tokens: tokens,
                ignore_eos: true,
                logprobs: Some(2),
                ..SamplingParams::greedy()
            },
            cache_salt: 0,
            deadline: None,
            constraint: None,
        })?);
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut out = Vec::with_capacity(prompts);
    for mut stream in streams {
        let (mut ids, mut bits) = (Vec::new(), Vec::new());
        while let Some(event) = stream.events.blocking_recv() {
            match event {
                TokenEvent::Token { id, logprobs, .. } => {
                    ids.push(id);
                    let top = logprobs.map(|l| l.top).unwrap_or_default();
                    let bit = |i: usize| top.get(i).map_or(u32::MAX, |t| t.1.to_bits());
                    bits.push([bit(0), bit(1)]);
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
        out.push((ids, bits));
    }
    Ok(out)
}

/// The prompts whose stream differs from the reference's, token or log-probability bits.
fn differing(reference: &[Stream], got: &[Stream]) -> Vec<usize> {
    reference
        .iter()
        .zip(got)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect()
}

pub fn run(args: TpArgs) -> Result<()> {
    let start = |placement: &CudaPlacement| -> Result<Engine> {
        Ok(start_cuda_engine(
            &args.model,
            placement,
            &fixed_kv(Device::Cuda(0), 256 << 20),
        )?
        .0)
    };
    let reference = {
        let engine = start(&CudaPlacement {
            sharded_reduction: true,
            ..CudaPlacement::single(args.device)
        })?;
        run_batch(&engine, args.prompts, args.tokens)?
    };
    let fused = run_batch(
        &start(&CudaPlacement::single(args.device))?,
        args.prompts,
        args.tokens,
    )?;

    let mut groups: Vec<(String, CudaPlacement)> = args
        .tp
        .iter()
        .map(|&n| {
            let placement = CudaPlacement {
                devices: vec![args.device; n],
                transport: Some(TpTransport::Staged),
                ..CudaPlacement::single(args.device)
            };
            (format!("tp{n}-staged"), placement)
        })
        .collect();
    if args.devices.len() > 1 {
        groups.push((
            format!("tp{}-nccl", args.devices.len()),
            CudaPlacement {
                devices: args.devices.clone(),
                transport: Some(TpTransport::Nccl),
                ..CudaPlacement::single(args.devices[0])
            },
        ));
    }
    let mut results = Vec::new();
    let mut passed = true;
    for (name, placement) in &groups {
        let got = run_batch(&start(placement)?, args.prompts, args.tokens)?;
        let differ = differing(&reference, &got);
        let ok = differ.is_empty();
        passed &= ok;
        println!(
            "{name}: {} of {} streams differ from one GPU in the shard order — {}",
            differ.len(),
            args.prompts,
            if ok { "PASS" } else { "FAIL" }
        );
        results.push(json!({"group": name, "devices": placement.devices,
                            "differing": differ, "passed": ok}));
    }
    // The canary: ranks that add only their own shards must not match.
    let canary = {
        let placement = CudaPlacement {
            devices: vec![args.device; 2],
            transport: Some(TpTransport::Staged),
            fault: PartialsFault::LocalSumOnly,
            ..CudaPlacement::single(args.device)
        };
        run_batch(&start(&placement)?, args.prompts, args.tokens)?
    };
    let canary_differ = differing(&reference, &canary);
    let canary_failed = !canary_differ.is_empty();
    passed &= canary_failed;
    println!(
        "canary (tp2 without the all-gather): {} of {} streams differ — {}",
        canary_differ.len(),
        args.prompts,
        if canary_failed {
            "PASS (it must differ)"
        } else {
            "FAIL (the canary matched)"
        }
    );
    let fused_differ = differing(&reference, &fused);
    println!(
        "for information: the fused order at TP = 1 differs in {} of {} streams from the shard \
         order",
        fused_differ.len(),
        args.prompts
    );
    write_json(
        args.json.as_deref(),
        &json!({"model": args.model, "prompts": args.prompts, "tokens": args.tokens,
                "groups": results, "canary_differing": canary_differ,
                "fused_order_differing": fused_differ, "passed": passed}),
    )?;
    ensure!(
        passed,
        "tensor-parallel ranks are not byte-identical to one GPU"
    );
    Ok(())
}
