//! The standing gate `run-spec` (docs/TESTING.md) on the CPU reference: speculative output is
//! byte-identical to plain output — greedy, seeded sampling, penalties and log-probabilities —
//! for draft lengths 1..=8, with staggered arrivals, through preemption, prefix-cache hits and
//! the host / disk tiers. Its canaries must fail it: a rollback one KV slot short, and
//! verification rows sent through the prompt path of a backend whose two paths differ.

use strata_protocol::{GenerateRequest, SamplingParams};

use super::{MAX_SPECULATIVE_TOKENS, SpecCounters, SpecMethod, SpeculativeConfig};
use crate::gates::{BackendFault, Harness, Setup, prompt, request};
use crate::scheduler::{Faults, SchedulerLimits};

/// A prompt that repeats a stretch of itself, so the n-gram proposer has something to find.
fn copy_heavy(seed: u32) -> Vec<u32> {
    let stretch = prompt(seed, 24);
    [
        prompt(seed + 50, 5),
        stretch.clone(),
        prompt(seed + 90, 3),
        stretch,
    ]
    .concat()
}

/// Requests of every sampling kind the scheduler draws differently: plain greedy (the device's
/// greedy token), seeded sampling, greedy with a repetition penalty and log-probabilities (the
/// host draws each row), and min_tokens over stop tokens (masked rows).
fn requests() -> Vec<GenerateRequest> {
    (0..12u32)
        .map(|i| {
            let mut r = request(copy_heavy(i));
            r.sampling = match i % 4 {
                0 => SamplingParams {
                    max_tokens: 40,
                    ..r.sampling
                },
                1 => SamplingParams {
                    max_tokens: 40,
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 1000 + u64::from(i),
                    ..r.sampling
                },
                2 => SamplingParams {
                    max_tokens: 40,
                    repetition_penalty: 1.1,
                    logprobs: Some(2),
                    ..r.sampling
                },
                _ => SamplingParams {
                    max_tokens: 40,
                    min_tokens: 30,
                    stop_token_ids: vec![r.prompt[3], r.prompt[7]],
                    ignore_eos: true,
                    ..r.sampling
                },
            };
            r
        })
        .collect()
}

/// Each request, arriving three steps after the one before, through one scheduler.
fn run(setup: Setup, requests: &[GenerateRequest]) -> (Vec<Vec<u32>>, SpecCounters, u64) {
    let arrivals: Vec<(u64, GenerateRequest)> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| (3 * i as u64, r.clone()))
        .collect();
    let mut h = Harness::new(setup);
    let out = h.outcomes(&arrivals);
    let out = out
        .into_iter()
        .map(|o| o.unwrap_or_else(|e| panic!("request failed: {e}")))
        .collect();
    (out, h.scheduler.spec_counters(), h.scheduler.preemptions())
}

fn ngram(k: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        prompt_lookup_min: Some(1),
        ..SpeculativeConfig::ngram(k)
    })
}

/// Whether speculation with `k` under `faults` (and `backend`) reproduces plain decoding over
/// `setup`'s KV sizes; the counters prove proposals were both accepted and rejected.
fn identical(
    k: usize,
    setup: impl Fn() -> Setup,
    faults: Faults,
    backend: BackendFault,
) -> (bool, SpecCounters, u64) {
    let requests = requests();
    let plain = run(
        Setup {
            backend_fault: backend,
            ..setup()
        },
        &requests,
    );
    let spec = run(
        Setup {
            speculative: ngram(k),
            faults,
            backend_fault: backend,
            ..setup()
        },
        &requests,
    );
    assert_eq!(plain.1, SpecCounters::default());
    (plain.0 == spec.0, spec.1, spec.2)
}

fn exercised(c: &SpecCounters) {
    assert!(c.accepted_tokens > 0, "some proposals were accepted: {c:?}");
    assert!(
        c.accepted_tokens < c.draft_tokens,
        "some proposals were rejected: {c:?}"
    );
}

#[test]
fn gate_spec_byte_identical_for_draft_lengths_1_to_8() {
    for k in 1..=MAX_SPECULATIVE_TOKENS {
        let (same, counters, _) =
            identical(k, Setup::default, Faults::default(), BackendFault::None);
        assert!(same, "k = {k}: speculative output differs from plain");
        exercised(&counters);
    }
}

/// A draft-model configuration (the model itself comes from `Setup::draft_seed`).
fn draft(k: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        method: SpecMethod::DraftModel,
        model: Some("synthesized".into()),
        ..SpeculativeConfig::ngram(k)
    })
}

