//! Where a chat template comes from: the checkpoint directory (in transformers' order of
//! lookup), a GGUF file's metadata, or a file given in their place (`--chat-template`). Every
//! source is compiled when it is read, so a broken template is an error at load, naming it.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::{ChatTemplate, DEFAULT_NAME, TemplateError};
use crate::gguf::{GgufHeader, SpecialTokens};
use crate::tokenizer::TokenizerConfig;

impl ChatTemplate {
    /// The checkpoint's template, found where transformers looks: `chat_template.jinja` (plus
    /// `additional_chat_templates/*.jinja`) when present, else `tokenizer_config.json`'s
    /// `chat_template` (a string or a `[{"name", "template"}]` list). `Ok(None)` when neither
    /// has one. BOS/EOS come from `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, TemplateError> {
        if crate::gguf::is_gguf_file(dir) {
            return Self::from_gguf(dir);
        }
        let config_path = dir.join("tokenizer_config.json");
        let config = match config_path.is_file() {
            true => Some(read_json(&config_path)?),
            false => None,
        };
        let special = config_tokens(&config_path, config.as_ref())?;
        let mut sources = template_files(dir)?;
        if sources.is_empty()
            && let Some(json) = &config
        {
            sources = config_templates(&config_path, json)?;
        }
        if sources.is_empty() {
            return Ok(None);
        }
        Self::from_sources(sources, special.bos, special.eos).map(Some)
    }

    /// The templates a GGUF file carries (`tokenizer.chat_template` and named ones), with the
    /// BOS/EOS tokens its tokenizer metadata names. `Ok(None)` when it has none.
    pub fn from_gguf(path: &Path) -> Result<Option<Self>, TemplateError> {
        let malformed = |message: String| TemplateError::MalformedConfig {
            path: path.to_owned(),
            message,
        };
        let file = crate::gguf::GgufFile::open(path).map_err(|e| malformed(e.problem()))?;
        let header = file.header();
        let special = gguf_tokens(path, header)?;
        let sources: Vec<TemplateSource> = crate::gguf::chat_templates(header)
            .map_err(|e| malformed(e.to_string()))?
            .into_iter()
            .map(|(name, source)| TemplateSource {
                origin: format!("{}: {}", path.display(), template_key(&name)),
                name,
                source,
            })
            .collect();
        if sources.is_empty() {
            return Ok(None);
        }
        Self::from_sources(sources, special.bos, special.eos).map(Some)
    }

    /// `file` in place of the checkpoint's templates (vLLM's `--chat-template`): its one
    /// template is `default`, so it renders requests with tools too, and it sees the BOS and EOS
    /// tokens of the checkpoint at `checkpoint` (a directory or a GGUF file). Read and compiled
    /// here, so a missing or broken file is an error naming it before anything is served.
    pub fn from_file(file: &Path, checkpoint: &Path) -> Result<Self, TemplateError> {
        let special = special_tokens(checkpoint)?;
        let source = TemplateSource {
            name: DEFAULT_NAME.into(),
            origin: file.display().to_string(),
            source: read_text(file)?,
        };
        Self::from_sources(vec![source], special.bos, special.eos)
    }
}

pub(super) struct TemplateSource {
    pub(super) name: String,
    pub(super) origin: String,
    pub(super) source: String,
}

fn read_text(path: &Path) -> Result<String, TemplateError> {
    fs::read_to_string(path).map_err(|error| TemplateError::Read {
        path: path.to_owned(),
        error,
    })
}

