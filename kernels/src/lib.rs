//! strata-kernels: the CUDA kernel layer of the fast backend.
//!
//! Kernels are CUDA C under `kernels/cuda/`, embedded in the binary, compiled by NVRTC for the
//! device's own architecture and cached on disk ([`compile`]). [`Kernels`] loads every module once
//! per [`CudaContext`] and offers one typed launch method per kernel; each method validates shapes
//! and alignment before launching, so a wrong shape is an error, never undefined behaviour.
//! cuBLASLt GEMMs for prefill rows live in [`gemm`].
//!
//! The crate builds and links on machines without CUDA: every CUDA library is loaded at run time
//! ([`libs`]), and a missing library is a [`KernelError`] naming what was looked for and where.
//!
//! Numerics follow DESIGN §3: bf16 storage, f32 accumulation, and every reduction in a fixed order
//! that depends only on its own row — never on batch size or grid shape, never through atomics.

mod attention;
pub mod bench;
mod blocks;
pub mod check;
pub mod compile;
mod elementwise;
mod fp4;
mod fp8;
pub mod gemm;
mod gemv;
mod kv_copy;
mod launch;
pub mod libs;
mod moe;
mod runs;
mod sampling;
pub mod sass;
pub mod selftest;
mod selftest_attention;
pub mod selftest_blocks;
mod selftest_gemma;
mod selftest_gemv;
pub mod selftest_lowp;
mod selftest_moe;
mod selftest_runs;
mod selftest_tiles;
mod selftest_tp;
pub mod tiles;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DriverError};

/// The cudarc this crate is built against, so callers name the same types.
pub use cudarc;

pub use attention::{
    ATTENTION_HEAD_DIMS, AttentionHeads, DECODE_SPLIT_TOKENS, DEFAULT_PREFILL_VARIANT, DecodeBatch,
    PagedKv, PrefillChunk, PrefillVariant, decode_workspace_elems,
};
pub use blocks::BlockFormat;
pub use check::{FunctionResources, Report, check};
pub use elementwise::{GateActivation, NormWeight, RopeKvShape};
pub use fp4::has_fp4_mma;
pub use gemm::{GemmIn, GemmOut, GemmShape, LtGemm};
pub use gemv::{DEFAULT_VARIANT, GEMV_FMA_MAX_M, GEMV_MAX_M, GemvOut, GemvVariant};
pub use kv_copy::KvParts;
pub use moe::{ExpertGroups, ExpertSlots, MOE_MAX_EXPERTS, MOE_MAX_TOP_K};
pub use sampling::{
    NO_TOKEN, SAMPLE_CANDIDATE_WORDS, SAMPLE_HEAD_WORDS, SAMPLE_PLAN_WORDS, SHAPE_ENTRY_WORDS,
    SampleHead, SamplePlan, ShapeOp,
};
pub use selftest::selftest;

/// One CUDA source file of the crate: `module` is its stem (`gemv` for `cuda/gemv.cu`), the name
/// under which [`Kernels::function`] finds its functions.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub module: &'static str,
    pub text: &'static str,
}

/// `cuda/gemv_blocks.cu` for one block format (`MACRO(id, name)` as `FOR_EACH_BLOCK_FORMAT` in
/// `cuda/blocks.cuh` lists it): one module per format, so that the formats compile in parallel and
/// each stays a small compilation unit (the eight together were a third of NVRTC's time at load).
macro_rules! block_source {
    ($module:literal, $format:literal) => {
        Source {
            module: $module,
            text: concat!(
                "#define BLOCK_FORMAT(MACRO) ",
                $format,
                "\n",
                include_str!("../cuda/gemv_blocks.cu")
            ),
        }
    };
}

/// Every kernel source, in load order.
pub const SOURCES: &[Source] = &[
    Source {
        module: "elementwise",
        text: include_str!("../cuda/elementwise.cu"),
    },
    Source {
        module: "gemv",
        text: include_str!("../cuda/gemv.cu"),
    },
    block_source!("gemv_blocks_q4_0", "MACRO(2, q4_0)"),
    block_source!("gemv_blocks_q4_1", "MACRO(3, q4_1)"),
    block_source!("gemv_blocks_q5_0", "MACRO(6, q5_0)"),
    block_source!("gemv_blocks_q5_1", "MACRO(7, q5_1)"),
    block_source!("gemv_blocks_q8_0", "MACRO(8, q8_0)"),
    block_source!("gemv_blocks_q4_k", "MACRO(12, q4_k)"),
    block_source!("gemv_blocks_q5_k", "MACRO(13, q5_k)"),
    block_source!("gemv_blocks_q6_k", "MACRO(14, q6_k)"),
    block_source!("gemv_blocks_nvfp4", "MACRO(1001, nvfp4)"),
    block_source!("gemv_blocks_nvfp4_modelopt", "MACRO(1002, nvfp4_modelopt)"),
    block_source!("gemv_blocks_fp8", "MACRO(1003, fp8)"),
    Source {
        module: "gemv_tiles",
        text: include_str!("../cuda/gemv_tiles.cu"),
    },
    Source {
        module: "runs",
        text: include_str!("../cuda/runs.cu"),
    },
    Source {
        module: "fp4",
        text: include_str!("../cuda/fp4.cu"),
    },
    Source {
        module: "fp8",
        text: include_str!("../cuda/fp8.cu"),
    },
    Source {
        module: "sampling",
        text: include_str!("../cuda/sampling.cu"),
    },
    Source {
        module: "attention",
        text: include_str!("../cuda/attention.cu"),
    },
    Source {
        module: "moe",
        text: include_str!("../cuda/moe.cu"),
    },
];

