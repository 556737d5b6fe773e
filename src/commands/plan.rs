//! `strata plan`: how many nodes a workload needs (the capacity planner of
//! `strata_router::plan`, the same answer the dashboard gives), and `strata plan measure`, which
//! measures a node's profile on this machine.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use strata_node::{Engine, start_engine};
use strata_protocol::{GenerateRequest, SamplingParams, TokenEvent};
use strata_router::plan::{
    DecodePoint, Load, Plan, Prefill, Profile, Source, Workload, builtin, builtin_names,
};

use super::engine_args::EngineSettings;
use super::generate::{default_cache_dir, default_model};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanArgs {
    #[command(subcommand)]
    command: Option<PlanCommand>,
    #[command(flatten)]
    size: SizeArgs,
}

#[derive(Subcommand)]
enum PlanCommand {
    /// List the profiles shipped in the binary, with the receipts they come from.
    Profiles,
    /// Measure this machine's node (decode steps by batch, prefill rate) into a profile file.
    Measure(Box<MeasureArgs>),
}

#[derive(Args)]
struct SizeArgs {
    /// A shipped profile's name (`strata plan profiles`) or a profile file from
    /// `strata plan measure`.
    #[arg(long, default_value = "h200-llama-3.1-8b")]
    profile: String,
    /// Requests per second arriving (open loop).
    #[arg(
        long,
        conflicts_with = "concurrency",
        required_unless_present = "concurrency"
    )]
    rate: Option<f64>,
    /// Clients each keeping one request in flight (closed loop).
    #[arg(long)]
    concurrency: Option<f64>,
    /// Mean prompt tokens per request.
    #[arg(long, default_value_t = 512.0)]
    prompt_tokens: f64,
    /// Mean output tokens per request.
    #[arg(long, default_value_t = 128.0)]
    output_tokens: f64,
    /// Share of prompt tokens found in the prefix cache (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    prefix_share: f64,
    /// Time-to-first-token target, milliseconds.
    #[arg(long)]
    ttft_ms: Option<f64>,
    /// Inter-token latency target, milliseconds.
    #[arg(long)]
    itl_ms: Option<f64>,
    /// Evaluate exactly this many nodes (a what-if) instead of finding the fewest.
    #[arg(long)]
    nodes: Option<usize>,
    /// Print the answer as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MeasureArgs {
    /// Checkpoint (default: the default model, or the demo model with --random-model).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, conflicts_with = "model")]
    random_model: bool,
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Decode batches to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    batches: Vec<usize>,
    /// Prompt tokens of the prefill measurement (and of each decode sequence's prompt).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Decode tokens per sequence of a batch measurement.
    #[arg(long, default_value_t = 48)]
    steps: u32,
    /// The profile's name.
    #[arg(long, default_value = "measured")]
    name: String,
    /// Where to write the profile (JSON).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    engine: EngineSettings,
}

pub fn run(args: PlanArgs) -> Result<()> {
    match args.command {
        Some(PlanCommand::Profiles) => {
            for name in builtin_names() {
                let p = builtin(name).context("a shipped profile does not parse")?;
                println!("{name}: {} — {}", p.device, p.model);
                let mut receipts: Vec<&str> =
                    p.decode.iter().map(|d| d.source.receipt.as_str()).collect();
                receipts.push(&p.prefill.source.receipt);
                receipts.dedup();
                println!("    from {}", receipts.join(", "));
            }
            Ok(())
        }
        Some(PlanCommand::Measure(m)) => measure(*m),
        None => size(args.size),
    }
}

/// A shipped profile by name, else a profile file.
pub fn load_profile(name: &str) -> Result<Profile> {
    if let Some(p) = builtin(name) {
        return Ok(p);
    }
    let path = PathBuf::from(name);
    if !path.exists() {
        bail!(
            "no profile `{name}`: neither a shipped one ({}) nor a file",
            builtin_names().join(", ")
        );
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let profile: Profile = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a profile", path.display()))?;
    profile.check()?;
    Ok(profile)
}

fn size(args: SizeArgs) -> Result<()> {
    let profile = load_profile(&args.profile)?;
    let load = match (args.rate, args.concurrency) {
        (Some(r), None) => Load::Rate(r),
        (None, Some(c)) => Load::Concurrency(c),
        _ => bail!("give one of --rate and --concurrency"),
    };
    let work = Workload {
        load,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        prefix_share: args.prefix_share,
        ttft_ms: args.ttft_ms,
        itl_ms: args.itl_ms,
    };
    let plan = match args.nodes {
        Some(n) => profile.evaluate(&work, n)?,
        None => profile.size(&work)?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render(&plan));
    }
    Ok(())
}

