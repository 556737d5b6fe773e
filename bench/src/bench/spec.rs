//! `strata bench spec`: speculative decoding against plain decoding on one engine, side by side
//! in one run. For each draft length it checks that every request's output is byte-identical to
//! the plain arm's (greedy, and seeded sampling with `--sampled`), and reports acceptance, mean
//! accepted length and decode speed per concurrency. On the CPU reference and on CUDA alike.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use strata_model::chat::ChatRequest;
use strata_node::speculative::{SpecCounters, SpecMethod, SpecPolicy, SpeculativeConfig};
use strata_node::{Device, Engine, EngineSpec, KvBudget, ServingParts, start_engine};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};

#[derive(Args)]
pub struct SpecArgs {
    /// A checkpoint (HF directory or GGUF file) [default: the packaged default model].
    #[arg(long)]
    model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Draft lengths (n-gram num_speculative_tokens), each an arm beside the plain one.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    k: Vec<usize>,
    /// Requests in flight at once, each a point of every arm.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Requests per point (raised to the concurrency): the first of the task's requests.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    /// Tokens generated per request at most.
    #[arg(long, default_value_t = 128)]
    tokens: u32,
    /// What the requests ask: `copy` rewrites a given source file or quotes a given text (what
    /// prompt lookup is for), `chat` asks open questions. A model without a chat template gets
    /// token prompts that repeat a stretch of themselves.
    #[arg(long, value_enum, default_value = "copy")]
    task: Task,
    /// Token prompts that repeat a stretch of themselves, run past end of sequence, whatever
    /// the model's template (for random-weight models, whose text means nothing).
    #[arg(long)]
    token_prompts: bool,
    /// Also run every request with seeded sampling (temperature 0.8, top-p 0.95).
    #[arg(long)]
    sampled: bool,
    /// KV cache, MiB [default: 1024].
    #[arg(long, default_value_t = 1024)]
    kv_cache_mib: usize,
    /// n-gram suffix lengths, MIN:MAX.
    #[arg(long, default_value = "2:4")]
    lookup: String,
    /// Propose with this draft checkpoint (the `draft_model` method) instead of n-gram lookup;
    /// the target's own path drafts for itself (every greedy proposal must be accepted).
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Verify every proposal whatever it costs (the `always` policy): the proposer's acceptance
    /// measured on every step, not only on the steps where speculation pays.
    #[arg(long)]
    always: bool,
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum Task {
    Copy,
    Chat,
}

/// Texts the copy task hands the model: this project's own sources and docs.
const COPY_SOURCES: [(&str, &str); 4] = [
    (
        "code",
        include_str!("../../../node/src/speculative/ngram.rs"),
    ),
    ("code", include_str!("../../../engine-api/src/hash.rs")),
    ("code", include_str!("../../../model/src/stop.rs")),
    ("text", include_str!("../../../docs/OPERATIONS.md")),
];

const CHAT_QUESTIONS: [&str; 6] = [
    "What are three good habits for writing readable code?",
    "Explain how a hash map works to a new programmer.",
    "Write a short story about a lighthouse keeper.",
    "What should I pack for a week of hiking in the mountains?",
    "Describe the water cycle in simple words.",
    "Give me a recipe for a quick vegetable soup.",
];

/// One arm at one concurrency: outputs in request order, and timings.
struct Point {
    outputs: Vec<Vec<u32>>,
    seconds: f64,
    /// Per request: seconds from its first token to its last.
    decode_s: Vec<f64>,
}

impl Point {
    fn tokens(&self) -> usize {
        self.outputs.iter().map(Vec::len).sum()
    }

    /// Tokens per second of one sequence's decoding: the tokens after each request's first
    /// over the time from its first token to its last, summed over requests (prefill and
    /// queueing excluded).
    fn decode_rate(&self) -> f64 {
        let tokens: usize = self.outputs.iter().map(|o| o.len().saturating_sub(1)).sum();
        tokens as f64 / self.decode_s.iter().sum::<f64>().max(1e-9)
    }

    /// Output tokens per second of the whole point, prefill included.
    fn output_rate(&self) -> f64 {
        self.tokens() as f64 / self.seconds
    }

