//! The threaded `Engine` handle: streaming, refusals with numbers, cancellation, deadlines.

use std::sync::Arc;
use std::time::Duration;

use strata_model::config::Architecture;
use strata_model::cpu::CpuModel;
use strata_model::grammar::GrammarCompiler;
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::tokenizer::Tokenizer;
use strata_node::backend::CpuBackend;
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Engine, EngineConfig, RequestStream, SubmitError};
use strata_protocol::{
    Constraint, FinishReason, GenerateRequest, SamplingParams, TokenEvent, Usage,
};

fn engine(device_blocks: usize) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), dir.path(), None).unwrap();
    let backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, device_blocks);
    let config = EngineConfig {
        limits: SchedulerLimits::default(),
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: None,
        speculative: None,
    };
    (dir, Engine::start(Box::new(backend), config).unwrap())
}

fn request(prompt_len: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        resume: None,
        embed: None,
        prompt: (0..prompt_len as u32).map(|i| i % 250).collect(),
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: 0,
        deadline: None,
        constraint: None,
    }
}

fn drain(mut stream: RequestStream) -> (Vec<u32>, FinishReason, Usage) {
    let mut tokens = Vec::new();
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, logprobs, .. } => {
                assert!(logprobs.is_none(), "not asked for");
                tokens.push(id);
            }
            TokenEvent::Finished { reason, usage } => return (tokens, reason, usage),
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                panic!("{message}")
            }
            TokenEvent::Embedding { .. } => panic!("an embedding for a generation"),
        }
    }
    panic!("stream ended without Finished");
}

#[test]
fn streams_tokens_then_usage_and_reuses_the_prefix() {
    let (_d, engine) = engine(64);
    let (a, reason, usage) = drain(engine.submit(request(40, 8)).unwrap());
    assert_eq!((a.len(), reason), (8, FinishReason::Length));
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens
        ),
        (40, 8, 0)
    );
    let (b, _, usage) = drain(engine.submit(request(40, 8)).unwrap());
    assert_eq!(a, b, "a prefix-cache hit generates the same tokens");
    assert_eq!(usage.cached_tokens, 32);
}

#[test]
fn refusals_carry_the_numbers() {
    let (_d, engine) = engine(4);
    let err = |r| engine.submit(r).err().expect("refused").to_string();
    assert_eq!(
        err(request(256, 1)),
        "prompt of 256 tokens exceeds the context window of 256 (room is needed for at least one generated token)"
    );
    assert!(
        err(request(100, 1))
            .contains("needs 7 KV blocks but the device holds 4 blocks of 16 tokens")
    );
    assert!(matches!(
        engine.submit(request(0, 1)),
        Err(SubmitError::EmptyPrompt)
    ));
    let mut r = request(4, 1);
    r.prompt[2] = 9999;
    assert!(err(r).contains("token id 9999 is outside the vocabulary of 320"));
    let mut r = request(4, 1);
    r.sampling.top_p = 0.0;
    assert!(err(r).contains("top_p"));
}

