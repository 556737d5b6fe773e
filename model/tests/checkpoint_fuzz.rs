//! Bad safetensors checkpoints never crash strata: a bounded, seeded fuzz run over mutations of
//! a quantized checkpoint `strata quantize` wrote (FP8 with its scales, compressed-tensors'
//! `quantization_config` in its config.json).
//!
//! Each case mutates either the weights file's header (its 8-byte length, the JSON of names,
//! dtypes, shapes and offsets: bits flipped, bytes overwritten, integers made extreme, the file
//! truncated) or config.json (the same on its text, the quantization config included), then
//! opens the directory as the loaders do — the config, the checkpoint, its validation against
//! the config, every tensor read through, and the CPU model loaded from it. Every outcome must
//! be a value or an error; a panic fails the test with the seed and case. Bounded by a case count
//! and a wall-clock budget so CI time stays fixed.

#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use strata_model::ModelConfig;
use strata_model::cpu::CpuModel;
use strata_model::quantize::{Plan, quantize};
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::weights::Checkpoint;

const SEED: u64 = 0x5eed_5afe;
const MAX_CASES: usize = 20_000;
const BUDGET: Duration = Duration::from_secs(30);

/// Everything a load reads from `dir`; `Ok(true)` when the model loaded.
fn load(dir: &Path) -> bool {
    let Ok(config) = ModelConfig::from_dir(dir) else {
        return false;
    };
    let Ok(ckpt) = Checkpoint::open(dir) else {
        return false;
    };
    if ckpt.validate(&config).is_err() {
        return false;
    }
    CpuModel::load(dir).is_ok()
}

/// One mutation of `bytes` within `region` (and maybe a shorter length); returns the length.
fn mutate(rng: &mut ChaCha8Rng, bytes: &mut [u8], region: std::ops::Range<usize>) -> usize {
    let at = |rng: &mut ChaCha8Rng| region.start + rng.next_u32() as usize % region.len();
    let mut len = bytes.len();
    for _ in 0..1 + rng.next_u32() % 3 {
        match rng.next_u32() % 5 {
            0 => {
                let i = at(rng);
                bytes[i] ^= 1 << (rng.next_u32() % 8);
            }
            1 => {
                let i = at(rng);
                bytes[i] = rng.next_u32() as u8;
            }
            2 => {
                // A digit run (a shape, an offset, a length) made extreme.
                let i = at(rng).min(region.end.saturating_sub(8));
                let text = [
                    "0",
                    "18446744073709551615",
                    "4294967296",
                    "-1",
                    "1e309",
                    "99999999",
                ][rng.next_u32() as usize % 6];
                let end = (i + text.len()).min(bytes.len());
                bytes[i..end].copy_from_slice(&text.as_bytes()[..end - i]);
            }
            3 => {
                // The 8-byte header length itself.
                let value: u64 = match rng.next_u32() % 4 {
                    0 => 0,
                    1 => u64::MAX,
                    2 => rng.next_u64() % 4096,
                    _ => rng.next_u64(),
                };
                if region.start == 0 && bytes.len() >= 8 {
                    bytes[..8].copy_from_slice(&value.to_le_bytes());
                }
            }
            _ => len = at(rng),
        }
    }
    len
}

/// One campaign of at most `max_cases` cases within `budget`, from `seed`.
fn campaign(seed: u64, max_cases: usize, budget: Duration) -> fuzz::Report {
    let tmp = tempfile::tempdir().unwrap();
    let source = tmp.path().join("source");
    synthesize(&SynthSpec::tiny_moe(9), &source, None).unwrap();
    let original = tmp.path().join("fp8");
    quantize(&source, &original, Plan::Fp8, None, |_| {}).unwrap();
    assert!(load(&original), "the unmutated checkpoint loads");
    let weights = std::fs::read(original.join("model.safetensors")).unwrap();
    let config = std::fs::read(original.join("config.json")).unwrap();
    let header_end = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let case_dir = tmp.path().join("case");
    std::fs::create_dir_all(&case_dir).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let started = Instant::now();
    let (mut cases, mut loaded) = (0usize, 0usize);
    while cases < max_cases && started.elapsed() < budget {
        cases += 1;
        let (mut w, mut c) = (weights.clone(), config.clone());
        let what = if rng.next_u32() % 3 == 0 {
            let span = 0..c.len();
            let len = mutate(&mut rng, &mut c, span);
            c.truncate(len);
            "config.json"
        } else {
            let len = mutate(&mut rng, &mut w, 0..header_end);
            w.truncate(len);
            "the weights' header"
        };
        std::fs::write(case_dir.join("model.safetensors"), &w).unwrap();
        std::fs::write(case_dir.join("config.json"), &c).unwrap();
        match catch_unwind(AssertUnwindSafe(|| load(&case_dir))) {
            Ok(ok) => loaded += usize::from(ok),
            Err(_) => {
                let kept = tmp.path().join("panicked");
                let _ = std::fs::rename(&case_dir, &kept);
                panic!("case {cases} (seed {seed:#x}, {what}) panicked");
            }
        }
    }
    fuzz::Report::of(
        "safetensors checkpoint",
        seed,
        started,
        cases,
        &[("loaded", loaded), ("refused", cases - loaded)],
    )
}

#[test]
fn mutated_checkpoints_and_configs_never_panic() {
    let report = campaign(SEED, MAX_CASES, BUDGET);
    let (cases, loaded) = (report.cases, report.count("loaded"));
    assert!(cases >= 100, "too few cases ran ({cases}) to mean anything");
    assert!(
        loaded > 0 && loaded < cases,
        "both outcomes must occur: {loaded} of {cases} loaded"
    );
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn checkpoints_for_ten_minutes() {
    campaign(SEED + 1, usize::MAX, fuzz::LONG);
}
