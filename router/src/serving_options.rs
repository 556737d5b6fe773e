//! vLLM's options for presenting the one served model: other names clients may call it by
//! (`--served-model-name`), a context window below the model's own (`--max-model-len`) and a
//! chat template in place of the checkpoint's (`--chat-template`). `strata serve` and
//! `strata router` apply them the same way, here in the front door: it renders the prompts and
//! checks every request, so the engine and the nodes behind it need not know.

use std::path::{Path, PathBuf};

use strata_model::chat::{ChatTemplate, TemplateError};

/// How the served model is presented, beyond its checkpoint. The default presents it as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServingOptions {
    /// Names accepted in a request's `model` besides the served name (which responses report).
    pub aliases: Vec<String>,
    /// The context window reported and enforced, at most the model's own; `None` = the model's.
    pub max_model_len: Option<usize>,
    /// A Jinja chat template file used in place of the checkpoint's templates.
    pub chat_template: Option<PathBuf>,
}

/// A serving option the model cannot take; the message names the flag.
#[derive(Debug, thiserror::Error)]
pub enum OptionsError {
    #[error("--max-model-len must be at least 1")]
    ZeroMaxModelLen,
    #[error("--max-model-len {requested} exceeds the model's context window of {window} tokens")]
    MaxModelLen { requested: usize, window: usize },
    #[error("--chat-template: {0}")]
    ChatTemplate(#[from] TemplateError),
}

impl ServingOptions {
    /// The context window served for a model whose own is `window`.
    pub fn context_window(&self, window: usize) -> Result<usize, OptionsError> {
        match self.max_model_len {
            None => Ok(window),
            Some(0) => Err(OptionsError::ZeroMaxModelLen),
            Some(requested) if requested > window => {
                Err(OptionsError::MaxModelLen { requested, window })
            }
            Some(requested) => Ok(requested),
        }
    }

    /// The `--chat-template` file's template, with the BOS and EOS tokens of the checkpoint at
    /// `checkpoint`; `None` without the option (the checkpoint's own templates stay).
    pub fn chat_template(&self, checkpoint: &Path) -> Result<Option<ChatTemplate>, OptionsError> {
        self.chat_template
            .as_deref()
            .map(|file| ChatTemplate::from_file(file, checkpoint))
            .transpose()
            .map_err(OptionsError::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_capped_never_raised() {
        let capped = |n| ServingOptions {
            max_model_len: Some(n),
            ..Default::default()
        };
        assert_eq!(
            ServingOptions::default().context_window(4096).unwrap(),
            4096
        );
        assert_eq!(capped(512).context_window(4096).unwrap(), 512);
        assert_eq!(capped(4096).context_window(4096).unwrap(), 4096);
        let over = capped(4097).context_window(4096).unwrap_err().to_string();
        assert!(over.contains("4097") && over.contains("4096"), "{over}");
        let zero = capped(0).context_window(4096).unwrap_err().to_string();
        assert!(zero.contains("--max-model-len"), "{zero}");
    }

    #[test]
    fn a_missing_template_file_names_the_flag_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let options = ServingOptions {
            chat_template: Some(dir.path().join("absent.jinja")),
            ..Default::default()
        };
        let err = options.chat_template(dir.path()).unwrap_err().to_string();
        assert!(
            err.starts_with("--chat-template: ") && err.contains("absent.jinja"),
            "{err}"
        );
        assert!(
            ServingOptions::default()
                .chat_template(dir.path())
                .unwrap()
                .is_none()
        );
    }
}