/// A prompt the device holds but not beside the blocks only pins hold is refused at submission
/// with both numbers (the scheduler's own refusal covers a pin made after submission).
#[test]
fn a_kv_refusal_names_the_blocks_pins_hold() {
    let (_d, engine) = engine(11);
    let primed = request(40, 1);
    drain(engine.submit(primed.clone()).unwrap());
    let hashes = strata_node::kv::prompt_block_hashes(&primed.prompt[..32], 16, 0);
    let pinned = engine.pin("doc".into(), hashes, None).unwrap().unwrap();
    assert_eq!(pinned.blocks, 2);
    // The load is published after each command, just after its reply: wait for the pin's.
    let published = |pinned: u64| {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while engine.load().pinned_blocks != pinned {
            assert!(std::time::Instant::now() < until, "{:?}", engine.load());
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    published(2);
    let refused = engine.submit(request(150, 1)).err().expect("refused");
    assert!(
        matches!(
            refused,
            SubmitError::KvCapacity {
                blocks: 10,
                capacity: 9,
                pinned: 2,
                ..
            }
        ),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("besides 2 held by pinned cached prefixes")
    );
    assert!(engine.unpin("doc".into()).unwrap());
    published(0);
    drain(engine.submit(request(150, 1)).unwrap());
}

#[test]
fn cancel_deadline_and_disconnect_end_requests() {
    let (_d, engine) = engine(64);
    let stream = engine.submit(request(20, 100_000)).unwrap();
    engine.cancel(stream.id).unwrap();
    assert_eq!(drain(stream).1, FinishReason::Cancelled);

    // A deadline that has passed when the engine next looks ends the request as a timeout,
    // whatever the machine's speed: a deadline of a few milliseconds raced the tiny model, whose
    // 236 tokens to its 256 positions take about 40 ms on two cores and less in release.
    let mut r = request(20, 100_000);
    r.deadline = Some(Duration::ZERO);
    let (tokens, reason, _) = drain(engine.submit(r).unwrap());
    assert_eq!((tokens.len(), reason), (0, FinishReason::Timeout));

    // A deadline past what the clock can name (a hostile peer's u64::MAX seconds) is no deadline:
    // the request runs to its length and the engine thread lives (it panicked on the overflow).
    let mut r = request(10, 3);
    r.deadline = Some(Duration::MAX);
    let (tokens, reason, _) = drain(engine.submit(r).unwrap());
    assert_eq!((tokens.len(), reason), (3, FinishReason::Length));

    // A dropped stream is a client that went away: the engine stops that request and serves on.
    drop(engine.submit(request(20, 100_000)).unwrap());
    let (tokens, reason, _) = drain(engine.submit(request(10, 3)).unwrap());
    assert_eq!((tokens.len(), reason), (3, FinishReason::Length));
}

#[test]
fn kv_events_stream_and_dump_agree() {
    use strata_node::kv::KvReplica;
    let (_d, engine) = engine(64);
    let start = engine.kv_dump().unwrap();
    let mut events = engine.subscribe_kv_events();
    let mut replica = KvReplica::from_dump(&start);
    drain(engine.submit(request(40, 30)).unwrap());
    drain(engine.submit(request(70, 5)).unwrap());
    while let Ok(event) = events.try_recv() {
        replica.apply(&event).unwrap();
    }
    let dump = engine.kv_dump().unwrap();
    assert!(dump.seq > start.seq && !dump.blocks.is_empty());
    assert_eq!(
        replica.to_dump(),
        dump,
        "replaying the events reproduces the dump"
    );
}

#[test]
fn paged_backend_matches_the_reference_forward_pass() {
    use strata_model::cpu::LogitRows;
    use strata_node::backend::{Backend, StepSeq};
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Qwen2, 8), dir.path(), None).unwrap();
    let reference = CpuModel::load(dir.path()).unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 31 + 7) % 300).collect();
    let mut cache = reference.new_cache();
    let want = reference
        .forward(&prompt, &mut cache, LogitRows::Last)
        .unwrap();
    let want_next = reference
        .forward(&[5], &mut cache, LogitRows::Last)
        .unwrap();

    let mut backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, 8);
    // Scattered, out-of-order blocks: the block table is the only thing that links them.
    let table = [6, 1, 4];
    let step = |b: &mut CpuBackend, tokens: &[u32], first: usize| {
        let seq = StepSeq {
            tokens,
            first_position: first,
            prompt_len: prompt.len(),
            block_table: &table,
            logit_rows: 1,
        };
        b.step(&[seq]).unwrap()
    };
    assert_eq!(step(&mut backend, &prompt, 0), want);
    assert_eq!(step(&mut backend, &[5], 37), want_next);
}

#[test]
fn a_sequence_that_outgrows_the_kv_pool_ends_with_length() {
    let (_d, engine) = engine(4);
    let (tokens, reason, usage) = drain(engine.submit(request(20, 1_000)).unwrap());
    // 4 blocks of 16 hold 64 positions; the 65th token is sampled but never needs KV.
    assert_eq!(
        (reason, usage.completion_tokens, tokens.len()),
        (FinishReason::Length, 45, 45)
    );
}

