//! `strata gpu decode`'s gates and sampling timing: graph replay against eager launches, greedy
//! rows reduced on the device, and rows sampled on the device (shaping and the row pass in CUDA,
//! the finish on the host), each against the CPU sampler over the same step's logits.

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use strata_model::sampler::{RowPlan, RowSummary, Sampled, Sampler, greedy_token};
use strata_node::backend::{CudaBackend, RowSampling};
use strata_protocol::SamplingParams;

use super::{decode_sampling, decode_step, staggered_batch};

/// The parameter mixes the gate cycles through, one per row: every path of the row pass (the
/// id-order draw with and without min-p, top-k, top-p from the candidate list, top-p whose list
/// overflows, greedy with shaping and log-probabilities), every shaping list, stop masks and a
/// grammar's bitmask.
fn mixes(vocab: usize) -> Vec<(SamplingParams, Extra)> {
    let p = |f: &dyn Fn(&mut SamplingParams)| {
        let mut p = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    };
    let biased: std::collections::BTreeMap<u32, f32> = (0..8u32)
        .map(|i| ((i * 7919) % vocab as u32, i as f32 - 3.5))
        .collect();
    vec![
        (p(&|p| p.temperature = 0.8), Extra::None),
        (p(&|p| (p.temperature, p.min_p) = (0.5, 0.1)), Extra::None),
        (p(&|p| p.top_k = 40), Extra::None),
        (p(&|p| (p.temperature, p.top_p) = (0.05, 0.9)), Extra::None),
        (p(&|p| (p.temperature, p.top_p) = (1.5, 0.95)), Extra::None),
        (p(&|p| (p.temperature, p.top_k) = (0.7, 50)), Extra::Grammar),
        (p(&|p| p.temperature = 0.0), Extra::Grammar),
        (
            p(&|p| {
                (p.top_k, p.top_p, p.min_p) = (20, 0.8, 0.05);
                (p.temperature, p.logprobs) = (0.9, Some(5));
            }),
            Extra::None,
        ),
        (
            p(&|p| {
                (p.temperature, p.logprobs) = (0.0, Some(3));
                p.repetition_penalty = 1.3;
                p.logit_bias = biased.clone();
            }),
            Extra::None,
        ),
        (
            p(&|p| {
                (p.presence_penalty, p.frequency_penalty) = (0.5, 0.3);
                p.repetition_penalty = 0.8;
                p.logprobs = Some(0);
            }),
            Extra::StopMask,
        ),
        (p(&|p| (p.top_k, p.temperature) = (3000, 0.7)), Extra::None),
    ]
}

/// What a row's plan carries besides its parameters' shaping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    None,
    /// Stop tokens masked (as before `min_tokens`), the argmax among them.
    StopMask,
    /// A grammar's allowed-token bitmask (a fixed pseudo-random half of the vocabulary, the
    /// argmax excluded).
    Grammar,
}

impl Extra {
    fn plan(self, sampler: &mut Sampler, row: &[f32]) -> RowPlan {
        let mut plan = sampler.plan(if self == Extra::StopMask {
            masked(row)
        } else {
            Vec::new()
        });
        if self == Extra::Grammar {
            plan.allowed = Some(allowed(row));
        }
        plan
    }

    /// The host reference's row: the same masks applied before [`Sampler::sample`] shapes it.
    fn reference_row(self, row: &[f32]) -> Vec<f32> {
        let mut row = row.to_vec();
        match self {
            Extra::None => {}
            Extra::StopMask => masked(&row)
                .iter()
                .for_each(|&t| row[t as usize] = f32::NEG_INFINITY),
            Extra::Grammar => strata_model::grammar::apply_allowed(&allowed(&row), &mut row),
        }
        row
    }
}

