//! `strata serve`: the router and the node in one process, on one machine.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use strata_model::synth::{DEMO_MODEL_NAME, ensure_demo_model};
use strata_router::admission::AdmissionLimits;
use strata_router::auth::KeyStore;
use strata_router::{Access, ServeConfig};

use super::generate::default_cache_dir;
use super::keys::KEYS_FILE;

#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint directory (HF layout). Default: the embedded demo model, synthesized on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Memory for the KV cache, in MiB.
    #[arg(long, default_value_t = 256)]
    kv_cache_mib: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Where the demo model is kept (default: $XDG_CACHE_HOME/strata or ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// API keys (`strata keys add`); without keys the server is open. Default: <cache dir>/keys.json.
    #[arg(long)]
    keys_file: Option<PathBuf>,
    /// Generation requests running at once.
    #[arg(long, default_value_t = AdmissionLimits::default().max_inflight)]
    max_inflight: usize,
    /// Generation requests waiting for a slot; beyond this, 429 with Retry-After.
    #[arg(long, default_value_t = AdmissionLimits::default().max_queued)]
    max_queued: usize,
    /// Largest request body, in bytes; larger is a 413.
    #[arg(long, default_value_t = AdmissionLimits::default().max_body_bytes)]
    max_body_bytes: usize,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let cache = args.cache_dir.unwrap_or_else(default_cache_dir);
    let keys_file = args.keys_file.unwrap_or_else(|| cache.join(KEYS_FILE));
    let access = Access {
        keys: KeyStore::load(&keys_file)?,
        limits: AdmissionLimits {
            max_inflight: args.max_inflight,
            max_queued: args.max_queued,
            max_body_bytes: args.max_body_bytes,
        },
    };
    if args.max_inflight == 0 {
        anyhow::bail!("--max-inflight must be at least 1");
    }
    if !access.keys.keys.is_empty() {
        eprintln!("keys: {}", keys_file.display());
    }
    let (model_dir, model_name, owned_by) = match args.model {
        Some(dir) => {
            let name = dir
                .canonicalize()
                .unwrap_or_else(|_| dir.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .with_context(|| format!("{}: cannot name the model", dir.display()))?;
            (dir, name, "strata".to_string())
        }
        None => {
            let dir = ensure_demo_model(&cache).context("preparing the demo model")?;
            eprintln!("model: {} (demo model, random weights)", dir.display());
            let owned_by = "strata (demo model, random weights)".to_string();
            (dir, DEMO_MODEL_NAME.to_string(), owned_by)
        }
    };
    let config = ServeConfig {
        model_dir,
        model_name,
        owned_by,
        addr: SocketAddr::new(args.host, args.port),
        kv_cache_mib: args.kv_cache_mib,
        block_size: args.block_size,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(strata_router::serve(config, access))?;
    Ok(())
}