/// An engine over the tiny model with a grammar compiler (its tokenizer's end-of-sequence id
/// ends grammars), plus that tokenizer.
fn constrained_engine() -> (tempfile::TempDir, Engine, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), dir.path(), None).unwrap();
    let model = CpuModel::load(dir.path()).unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let eos = tokenizer.eos_token_id().unwrap();
    let grammar = GrammarCompiler::new(&tokenizer, model.config().vocab_size, &[eos]).unwrap();
    let config = EngineConfig {
        limits: SchedulerLimits::default(),
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: Some(Arc::new(grammar)),
        speculative: None,
    };
    let backend = CpuBackend::with_blocks(model, 16, 64);
    let engine = Engine::start(Box::new(backend), config).unwrap();
    (dir, engine, tokenizer)
}

#[test]
fn constrained_output_follows_the_schema_and_ends_with_it() {
    let (_d, constrained, tokenizer) = constrained_engine();
    let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"},
        "n":{"type":"integer","minimum":0,"maximum":99}},"required":["ok","n"],
        "additionalProperties":false}"#;
    for seed in 0..4 {
        let mut r = request(12, 64);
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed,
            max_tokens: 64,
            ..SamplingParams::default()
        };
        r.constraint = Some(Constraint::JsonSchema(schema.into()));
        let (tokens, reason, _) = drain(constrained.submit(r).unwrap());
        let text = tokenizer.decode(&tokens, false).unwrap();
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        assert!(value["ok"].is_boolean() && value["n"].as_u64().unwrap() < 100);
        assert_eq!(reason, FinishReason::Stop, "the grammar ended it: {text}");
    }
    // Canary: the same sampling without the constraint is not JSON.
    let mut free = request(12, 32);
    free.sampling.temperature = 1.0;
    let (tokens, _, _) = drain(constrained.submit(free).unwrap());
    let text = tokenizer.decode(&tokens, false).unwrap();
    assert!(
        serde_json::from_str::<serde_json::Value>(&text).is_err(),
        "{text}"
    );

    let mut bad = request(12, 8);
    bad.constraint = Some(Constraint::JsonSchema("{\"type\": ".into()));
    assert!(matches!(
        constrained.submit(bad),
        Err(SubmitError::Grammar(_))
    ));
    let (_d2, plain) = engine(64);
    let mut unsupported = request(12, 8);
    unsupported.constraint = Some(Constraint::JsonObject);
    assert!(matches!(
        plain.submit(unsupported),
        Err(SubmitError::GrammarUnavailable)
    ));
}

#[test]
fn logprobs_list_the_most_likely_tokens() {
    let (_d, engine) = engine(64);
    let mut r = request(20, 6);
    r.sampling.logprobs = Some(5);
    let mut stream = engine.submit(r).unwrap();
    let mut seen = 0;
    while let Some(event) = stream.events.blocking_recv() {
        let TokenEvent::Token { id, logprobs, .. } = event else {
            break;
        };
        let info = logprobs.expect("asked for logprobs");
        assert_eq!(info.top.len(), 5);
        // Greedy: the chosen token is the most likely one, with the same log-probability.
        assert_eq!(info.top[0], (id, info.logprob));
        assert!(info.logprob <= 0.0);
        assert!(info.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mass: f32 = info.top.iter().map(|(_, l)| l.exp()).sum();
        assert!(mass <= 1.0 + 1e-5);
        seen += 1;
    }
    assert_eq!(seen, 6);
    let mut too_many = request(20, 6);
    too_many.sampling.logprobs = Some(21);
    assert!(matches!(
        engine.submit(too_many),
        Err(SubmitError::Sampling(_))
    ));
}

/// Tokens and the RNG position after each, of a stream.
fn drain_positions(mut stream: RequestStream) -> (Vec<(u32, u64)>, Usage) {
    let mut out = Vec::new();
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, rng_pos, .. } => out.push((id, rng_pos)),
            TokenEvent::Finished { usage, .. } => return (out, usage),
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                panic!("{message}")
            }
            TokenEvent::Embedding { .. } => panic!("an embedding for a generation"),
        }
    }
    panic!("stream ended without Finished");
}