/// The plan in words, as the terminal shows it.
pub fn render(plan: &Plan) -> String {
    use std::fmt::Write;
    let c = &plan.cluster;
    let n = &c.per_node;
    let mut out = String::new();
    let load = match plan.workload.load {
        Load::Rate(r) => format!("{r} requests/s"),
        Load::Concurrency(k) => format!("{k} concurrent clients"),
    };
    let _ = writeln!(
        out,
        "{} of {} ({}): {load}, {} prompt + {} output tokens, prefix share {}",
        plan.profile,
        plan.model,
        plan.device,
        plan.workload.prompt_tokens,
        plan.workload.output_tokens,
        plan.workload.prefix_share
    );
    let gpus = if c.gpus > 0 {
        format!(" ({} GPU{})", c.gpus, if c.gpus == 1 { "" } else { "s" })
    } else {
        String::new()
    };
    let verdict = if c.meets_targets {
        "meets the targets"
    } else {
        "does NOT meet the targets"
    };
    let _ = writeln!(out, "nodes: {}{gpus} — {verdict}", c.nodes);
    let _ = writeln!(
        out,
        "per node: {:.2} requests/s, {:.0} output tokens/s, batch {:.1}, prefill {:.0} % of the time",
        n.requests_per_s,
        n.output_tokens_per_s,
        n.batch,
        n.prefill_share * 100.0
    );
    let _ = writeln!(
        out,
        "latency: TTFT {:.0} ms, ITL {:.1} ms; cluster output {:.0} tokens/s",
        n.ttft_ms, n.itl_ms, c.output_tokens_per_s
    );
    if let Some(h) = c.headroom {
        let _ = writeln!(
            out,
            "headroom: the load can grow {h:.2}x with the targets met"
        );
    }
    if let Some(limit) = &n.limit {
        let _ = writeln!(out, "limit: {limit}");
    }
    let _ = writeln!(out, "from:");
    for f in &plan.sources {
        let at = if f.source.pointer.is_empty() {
            String::new()
        } else {
            format!(" {}", f.source.pointer)
        };
        let _ = writeln!(
            out,
            "  {} = {} ({}{at})",
            f.figure, f.value, f.source.receipt
        );
    }
    out
}

/// Decode steps by batch and the prefill rate of this machine's engine, as a profile.
fn measure(args: MeasureArgs) -> Result<()> {
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let cache = args.cache_dir.clone().unwrap_or_else(default_cache_dir);
            default_model(&cache, args.random_model)?.path
        }
    };
    let spec = args.engine.spec()?;
    if args.batches.is_empty() || args.batches.contains(&0) {
        bail!("--batches must be positive");
    }
    if args.steps < 8 {
        bail!("--steps must be at least 8");
    }
    let (engine, parts) = start_engine(&dir, &spec)?;
    let vocab = parts.tokenizer.vocab_size() as u32;
    if vocab <= 10 {
        bail!("the model's vocabulary ({vocab} tokens) is too small to draw distinct prompts");
    }
    let mut prompts = PromptSource::new(vocab, args.prompt_tokens);
    let run = format!("strata plan measure ({})", now_unix());

    // Warm-up, then the prefill rate: the median of three prompts' time to first token.
    generate(&engine, vec![prompts.next()], 2)?;
    let mut rates: Vec<f64> = (0..3)
        .map(|_| {
            let t = generate(&engine, vec![prompts.next()], 1)?;
            Ok(args.prompt_tokens as f64 / t.first_token[0].as_secs_f64())
        })
        .collect::<Result<_>>()?;
    rates.sort_by(f64::total_cmp);
    let prefill = Prefill {
        prompt_tokens: args.prompt_tokens,
        tokens_per_s: rates[1],
        source: Source {
            receipt: run.clone(),
            pointer: String::new(),
        },
    };
    eprintln!(
        "prefill: {:.0} tokens/s at {} prompt tokens",
        prefill.tokens_per_s, args.prompt_tokens
    );

    let mut batches = args.batches.clone();
    batches.sort_unstable();
    batches.dedup();
    let mut decode = Vec::new();
    for &batch in &batches {
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| prompts.next()).collect();
        let t = generate(&engine, prompts, args.steps)?;
        let step_ms = t.step.as_secs_f64() * 1e3;
        if step_ms <= 0.0 {
            bail!("batch {batch}: too few steps in the decode window; raise --steps");
        }
        eprintln!("decode: batch {batch}: {step_ms:.2} ms a step");
        decode.push(DecodePoint {
            batch,
            step_ms,
            source: Source {
                receipt: run.clone(),
                pointer: String::new(),
            },
        });
    }
    let device = spec.device.to_string();
    let profile = Profile {
        name: args.name,
        gpus_per_node: if device == "cpu" { 0 } else { spec.tp },
        device,
        model: dir.display().to_string(),
        max_batch: spec.limits.max_running,
        decode,
        prefill,
    };
    profile.check()?;
    std::fs::write(&args.out, serde_json::to_string_pretty(&profile)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("profile written to {}", args.out.display());
    Ok(())
}