#[test]
fn gate_spec_draft_model_byte_identical() {
    // The target drafting for itself (greedy rows all accepted, sampled ones not) and a model
    // of other weights (mostly rejected), at several draft lengths, with staggered arrivals.
    let requests = requests();
    let plain = run(Setup::default(), &requests);
    for (seed, k) in [(42, 3), (42, 8), (7, 2), (7, 5)] {
        let spec = run(
            Setup {
                speculative: draft(k),
                draft_seed: Some(seed),
                ..Setup::default()
            },
            &requests,
        );
        assert!(
            plain.0 == spec.0,
            "draft seed {seed}, k = {k}: outputs differ"
        );
        assert!(spec.1.drafts > 0, "draft seed {seed}: nothing was proposed");
        if seed == 42 {
            exercised(&spec.1);
        }
    }
    // Drafting for itself on plain greedy requests, the draft's K/V bookkeeping (catch-up after
    // rejections, rollback to the shared prefix) must make every proposal the target's token.
    let greedy: Vec<GenerateRequest> = requests.iter().step_by(4).cloned().collect();
    let own = run(
        Setup {
            speculative: draft(4),
            draft_seed: Some(42),
            ..Setup::default()
        },
        &greedy,
    );
    assert!(own.1.draft_tokens > 0);
    assert_eq!(own.1.accepted_tokens, own.1.draft_tokens, "{:?}", own.1);
    // The canary holds for a draft model too.
    let stale = run(
        Setup {
            speculative: draft(4),
            draft_seed: Some(7),
            faults: Faults {
                stale_slot_on_reject: true,
                ..Faults::default()
            },
            ..Setup::default()
        },
        &requests,
    );
    assert!(
        plain.0 != stale.0,
        "canary: a stale slot must fail the draft arm"
    );
}

#[test]
fn gate_spec_through_preemption_and_small_steps() {
    // 40 blocks of 16 tokens for 12 sequences of up to 98 tokens: sequences are preempted and
    // recomputed mid-generation; 24-token steps split prompts and cap proposals.
    let small = || Setup {
        device_blocks: 40,
        limits: SchedulerLimits {
            max_batch_tokens: 24,
            max_running: 64,
        },
        ..Setup::default()
    };
    let (same, counters, preemptions) = identical(5, small, Faults::default(), BackendFault::None);
    assert!(same);
    exercised(&counters);
    assert!(preemptions > 0, "the arm preempts");
}

#[test]
fn gate_spec_through_prefix_hits_and_tiers() {
    // Every request shares its 24-token stretch with another (seeds repeat mod 6 below), and
    // 24 device blocks push cached prefixes to the host or disk tier and back.
    for (host, disk) in [(0, 0), (64, 0), (1, 64)] {
        let tiers = || Setup {
            device_blocks: 24,
            host_blocks: host,
            disk_blocks: disk,
            ..Setup::default()
        };
        let requests: Vec<GenerateRequest> = requests()
            .into_iter()
            .enumerate()
            .map(|(i, mut r)| {
                r.prompt = copy_heavy(i as u32 % 6);
                r
            })
            .collect();
        let plain = run(tiers(), &requests);
        let spec = run(
            Setup {
                speculative: ngram(4),
                ..tiers()
            },
            &requests,
        );
        assert!(plain.0 == spec.0, "tiers ({host}, {disk}): outputs differ");
        exercised(&spec.1);
    }
}

#[test]
fn canary_spec_a_rollback_one_slot_short_fails() {
    let stale = Faults {
        stale_slot_on_reject: true,
        ..Faults::default()
    };
    let (same, _, _) = identical(4, Setup::default, stale, BackendFault::None);
    assert!(!same, "canary: a stale KV slot after a rejection must fail");
}

#[test]
fn canary_spec_verification_through_the_prompt_path_fails() {
    // With prompt and generated rows computed differently, verification through the generated
    // rows' path still matches plain decoding; through the prompt path it must not.
    let (same, counters, _) = identical(
        4,
        Setup::default,
        Faults::default(),
        BackendFault::PromptPathDiffers,
    );
    assert!(same);
    assert!(counters.drafts > 0);
    let as_prompt = Faults {
        verify_as_prompt: true,
        ..Faults::default()
    };
    let (same, _, _) = identical(
        4,
        Setup::default,
        as_prompt,
        BackendFault::PromptPathDiffers,
    );
    assert!(
        !same,
        "canary: verification rows through the prompt path must fail"
    );
}