#[test]
fn a_sampled_request_resumed_elsewhere_continues_the_same_stream() {
    use strata_protocol::Resume;
    let sampled = |max_tokens| GenerateRequest {
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            presence_penalty: 0.4,
            frequency_penalty: 0.3,
            seed: 77,
            ..request(30, max_tokens).sampling
        },
        ..request(30, max_tokens)
    };
    let (_a, first) = engine(64);
    let (whole, usage) = drain_positions(first.submit(sampled(24)).unwrap());
    assert_eq!(whole.len(), 24);
    assert_eq!(usage.completion_tokens, 24);
    // Another engine (another node) continues after 10 tokens.
    let (_b, second) = engine(64);
    let cut = 10;
    let resume = |rng_pos| Resume {
        output: whole[..cut].iter().map(|&(t, _)| t).collect(),
        rng_pos,
    };
    let continued = GenerateRequest {
        resume: Some(resume(whole[cut - 1].1)),
        ..sampled(24)
    };
    let (rest, usage) = drain_positions(second.submit(continued).unwrap());
    assert_eq!(
        rest,
        whole[cut..],
        "the continuation differs from the first engine's stream"
    );
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (30, 24));
    // Canary: resuming the RNG from the start instead of its position changes the stream.
    let wrong = GenerateRequest {
        resume: Some(resume(0)),
        ..sampled(24)
    };
    let (rest, _) = drain_positions(second.submit(wrong).unwrap());
    assert_ne!(rest, whole[cut..]);
    // A continuation with nothing left to generate is refused.
    let spent = GenerateRequest {
        resume: Some(Resume {
            output: whole.iter().map(|&(t, _)| t).collect(),
            rng_pos: whole[23].1,
        }),
        ..sampled(24)
    };
    assert!(matches!(
        second.submit(spent),
        Err(SubmitError::ResumeSpent { output: 24, .. })
    ));
}

fn engine_with_eos(eos: Vec<u32>) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), dir.path(), None).unwrap();
    let backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, 64);
    let config = EngineConfig {
        limits: SchedulerLimits::default(),
        tiers: Default::default(),
        eos_token_ids: eos,
        grammar: None,
        speculative: None,
    };
    (dir, Engine::start(Box::new(backend), config).unwrap())
}

#[test]
fn ignore_eos_and_min_tokens_hold_back_the_end() {
    // The model's own first greedy tokens, with no end-of-sequence id at all.
    let (_d, free) = engine_with_eos(vec![]);
    let (free_run, _, _) = drain(free.submit(request(20, 8)).unwrap());
    let eos = free_run[0];
    let (_d, engine) = engine_with_eos(vec![eos]);
    let with = |f: fn(&mut SamplingParams)| {
        let mut r = request(20, 8);
        f(&mut r.sampling);
        drain(engine.submit(r).unwrap())
    };
    // The canary arm: honouring EOS, the model ends at once.
    let (tokens, reason, _) = with(|p| p.ignore_eos = false);
    assert_eq!((tokens.len(), reason), (0, FinishReason::Stop));
    // ignore_eos runs to max_tokens, the same tokens as a model without EOS.
    let (tokens, reason, _) = with(|p| p.ignore_eos = true);
    assert_eq!((&tokens, reason), (&free_run, FinishReason::Length));
    // min_tokens: EOS cannot be sampled for the first 3 tokens; a stop token id (with
    // ignore_eos) is held back the same way.
    let (tokens, _, _) = with(|p| {
        p.ignore_eos = false;
        p.min_tokens = 3;
    });
    assert!(tokens.len() >= 3, "{tokens:?}");
    assert!(!tokens[..3].contains(&eos), "{tokens:?}");
    let mut r = request(20, 8);
    r.sampling.stop_token_ids = vec![eos];
    r.sampling.min_tokens = 2;
    let (tokens, _, _) = drain(engine.submit(r).unwrap());
    assert!(
        tokens.len() >= 2 && !tokens[..2].contains(&eos),
        "{tokens:?}"
    );
    // min_tokens above max_tokens is refused by name.
    let mut r = request(20, 4);
    r.sampling.min_tokens = 5;
    let err = engine.submit(r).err().expect("refused").to_string();
    assert!(err.contains("min_tokens"), "{err}");
}

