//! The `strata` binary: command-line wiring only; the work lives in the crates.

mod commands;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "strata: an LLM serving cluster in one binary"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Work with checkpoints: synthesize, inspect.
    #[command(subcommand)]
    Model(commands::model::ModelCommand),
    /// Write a checkpoint's Linear projections in FP8 or NVFP4 (compressed-tensors' layout).
    Quantize(commands::quantize::QuantizeArgs),
    /// Generate text from a prompt (CPU reference engine, or a GPU with --device).
    Generate(commands::generate::GenerateArgs),
    /// Measure a model: perplexity on a text, on any backend.
    #[command(subcommand)]
    Eval(commands::eval::EvalCommand),
    /// Serve the OpenAI API (router and engine in one process).
    Serve(commands::serve::ServeArgs),
    /// Manage the API keys `strata serve` accepts.
    #[command(subcommand)]
    Keys(commands::keys::KeysCommand),
    /// GPU checks and benchmarks of the CUDA backend (run by scripts/device/battery.sh).
    #[command(subcommand)]
    Gpu(strata_bench::gpu::GpuCommand),
    /// Compile-check the CUDA kernels, or run them against the CPU reference on a GPU.
    #[command(subcommand)]
    Kernels(strata_bench::kernels::KernelsCommand),
    /// The topology group: init, join, serve, status, members, placement, leave.
    #[command(subcommand)]
    Cluster(commands::cluster::ClusterCommand),
    /// A node: serve a model's engine to routers over QUIC; or list this machine's GPUs.
    #[command(subcommand)]
    Node(commands::node::NodeCommand),
    /// The HTTP surfaces in front of `strata node` processes, routing by cached prefix and load.
    Router(commands::router::RouterArgs),
    /// Benchmarks of a running server: `bench serve` sweeps load against any OpenAI-compatible
    /// endpoint.
    #[command(subcommand)]
    Bench(strata_bench::bench::BenchCommand),
    /// Capacity planning: the nodes a workload needs, from measured profiles (`plan measure`
    /// measures this machine's).
    Plan(commands::plan::PlanArgs),
}

fn main() {
    let cli = Cli::parse();
    if !cli.command.serves() {
        restore_sigpipe();
    }
    init_tracing();
    let result = match cli.command {
        Command::Model(cmd) => commands::model::run(cmd),
        Command::Quantize(args) => commands::quantize::run(args),
        Command::Generate(args) => commands::generate::run(args),
        Command::Eval(cmd) => commands::eval::run(cmd),
        Command::Serve(args) => commands::serve::run(args),
        Command::Keys(cmd) => commands::keys::run(cmd),
        Command::Kernels(cmd) => strata_bench::kernels::run(cmd),
        Command::Gpu(cmd) => strata_bench::gpu::run(cmd),
        Command::Node(cmd) => commands::node::run(cmd),
        Command::Router(args) => commands::router::run(args),
        Command::Cluster(cmd) => commands::cluster::run(cmd),
        Command::Bench(cmd) => strata_bench::bench::run(cmd, || {
            let cache = commands::generate::default_cache_dir();
            Ok(commands::generate::default_model(&cache, false)?.path)
        }),
        Command::Plan(args) => commands::plan::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", report(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, each cause said once: a message that already ends
/// with its cause's text (a library error that prints its source and also exposes it) does not
/// get the cause appended again.
fn report(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

impl Command {
    /// Whether the command runs servers or drives other processes' sockets and pipes (which
    /// must see a closed peer as an error, not die of it), rather than printing and exiting.
    fn serves(&self) -> bool {
        match self {
            Command::Serve(_)
            | Command::Node(_)
            | Command::Router(_)
            | Command::Bench(_)
            | Command::Gpu(_) => true,
            Command::Cluster(cmd) => cmd.serves(),
            Command::Model(_)
            | Command::Quantize(_)
            | Command::Generate(_)
            | Command::Eval(_)
            | Command::Keys(_)
            | Command::Plan(_)
            | Command::Kernels(_) => false,
        }
    }
}

/// A command that prints and exits ends quietly when its reader goes away (`strata cluster
/// status | head`), as Unix tools do: the Rust runtime ignores SIGPIPE, so a write to a closed
/// pipe would otherwise be an error `println!` panics on.
fn restore_sigpipe() {
    // SAFETY: setting a signal's disposition to its default before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Log lines go to stderr, filtered by `RUST_LOG` (default `info`), colored only on a terminal.
fn init_tracing() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

#[cfg(test)]
mod tests {
    use super::report;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Wrapped {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use");
        // A cause the message already ends with (it printed its source) is not repeated.
        let e = anyhow::Error::new(Wrapped {
            path: "127.0.0.1:8000",
            source: io(),
        });
        assert_eq!(
            format!("{e:#}"),
            "127.0.0.1:8000: Address already in use: Address already in use",
            "anyhow's own chain repeats it"
        );
        assert_eq!(report(&e), "127.0.0.1:8000: Address already in use");
        // A context over a plain error keeps both (the canary of the rule).
        let e = anyhow::Error::new(io()).context("cannot listen on 127.0.0.1:8000");
        assert_eq!(
            report(&e),
            "cannot listen on 127.0.0.1:8000: Address already in use"
        );
        let e = anyhow::Error::new(io()).context("starting");
        assert_eq!(format!("{e:#}"), "starting: Address already in use");
        assert_eq!(
            report(&e.context("serve")),
            "serve: starting: Address already in use"
        );
    }
}