/// Everything that can go wrong loading or launching a kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A CUDA library could not be found; `looked` lists every place searched.
    #[error("{library} not found; looked in: {}", looked.join(", "))]
    LibraryMissing {
        library: &'static str,
        looked: Vec<String>,
    },
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    /// NVRTC rejected a source; `log` is NVRTC's own program log.
    #[error("NVRTC could not compile {module}.cu for {arch}:\n{log}")]
    Compile {
        module: String,
        arch: String,
        log: String,
    },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("cuBLASLt: {0}")]
    Cublas(String),
    /// A launch argument does not satisfy the kernel's layout contract.
    #[error("{kernel}: {message}")]
    Shape {
        kernel: &'static str,
        message: String,
    },
    #[error("no kernel function `{name}` in module `{module}`")]
    UnknownFunction { module: String, name: String },
    #[error("unsupported GPU: compute capability {major}.{minor} (bf16 kernels need 8.0 or newer)")]
    UnsupportedArch { major: i32, minor: i32 },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("ptxas: {0}")]
    Ptxas(String),
}

/// Returns `Err(KernelError::Shape)` with the formatted message unless `cond` holds.
macro_rules! ensure_shape {
    ($cond:expr, $kernel:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::KernelError::Shape {
                kernel: $kernel,
                message: format!($($fmt)+),
            });
        }
    };
}
pub(crate) use ensure_shape;

/// The outcome of one device self-test check: a kernel's output against its CPU reference.
///
/// A `canary` check compares against a deliberately wrong reference and is `ok` only when the
/// comparison fails — proof that the check can fail.
#[derive(Debug, Clone)]
pub struct CheckResult {
    /// The kernel (or kernel family) checked, e.g. `rmsnorm`.
    pub kernel: String,
    /// The case: shapes and variant, e.g. `rows=7 h=4096`.
    pub case: String,
    pub canary: bool,
    /// The check's error measure: normally ‖out − ref‖₂ / ‖ref‖₂; for bitwise and exact checks
    /// the count of differing elements (with tolerance 0). NaN when the check could not run.
    pub max_rel_err: f64,
    pub tolerance: f64,
    /// Every output element was overwritten (none still holds the NaN poison).
    pub all_written: bool,
    pub ok: bool,
    /// Free text: the failing element, a launch error, bitwise mismatch counts.
    pub detail: String,
}

impl CheckResult {
    /// A comparison result; `ok` is "within tolerance and fully written", inverted for a canary.
    pub fn compare(
        kernel: &str,
        case: String,
        canary: bool,
        max_rel_err: f64,
        tolerance: f64,
        all_written: bool,
        detail: String,
    ) -> Self {
        let passed = all_written && max_rel_err <= tolerance;
        CheckResult {
            kernel: kernel.to_string(),
            case,
            canary,
            max_rel_err,
            tolerance,
            all_written,
            ok: passed != canary,
            detail,
        }
    }

    /// A check that could not run (launch or copy error): always a failure.
    pub fn error(kernel: &str, case: String, canary: bool, error: impl std::fmt::Display) -> Self {
        CheckResult {
            kernel: kernel.to_string(),
            case,
            canary,
            max_rel_err: f64::NAN,
            tolerance: 0.0,
            all_written: false,
            ok: false,
            detail: error.to_string(),
        }
    }
}

/// The NVRTC architecture for a compute capability: the arch-specific (`a`) target where one
/// exists, so Hopper/Blackwell-only instructions are available. `"unsupported"` for GPUs older
/// than Ampere (no bf16 arithmetic) or newer than this table; [`Kernels::load`] rejects those.
pub fn arch_for(cc_major: i32, cc_minor: i32) -> &'static str {
    match (cc_major, cc_minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90a",
        (10, 0) => "sm_100a",
        (10, 1) => "sm_101a",
        (10, 3) => "sm_103a",
        (11, 0) => "sm_110a",
        (12, 0) => "sm_120a",
        (12, 1) => "sm_121a",
        _ => "unsupported",
    }
}