#[test]
fn step_times_account_for_every_step() {
    let (_d, engine) = engine(64);
    let before = engine.step_times();
    let (tokens, _, _) = drain(engine.submit(request(40, 8)).unwrap());
    assert_eq!(tokens.len(), 8);
    // Published before the next step or when idle: wait for the idle publication.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut times = engine.step_times();
    while times.steps < before.steps + 8 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        times = engine.step_times();
    }
    // One prefill step (40 tokens, sampling the first token), then 7 decode steps.
    assert_eq!(times.steps - before.steps, 8, "{times:?}");
    assert_eq!(times.tokens - before.tokens, 40 + 7, "{times:?}");
    assert!(times.forward_ns > 0 && times.plan_ns > 0 && times.sample_ns > 0);
}

/// Blocks evicted to the disk tier outlive the engine: a new engine over the same directory
/// and checkpoint restores them (reported as cached) and generates what a cold engine does; an
/// engine over another checkpoint of the same shape finds none of them (they name their tokens,
/// not the weights that computed them).
#[test]
fn a_context_parked_on_disk_survives_an_engine_restart() {
    use strata_node::{DiskTierSpec, EngineSpec, KvBudget, KvTiers, start_engine};
    let model = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), model.path(), None).unwrap();
    let other = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 4), other.path(), None).unwrap();
    let disk = tempfile::tempdir().unwrap();
    let target = request(80, 8);
    let (cold, _) = start_engine(model.path(), &EngineSpec::default()).unwrap();
    let block_bytes = cold.kv_layout().block_bytes;
    let (expected, _, _) = drain(cold.submit(target.clone()).unwrap());
    drop(cold);
    let spec = EngineSpec {
        kv: KvBudget::Bytes(8 * block_bytes),
        tiers: KvTiers {
            host_bytes: 0,
            disk: Some(DiskTierSpec {
                dir: disk.path().to_path_buf(),
                bytes: 64 * block_bytes,
            }),
            ..Default::default()
        },
        ..EngineSpec::default()
    };
    let (first, _) = start_engine(model.path(), &spec).unwrap();
    let (tokens, _, usage) = drain(first.submit(target.clone()).unwrap());
    assert_eq!((tokens, usage.cached_tokens), (expected.clone(), 0));
    // Other prompts take the 8 device blocks; the target's prefix goes to disk.
    for seed in 0..3u32 {
        let mut r = request(100, 1);
        r.prompt
            .iter_mut()
            .for_each(|t| *t = (*t + 7 * (seed + 1)) % 250);
        drain(first.submit(r).unwrap());
    }
    drop(first);

    let (restarted, _) = start_engine(model.path(), &spec).unwrap();
    let (tokens, _, usage) = drain(restarted.submit(target.clone()).unwrap());
    assert_eq!(
        usage.cached_tokens, 64,
        "the 4 full prompt blocks restored from disk"
    );
    assert_eq!(tokens, expected, "restored from disk equals cold");
    drop(restarted);

    let (stranger, _) = start_engine(other.path(), &spec).unwrap();
    let (_, _, usage) = drain(stranger.submit(target).unwrap());
    assert_eq!(
        usage.cached_tokens, 0,
        "another checkpoint's engine takes nothing back"
    );
}

#[test]
fn usage_reports_the_wait_in_the_engine_before_the_first_step() {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), dir.path(), None).unwrap();
    let backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, 64);
    let config = EngineConfig {
        limits: SchedulerLimits {
            max_running: 1,
            ..SchedulerLimits::default()
        },
        tiers: Default::default(),
        eos_token_ids: vec![],
        grammar: None,
        speculative: None,
    };
    let engine = Engine::start(Box::new(backend), config).unwrap();
    // One running slot: the second request waits for the first's 200 tokens.
    let first = engine.submit(request(40, 200)).unwrap();
    let second = engine.submit(request(24, 4)).unwrap();
    let (_, _, first_usage) = drain(first);
    let (_, _, second_usage) = drain(second);
    assert!(
        second_usage.queued_ms > first_usage.queued_ms && second_usage.queued_ms >= 1,
        "first waited {} ms, second {} ms",
        first_usage.queued_ms,
        second_usage.queued_ms
    );
}