    fn summary(&self) -> Value {
        let mut tpot: Vec<f64> = self
            .outputs
            .iter()
            .zip(&self.decode_s)
            .map(|(o, s)| s / o.len().saturating_sub(1).max(1) as f64)
            .collect();
        tpot.sort_by(f64::total_cmp);
        json!({
            "output_tokens": self.tokens(),
            "seconds": self.seconds,
            "output_tok_per_s": self.output_rate(),
            "decode_tok_per_s": self.decode_rate(),
            "tpot_ms_median": tpot.get(tpot.len() / 2).map(|s| s * 1e3),
        })
    }
}

/// One speculative configuration per `--k`: n-gram lookup over `--lookup`, or the draft model.
fn configs(args: &SpecArgs) -> Result<Vec<SpeculativeConfig>> {
    ensure!(!args.k.is_empty(), "--k names no draft length");
    let (min, max) = args
        .lookup
        .split_once(':')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .context("--lookup takes MIN:MAX, e.g. 2:4")?;
    args.k
        .iter()
        .map(|&k| {
            let mut c = match &args.draft_model {
                Some(draft) => SpeculativeConfig {
                    method: SpecMethod::DraftModel,
                    model: Some(draft.clone()),
                    ..SpeculativeConfig::ngram(k)
                },
                None => SpeculativeConfig {
                    prompt_lookup_min: Some(min),
                    prompt_lookup_max: Some(max),
                    ..SpeculativeConfig::ngram(k)
                },
            };
            if args.always {
                c.policy = Some(SpecPolicy::Always);
            }
            c.validate().map(|()| c).map_err(anyhow::Error::msg)
        })
        .collect()
}

pub fn run(args: SpecArgs, default_model: impl FnOnce() -> Result<PathBuf>) -> Result<()> {
    ensure!(
        args.concurrency.iter().all(|&c| c > 0),
        "--concurrency must be at least 1"
    );
    let configs = configs(&args)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => default_model()?,
    };
    let spec = EngineSpec {
        kv: KvBudget::Bytes(args.kv_cache_mib << 20),
        ..EngineSpec::for_device(args.device)
    };
    let (engine, parts) = start_engine(&model, &spec)?;
    let requests = requests(&args, &parts, engine.model_config().vocab_size)?;
    let plain: Vec<Point> = args
        .concurrency
        .iter()
        .map(|&c| serve(&engine, point_requests(&requests, &args, c), c))
        .collect::<Result<_>>()?;
    drop(engine);
    let mut arms = Vec::new();
    let mut identical = true;
    println!(
        "{:>4} {:>5} {:>9} {:>10} {:>8} {:>11} {:>11} {:>8} {:>8}",
        "k",
        "conc",
        "identical",
        "acceptance",
        "mean len",
        "decode/seq",
        "plain",
        "decode x",
        "output x"
    );
    for config in &configs {
        let spec = EngineSpec {
            speculative: Some(config.clone()),
            ..spec.clone()
        };
        let (engine, _) = start_engine(&model, &spec)?;
        let mut points = Vec::new();
        let mut before = SpecCounters::default();
        for (&c, base) in args.concurrency.iter().zip(&plain) {
            let point = serve(&engine, point_requests(&requests, &args, c), c)?;
            let counters = engine.load().spec;
            let delta = counters_since(&counters, &before);
            before = counters;
            let same = point.outputs == base.outputs;
            identical &= same;
            println!(
                "{:>4} {:>5} {:>9} {:>10.3} {:>8.2} {:>11.1} {:>11.1} {:>7.2}x {:>7.2}x",
                config.num_speculative_tokens,
                c,
                same,
                delta.acceptance_rate(),
                delta.mean_accepted_len(),
                point.decode_rate(),
                base.decode_rate(),
                point.decode_rate() / base.decode_rate(),
                point.output_rate() / base.output_rate(),
            );
            points.push(json!({
                "concurrency": c,
                "identical": same,
                "differing_requests": point.outputs.iter().zip(&base.outputs)
                    .enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i)
                    .collect::<Vec<_>>(),
                "spec": point.summary(),
                "plain": base.summary(),
                "decode_speedup": point.decode_rate() / base.decode_rate(),
                "output_speedup": point.output_rate() / base.output_rate(),
                "drafts": delta.drafts,
                "draft_tokens": delta.draft_tokens,
                "accepted_tokens": delta.accepted_tokens,
                "acceptance_rate": delta.acceptance_rate(),
                "mean_accepted_len": delta.mean_accepted_len(),
                "accepted_hist": delta.accepted_hist,
            }));
        }
        arms.push(json!({"config": config, "points": points}));
    }
    let report = json!({
        "model": model,
        "device": args.device.to_string(),
        "task": format!("{:?}", args.task).to_lowercase(),
        "requests": requests.len(),
        "max_tokens": args.tokens,
        "sampled": args.sampled,
        "identical": identical,
        "arms": arms,
    });
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    ensure!(
        identical,
        "speculative output differs from plain decoding (see the table)"
    );
    Ok(())
}

/// The requests of a point at concurrency `c`: the first max(--requests, c) of each sampling
/// kind (greedy, then seeded when `--sampled`).
fn point_requests<'a>(
    requests: &'a [GenerateRequest],
    args: &SpecArgs,
    c: usize,
) -> &'a [GenerateRequest] {
    let kinds = if args.sampled { 2 } else { 1 };
    let n = args.requests.max(c) * kinds;
    &requests[..n.min(requests.len())]
}

fn counters_since(now: &SpecCounters, before: &SpecCounters) -> SpecCounters {
    let mut hist = now.accepted_hist;
    for (h, b) in hist.iter_mut().zip(before.accepted_hist) {
        *h -= b;
    }
    SpecCounters {
        drafts: now.drafts - before.drafts,
        draft_tokens: now.draft_tokens - before.draft_tokens,
        accepted_tokens: now.accepted_tokens - before.accepted_tokens,
        accepted_hist: hist,
    }
}

