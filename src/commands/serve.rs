//! `strata serve`: the router and the node in one process, on one machine. Settings come from
//! flags and, with `--config FILE`, from a TOML file; a flag on the command line wins over the
//! file, and the file over the built-in default.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;
use strata_model::synth::{DEMO_MODEL_NAME, ensure_demo_model};
use strata_router::admission::AdmissionLimits;
use strata_router::auth::KeyStore;
use strata_router::{Access, ServeConfig};

use super::generate::default_cache_dir;
use super::keys::KEYS_FILE;

const DEFAULT_HOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const DEFAULT_PORT: u16 = 8080;
const DEFAULT_KV_CACHE_MIB: usize = 256;
const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (same names, `_` for `-`); flags win over it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: ServeSettings,
}

/// Every setting of `strata serve`, each optional so a flag, the config file and the default
/// can be told apart. The same struct reads the flags and the file, so neither can lack one.
#[derive(Args, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ServeSettings {
    /// Checkpoint directory (HF layout). Default: the embedded demo model, synthesized on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Listening address [default: 127.0.0.1].
    #[arg(long)]
    host: Option<IpAddr>,
    /// Listening port; 0 picks a free one (the address is printed) [default: 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Memory for the KV cache, in MiB [default: 256].
    #[arg(long)]
    kv_cache_mib: Option<usize>,
    /// Tokens per KV block [default: 16].
    #[arg(long)]
    block_size: Option<usize>,
    /// Where the engine runs: cpu, cuda or cuda:N [default: cpu].
    #[arg(long)]
    device: Option<String>,
    /// Tensor-parallel ranks: the model's heads and MLP split over this many workers (threads
    /// on the CPU; on CUDA one GPU each, cuda:N .. N+tp-1, over NCCL), with output
    /// byte-identical to 1 [default: 1].
    #[arg(long)]
    tp: Option<usize>,
    /// Where the demo model is kept (default: $XDG_CACHE_HOME/strata or ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// API keys (`strata keys add`), reread when it changes; without keys the server is open.
    /// Default: <cache dir>/keys.json.
    #[arg(long)]
    keys_file: Option<PathBuf>,
    /// Generation requests running at once [default: 256].
    #[arg(long)]
    max_inflight: Option<usize>,
    /// Generation requests waiting for a slot; beyond this, 429 with Retry-After [default: 1024].
    #[arg(long)]
    max_queued: Option<usize>,
    /// Largest request body, in bytes; larger is a 413 [default: 4194304].
    #[arg(long)]
    max_body_bytes: Option<usize>,
}

impl ServeSettings {
    /// Reads a config file; its relative paths are taken from the file's directory.
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        let mut settings: Self = toml::from_str(&text)
            .with_context(|| format!("invalid config file {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new(""));
        for dir in [
            &mut settings.model,
            &mut settings.cache_dir,
            &mut settings.keys_file,
        ]
        .into_iter()
        .flatten()
        {
            if dir.is_relative() {
                *dir = base.join(&*dir);
            }
        }
        Ok(settings)
    }

    /// Each setting from `self`, else from `fallback`.
    fn or(self, fallback: Self) -> Self {
        Self {
            model: self.model.or(fallback.model),
            host: self.host.or(fallback.host),
            port: self.port.or(fallback.port),
            kv_cache_mib: self.kv_cache_mib.or(fallback.kv_cache_mib),
            block_size: self.block_size.or(fallback.block_size),
            device: self.device.or(fallback.device),
            tp: self.tp.or(fallback.tp),
            cache_dir: self.cache_dir.or(fallback.cache_dir),
            keys_file: self.keys_file.or(fallback.keys_file),
            max_inflight: self.max_inflight.or(fallback.max_inflight),
            max_queued: self.max_queued.or(fallback.max_queued),
            max_body_bytes: self.max_body_bytes.or(fallback.max_body_bytes),
        }
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let settings = match &args.config {
        Some(path) => args.settings.or(ServeSettings::from_file(path)?),
        None => args.settings,
    };
    let defaults = AdmissionLimits::default();
    let limits = AdmissionLimits {
        max_inflight: settings.max_inflight.unwrap_or(defaults.max_inflight),
        max_queued: settings.max_queued.unwrap_or(defaults.max_queued),
        max_body_bytes: settings.max_body_bytes.unwrap_or(defaults.max_body_bytes),
    };
    if limits.max_inflight == 0 {
        anyhow::bail!("max_inflight (--max-inflight) must be at least 1");
    }
    let cache = settings.cache_dir.unwrap_or_else(default_cache_dir);
    let keys_file = settings.keys_file.unwrap_or_else(|| cache.join(KEYS_FILE));
    let access = Access {
        keys: KeyStore::load(&keys_file)?,
        limits,
    };
    tracing::info!(
        "keys file: {} (reread when it changes)",
        keys_file.display()
    );
    let (model_dir, model_name, owned_by) = match settings.model {
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
            tracing::info!("model: {} (demo model, random weights)", dir.display());
            let owned_by = "strata (demo model, random weights)".to_string();
            (dir, DEMO_MODEL_NAME.to_string(), owned_by)
        }
    };
    let config = ServeConfig {
        model_dir,
        model_name,
        owned_by,
        addr: SocketAddr::new(
            settings.host.unwrap_or(DEFAULT_HOST),
            settings.port.unwrap_or(DEFAULT_PORT),
        ),
        kv_cache_mib: settings.kv_cache_mib.unwrap_or(DEFAULT_KV_CACHE_MIB),
        block_size: settings.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
        device: match &settings.device {
            Some(d) => d.parse().map_err(anyhow::Error::msg)?,
            None => Default::default(),
        },
        tp: settings.tp.unwrap_or(1),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(strata_router::serve(config, access, Some(keys_file)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let flags = ServeSettings {
            port: Some(9000),
            ..Default::default()
        };
        let file: ServeSettings = toml::from_str("port = 8000\nmax_queued = 7\n").unwrap();
        let merged = flags.or(file);
        assert_eq!(merged.port, Some(9000));
        assert_eq!(merged.max_queued, Some(7));
        assert_eq!(merged.max_inflight, None);
    }

    #[test]
    fn unknown_keys_are_named() {
        let Err(e) = toml::from_str::<ServeSettings>("port = 1\nmax_inflights = 2\n") else {
            panic!("an unknown key was accepted");
        };
        assert!(e.to_string().contains("max_inflights"), "{e}");
    }

    #[test]
    fn the_example_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/serve.example.toml");
        let settings = ServeSettings::from_file(&path).unwrap();
        assert_eq!(settings.port, Some(8080));
        assert!(settings.keys_file.unwrap().is_absolute());
    }
}
