//! `strata serve`: the router and the node in one process, on one machine. Settings come from
//! flags and, with `--config FILE`, from a TOML file; a flag on the command line wins over the
//! file, and the file over the built-in default.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;
use strata_router::ServeConfig;
use strata_router::auth::KeyStore;

use super::engine_args::EngineSettings;
use super::generate::{default_cache_dir, default_model};
use super::keys::KEYS_FILE;
use super::serving_args::{FrontDoor, ServingSettings};

#[derive(Args)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (same names, `_` for `-`); flags win over it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: ServeSettings,
}

/// Every setting of `strata serve`, each optional so a flag, the config file and the default
/// can be told apart. The same struct reads the flags and the file, so neither can lack one;
/// a file's keys are checked against the flags' names ([`ServeSettings::known_keys`]).
#[derive(Args, Deserialize, Default)]
struct ServeSettings {
    /// Checkpoint: an HF directory or a GGUF file. Default: SmolLM2-135M-Instruct, fetched on
    /// first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Without --model: serve the synthesized random-weight demo model instead of fetching the
    /// default model (offline use).
    #[arg(long)]
    #[serde(default)]
    random_model: bool,
    #[command(flatten)]
    #[serde(flatten)]
    front_door: FrontDoor,
    #[command(flatten)]
    #[serde(flatten)]
    engine: EngineSettings,
    /// Where the default and demo models are kept (default: $XDG_CACHE_HOME/strata or
    /// ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    serving: ServingSettings,
}

impl ServeSettings {
    /// Reads a config file; its relative paths are taken from the file's directory.
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        let mut settings = Self::parse_toml(&text)
            .with_context(|| format!("invalid config file {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new(""));
        for dir in [
            &mut settings.model,
            &mut settings.cache_dir,
            &mut settings.front_door.keys_file,
            &mut settings.serving.chat_template,
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

    /// The settings of a config file's text; a key that is no flag's name is refused by name
    /// (the engine's settings are flattened in, which serde's own check does not see through).
    fn parse_toml(text: &str) -> Result<Self> {
        let table: toml::Table = toml::from_str(text)?;
        let known = Self::known_keys();
        if let Some(key) = table
            .keys()
            .find(|k| !known.contains(&k.as_str().to_string()))
        {
            anyhow::bail!("unknown key `{key}`; the keys are: {}", known.join(", "));
        }
        Ok(table.try_into()?)
    }

    /// The flags' names, `_` for `-`: the keys a config file may hold.
    fn known_keys() -> Vec<String> {
        let command = <Self as Args>::augment_args(clap::Command::new("serve"));
        command
            .get_arguments()
            .map(|a| a.get_id().as_str().to_string())
            .collect()
    }

    /// Each setting from `self`, else from `fallback`.
    fn or(self, fallback: Self) -> Self {
        Self {
            model: self.model.or(fallback.model),
            random_model: self.random_model || fallback.random_model,
            front_door: self.front_door.or(fallback.front_door),
            engine: self.engine.or(fallback.engine),
            cache_dir: self.cache_dir.or(fallback.cache_dir),
            serving: self.serving.or(fallback.serving),
        }
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    let settings = match &args.config {
        Some(path) => args.settings.or(ServeSettings::from_file(path)?),
        None => args.settings,
    };
    let limits = settings.front_door.limits()?;
    let cache = settings.cache_dir.unwrap_or_else(default_cache_dir);
    let keys_file =
        (settings.front_door.keys_file.clone()).unwrap_or_else(|| cache.join(KEYS_FILE));
    let access = settings
        .serving
        .access(KeyStore::load(&keys_file)?, limits)?;
    tracing::info!(
        "keys file: {} (reread when it changes)",
        keys_file.display()
    );
    let (model_dir, checkpoint_name, owned_by) = match settings.model {
        Some(path) => {
            let canonical = path.canonicalize().unwrap_or_else(|_| path.clone());
            // A GGUF file is named without its extension, a directory by its name.
            let name = match canonical.extension() {
                Some(ext) if ext.eq_ignore_ascii_case("gguf") => canonical.file_stem(),
                _ => canonical.file_name(),
            }
            .map(|n| n.to_string_lossy().into_owned())
            .with_context(|| format!("{}: cannot name the model", path.display()))?;
            (path, name, "strata".to_string())
        }
        None => {
            let model = default_model(&cache, settings.random_model)?;
            (model.path, model.name, model.owned_by)
        }
    };
    let (model_name, options) = settings.serving.presentation(checkpoint_name)?;
    let config = ServeConfig {
        model_dir,
        model_name,
        owned_by,
        options,
        addr: settings.front_door.addr(),
        engine: std::sync::Arc::new(settings.engine.spec()?),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let drain_delay = settings.front_door.drain_delay();
    runtime.block_on(strata_router::serve(
        config,
        access,
        Some(keys_file),
        drain_delay,
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let flags = ServeSettings {
            front_door: FrontDoor {
                port: Some(9000),
                ..Default::default()
            },
            ..Default::default()
        };
        let file =
            ServeSettings::parse_toml("port = 8000\nmax_queued = 7\nmax_running = 9\n").unwrap();
        let merged = flags.or(file);
        assert_eq!(merged.front_door.port, Some(9000));
        assert_eq!(merged.front_door.max_queued, Some(7));
        assert_eq!(merged.front_door.max_inflight, None);
        assert_eq!(
            merged.engine.max_running,
            Some(9),
            "engine keys read from the file"
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let Err(e) = ServeSettings::parse_toml("port = 1\nmax_inflights = 2\n") else {
            panic!("an unknown key was accepted");
        };
        assert!(e.to_string().contains("max_inflights"), "{e}");
    }

    #[test]
    fn the_example_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/serve.example.toml");
        let settings = ServeSettings::from_file(&path).unwrap();
        assert_eq!(settings.front_door.port, Some(8080));
        assert_eq!(
            settings.front_door.drain_delay_s,
            Some(strata_router::drain::DEFAULT_DRAIN_DELAY_S)
        );
        assert!(settings.front_door.keys_file.unwrap().is_absolute());
    }
}
