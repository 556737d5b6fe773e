//! vLLM's serving flags, defined once as flags and TOML keys: `serve` and `router` flatten
//! [`ServingSettings`] into their own. They present the model (its names, its context window,
//! its chat template) and guard the door (a server key, browser origins); the engine never sees
//! them.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Deserialize;
use strata_router::admission::AdmissionLimits;
use strata_router::auth::{ApiKey, KeyStore};
use strata_router::cors::AllowedOrigins;
use strata_router::{Access, ServingOptions};

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
