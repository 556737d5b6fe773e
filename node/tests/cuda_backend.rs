//! The CUDA backend from a machine's point of view: without a driver it refuses with a clear
//! error (this is what CI sees); with one it runs a synthesized checkpoint and its greedy token
//! matches the CPU reference's unless the reference itself is near a tie (what the GPU battery
//! checks at scale).

use strata_model::config::Architecture;
use strata_model::cpu::CpuModel;
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::weights::Checkpoint;
use strata_node::backend::{Backend, CpuBackend, CudaBackend, CudaOptions, StepSeq, WeightSource};

#[test]
fn starts_on_a_gpu_or_says_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec {
        hidden: 256,
        heads: 4,
        kv_heads: 2,
        intermediate: 512,
        ..SynthSpec::tiny(Architecture::Llama, 5)
    };
    let config = synthesize(&spec, dir.path(), None).unwrap();
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let options = CudaOptions {
        device: 0,
        block_size: 16,
        kv_cache_bytes: 16 << 20,
        kv_memory_fraction: None,
        kernel_cache: None,
        max_positions: None,
        graphs: true,
        tp_rank: 0,
        tp_world: 1,
        sharded_reduction: false,
        widen_blocks: false,
        keep_quantized: false,
        quant_blocks: false,
        fp8_tiles: false,
        run_order: false,
    };
    let backend = CudaBackend::new(&config, WeightSource::Checkpoint(&checkpoint), &options);
    // SAFETY: only tries to dlopen libcuda by its known names.
    if !unsafe { strata_kernels::cudarc::driver::sys::is_culib_present() } {
        let message = backend.err().expect("no driver, no backend").to_string();
        assert!(message.contains("libcuda"), "{message}");
        return;
    }
    let mut gpu = backend.unwrap();
    let mut cpu = CpuBackend::with_blocks(CpuModel::load(dir.path()).unwrap(), 16, 8);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    let table = [3, 1, 5];
    let step = |b: &mut dyn Backend| {
        b.step(&[StepSeq {
            tokens: &prompt,
            first_position: 0,
            prompt_len: prompt.len(),
            block_table: &table,
            logit_rows: 1,
        }])
        .unwrap()
    };
    let (want, got) = (step(&mut cpu), step(&mut gpu));
    assert_eq!(want.len(), got.len());
    assert!(got.iter().all(|x| x.is_finite()));
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    let mut sorted = want.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted[0] - sorted[1] > 0.1 {
        assert_eq!(argmax(&want), argmax(&got));
    }
}
