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
    /// Generate text from a prompt with the CPU reference engine.
    Generate(commands::generate::GenerateArgs),
    /// Serve the OpenAI API (router and engine in one process).
    Serve(commands::serve::ServeArgs),
    /// Manage the API keys `strata serve` accepts.
    #[command(subcommand)]
    Keys(commands::keys::KeysCommand),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Model(cmd) => commands::model::run(cmd),
        Command::Generate(args) => commands::generate::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Keys(cmd) => commands::keys::run(cmd),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
