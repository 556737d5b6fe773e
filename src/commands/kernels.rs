//! `strata kernels check|selftest`: compile-check the CUDA kernels (no GPU needed) and run them
//! on a GPU against the CPU reference.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use strata_kernels::bench::GemvTiming;
use strata_kernels::cudarc::driver::CudaContext;
use strata_kernels::{
    BlockFormat, CheckResult, GEMV_FMA_MAX_M, GemvVariant, Kernels, PrefillVariant, libs, selftest,
};
use strata_model::gguf::GgmlType;

#[derive(Subcommand)]
pub enum KernelsCommand {
    /// Compile every kernel with NVRTC for each architecture and print ptxas's resource table
    /// (registers, shared memory, stack, spills). Needs NVRTC and CUDA headers, no GPU.
    Check {
        /// Comma-separated NVRTC architectures.
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_120a")]
        arch: Vec<String>,
    },
    /// Run every kernel on the GPU against a CPU reference on fresh random inputs, with canary
    /// arms that must fail; prints a table and exits non-zero on any failure.
    Selftest {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Seed for the random inputs (default: drawn from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// PTX cache directory (default: $XDG_CACHE_HOME/strata/kernels or ~/.cache/strata/kernels).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Time the decode GEMV (and the pinned cuBLASLt GEMM) on Llama-3-8B shapes and print their
    /// bandwidth (GB/s).
    Bench {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Comma-separated row counts M (the GEMV takes 1..=64).
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
        m: Vec<usize>,
    },
}

pub fn run(command: KernelsCommand) -> Result<()> {
    match command {
        KernelsCommand::Check { arch } => check(&arch),
        KernelsCommand::Selftest {
            device,
            seed,
            cache_dir,
        } => run_selftest(device, seed, cache_dir),
        KernelsCommand::Bench { device, m } => bench(device, &m),
    }
}

/// Opens a device with a clear error where there is no driver.
fn open(device: usize, what: &str) -> Result<Arc<CudaContext>> {
    libs::ensure_driver().with_context(|| format!("strata kernels {what} needs a GPU"))?;
    CudaContext::new(device).with_context(|| format!("opening CUDA device {device}"))
}

/// One row of the matrix-kernel table: kernel, shape `(m, n, k, f32 output)`, µs, GB/s.
fn print_timing(kernel: &str, (m, n, k, f32_out): (usize, usize, usize, bool), us: f64, gbps: f64) {
    let out = if f32_out { "f32" } else { "bf16" };
    println!("{kernel:<7} {m:>3} {n:>7} {k:>6} {out:>4} {us:>9.2} {gbps:>8.0}");
}

fn bench(device: usize, rows: &[usize]) -> Result<()> {
    let ctx = open(device, "bench")?;
    let kernels = Kernels::load(&ctx, None).context("loading the kernels")?;
    let stream = ctx.new_stream().context("creating a stream")?;
    // Llama-3-8B projections: qkv, o, gate_up, down; and the f32 LM head.
    let mut shapes = Vec::new();
    for &m in rows {
        for (n, k) in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] {
            shapes.push((m, n, k, false));
        }
        shapes.push((m, 128_256, 4096, true));
    }
    println!(
        "{:<7} {:>3} {:>7} {:>6} {:>4} {:>9} {:>8}",
        "variant", "m", "n", "k", "out", "us", "GB/s"
    );
    let mut print = |t: &GemvTiming| {
        let kernel = format!("{:?}", t.variant);
        print_timing(
            &kernel,
            (t.m, t.n, t.k, t.f32_out),
            t.micros,
            t.gbytes_per_s,
        );
    };
    // The FMA variant takes at most GEMV_FMA_MAX_M rows; wider shapes run the MMA variants only.
    let variants = [GemvVariant::Fma, GemvVariant::Mma, GemvVariant::Mma2];
    let (narrow, wide): (Vec<_>, Vec<_>) =
        shapes.into_iter().partition(|&(m, ..)| m <= GEMV_FMA_MAX_M);
    strata_kernels::bench::gemv_timings(&kernels, &stream, &narrow, &variants, &mut print)?;
    strata_kernels::bench::gemv_timings(&kernels, &stream, &wide, &variants[1..], &mut print)?;
    // The same shapes through the pinned cuBLASLt GEMM (batch-invariant too, `check_gemm`): what
    // decode rows would cost on the prompt rows' kernel.
    let all: Vec<_> = narrow.iter().chain(&wide).copied().collect();
    let mut print = |t: &strata_kernels::bench::GemmTiming| {
        print_timing("Gemm", (t.m, t.n, t.k, t.f32_out), t.micros, t.gbytes_per_s);
    };
    strata_kernels::bench::gemm_timings(&stream, &all, &mut print)?;

    // Prefill attention of the 8B shape (32 query heads, 8 KV heads, head_dim 128).
    println!(
        "\n{:<7} {:>5} {:>4} {:>4} {:>6} {:>10} {:>8}",
        "prefill", "q", "kv", "d", "tokens", "us", "TFLOP/s"
    );
    let shapes = [(32, 8, 128, 512), (32, 8, 128, 4096)];
    let variants = [PrefillVariant::F32, PrefillVariant::Mma];
    let mut print = |t: &strata_kernels::bench::PrefillTiming| {
        println!(
            "{:<7} {:>5} {:>4} {:>4} {:>6} {:>10.1} {:>8.1}",
            format!("{:?}", t.variant),
            t.n_q_heads,
            t.n_kv_heads,
            t.head_dim,
            t.tokens,
            t.micros,
            t.tflops
        );
    };
    strata_kernels::bench::prefill_attention_timings(
        &kernels, &stream, &shapes, &variants, &mut print,
    )?;
    Ok(())
}

fn check(arches: &[String]) -> Result<()> {
    let arches: Vec<&str> = arches.iter().map(String::as_str).collect();
    let report = strata_kernels::check(&arches);
    print!("{}", report.table());
    if !report.ok() {
        bail!("{} module(s) failed to compile", report.failures.len());
    }
    Ok(())
}

fn run_selftest(device: usize, seed: Option<u64>, cache_dir: Option<PathBuf>) -> Result<()> {
    libs::ensure_driver().context("strata kernels selftest needs a GPU")?;
    let ctx = CudaContext::new(device).with_context(|| format!("opening CUDA device {device}"))?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
    let kernels = Kernels::load(&ctx, cache_dir.as_deref()).context("loading the kernels")?;
    let stream = ctx.new_stream().context("creating a stream")?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("{name} ({}), seed {seed:#x}", kernels.arch());
    let mut results = selftest::selftest_with_seed(&kernels, &stream, seed);
    results.extend(strata_kernels::selftest_blocks::check_blocks(
        &kernels,
        &stream,
        seed,
        &cpu_dequantize,
    ));
    print_table(&results);
    let failed = results.iter().filter(|r| !r.ok).count();
    if failed > 0 {
        bail!("{failed} of {} checks failed", results.len());
    }
    println!("all {} checks passed", results.len());
    Ok(())
}

/// The checkpoint loader's dequantizer (bit-exact against the `gguf` package): the reference of
/// the block-format kernels. Panics only on a length the self-test itself got wrong.
fn cpu_dequantize(format: BlockFormat, bytes: &[u8], n: usize) -> Vec<f32> {
    let ty = GgmlType::from_id(format.ggml_type()).expect("every block format is a ggml type");
    strata_model::gguf::dequantize(ty, bytes, n as u64).expect("whole blocks of a known type")
}

fn print_table(results: &[CheckResult]) {
    println!(
        "{:<4} {:<14} {:<6} {:>10} {:>8} {:<7} {:<48} detail",
        "", "kernel", "arm", "rel err", "tol", "written", "case"
    );
    for r in results {
        println!(
            "{:<4} {:<14} {:<6} {:>10.2e} {:>8.1e} {:<7} {:<48} {}",
            if r.ok { "ok" } else { "FAIL" },
            r.kernel,
            if r.canary { "canary" } else { "check" },
            r.max_rel_err,
            r.tolerance,
            if r.all_written { "yes" } else { "NO" },
            r.case,
            r.detail
        );
    }
}