fn read_json(path: &Path) -> Result<Json, TemplateError> {
    serde_json::from_str(&read_text(path)?).map_err(|e| TemplateError::MalformedJson {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// `chat_template.jinja` as `default` and `additional_chat_templates/<name>.jinja` as `<name>`:
/// transformers gives these files priority over `tokenizer_config.json`.
fn template_files(dir: &Path) -> Result<Vec<TemplateSource>, TemplateError> {
    let mut sources = Vec::new();
    let main = dir.join("chat_template.jinja");
    if main.is_file() {
        sources.push(TemplateSource {
            name: DEFAULT_NAME.into(),
            origin: main.display().to_string(),
            source: read_text(&main)?,
        });
    }
    let extra_dir = dir.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let entries = fs::read_dir(&extra_dir).map_err(|error| TemplateError::Read {
            path: extra_dir.clone(),
            error,
        })?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|entry| Some(entry.ok()?.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "jinja"))
            .collect();
        paths.sort();
        for path in paths {
            let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            sources.push(TemplateSource {
                name: name.into(),
                origin: path.display().to_string(),
                source: read_text(&path)?,
            });
        }
    }
    Ok(sources)
}

/// `tokenizer_config.json`'s `chat_template`: a string, or HF's named list.
fn config_templates(path: &Path, json: &Json) -> Result<Vec<TemplateSource>, TemplateError> {
    let malformed = |message: &str| TemplateError::MalformedConfig {
        path: path.to_owned(),
        message: format!("chat_template: {message}"),
    };
    let origin = |name: &str| match name {
        DEFAULT_NAME => format!("{}#chat_template", path.display()),
        _ => format!("{}#chat_template[{name}]", path.display()),
    };
    match json.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(source)) => Ok(vec![TemplateSource {
            name: DEFAULT_NAME.into(),
            origin: origin(DEFAULT_NAME),
            source: source.clone(),
        }]),
        Some(Json::Array(entries)) => entries
            .iter()
            .map(|entry| {
                let name = entry.get("name").and_then(Json::as_str);
                let source = entry.get("template").and_then(Json::as_str);
                let (Some(name), Some(source)) = (name, source) else {
                    return Err(malformed(
                        "list entries need string \"name\" and \"template\"",
                    ));
                };
                Ok(TemplateSource {
                    name: name.into(),
                    origin: origin(name),
                    source: source.into(),
                })
            })
            .collect(),
        Some(_) => Err(malformed(
            "expected a string or a list of {\"name\", \"template\"}",
        )),
    }
}

/// The BOS and EOS tokens of the checkpoint at `checkpoint`: a GGUF file's metadata, else the
/// directory's `tokenizer_config.json` (none when it has no such file).
fn special_tokens(checkpoint: &Path) -> Result<SpecialTokens, TemplateError> {
    if crate::gguf::is_gguf_file(checkpoint) {
        let file = crate::gguf::GgufFile::open(checkpoint).map_err(|e| {
            TemplateError::MalformedConfig {
                path: checkpoint.to_owned(),
                message: e.problem(),
            }
        })?;
        return gguf_tokens(checkpoint, file.header());
    }
    let path = checkpoint.join("tokenizer_config.json");
    let config = match path.is_file() {
        true => Some(read_json(&path)?),
        false => None,
    };
    config_tokens(&path, config.as_ref())
}

/// The special tokens `tokenizer_config.json` (at `path`, read as `config`) names.
fn config_tokens(path: &Path, config: Option<&Json>) -> Result<SpecialTokens, TemplateError> {
    let Some(json) = config else {
        return Ok(SpecialTokens::default());
    };
    let config =
        TokenizerConfig::from_json(json).map_err(|message| TemplateError::MalformedConfig {
            path: path.to_owned(),
            message,
        })?;
    Ok(SpecialTokens {
        bos: config.bos_token,
        eos: config.eos_token,
    })
}

fn gguf_tokens(path: &Path, header: &GgufHeader) -> Result<SpecialTokens, TemplateError> {
    crate::gguf::special_tokens(header).map_err(|e| TemplateError::MalformedConfig {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// The GGUF metadata key a template named `name` comes from.
fn template_key(name: &str) -> String {
    match name {
        DEFAULT_NAME => crate::gguf::CHAT_TEMPLATE_KEY.to_string(),
        other => format!("{}.{other}", crate::gguf::CHAT_TEMPLATE_KEY),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::chat::ChatRequest;

    #[test]
    fn a_template_file_replaces_every_checkpoint_template_and_keeps_its_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({
            "bos_token": "<s>", "eos_token": "</s>",
            "chat_template": [
                {"name": "default", "template": "checkpoint"},
                {"name": "tool_use", "template": "checkpoint tools"}
            ]
        });
        fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let file = dir.path().join("mine.jinja");
        fs::write(&file, "{{ bos_token }}mine{{ eos_token }}").unwrap();
        let template = ChatTemplate::from_file(&file, dir.path()).unwrap();
        assert_eq!(template.names().collect::<Vec<_>>(), ["default"]);
        let with_tools = ChatRequest {
            tools: Some(Vec::new()),
            ..ChatRequest::default()
        };
        assert_eq!(template.render(&with_tools).unwrap(), "<s>mine</s>");
    }

    #[test]
    fn a_missing_or_broken_template_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent.jinja");
        let err = ChatTemplate::from_file(&missing, dir.path()).unwrap_err();
        assert!(
            matches!(err, TemplateError::Read { .. }) && err.to_string().contains("absent.jinja"),
            "{err}"
        );
        let broken = dir.path().join("broken.jinja");
        fs::write(&broken, "{% for m in messages %}unclosed").unwrap();
        let err = ChatTemplate::from_file(&broken, dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("broken.jinja") && text.contains("does not compile"),
            "{text}"
        );
    }
}
