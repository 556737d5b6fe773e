//! Finding the CUDA libraries, headers and tools at run time.
//!
//! cudarc opens libnvrtc / libcublas / libcublasLt by soname (`libnvrtc.so.13`), which only finds
//! them on the loader path. CUDA installs put them in `$CUDA_HOME/lib64`, which is usually not on
//! that path, and the pip wheels put them in `<dir>/nvidia/cu13/lib`. So before cudarc's first call
//! each library is opened here by full path and kept open; the loader then answers cudarc's later
//! open by soname with the already-loaded copy.
//!
//! Search order, first hit wins: every directory of `STRATA_CUDA_LIBS` (colon separated; each is a
//! pip `--target` directory, searched as `<dir>/nvidia/cu13/lib` and `<dir>` itself), then
//! `$CUDA_HOME/lib64`, then `/usr/local/cuda/lib64`, then the loader's own path.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::KernelError;

/// The CUDA major version the bindings were generated for (cudarc feature `cuda-13000`).
const CUDA_MAJOR: &str = "13";

/// Libraries opened by full path; kept open for the life of the process so the loader keeps
/// answering soname lookups with them.
static OPENED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

/// Roots from `STRATA_CUDA_LIBS`, in order.
fn wheel_roots() -> Vec<PathBuf> {
    std::env::var_os("STRATA_CUDA_LIBS")
        .map(|v| {
            std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default()
}

fn cuda_home() -> Option<PathBuf> {
    std::env::var_os("CUDA_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Directories searched for shared libraries, in order.
pub fn lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for root in wheel_roots() {
        dirs.push(root.join("nvidia/cu13/lib"));
        dirs.push(root.clone());
    }
    if let Some(home) = cuda_home() {
        dirs.push(home.join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

/// Directories searched for the CUDA headers NVRTC needs (`cuda_bf16.h`), in order:
/// `STRATA_CUDA_INCLUDE`, `<wheel root>/nvidia/cu13/include`, `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("STRATA_CUDA_INCLUDE").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(dir));
    }
    for root in wheel_roots() {
        dirs.push(root.join("nvidia/cu13/include"));
    }
    if let Some(home) = cuda_home() {
        dirs.push(home.join("include"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs
}

/// The first include directory holding `cuda_bf16.h`.
pub fn find_include_dir() -> Result<PathBuf, KernelError> {
    let dirs = include_dirs();
    dirs.iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .cloned()
        .ok_or_else(|| KernelError::LibraryMissing {
            library: "CUDA headers (cuda_bf16.h)",
            looked: display_all(&dirs),
        })
}

/// Candidate `ptxas` executables, in order: `STRATA_PTXAS`, `$CUDA_HOME/bin/ptxas`,
/// `<wheel root>/nvidia/cu13/bin/ptxas`, `/usr/local/cuda/bin/ptxas`.
pub fn ptxas_candidates() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(p) = std::env::var_os("STRATA_PTXAS").filter(|v| !v.is_empty()) {
        paths.push(PathBuf::from(p));
    }
    if let Some(home) = cuda_home() {
        paths.push(home.join("bin/ptxas"));
    }
    for root in wheel_roots() {
        paths.push(root.join("nvidia/cu13/bin/ptxas"));
    }
    paths.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    paths
}

/// The first existing `ptxas`, if any.
pub fn find_ptxas() -> Option<PathBuf> {
    ptxas_candidates().into_iter().find(|p| p.is_file())
}

/// Candidate `nvdisasm` executables, in order: `STRATA_NVDISASM`, `$CUDA_HOME/bin/nvdisasm`,
/// `<wheel root>/nvidia/cu13/bin/nvdisasm`, `/usr/local/cuda/bin/nvdisasm`.
pub fn nvdisasm_candidates() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(p) = std::env::var_os("STRATA_NVDISASM").filter(|v| !v.is_empty()) {
        paths.push(PathBuf::from(p));
    }
    if let Some(home) = cuda_home() {
        paths.push(home.join("bin/nvdisasm"));
    }
    for root in wheel_roots() {
        paths.push(root.join("nvidia/cu13/bin/nvdisasm"));
    }
    paths.push(PathBuf::from("/usr/local/cuda/bin/nvdisasm"));
    paths
}

/// The first existing `nvdisasm`, if any.
pub fn find_nvdisasm() -> Option<PathBuf> {
    nvdisasm_candidates().into_iter().find(|p| p.is_file())
}

fn display_all(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.display().to_string()).collect()
}

/// Opens the first of `files` found in `lib_dirs()` by full path and keeps it open. Returns the
/// places looked in when none was found (the caller then tries the loader path).
fn open_from_dirs(files: &[String]) -> Result<PathBuf, Vec<String>> {
    let mut looked = Vec::new();
    for dir in lib_dirs() {
        for file in files {
            let path = dir.join(file);
            if path.is_file() && open_path(&path).is_ok() {
                return Ok(path);
            }
        }
        looked.push(dir.display().to_string());
    }
    Err(looked)
}

fn open_path(path: &Path) -> Result<(), libloading::Error> {
    // SAFETY: the CUDA libraries' initialisers are safe to run at any time on any thread.
    let lib = unsafe { libloading::Library::new(path) }?;
    OPENED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(lib);
    Ok(())
}

/// Preloads one library (`stem` like `nvrtc`), then confirms cudarc can open it by soname.
fn preload(
    stem: &'static str,
    companions: &[&str],
    present: unsafe fn() -> bool,
) -> Result<(), Missing> {
    let files = vec![
        format!("lib{stem}.so.{CUDA_MAJOR}"),
        format!("lib{stem}.so"),
    ];
    let found = open_from_dirs(&files);
    if let Ok(path) = &found {
        // Companions sit beside the main library (NVRTC's builtins are opened by soname later).
        if let Some(dir) = path.parent() {
            for companion in companions {
                let p = dir.join(companion);
                if p.is_file() {
                    let _ = open_path(&p);
                }
            }
        }
    }
    // SAFETY: `present` only tries to dlopen by soname and closes again.
    if unsafe { present() } {
        return Ok(());
    }
    let mut looked = found.err().unwrap_or_default();
    looked.push("the loader path (LD_LIBRARY_PATH, ldconfig)".to_string());
    Err((stem_name(stem), looked))
}

fn stem_name(stem: &'static str) -> &'static str {
    match stem {
        "nvrtc" => "libnvrtc (NVRTC)",
        "cublas" => "libcublas (cuBLAS)",
        "cublasLt" => "libcublasLt (cuBLASLt)",
        other => other,
    }
}

/// Makes libnvrtc loadable by cudarc; idempotent and cheap after the first call.
pub fn ensure_nvrtc() -> Result<(), KernelError> {
    static DONE: OnceLock<Result<(), Missing>> = OnceLock::new();
    once(&DONE, || {
        preload(
            "nvrtc",
            &[&format!("libnvrtc-builtins.so.{CUDA_MAJOR}.0")],
            cudarc::nvrtc::sys::is_culib_present,
        )
    })
}

/// Makes libcublasLt and libcublas loadable by cudarc; idempotent.
pub fn ensure_cublaslt() -> Result<(), KernelError> {
    static DONE: OnceLock<Result<(), Missing>> = OnceLock::new();
    once(&DONE, || {
        // cuBLAS links against cuBLASLt: open Lt first so cuBLAS's dependency resolves to it.
        preload("cublasLt", &[], cudarc::cublaslt::sys::is_culib_present)?;
        preload("cublas", &[], cudarc::cublas::sys::is_culib_present)
    })
}

/// Fails with a clear error unless the CUDA driver library (libcuda) can be loaded. Call before
/// any driver use: cudarc panics when it is missing.
pub fn ensure_driver() -> Result<(), KernelError> {
    // SAFETY: only tries to dlopen libcuda by its known names.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::LibraryMissing {
            library: "no CUDA driver: libcuda.so.1",
            looked: vec![
                "the loader path (LD_LIBRARY_PATH, ldconfig); it ships with the NVIDIA driver"
                    .to_string(),
            ],
        })
    }
}

/// A library that was not found, and where it was looked for.
type Missing = (&'static str, Vec<String>);

/// Runs `f` once per process and replays its outcome; a library search is not retried.
fn once(
    cell: &OnceLock<Result<(), Missing>>,
    f: impl FnOnce() -> Result<(), Missing>,
) -> Result<(), KernelError> {
    cell.get_or_init(f)
        .clone()
        .map_err(|(library, looked)| KernelError::LibraryMissing { library, looked })
}
