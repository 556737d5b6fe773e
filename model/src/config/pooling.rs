//! How a checkpoint turns its hidden states into an embedding: the sentence-transformers files
//! beside the weights (`modules.json`, its Pooling module's `config.json`), as vLLM and
//! sentence-transformers read them.

use std::path::Path;

use serde::Deserialize;
use strata_protocol::Pooling;

use super::ConfigError;

/// The embedding a checkpoint asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingConfig {
    /// How hidden states pool; `Err` names a pooling mode the engine does not compute (the
    /// embeddings endpoints then refuse with it, generation is unaffected).
    pub pooling: Result<Pooling, String>,
    /// Whether embeddings are scaled to unit length.
    pub normalize: bool,
}

impl Default for EmbeddingConfig {
    /// A decoder without sentence-transformers files: its last token, normalized (vLLM's default
    /// for a causal model served as an embedding model).
    fn default() -> Self {
        Self {
            pooling: Ok(Pooling::Last),
            normalize: true,
        }
    }
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize, Default)]
struct PoolingFile {
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
}

impl EmbeddingConfig {
    /// Reads `dir/modules.json` and its Pooling module's config; the default without them (and
    /// for a GGUF file).
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("modules.json");
        if crate::gguf::is_gguf_file(dir) || !path.is_file() {
            return Ok(Self::default());
        }
        let modules: Vec<Module> = read_json(&path)?;
        let normalize = modules.iter().any(|m| m.kind.ends_with(".Normalize"));
        let pooling = match modules.iter().find(|m| m.kind.ends_with(".Pooling")) {
            None => Ok(Pooling::Last),
            Some(m) => {
                let file = dir.join(&m.path).join("config.json");
                pooling_of(&read_json::<PoolingFile>(&file)?)
            }
        };
        Ok(Self { pooling, normalize })
    }
}

fn pooling_of(file: &PoolingFile) -> Result<Pooling, String> {
    let modes = [
        (file.pooling_mode_lasttoken, "lasttoken"),
        (file.pooling_mode_mean_tokens, "mean_tokens"),
        (file.pooling_mode_cls_token, "cls_token"),
        (file.pooling_mode_max_tokens, "max_tokens"),
        (
            file.pooling_mode_mean_sqrt_len_tokens,
            "mean_sqrt_len_tokens",
        ),
        (file.pooling_mode_weightedmean_tokens, "weightedmean_tokens"),
    ];
    let set: Vec<&str> = modes.iter().filter(|m| m.0).map(|m| m.1).collect();
    match set[..] {
        ["lasttoken"] => Ok(Pooling::Last),
        ["mean_tokens"] => Ok(Pooling::Mean),
        [] => Err("the checkpoint's Pooling module sets no pooling mode".to_string()),
        _ => Err(format!(
            "the checkpoint pools by {}; this server pools by the last token or the mean",
            set.join(" + ")
        )),
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(path, format!("cannot read: {e}")))?;
    serde_json::from_str(&text).map_err(|e| ConfigError::new(path, format!("malformed JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, modules: &str, pooling: Option<&str>) {
        std::fs::write(dir.join("modules.json"), modules).unwrap();
        if let Some(p) = pooling {
            std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
            std::fs::write(dir.join("1_Pooling/config.json"), p).unwrap();
        }
    }

    const MODULES: &str = r#"[
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    ]"#;

    #[test]
    fn sentence_transformers_files_decide_pooling_and_normalization() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            EmbeddingConfig::from_dir(dir.path()).unwrap(),
            EmbeddingConfig::default()
        );
        write(
            dir.path(),
            MODULES,
            Some(r#"{"word_embedding_dimension": 64, "pooling_mode_lasttoken": true}"#),
        );
        let c = EmbeddingConfig::from_dir(dir.path()).unwrap();
        assert_eq!((c.pooling, c.normalize), (Ok(Pooling::Last), true));
        let without_normalize = MODULES.replace(".Normalize", ".Dense");
        write(
            dir.path(),
            &without_normalize,
            Some(r#"{"pooling_mode_mean_tokens": true}"#),
        );
        let c = EmbeddingConfig::from_dir(dir.path()).unwrap();
        assert_eq!((c.pooling, c.normalize), (Ok(Pooling::Mean), false));
        write(
            dir.path(),
            MODULES,
            Some(r#"{"pooling_mode_cls_token": true}"#),
        );
        let err = EmbeddingConfig::from_dir(dir.path())
            .unwrap()
            .pooling
            .unwrap_err();
        assert!(err.contains("cls_token"), "{err}");
        write(dir.path(), "{not json", None);
        let err = EmbeddingConfig::from_dir(dir.path()).unwrap_err();
        assert!(err.problem.contains("malformed JSON"), "{}", err.problem);
    }
}
