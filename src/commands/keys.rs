//! `strata keys add|list|revoke`: the API keys `strata serve` accepts. Only each key's SHA-256
//! is stored; the key itself is printed once, by `add`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use strata_router::auth::KeyStore;
use strata_router::state::unix_now;

use super::generate::default_cache_dir;

/// The keys file's name inside the cache directory.
pub const KEYS_FILE: &str = "keys.json";

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Make a key for a tenant; it is printed once and stored only as a hash.
    Add {
        /// The tenant the key belongs to; a tenant's cached prefixes are its own.
        #[arg(long)]
        tenant: String,
        #[command(flatten)]
        file: KeysFile,
    },
    /// Show every key's id, tenant and creation time (never the key).
    List {
        #[command(flatten)]
        file: KeysFile,
    },
    /// Remove a key by its id; a running server rereads the file and refuses it within seconds.
    Revoke {
        id: String,
        #[command(flatten)]
        file: KeysFile,
    },
}

#[derive(Args)]
pub struct KeysFile {
    /// The keys file (default: <cache dir>/keys.json, where `strata serve` looks).
    #[arg(long)]
    keys_file: Option<PathBuf>,
    /// Cache directory (default: $XDG_CACHE_HOME/strata or ~/.cache/strata).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

impl KeysFile {
    fn path(self) -> PathBuf {
        self.keys_file.unwrap_or_else(|| {
            self.cache_dir
                .unwrap_or_else(default_cache_dir)
                .join(KEYS_FILE)
        })
    }
}

pub fn run(command: KeysCommand) -> Result<()> {
    match command {
        KeysCommand::Add { tenant, file } => {
            let path = file.path();
            let mut store = KeyStore::load(&path)?;
            let (record, key) = store.add(&tenant, unix_now())?;
            store.save(&path)?;
            eprintln!(
                "added key {} for tenant `{}` to {}; it is shown only this once:",
                record.id,
                record.tenant,
                path.display()
            );
            println!("{key}");
        }
        KeysCommand::List { file } => {
            let path = file.path();
            let store = KeyStore::load(&path)?;
            if store.keys.is_empty() {
                eprintln!("no keys in {}: `strata serve` is open", path.display());
            }
            for k in &store.keys {
                println!("{}\t{}\t{}", k.id, k.tenant, utc_date(k.created));
            }
        }
        KeysCommand::Revoke { id, file } => {
            let path = file.path();
            let mut store = KeyStore::load(&path)?;
            let record = store
                .revoke(&id)
                .with_context(|| format!("in {}", path.display()))?;
            store.save(&path)?;
            eprintln!(
                "revoked key {} of tenant `{}`; a `strata serve` using this file refuses it \
                 within a second or two",
                record.id, record.tenant
            );
        }
    }
    Ok(())
}

/// `YYYY-MM-DDTHH:MM:SSZ` for unix seconds (days to civil date: Howard Hinnant's algorithm).
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::utc_date;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_date(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_date(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_date(1_764_688_210), "2025-12-02T15:10:10Z");
    }
}
