//! Engine overhead with no model math: what the scheduler, the block manager, the prefix index
//! and the KV event log cost per step, measured against a backend that computes nothing.
//!
//! Prints one JSON object to stdout (`scripts/bench/engine-overhead.sh` turns it into a receipt).
//! Every figure is the min / median / max over `REPS` repetitions, after a warm-up.

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use strata_model::ModelConfig;
use strata_model::sampler::Sampler;
use strata_node::backend::{Backend, BackendError, StepSeq};
use strata_node::kv::{
    BlockHash, BlockId, BlockManager, BlockManagerConfig, KvBlockIo, KvError, KvEventKind,
    KvEventLog, Tier, prompt_block_hashes,
};
use strata_node::scheduler::{Scheduler, SchedulerLimits, Sequence};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

const REPS: usize = 7;
const VOCAB: usize = 320;
const BLOCK_SIZE: usize = 16;
const BLOCK_BYTES: usize = 64;

// Scheduler figure.
const SEQS: usize = 256;
const PROMPT: usize = 64;
const WARMUP_STEPS: usize = 50;
const STEPS_PER_REP: usize = 100;

// Prefix index figures.
const INDEX_BLOCKS: usize = 100_000;
const CHAIN: usize = 64;
const HASH_TOKENS: usize = 1 << 20;

// Event figures.
const EVENTS: usize = 1_000_000;
const EVENT_CAPACITY: usize = 4096;
const DRAIN_EVERY: usize = 1024;

const MODEL_CONFIG: &str = r#"{
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1000000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": false,
    "eos_token_id": 2
}"#;

/// A backend that computes nothing: zero logits for every sequence that wants them, and a plain
/// byte pool behind export/import so tier moves cost a copy, as on the CPU backend.
struct NullBackend {
    config: ModelConfig,
    num_blocks: usize,
    pool: Vec<u8>,
}

impl NullBackend {
    fn new(num_blocks: usize) -> BenchResult<Self> {
        let config = ModelConfig::from_json(MODEL_CONFIG)?;
        assert_eq!(config.vocab_size, VOCAB, "MODEL_CONFIG and VOCAB agree");
        Ok(Self {
            config,
            num_blocks,
            pool: vec![0; num_blocks * BLOCK_BYTES],
        })
    }
}

impl KvBlockIo for NullBackend {
    fn block_bytes(&self) -> usize {
        BLOCK_BYTES
    }

    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let at = id as usize * BLOCK_BYTES;
        out.copy_from_slice(&self.pool[at..at + BLOCK_BYTES]);
        Ok(())
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        let at = id as usize * BLOCK_BYTES;
        self.pool[at..at + BLOCK_BYTES].copy_from_slice(data);
        Ok(())
    }
}