/// Half the vocabulary by a fixed hash, never the row's argmax.
fn allowed(row: &[f32]) -> Vec<u32> {
    let top = greedy_token(row).unwrap_or(0) as usize;
    let mut bits = vec![0u32; row.len().div_ceil(32)];
    for id in 0..row.len() {
        if id != top && (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 63 == 1 {
            bits[id / 32] |= 1 << (id % 32);
        }
    }
    bits
}

/// One sampler per row: the mix for the row, its own seed, a prompt and output history so the
/// penalty lists are not empty.
fn samplers(batch: usize, vocab: usize) -> Result<Vec<(Sampler, Extra)>> {
    let mixes = mixes(vocab);
    (0..batch)
        .map(|b| {
            let (mut params, extra) = mixes[b % mixes.len()].clone();
            params.seed = 1000 + b as u64;
            let mut s = Sampler::new(&params, vocab)?;
            let history: Vec<u32> = (0..50u32)
                .map(|i| (i * 104_729 + b as u32) % vocab as u32)
                .collect();
            s.observe_prompt(&history);
            s.resume(&history[..10], 0)?;
            Ok((s, extra))
        })
        .collect()
}

/// Tokens masked out before the draw (as before `min_tokens`): a few ids, among them the row's
/// argmax, so the mask visibly changes the outcome.
fn masked(row: &[f32]) -> Vec<u32> {
    let top = greedy_token(row).unwrap_or(0);
    vec![top, 1, 2, 3]
}

/// Device summaries against the host reference, token for token and bit for bit, at each batch
/// size through graph replay and eager launches: every row samples with its mix, the device's
/// summary is compared with [`RowSummary::of`] the host-shaped row and the finished draw with
/// [`Sampler::sample`]. The canary flips the top bit of every plan's random word on the device
/// side and must change some token.
pub(super) fn check_seeded_sampling(
    backend: &mut CudaBackend,
    batches: &[usize],
    context: usize,
    blocks_per_seq: usize,
    vocab: usize,
) -> Result<Value> {
    let mut checks = Vec::new();
    for &batch in batches {
        let (tables, contexts, tokens) =
            staggered_batch(backend, batch, context, blocks_per_seq, vocab)?;
        let (mut mismatches, mut summaries_differing, mut overflowed) = (0, 0, 0);
        let mut canary_changed = 0;
        for graphs in [true, false] {
            backend.set_graphs(graphs);
            let logits = decode_step(backend, &tables, &contexts, &tokens)?;
            let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
            let mut host = samplers(batch, vocab)?;
            let mut device = samplers(batch, vocab)?;
            let mut canary = samplers(batch, vocab)?;
            let plans: Vec<RowPlan> = device
                .iter_mut()
                .zip(&rows)
                .map(|((s, extra), row)| extra.plan(s, row))
                .collect();
            let canary_plans: Vec<RowPlan> = canary
                .iter_mut()
                .zip(&rows)
                .map(|((s, extra), row)| {
                    let mut plan = extra.plan(s, row);
                    plan.draw.random ^= 1 << 63;
                    plan
                })
                .collect();
            let sampling: Vec<RowSampling<'_>> = plans.iter().map(RowSampling::Summary).collect();
            let out = decode_sampling(backend, &tables, &contexts, &tokens, &sampling)?;
            let sampling: Vec<RowSampling<'_>> =
                canary_plans.iter().map(RowSampling::Summary).collect();
            let canary_out = decode_sampling(backend, &tables, &contexts, &tokens, &sampling)?;
            ensure!(
                out.summaries.len() == batch && canary_out.summaries.len() == batch,
                "batch {batch}: {} summaries for {batch} rows",
                out.summaries.len()
            );
            for (b, row) in rows.iter().enumerate() {
                let mut shaped = row.to_vec();
                plans[b].shape(&mut shaped);
                let mut want = RowSummary::of(&shaped, &plans[b].draw).ok();
                let mut got = out.summaries[b].clone();
                want.iter_mut()
                    .chain(got.iter_mut())
                    .for_each(|s| s.sort_prefix());
                summaries_differing += usize::from(want != got);
                overflowed += usize::from(got.as_ref().is_some_and(|s| s.prefix.len() > 1024));

                let (s, extra) = &mut host[b];
                let mut reference_row = extra.reference_row(row);
                let expected: Sampled = s.sample(&mut reference_row)?;
                let summary = out.summaries[b].clone().ok_or_else(|| {
                    anyhow::anyhow!("batch {batch} row {b}: the device found no finite logit")
                })?;
                let sampled = device[b].0.finish(&plans[b], summary)?;
                mismatches += usize::from(!same_sample(&sampled, &expected));
                if let Some(summary) = canary_out.summaries[b].clone() {
                    let wrong = canary[b].0.finish(&canary_plans[b], summary)?;
                    canary_changed += usize::from(wrong.token != expected.token);
                }
            }
        }
        backend.set_graphs(true);
        let passed = mismatches == 0 && summaries_differing == 0;
        let canary_caught = canary_changed > 0;
        println!(
            "  seeded sampling batch {batch:>3}: device {} host (summaries and draws, graphs and \
             eager; {overflowed} row(s) over the candidate list), canary {} ({canary_changed} \
             tokens changed)",
            if passed { "==" } else { "!=" },
            if canary_caught { "caught" } else { "MISSED" },
        );
        ensure!(
            passed,
            "batch {batch}: {mismatches} device-sampled tokens and {summaries_differing} row \
             summaries differ from the host's"
        );
        ensure!(
            canary_caught,
            "batch {batch}: the canary was not told apart"
        );
        checks.push(
            json!({"batch": batch, "identical": passed, "canary_caught": canary_caught,
            "canary_tokens_changed": canary_changed, "rows_over_candidate_list": overflowed,
            "mixes": mixes(vocab).len()}),
        );
    }
    Ok(Value::Array(checks))
}

/// Greedy sampling on the device against the CPU sampler's greedy choice over the same step's
/// logits, token for token, at each batch size, through graph replay and eager launches: every
/// row greedy, then every other row (the others' logits must come back bit for bit). The canary
/// takes the host's choice with each row's top logit removed (the runner-up) and must differ.
pub(super) fn check_greedy_sampling(
    backend: &mut CudaBackend,
    batches: &[usize],
    context: usize,
    blocks_per_seq: usize,
    vocab: usize,
) -> Result<Value> {
    let mut checks = Vec::new();
    for &batch in batches {
        let (tables, contexts, tokens) =
            staggered_batch(backend, batch, context, blocks_per_seq, vocab)?;
        let mut mismatches = 0;
        let mut canary_caught = true;
        for graphs in [true, false] {
            backend.set_graphs(graphs);
            let logits = decode_step(backend, &tables, &contexts, &tokens)?;
            let host: Vec<Option<u32>> = logits.chunks_exact(vocab).map(greedy_token).collect();
            let all = vec![RowSampling::Greedy; batch];
            let device = decode_sampling(backend, &tables, &contexts, &tokens, &all)?;
            mismatches += count_differing(&device.tokens, &host) + device.logits.len();
            let every_other: Vec<RowSampling<'_>> = (0..batch)
                .map(|b| {
                    if b % 2 == 0 {
                        RowSampling::Greedy
                    } else {
                        RowSampling::Host
                    }
                })
                .collect();
            let mixed = decode_sampling(backend, &tables, &contexts, &tokens, &every_other)?;
            let (mut want_tokens, mut want_logits) = (Vec::new(), Vec::new());
            for (b, row) in logits.chunks_exact(vocab).enumerate() {
                if b % 2 == 0 {
                    want_tokens.push(host[b]);
                } else {
                    want_logits.extend_from_slice(row);
                }
            }
            mismatches += count_differing(&mixed.tokens, &want_tokens);
            mismatches += mixed.logits.len().abs_diff(want_logits.len());
            mismatches += mixed
                .logits
                .iter()
                .zip(&want_logits)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            let runner_up: Vec<Option<u32>> = logits
                .chunks_exact(vocab)
                .map(|row| {
                    let mut row = row.to_vec();
                    if let Some(top) = greedy_token(&row) {
                        row[top as usize] = f32::NEG_INFINITY;
                    }
                    greedy_token(&row)
                })
                .collect();
            canary_caught &= count_differing(&device.tokens, &runner_up) == batch;
        }
        backend.set_graphs(true);
        let passed = mismatches == 0;
        println!(
            "  sampling batch {batch:>3}: device greedy {} host greedy (graphs and eager), canary {}",
            if passed { "==" } else { "!=" },
            if canary_caught { "caught" } else { "MISSED" },
        );
        ensure!(
            passed,
            "batch {batch}: {mismatches} device-sampled tokens or logits differ from the host's"
        );
        ensure!(
            canary_caught,
            "batch {batch}: the canary was not told apart"
        );
        checks.push(json!({"batch": batch, "identical": passed, "canary_caught": canary_caught}));
    }
    Ok(Value::Array(checks))
}

fn count_differing(a: &[Option<u32>], b: &[Option<u32>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
}

/// Token, log-probability bits and reported log-probabilities all equal.
fn same_sample(a: &Sampled, b: &Sampled) -> bool {
    let bits = |l: Option<f32>| l.map(f32::to_bits);
    a.token == b.token && bits(a.logprob) == bits(b.logprob) && a.logprobs == b.logprobs
}

/// Median seconds per decode step of `tables` with every row sampled at temperature 0.8 (what an
/// OpenAI client sends by default past greedy), on the device (`device`) or from logits on the
/// host.
pub(super) fn time_sampled(
    backend: &mut CudaBackend,
    tables: &[Vec<u32>],
    context: usize,
    steps: usize,
    device: bool,
) -> Result<f64> {
    let vocab = backend_vocab(backend);
    let params = SamplingParams {
        temperature: 0.8,
        ..SamplingParams::default()
    };
    let mut samplers: Vec<Sampler> = (0..tables.len())
        .map(|_| Sampler::new(&params, vocab))
        .collect::<Result<_, _>>()?;
    let tokens = vec![11u32; tables.len()];
    let positions = vec![context; tables.len()];
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps + 4 {
        let started = std::time::Instant::now();
        if device {
            let plans: Vec<RowPlan> = samplers.iter_mut().map(|s| s.plan(Vec::new())).collect();
            let sampling: Vec<RowSampling<'_>> = plans.iter().map(RowSampling::Summary).collect();
            let out = decode_sampling(backend, tables, &positions, &tokens, &sampling)?;
            for ((s, plan), summary) in samplers.iter_mut().zip(&plans).zip(out.summaries) {
                if let Some(summary) = summary {
                    s.finish(plan, summary)?;
                }
            }
        } else {
            let sampling = vec![RowSampling::Host; tables.len()];
            let mut out = decode_sampling(backend, tables, &positions, &tokens, &sampling)?;
            for (s, row) in samplers.iter_mut().zip(out.logits.chunks_exact_mut(vocab)) {
                s.sample(row)?;
            }
        }
        if i >= 4 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn backend_vocab(backend: &CudaBackend) -> usize {
    use strata_node::backend::Backend;
    backend.model_config().vocab_size
}

/// Graph replay against eager launches, bit for bit, at each batch size: sequences of staggered
/// context lengths (so the padded rows, the table width and the split counts all vary), the same
/// step run with graphs on and off. The canary changes one row's token in the eager run and
/// must be told apart.
pub(super) fn check_graphs(
    backend: &mut CudaBackend,
    batches: &[usize],
    context: usize,
    blocks_per_seq: usize,
    vocab: usize,
) -> Result<Value> {
    let mut checks = Vec::new();
    for &batch in batches {
        let (tables, contexts, tokens) =
            staggered_batch(backend, batch, context, blocks_per_seq, vocab)?;
        backend.set_graphs(true);
        let graphs_before = backend.captured_graphs();
        let replayed = decode_step(backend, &tables, &contexts, &tokens)?;
        // A second replay of the same graph, after its capture.
        let replayed_again = decode_step(backend, &tables, &contexts, &tokens)?;
        backend.set_graphs(false);
        let eager = decode_step(backend, &tables, &contexts, &tokens)?;
        let mut canary_tokens = tokens.clone();
        canary_tokens[0] = (canary_tokens[0] + 1) % vocab as u32;
        let canary = decode_step(backend, &tables, &contexts, &canary_tokens)?;
        backend.set_graphs(true);
        let same = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        let identical = same(&replayed, &eager) && same(&replayed_again, &eager);
        let canary_caught = !same(&canary, &eager);
        let captured = backend.captured_graphs() > graphs_before;
        println!(
            "  graphs batch {batch:>3}: replay {} eager, canary {}, {} graph(s) cached",
            if identical { "==" } else { "!=" },
            if canary_caught { "caught" } else { "MISSED" },
            backend.captured_graphs()
        );
        ensure!(
            identical,
            "batch {batch}: graph replay differs from eager launches"
        );
        ensure!(
            canary_caught,
            "batch {batch}: the canary was not told apart"
        );
        checks.push(json!({"batch": batch, "bitwise_identical": identical,
            "canary_caught": canary_caught, "captured_new_graph": captured}));
    }
    Ok(Value::Array(checks))
}