/// The task's requests: greedy, each followed (with `--sampled`) by its prompt seeded and sampled.
fn requests(args: &SpecArgs, parts: &ServingParts, vocab: usize) -> Result<Vec<GenerateRequest>> {
    let n = args
        .requests
        .max(args.concurrency.iter().copied().max().unwrap_or(1));
    let template = parts.template.as_ref().filter(|_| !args.token_prompts);
    let prompts: Vec<(Vec<u32>, bool)> = match template {
        Some(template) => (0..n)
            .map(|i| {
                let user = match args.task {
                    Task::Copy => {
                        let (kind, text) = COPY_SOURCES[i % COPY_SOURCES.len()];
                        match kind {
                            "code" => format!(
                                "Rewrite this Rust code exactly as it is, with every comment \
                                 removed. Reply with the code only.\n\n```rust\n{text}```"
                            ),
                            _ => format!(
                                "Quote the three most important sentences of this text word \
                                 for word, each on its own line.\n\n{text}"
                            ),
                        }
                    }
                    Task::Chat => CHAT_QUESTIONS[i % CHAT_QUESTIONS.len()].to_string(),
                };
                let text = template.render(&ChatRequest {
                    messages: vec![json!({"role": "user", "content": user})],
                    tools: None,
                    add_generation_prompt: true,
                    extra: Default::default(),
                })?;
                Ok((parts.tokenizer.encode(&text, false)?, false))
            })
            .collect::<Result<_>>()?,
        None => (0..n).map(|i| (token_prompt(i, vocab), true)).collect(),
    };
    let mut requests: Vec<GenerateRequest> = prompts
        .iter()
        .map(|(prompt, ignore_eos)| GenerateRequest {
            resume: None,
            embed: None,
            prompt: prompt.clone(),
            sampling: SamplingParams {
                max_tokens: args.tokens,
                ignore_eos: *ignore_eos,
                ..SamplingParams::greedy()
            },
            cache_salt: 0,
            deadline: None,
            constraint: None,
        })
        .collect();
    if args.sampled {
        // Interleaved, so the first 2m requests are m prompts greedy and seeded.
        requests = requests
            .into_iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let mut sampled = r.clone();
                sampled.sampling.temperature = 0.8;
                sampled.sampling.top_p = 0.95;
                sampled.sampling.seed = 7 + i as u64;
                [r, sampled]
            })
            .collect();
    }
    Ok(requests)
}

/// A deterministic token prompt: 40 tokens, a 96-token stretch, 16 tokens, the stretch again.
fn token_prompt(i: usize, vocab: usize) -> Vec<u32> {
    let tok = |seed: usize, j: usize| {
        (((j as u64 * 2_654_435_761) ^ ((seed as u64 + 1) * 40_503)) % vocab.min(30_000) as u64)
            as u32
    };
    let stretch: Vec<u32> = (0..96).map(|j| tok(1000 + i, j)).collect();
    let head: Vec<u32> = (0..40).map(|j| tok(i, j)).collect();
    let mid: Vec<u32> = (0..16).map(|j| tok(500 + i, j)).collect();
    [head, stretch.clone(), mid, stretch].concat()
}

/// A finished request: its index, tokens and seconds from its first token to its last.
type Done = (usize, Vec<u32>, f64);

/// Runs `requests` with `concurrency` in flight (closed loop), in request order.
fn serve(engine: &Engine, requests: &[GenerateRequest], concurrency: usize) -> Result<Point> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let results: Vec<Result<Vec<Done>>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(request) = requests.get(i) else {
                            return Ok(done);
                        };
                        let (ids, decode_s) = generate(engine, request.clone())?;
                        done.push((i, ids, decode_s));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| bail!("a benchmark worker panicked"))
            })
            .collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut outputs = vec![Vec::new(); requests.len()];
    let mut decode_s = Vec::new();
    for done in results {
        for (i, ids, t) in done? {
            outputs[i] = ids;
            decode_s.push(t);
        }
    }
    Ok(Point {
        outputs,
        seconds,
        decode_s,
    })
}

/// One request's tokens and the seconds from its first token to its last.
fn generate(engine: &Engine, request: GenerateRequest) -> Result<(Vec<u32>, f64)> {
    let mut stream = engine.submit(request)?;
    let mut ids = Vec::new();
    let mut first: Option<Instant> = None;
    while let Some(event) = stream.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => {
                first.get_or_insert_with(Instant::now);
                ids.push(id);
            }
            TokenEvent::Finished { .. } => break,
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                bail!("generation failed: {message}")
            }
            TokenEvent::Embedding { .. } => bail!("the engine answered with an embedding"),
        }
    }
    let after_first = first.map_or(Duration::ZERO, |f| f.elapsed());
    Ok((ids, after_first.as_secs_f64()))
}
