//! The threaded `Engine` handle: streaming, refusals with numbers, cancellation, deadlines.

use std::time::Duration;

use strata_model::config::Architecture;
use strata_model::cpu::CpuModel;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::backend::CpuBackend;
use strata_node::scheduler::SchedulerLimits;
use strata_node::{Engine, EngineConfig, RequestStream, SubmitError};
use strata_protocol::{FinishReason, GenerateRequest, SamplingParams, TokenEvent, Usage};

fn engine(device_blocks: usize) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&SynthSpec::tiny(Architecture::Llama, 3), dir.path(), None).unwrap();
    let backend = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, device_blocks);
    let config = EngineConfig {
        limits: SchedulerLimits::default(),
        host_blocks: 0,
        disk: None,
        eos_token_ids: vec![],
    };
    (dir, Engine::start(Box::new(backend), config).unwrap())
}

fn request(prompt_len: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: (0..prompt_len as u32).map(|i| i % 250).collect(),
        sampling: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: 0,
        deadline: None,
    }
}

fn drain(mut stream: RequestStream) -> (Vec<u32>, FinishReason, Usage) {
    let mut tokens = Vec::new();
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, logprob } => {
                assert!(logprob <= 0.0);
                tokens.push(id);
            }
            TokenEvent::Finished { reason, usage } => return (tokens, reason, usage),
            TokenEvent::Failed { message } => panic!("{message}"),
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

#[test]
fn cancel_deadline_and_disconnect_end_requests() {
    let (_d, engine) = engine(64);
    let stream = engine.submit(request(20, 100_000)).unwrap();
    engine.cancel(stream.id).unwrap();
    assert_eq!(drain(stream).1, FinishReason::Cancelled);

    let mut r = request(20, 100_000);
    r.deadline = Some(Duration::from_millis(50));
    assert_eq!(drain(engine.submit(r).unwrap()).1, FinishReason::Timeout);

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
            block_table: &table,
            want_logits: true,
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
