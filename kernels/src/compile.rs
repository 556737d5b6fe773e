//! NVRTC compilation of the embedded CUDA sources, with an on-disk PTX cache.
//!
//! Every source is compiled with the same fixed options: the target architecture, C++17, the CUDA
//! include directory, and nothing that trades exactness for speed (no `--use_fast_math`, IEEE
//! division and square root, no flush-to-zero). The cache key is sha256 over the full source
//! text, the architecture, the options and the NVRTC version, so a changed kernel, compiler or
//! flag never reuses stale PTX.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{KernelError, Source, libs};

/// Headers the sources may `#include "name"`, handed to NVRTC from memory.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("blocks.cuh", include_str!("../cuda/blocks.cuh")),
    ("gemv_mma.cuh", include_str!("../cuda/gemv_mma.cuh")),
    ("lowp.cuh", include_str!("../cuda/lowp.cuh")),
];

/// The NVRTC options for `arch` with headers from `include_dir`.
pub fn options(arch: &str, include_dir: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        format!("--include-path={}", include_dir.display()),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "--fmad=true".to_string(),
        "-default-device".to_string(),
    ]
}

/// The default PTX cache: `$XDG_CACHE_HOME/strata/kernels`, else `~/.cache/strata/kernels`.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(xdg) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(xdg).join("strata/kernels"));
    }
    std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(|home| PathBuf::from(home).join(".cache/strata/kernels"))
}

/// The loaded NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    libs::ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both out-pointers are valid for the duration of the call.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_ok(status, "nvrtcVersion")?;
    Ok((major, minor))
}

fn nvrtc_ok(status: cudarc::nvrtc::sys::nvrtcResult, call: &str) -> Result<(), KernelError> {
    status
        .result()
        .map_err(|e| KernelError::Nvrtc(format!("{call}: {e:?}")))
}

/// Compiles sources for any architecture, through the disk cache when one is configured.
pub struct Compiler {
    include_dir: PathBuf,
    cache_dir: Option<PathBuf>,
    version: (i32, i32),
}

impl Compiler {
    /// Finds NVRTC and the CUDA headers. `cache_dir` overrides [`default_cache_dir`].
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Compiler, KernelError> {
        let version = nvrtc_version()?;
        let include_dir = libs::find_include_dir()?;
        Ok(Compiler {
            include_dir,
            cache_dir: cache_dir.or_else(default_cache_dir),
            version,
        })
    }

    /// A compiler that never touches the disk cache.
    pub fn uncached() -> Result<Compiler, KernelError> {
        let mut compiler = Compiler::new(None)?;
        compiler.cache_dir = None;
        Ok(compiler)
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.version
    }

    /// The PTX of `source` for `arch`, from the cache when present, else compiled and cached.
    /// A cache that cannot be read or written is skipped, never an error.
    pub fn compile(&self, source: &Source, arch: &str) -> Result<String, KernelError> {
        let text = source.text;
        let options = options(arch, &self.include_dir);
        let cache_path = self.cache_dir.as_ref().map(|dir| {
            let key = cache_key(text, arch, &options, self.version);
            dir.join(format!("{}-{arch}-{key}.ptx", source.module))
        });
        if let Some(path) = &cache_path
            && let Ok(ptx) = std::fs::read_to_string(path)
            && ptx.contains(".entry")
        {
            return Ok(ptx);
        }
        let ptx = compile_text(text, source.module, arch, &options)?;
        if let Some(path) = &cache_path {
            store(path, &ptx);
        }
        Ok(ptx)
    }
}

/// sha256 over everything that determines the PTX, hex encoded.
fn cache_key(text: &str, arch: &str, options: &[String], version: (i32, i32)) -> String {
    let mut hasher = Sha256::new();
    let joined = options.join("\u{1f}");
    let mut parts = vec![text, arch, joined.as_str()];
    for (name, header) in HEADERS {
        parts.extend([*name, *header]);
    }
    for part in parts {
        hasher.update(part.as_bytes());
        hasher.update([0u8]);
    }
    hasher.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `ptx` through a temporary file and a rename, so a concurrent reader never sees half.
fn store(path: &Path, ptx: &str) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, ptx).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Runs NVRTC on `text`; a rejected source becomes [`KernelError::Compile`] with NVRTC's log.
pub fn compile_text(
    text: &str,
    module: &str,
    arch: &str,
    options: &[String],
) -> Result<String, KernelError> {
    libs::ensure_nvrtc()?;
    let src = CString::new(text)
        .map_err(|_| KernelError::Nvrtc(format!("{module}.cu contains a NUL byte")))?;
    let name = CString::new(format!("{module}.cu"))
        .map_err(|_| KernelError::Nvrtc(format!("module name {module:?} contains a NUL byte")))?;
    let program = Program::create(&src, &name)?;
    // SAFETY: `prog` was created above and is destroyed only by `Program::drop`.
    let compiled = unsafe { cudarc::nvrtc::result::compile_program(program.0, options) };
    if compiled.is_err() {
        let log = program.log();
        return Err(KernelError::Compile {
            module: module.to_string(),
            arch: arch.to_string(),
            log: if log.trim().is_empty() {
                format!("{compiled:?} (no log)")
            } else {
                log
            },
        });
    }
    // SAFETY: as above; compilation succeeded.
    let ptx = unsafe { cudarc::nvrtc::result::get_ptx(program.0) }
        .map_err(|e| KernelError::Nvrtc(format!("nvrtcGetPTX: {e:?}")))?;
    let bytes: Vec<u8> = ptx
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8(bytes).map_err(|_| KernelError::Nvrtc("PTX is not UTF-8".to_string()))
}