/// One loaded module and its kernel functions by name.
struct LoadedModule {
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// Compiles `source` for `arch` (or takes it from the cache) and loads it with its functions.
fn load_module(
    ctx: &Arc<CudaContext>,
    compiler: &compile::Compiler,
    source: &Source,
    arch: &str,
) -> Result<LoadedModule, KernelError> {
    let ptx = compiler.compile(source, arch)?;
    let names = compile::entry_names(&ptx);
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
    let mut functions = HashMap::new();
    for name in names {
        let function = module.load_function(&name)?;
        functions.insert(name, function);
    }
    Ok(LoadedModule {
        _module: module,
        functions,
    })
}

/// Every kernel module, compiled for and loaded into one [`CudaContext`].
///
/// Load once per context and share it; launch methods take the stream to launch on.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    arch: &'static str,
    modules: HashMap<&'static str, LoadedModule>,
}

impl Kernels {
    /// Compiles (or takes from the disk cache) every module in [`SOURCES`] for the context's
    /// device and loads all of their `extern "C"` kernels.
    ///
    /// `cache_dir` overrides [`compile::default_cache_dir`]; with neither available nothing is
    /// cached. Fails with a clear error when the driver, NVRTC or CUDA headers are missing.
    pub fn load(ctx: &Arc<CudaContext>, cache_dir: Option<&Path>) -> Result<Kernels, KernelError> {
        libs::ensure_driver()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_for(major, minor);
        if arch == "unsupported" {
            return Err(KernelError::UnsupportedArch { major, minor });
        }
        let compiler = compile::Compiler::new(cache_dir.map(Path::to_path_buf))?;
        // Each module compiles (NVRTC) and loads (the driver's PTX JIT) on its own thread: a
        // first start on a machine with an empty cache pays the slowest module, not their sum.
        let loaded: Vec<Result<LoadedModule, KernelError>> = std::thread::scope(|scope| {
            let threads: Vec<_> = SOURCES
                .iter()
                .map(|source| scope.spawn(|| load_module(ctx, &compiler, source, arch)))
                .collect();
            threads
                .into_iter()
                .zip(SOURCES)
                .map(|(thread, source)| {
                    thread.join().unwrap_or_else(|_| {
                        Err(KernelError::Nvrtc(format!(
                            "the thread compiling {}.cu panicked",
                            source.module
                        )))
                    })
                })
                .collect()
        });
        let mut modules = HashMap::new();
        for (source, module) in SOURCES.iter().zip(loaded) {
            modules.insert(source.module, module?);
        }
        let kernels = Kernels {
            ctx: ctx.clone(),
            arch,
            modules,
        };
        // Once here, never at a launch: a launch may be inside a graph capture.
        kernels.allow_runs_gemm_smem()?;
        Ok(kernels)
    }

    /// The NVRTC architecture the modules were compiled for (see [`arch_for`]).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The kernel `name` (its `extern "C"` name) of module `module` (the `.cu` file's stem).
    pub fn function(&self, module: &str, name: &str) -> Result<&CudaFunction, KernelError> {
        self.modules
            .get(module)
            .and_then(|m| m.functions.get(name))
            .ok_or_else(|| KernelError::UnknownFunction {
                module: module.to_string(),
                name: name.to_string(),
            })
    }

    /// Names of every loaded kernel function of `module`, sorted.
    pub fn function_names(&self, module: &str) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .modules
            .get(module)
            .map(|m| m.functions.keys().map(String::as_str).collect())
            .unwrap_or_default();
        names.sort_unstable();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_for_maps_known_gpus_to_their_arch_specific_targets() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(10, 0), "sm_100a");
        assert_eq!(arch_for(12, 0), "sm_120a");
        assert_eq!(arch_for(8, 6), "sm_86");
        assert_eq!(arch_for(7, 5), "unsupported");
    }

    #[test]
    fn a_canary_is_ok_only_when_its_comparison_fails() {
        let pass = |canary| {
            CheckResult::compare("k", String::new(), canary, 1e-4, 1e-3, true, String::new())
        };
        let fail = |canary| {
            CheckResult::compare("k", String::new(), canary, 1e-2, 1e-3, true, String::new())
        };
        assert!(pass(false).ok && !fail(false).ok);
        assert!(!pass(true).ok && fail(true).ok);
        let unwritten =
            CheckResult::compare("k", String::new(), false, 0.0, 1e-3, false, String::new());
        assert!(!unwritten.ok);
        assert!(
            !CheckResult::compare(
                "k",
                String::new(),
                false,
                f64::NAN,
                1e-3,
                true,
                String::new()
            )
            .ok
        );
    }

    #[test]
    fn kernels_can_be_shared_across_rank_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Kernels>();
        send::<LtGemm>();
    }

    #[test]
    fn every_source_has_a_distinct_module_name() {
        let mut names: Vec<_> = SOURCES.iter().map(|s| s.module).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SOURCES.len());
    }
}
