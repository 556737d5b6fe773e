//! Compiles every kernel for sm_90a, sm_100a and sm_120a through NVRTC from the pip wheels that
//! `scripts/fetch-test-data.sh` installs under `target/test-data/cuda`, and reads ptxas's report.
//! Skips (with a message) when the wheels are not installed.

use std::path::PathBuf;

use strata_kernels::check::check_sources;
use strata_kernels::{Source, check};

const ARCHES: &[&str] = &["sm_90a", "sm_100a", "sm_120a"];

/// Points the library search at the wheels; false when they are not installed.
fn use_wheels() -> bool {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-data/cuda");
    if !root.join("nvidia/cu13/lib/libnvrtc.so.13").is_file() {
        eprintln!(
            "skipped: CUDA wheels not installed under {} (run scripts/fetch-test-data.sh)",
            root.display()
        );
        return false;
    }
    // SAFETY: set before any library search, identically by every test of this binary.
    unsafe {
        std::env::set_var("STRATA_CUDA_LIBS", &root);
        std::env::set_var("STRATA_CUDA_INCLUDE", root.join("nvidia/cu13/include"));
        std::env::set_var("STRATA_PTXAS", root.join("nvidia/cu13/bin/ptxas"));
    }
    true
}

/// Every kernel function the launchers load by name.
fn expected_functions() -> Vec<String> {
    let mut names: Vec<String> = [
        "embed",
        "rmsnorm",
        "add_rmsnorm",
        "head_rmsnorm",
        "add_bias",
        "rope_kv_write",
        "silu_mul",
        "rmsnorm_f32w",
        "head_rmsnorm_f32w",
        "sandwich_add_rmsnorm",
        "gelu_tanh_mul",
        "scale_bf16",
        "argmax_f32",
        "sum_shards_bf16",
        "moe_logits",
        "moe_route",
        "moe_route_warp",
        "moe_gate_up",
        "moe_down",
        "moe_sort",
        "moe_gate_up_grouped",
        "moe_down_grouped",
        "moe_combine",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for xt in 1..=4 {
        names.push(format!("gemv_mma_bf16_x{xt}"));
        names.push(format!("gemv_mma_f32_x{xt}"));
        names.push(format!("gemv_mma3_bf16_x{xt}"));
        names.push(format!("gemv_mma_shards_f32_x{xt}"));
    }
    for format in strata_kernels::BlockFormat::ALL {
        let name = format.kernel_name();
        for xt in 1..=4 {
            names.push(format!("gemv_mma_{name}_bf16_x{xt}"));
            names.push(format!("gemv_mma_{name}_f32_x{xt}"));
            names.push(format!("gemv_mma_shards_{name}_f32_x{xt}"));
        }
        names.push(format!("dequant_{name}"));
        names.push(format!("embed_{name}"));
    }
    for name in [
        "nvfp4_quantize_rows",
        "nvfp4_mma_gemm",
        "nvfp4_mma_gemm_modelopt",
        "fp8_quantize_rows",
        "fp8_scale_out",
    ] {
        names.push(name.to_string());
    }
    for out in ["bf16", "f32"] {
        for phases in [16, 4] {
            names.push(format!("runs_gemm_{out}_p{phases}"));
            for xt in 1..=4 {
                names.push(format!("runs_gemv_{out}_p{phases}_x{xt}"));
            }
        }
    }
    for (r, p, u) in strata_kernels::tiles::TILE_CONFIGS {
        let twin = strata_kernels::tiles::has_twin((r, p, u));
        for format in ["nvfp4", "twin"]
            .into_iter()
            .filter(|f| twin || *f == "nvfp4")
        {
            for out in ["bf16", "f32"] {
                for mt in [1, 2, 4, 8] {
                    names.push(format!("gemv_tiles_{format}_{out}_m{mt}_r{r}_p{p}_u{u}"));
                }
            }
        }
    }
    names.push("dequant_tiles_nvfp4".to_string());
    for m in 1..=16 {
        names.push(format!("gemv_bf16_m{m}"));
        names.push(format!("gemv_f32_m{m}"));
    }
    names
}

#[test]
fn every_kernel_compiles_for_every_arch_without_spills_on_hopper() {
    if !use_wheels() {
        return;
    }
    let report = check(ARCHES);
    println!("{}", report.table());
    assert!(report.ok(), "check failed:\n{}", report.table());
    assert!(report.ptxas.is_some(), "ptxas from the wheel not found");
    for arch in ARCHES {
        for name in expected_functions() {
            assert!(report.has_entry(arch, &name), "{name} missing for {arch}");
            assert!(
                report.resources(arch, &name).is_some(),
                "no ptxas resources for {name} on {arch}"
            );
        }
    }
    let spilling: Vec<_> = report
        .functions
        .iter()
        .filter(|f| f.arch == "sm_90a" && (f.spills() || f.stack_frame_bytes > 0))
        .map(|f| f.function.clone())
        .collect();
    assert!(
        spilling.is_empty(),
        "spills or stack on sm_90a: {spilling:?}"
    );
}

#[test]
fn a_broken_kernel_fails_check_with_nvrtcs_message() {
    if !use_wheels() {
        return;
    }
    let broken = Source {
        module: "canary",
        text: "#include \"common.cuh\"\nextern \"C\" __global__ void canary(float* y) { y[0] = undeclared_name; }\n",
    };
    let report = check_sources(&[broken], &["sm_90a"]);
    assert!(!report.ok(), "a broken source passed check");
    let message = &report.failures[0].message;
    assert!(
        message.contains("undeclared_name") && message.contains("canary.cu"),
        "NVRTC's log missing from the failure: {message}"
    );
}

#[test]
fn compiled_ptx_is_cached_on_disk_and_reused() {
    if !use_wheels() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let compiler =
        strata_kernels::compile::Compiler::new(Some(dir.path().to_path_buf())).expect("NVRTC");
    let source = strata_kernels::SOURCES
        .iter()
        .find(|s| s.module == "sampling")
        .expect("sampling source");
    let first = compiler.compile(source, "sm_90a").expect("compiles");
    let cached: Vec<_> = std::fs::read_dir(dir.path())
        .expect("cache dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(cached.len(), 1, "one PTX file cached: {cached:?}");
    // A cache hit returns the file's contents: prove it by planting a marker in the file.
    let marked = format!("{first}\n// cached\n");
    std::fs::write(&cached[0], &marked).expect("write");
    assert_eq!(compiler.compile(source, "sm_90a").expect("hit"), marked);
    // Another arch is another key.
    compiler.compile(source, "sm_100a").expect("compiles");
    assert_eq!(std::fs::read_dir(dir.path()).expect("cache dir").count(), 2);
}

/// The block-scaled FP4 MMA is compiled where the instruction exists (sm_120a; ptxas assembles
/// it in the test above) and nowhere else (the kernel traps there and its launcher refuses).
#[test]
fn the_fp4_mma_is_compiled_for_sm_120a_only() {
    if !use_wheels() {
        return;
    }
    let compiler = strata_kernels::compile::Compiler::uncached().expect("NVRTC");
    let source = strata_kernels::SOURCES
        .iter()
        .find(|s| s.module == "fp4")
        .expect("fp4 source");
    for (arch, mma) in [("sm_120a", true), ("sm_90a", false), ("sm_100a", false)] {
        let ptx = compiler.compile(source, arch).expect("compiles");
        // The k loop is unrolled: several instructions a kernel where any.
        assert_eq!(ptx.contains("kind::mxf4nvf4.block_scale"), mma, "{arch}");
    }
}
