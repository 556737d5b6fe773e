//! `strata generate` (being written).
use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct GenerateArgs {}

pub fn run(_args: GenerateArgs) -> Result<()> {
    anyhow::bail!("not yet")
}
