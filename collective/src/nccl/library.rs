//! Finding libnccl at run time.
//!
//! cudarc opens NCCL by name (`libnccl.so`, then versioned names such as `libnccl.so.13`), through
//! the loader's own search (LD_LIBRARY_PATH, ldconfig). Unlike NVRTC (see
//! `strata_kernels::libs`), opening NCCL by full path first does not help: the loader reuses an
//! already-open library only when the name asked for is its soname, and NCCL's soname
//! (`libnccl.so.2`) is not among cudarc's names. So the search here only explains a failure: it
//! looks in the CUDA directories `strata_kernels::libs` searches and the distribution's library
//! directories, and says where a libnccl was seen off the loader path.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::CollectiveError;

/// Directories searched for an explanation when cudarc cannot open libnccl.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = strata_kernels::libs::lib_dirs();
    dirs.push(PathBuf::from("/usr/lib/x86_64-linux-gnu"));
    dirs.push(PathBuf::from("/usr/lib/aarch64-linux-gnu"));
    dirs.push(PathBuf::from("/usr/lib64"));
    dirs
}

const FILES: [&str; 2] = ["libnccl.so", "libnccl.so.2"];

/// Fails with a clear error unless cudarc can load libnccl; the check runs once per process.
pub fn ensure_nccl() -> Result<(), CollectiveError> {
    static DONE: OnceLock<Result<(), CollectiveError>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: only tries to dlopen libnccl by cudarc's names and closes it again.
        if unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Ok(());
        }
        let dirs = search_dirs();
        let seen: Vec<PathBuf> = dirs
            .iter()
            .flat_map(|d| FILES.iter().map(move |f| d.join(f)))
            .filter(|p| p.is_file())
            .collect();
        Err(missing(&dirs, &seen))
    })
    .clone()
}

/// The error for a libnccl that cudarc could not open, given the directories searched and the
/// files seen there.
fn missing(dirs: &[PathBuf], seen: &[PathBuf]) -> CollectiveError {
    let mut names = cudarc::get_lib_name_candidates("nccl");
    names.sort_unstable();
    names.dedup();
    let mut looked = vec![format!(
        "the loader path (LD_LIBRARY_PATH, ldconfig) under cudarc's names {}",
        names.join(" ")
    )];
    looked.extend(dirs.iter().map(|d| d.display().to_string()));
    let library = if seen.is_empty() {
        "libnccl (NCCL; Debian/Ubuntu package libnccl2, plus libnccl-dev for the libnccl.so link)"
            .to_string()
    } else {
        let seen: Vec<String> = seen.iter().map(|p| p.display().to_string()).collect();
        format!(
            "libnccl under a name cudarc opens (seen: {}; put a libnccl.so link to it in a \
             directory on LD_LIBRARY_PATH)",
            seen.join(", ")
        )
    };
    CollectiveError::LibraryMissing { library, looked }
}

/// The loaded NCCL's version as `major.minor.patch`.
pub fn nccl_version() -> Result<String, CollectiveError> {
    ensure_nccl()?;
    let code = cudarc::nccl::result::get_nccl_version()
        .map_err(|e| super::nccl_error("ncclGetVersion", &e))?;
    // NCCL ≥ 2.9 encodes major * 10000 + minor * 100 + patch.
    Ok(format!(
        "{}.{}.{}",
        code / 10000,
        code / 100 % 100,
        code % 100
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libnccl_names_every_place_looked() {
        let dirs = [
            PathBuf::from("/opt/cuda/lib64"),
            PathBuf::from("/usr/lib64"),
        ];
        let err = missing(&dirs, &[]).to_string();
        assert!(err.starts_with("libnccl (NCCL"), "{err}");
        assert!(err.contains("LD_LIBRARY_PATH"), "{err}");
        assert!(err.contains("libnccl.so"), "{err}");
        assert!(
            err.contains("/opt/cuda/lib64") && err.contains("/usr/lib64"),
            "{err}"
        );
    }

    #[test]
    fn a_libnccl_seen_off_the_loader_path_is_named() {
        let seen = [PathBuf::from("/opt/nccl/lib/libnccl.so.2")];
        let err = missing(&[PathBuf::from("/opt/nccl/lib")], &seen).to_string();
        assert!(err.contains("seen: /opt/nccl/lib/libnccl.so.2"), "{err}");
    }

    #[test]
    fn the_search_covers_the_distribution_directory() {
        assert!(search_dirs().contains(&PathBuf::from("/usr/lib/x86_64-linux-gnu")));
    }
}
