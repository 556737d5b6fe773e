//! Compiles the NCCL communicator's ordered-sum kernels for sm_90a, sm_100a and sm_120a through
//! NVRTC from the pip wheels that `scripts/fetch-test-data.sh` installs under
//! `target/test-data/cuda`, and reads ptxas's report — so a syntax error never costs GPU time.
//! Skips (with a message) when the wheels are not installed, as the kernel crate's test does.

use std::path::PathBuf;

use strata_collective::nccl::ORDERED_SUM;
use strata_kernels::check::check_sources;

const ARCHES: &[&str] = &["sm_90a", "sm_100a", "sm_120a"];

#[test]
fn the_ordered_sum_kernels_compile_for_every_arch_without_spills() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-data/cuda");
    if !root.join("nvidia/cu13/lib/libnvrtc.so.13").is_file() {
        eprintln!(
            "skipped: CUDA wheels not installed under {} (run scripts/fetch-test-data.sh)",
            root.display()
        );
        return;
    }
    // SAFETY: set before any library search; this binary has no other test.
    unsafe {
        std::env::set_var("STRATA_CUDA_LIBS", &root);
        std::env::set_var("STRATA_CUDA_INCLUDE", root.join("nvidia/cu13/include"));
        std::env::set_var("STRATA_PTXAS", root.join("nvidia/cu13/bin/ptxas"));
    }
    let report = check_sources(&[ORDERED_SUM], ARCHES);
    println!("{}", report.table());
    assert!(report.ok(), "check failed:\n{}", report.table());
    for arch in ARCHES {
        for name in ["ordered_sum_f32", "ordered_sum_bf16"] {
            assert!(report.has_entry(arch, name), "{name} missing for {arch}");
            let resources = report.resources(arch, name);
            assert!(
                resources.is_some_and(|r| !r.spills() && r.stack_frame_bytes == 0),
                "{name} on {arch}: {resources:?}"
            );
        }
    }
}
