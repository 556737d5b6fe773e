//! `strata kernels check|selftest`: compile-check the CUDA kernels (no GPU needed) and run them
//! on a GPU against the CPU reference.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use strata_kernels::bench::GemvTiming;
use strata_kernels::cudarc::driver::{CudaContext, CudaStream};
use strata_kernels::selftest_lowp::RowQuant;
use strata_kernels::tiles::TileFormat;
use strata_kernels::{
    BlockFormat, CheckResult, GEMV_FMA_MAX_M, GemvVariant, Kernels, PrefillVariant, libs, selftest,
};
use strata_model::gguf::GgmlType;
use strata_node::backend::safetensors_block_values;

#[derive(Subcommand)]
pub enum KernelsCommand {
    /// Compile every kernel with NVRTC for each architecture and print ptxas's resource table
    /// (registers, shared memory, stack, spills). Needs NVRTC and CUDA headers, no GPU.
    Check {
        /// Comma-separated NVRTC architectures.
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_100a,sm_120a")]
        arch: Vec<String>,
    },
    /// The instruction budget: the hot loop of every weight format's decode GEMV (one x tile)
    /// counted from its SASS, instructions per weight against bf16's. Needs NVRTC, ptxas and
    /// nvdisasm (STRATA_NVDISASM or CUDA_HOME), no GPU.
    Budget {
        #[arg(long, default_value = "sm_90a")]
        arch: String,
    },
    /// Run every kernel on the GPU against a CPU reference on fresh random inputs, with canary
    /// arms that must fail; prints a table and exits non-zero on any failure.
    Selftest {
        /// The GPU: cuda or cuda:N.
        #[arg(long, default_value = "cuda:0", value_parser = crate::cuda_ordinal)]
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
        /// The GPU: cuda or cuda:N.
        #[arg(long, default_value = "cuda:0", value_parser = crate::cuda_ordinal)]
        device: usize,
        /// Comma-separated row counts M (the GEMV takes 1..=64).
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
        m: Vec<usize>,
        /// Only the decode GEMV of each weight layout on the four projections: bf16, NVFP4 in
        /// blocks and NVFP4 and FP8 in fragment-ordered tiles (every built shape), side by side,
        /// then per M the tiles in the shapes the engine picks against bf16 over the four.
        #[arg(long)]
        tiles: bool,
        /// With --tiles: also write every timing and the per-M summary as JSON here.
        #[arg(long, requires = "tiles")]
        json: Option<PathBuf>,
    },
}

pub fn run(command: KernelsCommand) -> Result<()> {
    match command {
        KernelsCommand::Check { arch } => check(&arch),
        KernelsCommand::Budget { arch } => {
            let rows =
                strata_kernels::sass::decode_gemv_budget(&arch).map_err(anyhow::Error::msg)?;
            print!("{}", strata_kernels::sass::budget_table(&rows));
            Ok(())
        }
        KernelsCommand::Selftest {
            device,
            seed,
            cache_dir,
        } => run_selftest(device, seed, cache_dir),
        KernelsCommand::Bench {
            device,
            m,
            tiles,
            json,
        } => {
            if tiles {
                bench_tiles(device, &m, json.as_deref())
            } else {
                bench(device, &m)
            }
        }
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
    bench_decode_rows(&kernels, &stream, rows)?;
    bench_prompt_rows(&kernels, &stream)
}

/// Decode rows: the GEMV variants, the block formats and the pinned cuBLASLt GEMM on the 8B
/// projections and the LM head, at each of `rows`.
fn bench_decode_rows(kernels: &Kernels, stream: &Arc<CudaStream>, rows: &[usize]) -> Result<()> {
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
    let variants = [
        GemvVariant::Fma,
        GemvVariant::Mma,
        GemvVariant::Mma2,
        GemvVariant::MmaRuns,
        GemvVariant::Mma2Runs,
    ];
    let (narrow, wide): (Vec<_>, Vec<_>) =
        shapes.into_iter().partition(|&(m, ..)| m <= GEMV_FMA_MAX_M);
    strata_kernels::bench::gemv_timings(kernels, stream, &narrow, &variants, &mut print)?;
    strata_kernels::bench::gemv_timings(kernels, stream, &wide, &variants[1..], &mut print)?;
    // The block formats on the same projections (bf16 out), where the weights are the bytes
    // that move: GGUF's Q4_K and Q8_0 beside the safetensors NVFP4 and FP8.
    println!(
        "\n{:<14} {:<7} {:>3} {:>7} {:>6} {:>9} {:>8}",
        "format", "variant", "m", "n", "k", "us", "GB/s"
    );
    let formats = [
        BlockFormat::Q4_K,
        BlockFormat::Q8_0,
        BlockFormat::Nvfp4,
        BlockFormat::Fp8,
    ];
    let block_shapes: Vec<_> = rows
        .iter()
        .filter(|&&m| m <= 64)
        .flat_map(|&m| {
            [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)].map(|(n, k)| (m, n, k))
        })
        .collect();
    strata_kernels::bench::gemv_block_timings(
        kernels,
        stream,
        &formats,
        &block_shapes,
        &[GemvVariant::Mma, GemvVariant::Mma2],
        &mut |t| {
            println!(
                "{:<14} {:<7} {:>3} {:>7} {:>6} {:>9.2} {:>8.0}",
                t.format.kernel_name(),
                format!("{:?}", t.variant),
                t.m,
                t.n,
                t.k,
                t.micros,
                t.gbytes_per_s
            );
        },
    )?;
    // The same shapes through the pinned cuBLASLt GEMM (batch-invariant too, `check_gemm`): what
    // decode rows would cost on the prompt rows' kernel.
    let all: Vec<_> = narrow.iter().chain(&wide).copied().collect();
    let mut print = |t: &strata_kernels::bench::GemmTiming| {
        print_timing("Gemm", (t.m, t.n, t.k, t.f32_out), t.micros, t.gbytes_per_s);
    };
    strata_kernels::bench::gemm_timings(stream, &all, &mut print)?;
    Ok(())
}