/// Destroys the NVRTC program on every exit path; keeps the header strings alive as long as it.
struct Program(
    cudarc::nvrtc::sys::nvrtcProgram,
    #[allow(dead_code)] Vec<CString>,
);

impl Program {
    /// Creates the program with [`HEADERS`] available to `#include`.
    fn create(src: &CStr, name: &CStr) -> Result<Program, KernelError> {
        let names: Vec<CString> = HEADERS
            .iter()
            .map(|(n, _)| CString::new(*n).expect("header names are NUL-free literals"))
            .collect();
        let texts: Vec<CString> = HEADERS
            .iter()
            .map(|(_, t)| CString::new(*t).expect("embedded headers contain no NUL"))
            .collect();
        let name_ptrs: Vec<*const std::ffi::c_char> = names.iter().map(|c| c.as_ptr()).collect();
        let text_ptrs: Vec<*const std::ffi::c_char> = texts.iter().map(|c| c.as_ptr()).collect();
        let mut prog = std::mem::MaybeUninit::uninit();
        // SAFETY: every pointer is valid for the call and stays valid while the program lives.
        let status = unsafe {
            cudarc::nvrtc::sys::nvrtcCreateProgram(
                prog.as_mut_ptr(),
                src.as_ptr(),
                name.as_ptr(),
                HEADERS.len() as std::ffi::c_int,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        nvrtc_ok(status, "nvrtcCreateProgram")?;
        // SAFETY: creation succeeded, so the handle is initialised.
        let mut keep = names;
        keep.extend(texts);
        Ok(Program(unsafe { prog.assume_init() }, keep))
    }

    fn log(&self) -> String {
        // SAFETY: the program is alive until drop.
        match unsafe { cudarc::nvrtc::result::get_program_log(self.0) } {
            Ok(raw) => {
                // SAFETY: NVRTC returns a NUL-terminated string.
                let cstr = unsafe { CStr::from_ptr(raw.as_ptr()) };
                cstr.to_string_lossy().into_owned()
            }
            Err(e) => format!("(log unavailable: {e:?})"),
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        let _ = unsafe { cudarc::nvrtc::result::destroy_program(self.0) };
    }
}

/// Names of the kernel entry points (`.entry name(`) in a PTX text, in order.
pub fn entry_names(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.trim_start();
            let rest = rest.strip_prefix(".visible ").unwrap_or(rest);
            let rest = rest.strip_prefix(".entry ")?;
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_reads_visible_entries_in_order() {
        let ptx = ".version 8.8\n.visible .entry rmsnorm(\n\t.param .u64 a\n)\n\
                   .entry gemv_f32_m1(\n.func helper(\n";
        assert_eq!(entry_names(ptx), vec!["rmsnorm", "gemv_f32_m1"]);
    }

    #[test]
    fn the_cache_key_changes_with_source_arch_options_and_compiler() {
        let opts = options("sm_90a", Path::new("/inc"));
        let base = cache_key("a", "sm_90a", &opts, (13, 0));
        assert_eq!(base, cache_key("a", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("b", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("a", "sm_100a", &opts, (13, 0)));
        assert_ne!(base, cache_key("a", "sm_90a", &opts[1..], (13, 0)));
        assert_ne!(base, cache_key("a", "sm_90a", &opts, (13, 1)));
    }

    #[test]
    fn no_option_trades_exactness_for_speed() {
        let opts = options("sm_90a", Path::new("/inc")).join(" ");
        assert!(!opts.contains("fast-math") && opts.contains("--ftz=false"));
        assert!(opts.contains("--prec-div=true") && opts.contains("--prec-sqrt=true"));
    }
}
