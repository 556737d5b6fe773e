//! `strata bench serve`: a serving benchmark against any OpenAI-compatible endpoint, after
//! vLLM's `benchmark_serving.py` and guidellm. It sweeps load points (closed-loop concurrency or
//! open-loop Poisson request rates), streams `/v1/completions` with token-id prompts, and reports
//! per point TTFT, inter-token latency, TPOT, end-to-end latency and throughput as a table and,
//! with `--json`, a file for the receipt.

mod client;
mod endpoint;
mod load;
mod report;
mod spec;
mod sse;
mod stream;
mod table;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args, Subcommand};
use serde_json::json;

use client::{Client, ConnectionMode, completion_body};
use endpoint::Endpoint;
use load::{Load, PlannedRequest};
use report::{PointReport, SpecDecode};
use workload::{RequestRate, Workload, WorkloadError, WorkloadSpec};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Load an OpenAI-compatible server with streamed completions at each point of a sweep and
    /// report TTFT, ITL, TPOT, e2e latency and throughput.
    Serve(ServeArgs),
    /// Speculative decoding beside plain decoding on one in-process engine: byte identity per
    /// draft length, acceptance, and decode speed per concurrency.
    Spec(spec::SpecArgs),
}

#[derive(Args)]
#[command(group(ArgGroup::new("load").required(true).args(["concurrency", "request_rate"])))]
pub struct ServeArgs {
    /// The server's base URL. Plain http only: https is refused (this client speaks no TLS).
    /// A trailing `/v1` is allowed and dropped.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: Endpoint,
    /// The model to ask for (default: the first id `GET /v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// Closed-loop points: N workers, each keeping one request in flight (e.g. `1,16,64`).
    #[arg(long, value_delimiter = ',', value_parser = parse_concurrency)]
    concurrency: Vec<u32>,
    /// Open-loop points: Poisson arrivals at this many requests per second, `inf` for all at
    /// once (e.g. `2,8,inf`).
    #[arg(long, value_delimiter = ',')]
    request_rate: Vec<RequestRate>,
    /// Measured requests per point (default: max(4 x concurrency, 16), or 64 at a rate point).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    num_prompts: Option<u32>,
    /// Unmeasured requests sent before each point.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Prompt tokens per request (after the shared prefix, if any).
    #[arg(long, default_value_t = 512)]
    input_len: u32,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 128)]
    output_len: u32,
    /// Sampling temperature of every request (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus cut of every request (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Lengths are drawn uniformly in [len x (1 - r), len x (1 + r)]; 0 gives exact lengths.
    #[arg(long, default_value_t = 0.0)]
    range_ratio: f64,
    /// Tokens of the shared prefix each prompt starts with (0: none).
    #[arg(long, default_value_t = 0)]
    prefix_len: u32,
    /// Distinct shared prefixes; request i starts with prefix i mod G.
    #[arg(long, default_value_t = 1)]
    prefix_groups: u32,
    /// Prompt token ids are drawn in [10, vocab-size): valid for any model with that many tokens.
    #[arg(long, default_value_t = 32000)]
    vocab_size: u32,
    /// Seeds prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// `reuse`: kept-alive connections (what SDKs do); `fresh`: a new TCP connection per request.
    #[arg(long, value_enum, default_value_t = ConnectionMode::Reuse)]
    connection: ConnectionMode,
    /// A request not finished within this many seconds counts as failed.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Free text copied into the JSON report.
    #[arg(long)]
    label: Option<String>,
}

fn parse_concurrency(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(0) => {
            Err("concurrency must be at least 1 (workers each keeping a request in flight)".into())
        }
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "a concurrency is a whole number of workers; got `{s}`"
        )),
    }
}

impl ServeArgs {
    fn loads(&self) -> Vec<Load> {
        let closed = self.concurrency.iter().map(|&c| Load::Concurrency(c));
        closed
            .chain(self.request_rate.iter().map(|&r| Load::Rate(r)))
            .collect()
    }

    fn num_prompts(&self, load: Load) -> u32 {
        self.num_prompts.unwrap_or(match load {
            Load::Concurrency(c) => c.saturating_mul(4).max(16),
            Load::Rate(_) => 64,
        })
    }

    fn workload(&self) -> WorkloadSpec {
        WorkloadSpec {
            input_len: self.input_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            prefix_len: self.prefix_len,
            prefix_groups: self.prefix_groups,
            vocab_size: self.vocab_size,
            seed: self.seed,
        }
    }

    fn client(&self) -> Result<Arc<Client>> {
        let timeout = Duration::from_secs(self.request_timeout);
        let client = Client::new(
            self.url.clone(),
            self.api_key.as_deref(),
            self.connection,
            timeout,
        )
        .context("--api-key is not a valid header value")?;
        Ok(Arc::new(client))
    }
}