/// Prompt rows: a 4k prefill's GEMMs (bf16 and FP8), the run-order GEMM against the pinned
/// cuBLASLt GEMM, and prefill attention, on the 8B shape.
fn bench_prompt_rows(kernels: &Kernels, stream: &Arc<CudaStream>) -> Result<()> {
    // Prompt rows of a 4k prefill through the bf16 GEMM and the FP8 (e4m3) GEMM: the W8A8 path's
    // product (its scales, one more elementwise pass, not included).
    println!(
        "\n{:<9} {:>5} {:>6} {:>6} {:>10} {:>8}",
        "prefill", "m", "n", "k", "us", "TFLOP/s"
    );
    let shapes =
        [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)].map(|(n, k)| (4096, n, k));
    // A failure here (an FP8 GEMM this cuBLASLt or GPU refuses) is printed, not fatal: the
    // timings above stand, and the selftest is the FP8 path's gate.
    let timed = strata_kernels::bench::prefill_gemm_timings(stream, &shapes, &mut |t| {
        println!(
            "{:<9} {:>5} {:>6} {:>6} {:>10.1} {:>8.1}",
            if t.fp8 { "gemm fp8" } else { "gemm bf16" },
            t.m,
            t.n,
            t.k,
            t.micros,
            t.tflops
        );
    });
    if let Err(e) = timed {
        println!("prefill gemm: {e}");
    }

    // The run-order GEMM (decode and prompt rows of one step in one weight read, each row the
    // run-order GEMV's bits) against the pinned cuBLASLt GEMM: a decode batch, a serving step of
    // 64 decode rows and 256 prompt rows, a 512-token prompt, a 4k prefill.
    println!(
        "\n{:<9} {:>5} {:>6} {:>6} {:>10} {:>8} {:>8}",
        "gemm", "m", "n", "k", "us", "GB/s", "TFLOP/s"
    );
    let shapes: Vec<_> = [64, 320, 512, 4096]
        .into_iter()
        .flat_map(|m| {
            [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)].map(|(n, k)| (m, n, k))
        })
        .collect();
    let timed = strata_kernels::bench::runs_gemm_timings(kernels, stream, &shapes, &mut |t| {
        println!(
            "{:<9} {:>5} {:>6} {:>6} {:>10.1} {:>8.0} {:>8.1}",
            t.kernel, t.m, t.n, t.k, t.micros, t.gbytes_per_s, t.tflops
        );
    });
    if let Err(e) = timed {
        println!("runs gemm: {e}");
    }

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
        kernels, stream, &shapes, &variants, &mut print,
    )?;
    Ok(())
}

/// The Llama-3-8B projections (n, k): qkv, o, gate_up, down.
const PROJECTIONS: [(usize, usize); 4] = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)];