/// Distinct prompts of random token ids (a fixed seed: the same run each time), so that no
/// prompt finds another's blocks in the prefix cache.
struct PromptSource {
    state: u64,
    vocab: u32,
    len: usize,
}

impl PromptSource {
    fn new(vocab: u32, len: usize) -> Self {
        Self {
            state: 0x9e37_79b9_7f4a_7c15,
            vocab,
            len,
        }
    }

    fn next(&mut self) -> Vec<u32> {
        (0..self.len)
            .map(|_| {
                // xorshift64*: enough for distinct prompts.
                self.state ^= self.state >> 12;
                self.state ^= self.state << 25;
                self.state ^= self.state >> 27;
                let r = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
                10 + (r >> 33) as u32 % (self.vocab - 10)
            })
            .collect()
    }
}

/// When each sequence of a batch got its first token (from the submission), and the decode
/// step in the window where every sequence of the batch was decoding.
struct Timings {
    first_token: Vec<Duration>,
    step: Duration,
}

/// Runs `prompts` at once for `max_tokens` greedy tokens each (end of sequence ignored).
fn generate(engine: &Engine, prompts: Vec<Vec<u32>>, max_tokens: u32) -> Result<Timings> {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    let count = prompts.len();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let mut stream = engine.submit(GenerateRequest {
            resume: None,
            embed: None,
            prompt,
            sampling: SamplingParams {
                temperature: 0.0,
                max_tokens,
                ignore_eos: true,
                ..SamplingParams::default()
            },
            cache_salt: 0,
            deadline: None,
            constraint: None,
        })?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut times = Vec::new();
            let mut failure = None;
            while let Some(event) = stream.events.blocking_recv() {
                match event {
                    TokenEvent::Token { .. } => times.push(start.elapsed()),
                    TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                        failure = Some(message)
                    }
                    other if other.ends_stream() => break,
                    _ => {}
                }
            }
            let _ = tx.send((i, times, failure));
        });
    }
    drop(tx);
    let mut all = vec![Vec::new(); count];
    for (i, times, failure) in rx {
        if let Some(message) = failure {
            bail!("a measurement request failed: {message}");
        }
        if times.is_empty() {
            bail!("a measurement request produced no token");
        }
        all[i] = times;
    }
    let first_token: Vec<Duration> = all.iter().map(|t| t[0]).collect();
    // The window: after the last sequence's first token (every prefill done), up to the first
    // sequence's last token (none finished). One sequence's tokens in it are one a step.
    let from = *first_token.iter().max().unwrap_or(&Duration::ZERO);
    let to = all
        .iter()
        .filter_map(|t| t.last())
        .min()
        .copied()
        .unwrap_or(from);
    let inside: Vec<Duration> = all[0]
        .iter()
        .copied()
        .filter(|&t| t > from && t <= to)
        .collect();
    let step = match inside.as_slice() {
        [first, .., last] => (*last - *first) / (inside.len() - 1) as u32,
        _ => Duration::ZERO,
    };
    Ok(Timings { first_token, step })
}

fn now_unix() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("unix {secs}")
}