/// Runs `strata bench`; `default_model` gives the checkpoint `bench spec` uses without `--model`
/// (the binary's packaged default, fetched on first use).
pub fn run(cmd: BenchCommand, default_model: impl FnOnce() -> Result<PathBuf>) -> Result<()> {
    match cmd {
        BenchCommand::Serve(args) => serve(args),
        BenchCommand::Spec(args) => spec::run(args, default_model),
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    let workload = Workload::new(args.workload())?;
    args.client()?; // refuses a bad --api-key before any request
    let started_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let (model, points) = runtime.block_on(sweep(&args, workload))?;

    println!(
        "strata bench serve: {} model `{model}`, {} connections, input {} output {} tokens",
        args.url,
        args.connection.name(),
        args.input_len,
        args.output_len
    );
    print!("{}", table::render(&points));
    if let Some(path) = &args.json {
        let report = json_report(&args, &model, &started_at, &points);
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("writing the report to {}", path.display()))?;
    }
    let dead: Vec<&PointReport> = points.iter().filter(|p| p.all_failed()).collect();
    if let Some(first) = dead.first() {
        let why = first.errors.first().map_or("", |e| e.message.as_str());
        let loads: Vec<String> = dead.iter().map(|p| p.load.to_string()).collect();
        bail!(
            "every request failed at {} (first: {why})",
            loads.join(", ")
        );
    }
    Ok(())
}

/// Runs every point in order; each point gets its own connection pool, warmed by its warmup.
async fn sweep(args: &ServeArgs, mut workload: Workload) -> Result<(String, Vec<PointReport>)> {
    let model = match &args.model {
        Some(model) => model.clone(),
        None => args.client()?.first_model().await.with_context(|| {
            format!(
                "asking {} for its model (GET /v1/models); pass --model to name it",
                args.url
            )
        })?,
    };
    let loads = args.loads();
    // Indices run on across warmups and points, so no prompt of the run repeats another.
    let mut next_index = 0;
    let mut points = Vec::with_capacity(loads.len());
    for (i, &load) in loads.iter().enumerate() {
        let count = args.num_prompts(load);
        let sampling = (args.temperature, args.top_p);
        let warm = plan(
            &mut workload,
            &mut next_index,
            &model,
            sampling,
            args.warmup,
        )?;
        let measured = plan(&mut workload, &mut next_index, &model, sampling, count)?;
        tracing::info!(
            "point {}/{}: {load}, {count} requests after {} warmup",
            i + 1,
            loads.len(),
            args.warmup
        );
        let client = args.client()?;
        let warm_workers = match load {
            Load::Concurrency(c) => c as usize,
            Load::Rate(_) => warm.len(),
        };
        let warmed = load::closed_loop(client.clone(), warm, warm_workers).await;
        if let Some(e) = warmed.iter().find_map(|o| o.result.as_ref().err()) {
            tracing::warn!("{load}: a warmup request failed: {e}");
        }
        let before = client.metrics().await;
        let outcomes = load::apply(client.clone(), load, measured, args.seed, i as u64).await;
        let mut report = PointReport::new(load, &outcomes);
        if let (Some(before), Some(after)) = (before, client.metrics().await) {
            report.spec_decode =
                SpecDecode::between(SpecDecode::totals(&before), SpecDecode::totals(&after));
        }
        if let Some(s) = &report.spec_decode {
            println!(
                "{load}: speculative decoding accepted {:.0} of {:.0} proposed tokens ({:.1} %), \
                 {:.2} tokens per verification",
                s.accepted_tokens,
                s.draft_tokens,
                100.0 * s.acceptance_rate,
                s.mean_accepted_len
            );
        }
        tracing::info!(
            "{load}: {} ok, {} failed in {:.2} s, {:.1} output tok/s",
            report.completed,
            report.failed,
            report.duration_s,
            report.output_tok_s
        );
        for e in &report.errors {
            tracing::warn!("{load}: {} failed with: {}", e.count, e.message);
        }
        points.push(report);
    }
    Ok((model, points))
}

/// The next `count` requests of the run, their bodies built before the clock starts.
fn plan(
    workload: &mut Workload,
    next_index: &mut u64,
    model: &str,
    sampling: (f32, f32),
    count: u32,
) -> Result<Vec<PlannedRequest>, WorkloadError> {
    (0..count)
        .map(|_| {
            let prompt = workload.prompt(*next_index)?;
            *next_index += 1;
            Ok(PlannedRequest {
                body: completion_body(model, &prompt, sampling),
                prompt_len: prompt.tokens.len() as u64,
            })
        })
        .collect()
}

fn json_report(
    args: &ServeArgs,
    model: &str,
    started_at: &str,
    points: &[PointReport],
) -> serde_json::Value {
    let rates: Vec<String> = args.request_rate.iter().map(|r| r.to_string()).collect();
    json!({
        "tool": "strata bench serve",
        "started_at": started_at,
        "label": args.label,
        "args": {
            "url": args.url.to_string(),
            "model": model,
            "connection": args.connection.name(),
            "concurrency": (!args.concurrency.is_empty()).then_some(&args.concurrency),
            "request_rate": (!rates.is_empty()).then_some(rates),
            "num_prompts": args.num_prompts,
            "warmup": args.warmup,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "range_ratio": args.range_ratio,
            "prefix_len": args.prefix_len,
            "prefix_groups": args.prefix_groups,
            "vocab_size": args.vocab_size,
            "seed": args.seed,
            "request_timeout_s": args.request_timeout,
        },
        "points": points,
    })
}