/// `strata kernels bench --tiles`: the decode GEMV per weight layout, each timed in this run, then
/// per M the tiles in the shapes the engine picks ([`strata_kernels::tiles::tile_config`]) against
/// bf16, summed over the four projections.
fn bench_tiles(device: usize, rows: &[usize], json: Option<&std::path::Path>) -> Result<()> {
    let ctx = open(device, "bench")?;
    let kernels = Kernels::load(&ctx, None).context("loading the kernels")?;
    let stream = ctx.new_stream().context("creating a stream")?;
    let rows: Vec<usize> = rows
        .iter()
        .copied()
        .filter(|&m| (1..=64).contains(&m))
        .collect();
    let shapes: Vec<_> = rows
        .iter()
        .flat_map(|&m| PROJECTIONS.map(|(n, k)| (m, n, k)))
        .collect();
    println!(
        "{:<16} {:>3} {:>7} {:>6} {:>9} {:>8}",
        "layout", "m", "n", "k", "us", "GB/s"
    );
    let timings = std::cell::RefCell::new(Vec::<TileBenchRow>::new());
    let line = |layout: &str, (m, n, k): (usize, usize, usize), us: f64, gbps: f64| {
        println!("{layout:<16} {m:>3} {n:>7} {k:>6} {us:>9.2} {gbps:>8.0}");
        timings.borrow_mut().push(TileBenchRow {
            layout: layout.to_string(),
            shape: (m, n, k),
            us,
            gbps,
        });
    };
    let bf16: Vec<_> = shapes.iter().map(|&(m, n, k)| (m, n, k, false)).collect();
    strata_kernels::bench::gemv_timings(&kernels, &stream, &bf16, &[GemvVariant::Mma], &mut |t| {
        line("bf16 mma", (t.m, t.n, t.k), t.micros, t.gbytes_per_s)
    })?;
    strata_kernels::bench::gemv_block_timings(
        &kernels,
        &stream,
        &[BlockFormat::Nvfp4],
        &shapes,
        &[GemvVariant::Mma],
        &mut |t| line("nvfp4 blocks", (t.m, t.n, t.k), t.micros, t.gbytes_per_s),
    )?;
    for format in TILED {
        strata_kernels::bench::tile_timings(
            &kernels,
            &stream,
            format,
            &shapes,
            &strata_kernels::tiles::TILE_CONFIGS,
            &mut |t| {
                line(
                    &tile_layout(t.format, t.config),
                    (t.m, t.n, t.k),
                    t.micros,
                    t.gbytes_per_s,
                )
            },
        )?;
    }
    let timings = timings.into_inner();
    let summary = tiles_summary(&timings, &rows);
    println!(
        "\n{:>3} {:>10} {:>10} {:>8} {:>10} {:>8}",
        "m", "bf16 us", "nvfp4 us", "x bf16", "fp8 us", "x bf16"
    );
    for s in &summary {
        println!(
            "{:>3} {:>10.2} {:>10.2} {:>8.2} {:>10.2} {:>8.2}",
            s.m,
            s.bf16_us,
            s.tiles_us[0],
            s.bf16_us / s.tiles_us[0],
            s.tiles_us[1],
            s.bf16_us / s.tiles_us[1]
        );
    }
    if let Some(path) = json {
        let rows: Vec<_> = timings
            .iter()
            .map(|t| {
                let (m, n, k) = t.shape;
                serde_json::json!({"layout": t.layout, "m": m, "n": n, "k": k, "us": t.us,
                    "gbytes_per_s": t.gbps})
            })
            .collect();
        let summary: Vec<_> = summary
            .iter()
            .map(|s| {
                serde_json::json!({"m": s.m, "bf16_us": s.bf16_us, "tiles_us": s.tiles_us[0],
                    "tiles_over_bf16": s.bf16_us / s.tiles_us[0], "fp8_tiles_us": s.tiles_us[1],
                    "fp8_tiles_over_bf16": s.bf16_us / s.tiles_us[1]})
            })
            .collect();
        let device = ctx.name().unwrap_or_else(|_| "unknown".into());
        let doc = serde_json::json!({
            "device": device,
            "projections": PROJECTIONS,
            "summary": "per M, the four projections' bf16 GEMV time over the NVFP4 tiles' and the FP8 tiles' in the shape the engine picks (tile_config)",
            "per_m": summary,
            "timings": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One timed GEMV of `strata kernels bench --tiles`.
struct TileBenchRow {
    layout: String,
    shape: (usize, usize, usize),
    us: f64,
    gbps: f64,
}

/// The tiled formats the bench times, in the order of [`TilesAtM::tiles_us`].
const TILED: [TileFormat; 2] = [TileFormat::Nvfp4, TileFormat::Fp8];

/// The table name of a tile shape.
fn tile_layout(format: TileFormat, (r, p, u): (usize, usize, usize)) -> String {
    format!("{} tiles r{r}p{p}u{u}", format.name())
}

/// Per M: the bf16 GEMV and each tiled format ([`TILED`]) in the shape the engine picks, summed
/// over the projections.
struct TilesAtM {
    m: usize,
    bf16_us: f64,
    tiles_us: [f64; 2],
}

fn tiles_summary(timings: &[TileBenchRow], rows: &[usize]) -> Vec<TilesAtM> {
    let time = |layout: &str, shape| {
        timings
            .iter()
            .find(|t| t.layout == layout && t.shape == shape)
            .map(|t| t.us)
    };
    rows.iter()
        .filter_map(|&m| {
            let (mut bf16_us, mut tiles_us) = (0.0, [0.0; 2]);
            for (n, k) in PROJECTIONS {
                bf16_us += time("bf16 mma", (m, n, k))?;
                for (us, format) in tiles_us.iter_mut().zip(TILED) {
                    let kept = tile_layout(format, strata_kernels::tiles::tile_config(m, n));
                    *us += time(&kept, (m, n, k))?;
                }
            }
            Some(TilesAtM {
                m,
                bf16_us,
                tiles_us,
            })
        })
        .collect()
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
    results.extend(strata_kernels::selftest_lowp::check_lowp(
        &kernels,
        &stream,
        seed,
        &cpu_activations,
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

/// The reference of the block-format kernels: for GGUF formats the checkpoint loader's
/// dequantizer (bit-exact against the `gguf` package); for the safetensors formats
/// [`safetensors_block_values`]. Panics only on a length the self-test itself got wrong.
/// The CPU reference of activation rows quantized as `scheme` says.
fn cpu_activations(scheme: RowQuant, x: &[f32], width: usize) -> Vec<f32> {
    use strata_model::quantize::ActivationQuant;
    let quant = match scheme {
        RowQuant::Fp8Static(scale) => ActivationQuant::Fp8Static { scale },
        RowQuant::Fp8Token => ActivationQuant::Fp8Token,
        RowQuant::Nvfp4(global) => ActivationQuant::Nvfp4 { global },
    };
    quant.apply(x, width)
}

fn cpu_dequantize(format: BlockFormat, bytes: &[u8], n: usize) -> Vec<f32> {
    if BlockFormat::SAFETENSORS.contains(&format) {
        let values = safetensors_block_values(format, bytes);
        assert_eq!(values.len(), n, "whole blocks");
        return values;
    }
    let ty = GgmlType::from_id(format.ggml_type()).expect("every GGUF block format is a ggml type");
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::Path;

    use half::bf16;
    use strata_model::weights::e4m3_to_f32;

    use super::*;

    /// A safetensors file's tensors: name → (dtype, shape, bytes).
    fn tensors(path: &Path) -> HashMap<String, (String, Vec<usize>, Vec<u8>)> {
        let file = std::fs::read(path).unwrap();
        let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&file[8..8 + len]).unwrap();
        let data = &file[8 + len..];
        header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(name, _)| *name != "__metadata__")
            .map(|(name, t)| {
                let offsets: Vec<usize> =
                    serde_json::from_value(t["data_offsets"].clone()).unwrap();
                let shape: Vec<usize> = serde_json::from_value(t["shape"].clone()).unwrap();
                let dtype = t["dtype"].as_str().unwrap().to_string();
                (
                    name.clone(),
                    (dtype, shape, data[offsets[0]..offsets[1]].to_vec()),
                )
            })
            .collect()
    }

    fn scale_values(dtype: &str, bytes: &[u8]) -> Vec<f32> {
        match dtype {
            "F32" => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            "BF16" => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            "F8_E4M3" => bytes.iter().map(|&b| e4m3_to_f32(b)).collect(),
            other => panic!("scale dtype {other}"),
        }
    }

    /// Every quantized Linear of a checkpoint compressed-tensors wrote, put in the device blocks
    /// and read back by the kernels' reference, rounded to bf16: the bits compressed-tensors
    /// itself dequantizes to (`tests/oracle/quant`). Returns how many weights differ, how many
    /// were compared, and how many weights the device blocks refused.
    fn against_the_library(
        scheme: &str,
        format: BlockFormat,
        tamper: bool,
    ) -> (usize, usize, usize) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/quant");
        let stored = tensors(&root.join(format!("ct-{scheme}/model.safetensors")));
        let library = tensors(&root.join(format!("ct-{scheme}.dequantized.safetensors")));
        let (mut differ, mut compared, mut refused) = (0, 0, 0);
        for (name, (_, shape, want)) in &library {
            let base = name.trim_end_matches(".weight");
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let blocks = if format == BlockFormat::Fp8 {
                let Some((dtype, _, data)) = stored.get(name).filter(|t| t.0 == "F8_E4M3") else {
                    continue;
                };
                assert_eq!(dtype, "F8_E4M3");
                let (sdtype, sshape, sbytes) = &stored[&format!("{base}.weight_scale")];
                let s = scale_values(sdtype, sbytes);
                let per_block = sshape.len() == 2 && sshape[1] > 1;
                let scale_cols = if per_block { cols / sshape[1] } else { cols };
                let blocks =
                    BlockFormat::fp8_blocks(data, (rows, cols), scale_cols, |r, c| match s.len() {
                        1 => s[0],
                        n if n == rows && !per_block => s[r],
                        _ => s[r / (rows / sshape[0]) * sshape[1] + c / scale_cols],
                    });
                match blocks {
                    Some(blocks) => blocks,
                    None => {
                        refused += 1;
                        continue;
                    }
                }
            } else {
                let Some((_, _, packed)) = stored.get(&format!("{base}.weight_packed")) else {
                    continue;
                };
                let (_, _, groups) = &stored[&format!("{base}.weight_scale")];
                let (tdtype, _, t) = &stored[&format!("{base}.weight_global_scale")];
                let t = scale_values(tdtype, t)[0];
                BlockFormat::nvfp4_blocks(packed, groups, t, (rows, cols)).unwrap()
            };
            let mut blocks = blocks;
            if tamper {
                blocks[3] ^= 0x04; // the first block's scale, an exponent bit
            }
            let got: Vec<u16> = safetensors_block_values(format, &blocks)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_bits())
                .collect();
            let want: Vec<u16> = want
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert_eq!(got.len(), want.len(), "{name}");
            differ += got.iter().zip(&want).filter(|(a, b)| a != b).count();
            compared += got.len();
        }
        (differ, compared, refused)
    }

    #[test]
    fn device_blocks_of_library_written_checkpoints_read_back_to_the_librarys_bits() {
        for (scheme, format) in [
            ("nvfp4", BlockFormat::Nvfp4),
            ("fp8-tensor", BlockFormat::Fp8),
            ("fp8-channel", BlockFormat::Fp8),
        ] {
            let (differ, compared, refused) = against_the_library(scheme, format, false);
            assert!(
                compared >= 7 * 4096,
                "{scheme}: only {compared} weights compared"
            );
            assert_eq!((differ, refused), (0, 0), "{scheme}: of {compared}");
            // Canary: one block's scale changed must show.
            let (differ, _, _) = against_the_library(scheme, format, true);
            assert!(differ > 0, "{scheme}: a changed scale went unseen");
        }
        // 32 x 32 FP8 blocks do not fit a device block's one scale per 64 columns: refused (such
        // a weight is widened to bf16), never read with the wrong scale.
        let (_, compared, refused) = against_the_library("fp8-block", BlockFormat::Fp8, false);
        assert!(
            compared == 0 && refused > 0,
            "{compared} compared, {refused} refused"
        );
        // Canary: compressed-tensors' NVFP4 read as ModelOpt's (tensor scale multiplied).
        let (differ, compared, _) = against_the_library("nvfp4", BlockFormat::Nvfp4Modelopt, false);
        assert!(differ > compared / 2, "{differ} of {compared}");
    }

    /// The summary takes each projection in the shape `tile_config` picks: a timing of any
    /// other shape must not count.
    #[test]
    fn the_tiles_summary_takes_the_shapes_the_engine_picks() {
        let mut timings = Vec::new();
        for m in [1, 32] {
            for (n, k) in PROJECTIONS {
                let row = |layout: String, us: f64| TileBenchRow {
                    layout,
                    shape: (m, n, k),
                    us,
                    gbps: 0.0,
                };
                timings.push(row("bf16 mma".into(), 10.0));
                for (format, us) in [(TileFormat::Nvfp4, 5.0), (TileFormat::Fp8, 8.0)] {
                    for config in strata_kernels::tiles::TILE_CONFIGS {
                        let kept = strata_kernels::tiles::tile_config(m, n) == config;
                        let us = if kept { us } else { 50.0 };
                        timings.push(row(tile_layout(format, config), us));
                    }
                }
            }
        }
        let summary = tiles_summary(&timings, &[1, 32, 8]);
        // M = 8 has no timings: left out, not a division by zero.
        assert_eq!(summary.iter().map(|s| s.m).collect::<Vec<_>>(), [1, 32]);
        for s in &summary {
            assert_eq!((s.bf16_us, s.tiles_us), (40.0, [20.0, 32.0]), "m = {}", s.m);
        }
    }
}