impl Backend for NullBackend {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn block_size(&self) -> usize {
        BLOCK_SIZE
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn kv_layout(&self) -> String {
        "none".into()
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        let rows = seqs.iter().map(|s| s.logit_rows).sum::<usize>();
        Ok(vec![0.0; rows * VOCAB])
    }
}

/// min / median / max of `samples`, with the samples themselves.
fn stats(samples: &[f64]) -> Value {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    json!({
        "min": sorted[0],
        "median": sorted[sorted.len() / 2],
        "max": sorted[sorted.len() - 1],
        "samples": samples,
    })
}

fn per_second(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

/// Drains every stream; returns the tokens received. Receivers stay alive (dropping one cancels
/// its request).
fn drain(receivers: &mut [UnboundedReceiver<TokenEvent>]) -> usize {
    let mut tokens = 0;
    for rx in receivers {
        while let Ok(event) = rx.try_recv() {
            match event {
                TokenEvent::Token { .. } => tokens += 1,
                other => panic!("a request ended during the benchmark: {other:?}"),
            }
        }
    }
    tokens
}

/// Decode steps of `SEQS` sequences × 1 token. The event drain runs outside the timed region.
fn scheduler_step() -> BenchResult<Value> {
    // Every sequence grows by one block per BLOCK_SIZE steps; leave room for all of them.
    let steps = 1 + WARMUP_STEPS + REPS * STEPS_PER_REP;
    let device_blocks = SEQS * (PROMPT + steps).div_ceil(BLOCK_SIZE) * 2;
    let mut backend = NullBackend::new(device_blocks)?;
    let blocks = BlockManager::new(
        BlockManagerConfig {
            block_size: BLOCK_SIZE,
            device_blocks,
            host_blocks: 0,
            disk: None,
        },
        BLOCK_BYTES,
    )?;
    let limits = SchedulerLimits {
        max_batch_tokens: SEQS * PROMPT,
        max_running: SEQS,
    };
    let context_window = backend.model_config().max_position_embeddings;
    let mut scheduler = Scheduler::new(limits, blocks, vec![2], context_window);
    let sampling = SamplingParams {
        temperature: 0.0,
        max_tokens: u32::MAX,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut receivers = Vec::with_capacity(SEQS);
    for i in 0..SEQS {
        // Distinct first tokens: no two prompts share a cached block.
        let prompt: Vec<u32> = (0..PROMPT).map(|j| ((i + j * 7) % VOCAB) as u32).collect();
        let (tx, rx) = unbounded_channel();
        let request = GenerateRequest {
            resume: None,
            embed: None,
            prompt,
            sampling: sampling.clone(),
            cache_salt: 0,
            deadline: None,
            constraint: None,
        };
        let sampler = Sampler::new(&sampling, VOCAB)?;
        scheduler.add(Sequence::new(i as u64, request, sampler, tx));
        receivers.push(rx);
    }

    // Prefill: until every sequence has its first token, so each later step is pure decode.
    let mut first_tokens = 0;
    while first_tokens < SEQS {
        scheduler.step(&mut backend)?;
        first_tokens += drain(&mut receivers);
    }
    let mut timed_step = |scheduler: &mut Scheduler| -> BenchResult<Duration> {
        let start = Instant::now();
        let computed = scheduler.step(&mut backend)?;
        let elapsed = start.elapsed();
        assert_eq!(computed, SEQS, "every step decodes one token per sequence");
        assert_eq!(drain(&mut receivers), SEQS);
        Ok(elapsed)
    };
    for _ in 0..WARMUP_STEPS {
        timed_step(&mut scheduler)?;
    }
    let mut per_step_us = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let mut total = Duration::ZERO;
        for _ in 0..STEPS_PER_REP {
            total += timed_step(&mut scheduler)?;
        }
        per_step_us.push(total.as_secs_f64() * 1e6 / STEPS_PER_REP as f64);
    }
    assert_eq!(scheduler.preemptions(), 0, "the pool never ran out");
    let per_token_ns: Vec<f64> = per_step_us
        .iter()
        .map(|us| us * 1e3 / SEQS as f64)
        .collect();
    Ok(json!({
        "what": "Scheduler::step with a null backend (zero logits, no model math): plan, block \
                 reservation, block commits every block_size steps, greedy sampling over the \
                 vocab, token events. The backend's logits Vec allocation is included; draining \
                 the token streams is not.",
        "params": {
            "running_sequences": SEQS,
            "prompt_tokens": PROMPT,
            "block_size": BLOCK_SIZE,
            "device_blocks": device_blocks,
            "vocab": VOCAB,
            "max_batch_tokens": limits.max_batch_tokens,
            "warmup_steps": WARMUP_STEPS,
            "steps_per_rep": STEPS_PER_REP,
            "reps": REPS,
        },
        "us_per_step": stats(&per_step_us),
        "ns_per_sequence_token": stats(&per_token_ns),
    }))
}

/// `CHAIN`-long hash chains covering `INDEX_BLOCKS` blocks, all distinct.
fn hash_chains() -> Vec<Vec<BlockHash>> {
    (0..INDEX_BLOCKS / CHAIN)
        .map(|c| {
            let tokens: Vec<u32> = (0..CHAIN * BLOCK_SIZE)
                .map(|t| (c * 31 + t) as u32)
                .collect();
            prompt_block_hashes(&tokens, BLOCK_SIZE, c as u64)
        })
        .collect()
}

fn index_manager() -> BenchResult<BlockManager> {
    Ok(BlockManager::new(
        BlockManagerConfig {
            block_size: BLOCK_SIZE,
            device_blocks: INDEX_BLOCKS,
            host_blocks: 0,
            disk: None,
        },
        BLOCK_BYTES,
    )?)
}

/// Allocates and commits every chain; returns the elapsed time of that alone.
fn insert_all(
    manager: &mut BlockManager,
    io: &mut NullBackend,
    chains: &[Vec<BlockHash>],
) -> BenchResult<Duration> {
    let start = Instant::now();
    for chain in chains {
        let mut parent = None;
        for &hash in chain {
            let id = manager.allocate(io)?;
            manager.commit(id, hash, parent)?;
            parent = Some(hash);
        }
    }
    Ok(start.elapsed())
}

fn prefix_index() -> BenchResult<Value> {
    let chains = hash_chains();
    let hashes = chains.len() * CHAIN;
    let mut io = NullBackend::new(INDEX_BLOCKS)?;

    // Insert: a fresh manager per repetition (built outside the timed region).
    insert_all(&mut index_manager()?, &mut io, &chains)?;
    let mut insert_per_s = Vec::with_capacity(REPS);
    let mut manager = index_manager()?;
    for rep in 0..REPS {
        if rep > 0 {
            manager = index_manager()?;
        }
        let elapsed = insert_all(&mut manager, &mut io, &chains)?;
        insert_per_s.push(per_second(hashes, elapsed));
    }

    // Lookup: every chain is a full hit on the last manager.
    let lookup_all = |manager: &BlockManager| {
        let start = Instant::now();
        for chain in &chains {
            let found = manager.lookup(black_box(chain));
            assert_eq!(found.device, CHAIN, "every chain is cached on device");
        }
        start.elapsed()
    };
    lookup_all(&manager);
    let mut chains_per_s = Vec::with_capacity(REPS);
    let mut lookup_hashes_per_s = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let elapsed = lookup_all(&manager);
        chains_per_s.push(per_second(chains.len(), elapsed));
        lookup_hashes_per_s.push(per_second(hashes, elapsed));
    }

    // Hashing: chained block hashes of one long prompt.
    let tokens: Vec<u32> = (0..HASH_TOKENS as u32).map(|t| t % 128_256).collect();
    let hash_once = || {
        let start = Instant::now();
        let out = prompt_block_hashes(black_box(&tokens), BLOCK_SIZE, 0);
        let elapsed = start.elapsed();
        assert_eq!(out.len(), HASH_TOKENS / BLOCK_SIZE);
        elapsed
    };
    hash_once();
    let hash_tokens_per_s: Vec<f64> = (0..REPS)
        .map(|_| per_second(HASH_TOKENS, hash_once()))
        .collect();

    Ok(json!({
        "what": "BlockManager prefix index (device tier only). insert = allocate + commit of a \
                 new hash (includes publishing its Stored event with no subscriber); lookup = \
                 BlockManager::lookup of a fully cached chain; hashing = prompt_block_hashes.",
        "params": {
            "device_blocks": INDEX_BLOCKS,
            "hashes": hashes,
            "chain_length": CHAIN,
            "block_size": BLOCK_SIZE,
            "hash_tokens": HASH_TOKENS,
            "reps": REPS,
        },
        "insert_per_s": stats(&insert_per_s),
        "lookup_chains_per_s": stats(&chains_per_s),
        "lookup_hashes_per_s": stats(&lookup_hashes_per_s),
        "hash_tokens_per_s": stats(&hash_tokens_per_s),
    }))
}

fn stored(i: usize) -> KvEventKind {
    KvEventKind::Stored {
        hash: BlockHash(i as u128),
        parent: i.checked_sub(1).map(|p| BlockHash(p as u128)),
        tier: Tier::Device,
    }
}

/// Publishes `EVENTS` events; with a subscriber, it drains every `DRAIN_EVERY` events on the same
/// thread (under the channel capacity, so it never lags) and the drain is timed too.
fn publish_run(subscribed: bool) -> f64 {
    let mut log = KvEventLog::new(EVENT_CAPACITY);
    let mut subscriber = subscribed.then(|| log.subscribe());
    let mut received = 0;
    let start = Instant::now();
    for i in 0..EVENTS {
        black_box(log.publish(stored(i)));
        if let Some(rx) = &mut subscriber
            && (i + 1) % DRAIN_EVERY == 0
        {
            while let Ok(event) = rx.try_recv() {
                black_box(&event);
                received += 1;
            }
        }
    }
    let elapsed = start.elapsed();
    if subscribed {
        assert_eq!(
            received,
            EVENTS / DRAIN_EVERY * DRAIN_EVERY,
            "no event lost"
        );
    }
    per_second(EVENTS, elapsed)
}

fn event_log() -> Value {
    let mut figures = serde_json::Map::new();
    for (name, subscribed) in [("no_subscriber", false), ("one_subscriber_draining", true)] {
        publish_run(subscribed);
        let per_s: Vec<f64> = (0..REPS).map(|_| publish_run(subscribed)).collect();
        figures.insert(format!("{name}_events_per_s"), stats(&per_s));
    }
    let mut out = json!({
        "what": "KvEventLog::publish of Stored events. With a subscriber, the same thread drains \
                 it with try_recv every drain_every events and that drain is inside the timing.",
        "params": {
            "events": EVENTS,
            "channel_capacity": EVENT_CAPACITY,
            "drain_every": DRAIN_EVERY,
            "reps": REPS,
        },
    });
    out.as_object_mut().expect("json! object").extend(figures);
    out
}

fn main() -> BenchResult<()> {
    let report = json!({
        "bench": "engine_overhead",
        "scheduler_decode_step": scheduler_step()?,
        "prefix_index": prefix_index()?,
        "event_log": event_log(),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
