//! The front door's flags, defined once as flags and TOML keys: `serve` and `router` flatten
//! [`FrontDoor`] (address, keys file, admission limits, drain delay) and [`ServingSettings`]
//! (vLLM's serving flags: the model's names, its context window, its chat template, a server
//! key, browser origins) into their own; the engine never sees them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Deserialize;
use strata_router::admission::AdmissionLimits;
use strata_router::auth::{ApiKey, KeyStore};
use strata_router::cors::AllowedOrigins;
use strata_router::{Access, ServingOptions};

/// Where a server listens and how much it admits, each optional so a flag, a config file and
/// the default can be told apart.
#[derive(Args, Deserialize, Default, Clone)]
pub struct FrontDoor {
    /// Listening address [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<IpAddr>,
    /// Listening port; 0 picks a free one (the address is printed) [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// API keys (`strata keys add`), reread when it changes; without keys the server is open.
    /// `serve` defaults to <cache dir>/keys.json; `router` has no default.
    #[arg(long)]
    pub keys_file: Option<PathBuf>,
    /// Generation requests running at once [default: 256].
    #[arg(long)]
    pub max_inflight: Option<usize>,
    /// Generation requests waiting for a slot; beyond this, 429 with Retry-After [default: 1024].
    #[arg(long)]
    pub max_queued: Option<usize>,
    /// Largest request body, in bytes; larger is a 413 [default: 4194304].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// On SIGTERM: seconds the server goes on serving while `GET /ready` answers 503, so that a
    /// load balancer checking it takes the server out before it stops accepting (make it longer
    /// than the balancer's check interval times its failure count); then the requests in flight
    /// finish. Ctrl-C skips it [default: 5].
    #[arg(long)]
    pub drain_delay_s: Option<u64>,
}

impl FrontDoor {
    /// Each setting from `self`, else from `fallback`.
    pub fn or(self, fallback: Self) -> Self {
        Self {
            host: self.host.or(fallback.host),
            port: self.port.or(fallback.port),
            keys_file: self.keys_file.or(fallback.keys_file),
            max_inflight: self.max_inflight.or(fallback.max_inflight),
            max_queued: self.max_queued.or(fallback.max_queued),
            max_body_bytes: self.max_body_bytes.or(fallback.max_body_bytes),
            drain_delay_s: self.drain_delay_s.or(fallback.drain_delay_s),
        }
    }

    /// The listening address (127.0.0.1:8080 unless given).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(
            self.host.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            self.port.unwrap_or(8080),
        )
    }

    /// The admission limits given (each `None` keeps its default), checked.
    pub fn limits(&self) -> Result<AdmissionLimits> {
        let defaults = AdmissionLimits::default();
        let limits = AdmissionLimits {
            max_inflight: self.max_inflight.unwrap_or(defaults.max_inflight),
            max_queued: self.max_queued.unwrap_or(defaults.max_queued),
            max_body_bytes: self.max_body_bytes.unwrap_or(defaults.max_body_bytes),
        };
        if limits.max_inflight == 0 {
            bail!("max_inflight (--max-inflight) must be at least 1");
        }
        Ok(limits)
    }

    /// How long a SIGTERM keeps serving while `/ready` answers 503.
    pub fn drain_delay(&self) -> Duration {
        Duration::from_secs(
            self.drain_delay_s
                .unwrap_or(strata_router::drain::DEFAULT_DRAIN_DELAY_S),
        )
    }
}

/// Every serving setting, each optional so a flag, a config file and the default can be told
/// apart.
#[derive(Args, Deserialize, Default, Clone)]
pub struct ServingSettings {
    /// Names the model is served under: the first is the one /v1/models lists and responses
    /// report, and a request's `model` may give any of them [default: the checkpoint's name].
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub served_model_name: Option<Vec<String>>,
    /// The context window served, at most the model's own: reported as `max_model_len`, and a
    /// request whose prompt and max_tokens exceed it is refused, vLLM's way. Without it the
    /// window is the model's own, a prompt that leaves no room in it is refused, and a larger
    /// max_tokens ends the generation at the window (finish reason `length`).
    #[arg(long, value_name = "N")]
    pub max_model_len: Option<usize>,
    /// A Jinja chat template file used in place of the checkpoint's templates.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// A key every request must present (`Authorization: Bearer KEY` or `x-api-key: KEY`),
    /// accepted beside the keys file's; `/health`, `/ping`, `/ready`, `/metrics` stay open. A
    /// flag shows in the process list: the config file's `api_key` does not.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Browser origins allowed by CORS (`scheme://host[:port]`, or `*` for any); preflights
    /// are answered. Without it, no CORS headers.
    #[arg(long, num_args = 1.., value_name = "ORIGIN")]
    pub allowed_origins: Option<Vec<String>>,
}

