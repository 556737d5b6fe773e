//! `--speculative-config`: what proposes tokens and how many, spelled as vLLM spells it
//! (`{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
//! "prompt_lookup_min": 2}`), checked once at start so a bad setting is refused by name.

use serde::{Deserialize, Serialize};

pub use strata_engine_api::load::MAX_SPECULATIVE_TOKENS;

/// The longest suffix the n-gram proposer matches.
pub const MAX_PROMPT_LOOKUP: usize = 32;

/// Which proposer drafts the tokens a step verifies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMethod {
    /// Prompt lookup: the longest recent suffix found earlier in the prompt or the output
    /// proposes what followed it.
    Ngram,
    /// A smaller checkpoint with the target's tokenizer drafts greedily.
    DraftModel,
}

/// Speculative decoding's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeConfig {
    pub method: SpecMethod,
    /// Tokens proposed per sequence and step at most (1..=[`MAX_SPECULATIVE_TOKENS`]); the
    /// scheduler proposes fewer where acceptance or the step's cost says so.
    pub num_speculative_tokens: usize,
    /// n-gram: the longest suffix matched [default: 4].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_lookup_max: Option<usize>,
    /// n-gram: the shortest suffix matched [default: 2, or the maximum when it is smaller].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_lookup_min: Option<usize>,
    /// draft_model: the draft checkpoint's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<std::path::PathBuf>,
    /// Speculation pauses while more sequences than this are running (vLLM's name) [default:
    /// none; the measured step cost decides].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_by_batch_size: Option<usize>,
    /// strata's own: `measured` (the default) verifies the proposals that pay by the measured
    /// step and proposer costs; `always` verifies every proposal whatever it costs (to measure
    /// a proposer's acceptance, or where the policy is not wanted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<SpecPolicy>,
}

/// Which proposals a step verifies ([`SpeculativeConfig::policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecPolicy {
    /// The ones expected to raise tokens per second by the measured costs.
    Measured,
    /// Every one (up to the draft length, the budget and the free blocks).
    Always,
}

impl SpeculativeConfig {
    /// Parses the JSON of `--speculative-config` and checks it.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let config: Self = serde_json::from_str(text)
            .map_err(|e| format!("--speculative-config is not a speculative configuration: {e}"))?;
        config.validate()?;
        Ok(config)
    }

    /// An n-gram configuration with the default lookup lengths.
    pub fn ngram(num_speculative_tokens: usize) -> Self {
        Self {
            method: SpecMethod::Ngram,
            num_speculative_tokens,
            prompt_lookup_max: None,
            prompt_lookup_min: None,
            model: None,
            disable_by_batch_size: None,
            policy: None,
        }
    }

    /// The n-gram proposer's suffix lengths, (min, max).
    pub fn lookup(&self) -> (usize, usize) {
        let max = self.prompt_lookup_max.unwrap_or(4);
        let min = self.prompt_lookup_min.unwrap_or(2.min(max));
        (min, max)
    }

    /// The settings' own consistency; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        let k = self.num_speculative_tokens;
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&k) {
            return Err(format!(
                "speculative num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS}; got {k}"
            ));
        }
        if self.disable_by_batch_size == Some(0) {
            return Err("speculative disable_by_batch_size must be at least 1".into());
        }
        match self.method {
            SpecMethod::Ngram => {
                if self.model.is_some() {
                    return Err(
                        "speculative method ngram takes no model (method draft_model does)".into(),
                    );
                }
                let (min, max) = self.lookup();
                if min == 0 || max > MAX_PROMPT_LOOKUP || min > max {
                    return Err(format!(
                        "speculative prompt_lookup_min {min} and prompt_lookup_max {max} must \
                         satisfy 1 <= min <= max <= {MAX_PROMPT_LOOKUP}"
                    ));
                }
                Ok(())
            }
            SpecMethod::DraftModel => {
                if self.model.is_none() {
                    return Err("speculative method draft_model needs a model (its path)".into());
                }
                if self.prompt_lookup_max.is_some() || self.prompt_lookup_min.is_some() {
                    return Err(
                        "speculative prompt_lookup_min / prompt_lookup_max belong to method \
                         ngram"
                            .into(),
                    );
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_spelling_parses_and_bad_settings_are_named() {
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}"#,
        )
        .unwrap();
        assert_eq!(c.method, SpecMethod::Ngram);
        assert_eq!(c.lookup(), (2, 4));
        assert_eq!(SpeculativeConfig::ngram(3).lookup(), (2, 4));
        let err = |json: &str| SpeculativeConfig::from_json(json).unwrap_err();
        assert!(err(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).contains("1..=8"));
        assert!(err(r#"{"method": "ngram", "num_speculative_tokens": 9}"#).contains("got 9"));
        assert!(err(r#"{"method": "eagle", "num_speculative_tokens": 2}"#).contains("eagle"));
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}"#).contains("typo")
        );
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}"#)
                .contains("prompt_lookup_min 5")
        );
        assert!(err(r#"{"method": "draft_model", "num_speculative_tokens": 2}"#).contains("model"));
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}"#)
                .contains("takes no model")
        );
        assert!(err("not json").contains("--speculative-config"));
        let always = r#"{"method": "ngram", "num_speculative_tokens": 2, "policy": "always"}"#;
        assert_eq!(
            SpeculativeConfig::from_json(always).unwrap().policy,
            Some(SpecPolicy::Always)
        );
        assert!(
            err(r#"{"method": "ngram", "num_speculative_tokens": 2, "policy": "sometimes"}"#)
                .contains("sometimes")
        );
    }
}