impl ServingSettings {
    /// Each setting from `self`, else from `fallback`.
    pub fn or(self, fallback: Self) -> Self {
        Self {
            served_model_name: self.served_model_name.or(fallback.served_model_name),
            max_model_len: self.max_model_len.or(fallback.max_model_len),
            chat_template: self.chat_template.or(fallback.chat_template),
            api_key: self.api_key.or(fallback.api_key),
            allowed_origins: self.allowed_origins.or(fallback.allowed_origins),
        }
    }

    /// The served name (the first of `--served-model-name`, else `checkpoint_name`) and the
    /// options presenting the model.
    pub fn presentation(&self, checkpoint_name: String) -> Result<(String, ServingOptions)> {
        let (name, aliases) = match self.served_model_name.as_deref() {
            None => (checkpoint_name, Vec::new()),
            Some([]) => bail!("--served-model-name needs at least one name"),
            Some([first, rest @ ..]) => (first.clone(), rest.to_vec()),
        };
        if std::iter::once(&name)
            .chain(&aliases)
            .any(|n| n.trim().is_empty())
        {
            bail!("--served-model-name: a name cannot be empty");
        }
        let options = ServingOptions {
            aliases,
            max_model_len: self.max_model_len,
            chat_template: self.chat_template.clone(),
        };
        Ok((name, options))
    }

    /// Who may use the server: the keys file's `keys`, the server's own key, the CORS
    /// origins, under `limits`.
    pub fn access(&self, keys: KeyStore, limits: AdmissionLimits) -> Result<Access> {
        let api_key = self
            .api_key
            .as_deref()
            .map(ApiKey::new)
            .transpose()
            .context("--api-key")?;
        let cors = AllowedOrigins::parse(self.allowed_origins.as_deref().unwrap_or_default())?;
        Ok(Access {
            keys,
            api_key,
            limits,
            cors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serving: ServingSettings,
    }

    fn parse(args: &[&str]) -> ServingSettings {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("strata").chain(args.iter().copied()))
            .unwrap()
            .serving
    }

    #[test]
    fn the_first_name_is_served_and_the_others_are_aliases() {
        let settings = parse(&["--served-model-name", "gpt-x", "alias-1", "alias-2"]);
        let (name, options) = settings.presentation("checkpoint".into()).unwrap();
        assert_eq!(name, "gpt-x");
        assert_eq!(options.aliases, ["alias-1", "alias-2"]);
        let (name, options) = parse(&[]).presentation("checkpoint".into()).unwrap();
        assert_eq!(
            (name.as_str(), options),
            ("checkpoint", ServingOptions::default())
        );
        let blank = parse(&["--served-model-name", "a", " "]).presentation("c".into());
        assert!(blank.unwrap_err().to_string().contains("cannot be empty"));
    }

    #[test]
    fn flags_and_toml_keys_are_the_same_settings() {
        let toml: ServingSettings = toml::from_str(
            "served_model_name = [\"a\", \"b\"]\nmax_model_len = 512\napi_key = \"k\"\n\
             allowed_origins = [\"*\"]\nchat_template = \"t.jinja\"\n",
        )
        .unwrap();
        let flags = parse(&[
            "--max-model-len",
            "256",
            "--allowed-origins",
            "https://x.example",
        ]);
        let merged = flags.or(toml);
        assert_eq!(merged.max_model_len, Some(256));
        assert_eq!(
            merged.served_model_name.as_deref(),
            Some(&["a".into(), "b".into()][..])
        );
        let access = merged
            .access(KeyStore::default(), AdmissionLimits::default())
            .unwrap();
        assert!(access.api_key.is_some());
        assert!(matches!(access.cors, AllowedOrigins::List(ref o) if o.len() == 1));
        let bad = parse(&["--api-key", "two words"]);
        let err = bad
            .access(KeyStore::default(), AdmissionLimits::default())
            .unwrap_err();
        assert!(format!("{err:#}").contains("--api-key"), "{err:#}");
    }
}
