//! Logit parity of the CPU reference against HF transformers.
//!
//! The fixtures under tests/oracle/fixtures were written by tests/oracle/make_fixtures.py (HF
//! transformers, float32, eager attention) from checkpoints synthesized from tests/oracle/cases.json.
//! Here the same checkpoints are synthesized again (a fixture names the sha256 of the weights it
//! was made from) and the CPU reference must reproduce every fixture row within the bound, both in
//! one prefill pass and through prefill + one-token decodes over its KV cache. A canary with a
//! perturbed rope_theta must break the bound, proving the comparison can fail; so must a mixture
//! of experts routed with the other choice of renormalizing the chosen experts' weights.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use strata_model::ModelConfig;
use strata_model::cpu::{CpuModel, LogitRows};
use strata_model::synth::{SynthSpec, synthesize};
use strata_model::weights::Checkpoint;

/// Max |ours − HF| over a row, relative to max |HF| of that row.
const BOUND: f32 = 1e-4;

#[derive(Deserialize)]
struct CaseFile {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    spec: SynthSpec,
    prompts: Vec<Vec<u32>>,
}

struct FixtureRow {
    prompt: usize,
    position: usize,
    logits: Vec<f32>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(repo().join("tests/oracle/cases.json")).unwrap();
    serde_json::from_str::<CaseFile>(&text).unwrap().cases
}

fn fixture(name: &str) -> (String, Vec<FixtureRow>) {
    let path = repo().join(format!("tests/oracle/fixtures/{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let sha = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("weights_sha256"))
        .cloned()
        .unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut rows = Vec::new();
    for prompt in 0.. {
        let Ok(pos) = st.tensor(&format!("prompt{prompt}.positions")) else {
            break;
        };
        let logits = st.tensor(&format!("prompt{prompt}.logits")).unwrap();
        let vocab = logits.shape()[1];
        let positions: Vec<usize> = pos
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        let values: Vec<f32> = logits
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        for (i, position) in positions.into_iter().enumerate() {
            rows.push(FixtureRow {
                prompt,
                position,
                logits: values[i * vocab..(i + 1) * vocab].to_vec(),
            });
        }
    }
    (sha, rows)
}

fn relative_error(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len(), "vocabulary sizes differ");
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Logits of every position of `prompt`, in one pass.
fn prefill_logits(model: &CpuModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let all = model.forward(prompt, &mut cache, LogitRows::All).unwrap();
    all.chunks_exact(model.config().vocab_size)
        .map(<[f32]>::to_vec)
        .collect()
}

/// Logits of every position of `prompt`: a 3-token prefill, then one-token decodes.
fn decode_logits(model: &CpuModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab_size;
    let mut cache = model.new_cache();
    let head = prompt.len().min(3);
    let mut rows: Vec<Vec<f32>> = model
        .forward(&prompt[..head], &mut cache, LogitRows::All)
        .unwrap()
        .chunks_exact(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for &t in &prompt[head..] {
        rows.push(model.forward(&[t], &mut cache, LogitRows::Last).unwrap());
    }
    rows
}

fn synthesized(case: &Case, dir: &Path) -> PathBuf {
    let out = dir.join(&case.name);
    synthesize(&case.spec, &out, None).unwrap();
    out
}

fn weights_sha256(dir: &Path) -> String {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn cpu_reference_matches_transformers_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let mut archs = std::collections::BTreeSet::new();
    for case in cases() {
        let dir = synthesized(&case, tmp.path());
        let (sha, rows) = fixture(&case.name);
        assert_eq!(
            weights_sha256(&dir),
            sha,
            "{}: synthesized weights differ from those the fixture was made from; \
             regenerate the fixtures (scripts/device/oracle.sh)",
            case.name
        );
        let model = CpuModel::load(&dir).unwrap();
        archs.insert(model.config().architecture.to_string());
        let mut worst = 0.0f32;
        for (prompt_index, prompt) in case.prompts.iter().enumerate() {
            let paths = [
                prefill_logits(&model, prompt),
                decode_logits(&model, prompt),
            ];
            for row in rows.iter().filter(|r| r.prompt == prompt_index) {
                for (path, logits) in ["prefill", "decode"].iter().zip(&paths) {
                    let err = relative_error(&logits[row.position], &row.logits);
                    assert!(
                        err <= BOUND,
                        "{} prompt {} position {} ({path}): relative error {err:e} > {BOUND:e}",
                        case.name,
                        row.prompt,
                        row.position
                    );
                    worst = worst.max(err);
                }
            }
        }
        eprintln!(
            "{:<22} worst relative error {worst:.2e} (bound {BOUND:e})",
            case.name
        );
    }
    assert_eq!(archs.len(), 7, "every architecture is covered: {archs:?}");
}

/// The worst relative error of `case`'s fixture rows against the CPU reference with the config
/// `perturb` changes.
fn perturbed_worst(case: &Case, dir: &Path, perturb: impl Fn(&mut ModelConfig)) -> f32 {
    let (_, rows) = fixture(&case.name);
    let mut config = ModelConfig::from_dir(dir).unwrap();
    perturb(&mut config);
    let model = CpuModel::from_checkpoint(config, &Checkpoint::open(dir).unwrap()).unwrap();
    case.prompts
        .iter()
        .enumerate()
        .flat_map(|(i, prompt)| {
            let logits = prefill_logits(&model, prompt);
            rows.iter()
                .filter(move |r| r.prompt == i)
                .map(move |r| relative_error(&logits[r.position], &r.logits))
                .collect::<Vec<_>>()
        })
        .fold(0.0f32, f32::max)
}

#[test]
fn canary_moe_routing_renormalized_the_other_way_breaks_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for case in cases().into_iter().filter(|c| c.spec.moe.is_some()) {
        let dir = synthesized(&case, tmp.path());
        let worst = perturbed_worst(&case, &dir, |c| {
            let moe = c.moe.as_mut().unwrap();
            moe.norm_topk_prob = !moe.norm_topk_prob;
        });
        eprintln!(
            "{:<22} routing canary worst relative error {worst:.2e}",
            case.name
        );
        assert!(
            worst > BOUND,
            "{}: the routing canary passed ({worst:e})",
            case.name
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn canary_perturbed_rope_theta_breaks_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    for case in cases() {
        let dir = synthesized(&case, tmp.path());
        let worst = perturbed_worst(&case, &dir, |c| c.rope_theta *= 1.01);
        eprintln!("{:<22} canary worst relative error {worst:.2e}", case.name);
        assert!(
            worst > BOUND,
            "{}: the canary passed the bound ({worst:e})",
            case.name
        );
    }
}

/// A step whose top-1 minus top-2 logit margin (transformers') is below this is a near tie: the
/// reference may part from transformers there (f32 sums in another order), nowhere else.
const NEAR_TIE: f32 = 1e-3;

/// transformers' greedy continuation of a case's first prompt (tests/oracle/make_greedy.py).
#[derive(Deserialize)]
struct Greedy {
    weights_sha256: String,
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    margins: Vec<f32>,
}

fn greedy_fixtures() -> std::collections::BTreeMap<String, Greedy> {
    let text = std::fs::read_to_string(repo().join("tests/oracle/fixtures/greedy.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The CPU reference's greedy tokens after `prompt` (ties to the lower id, as torch's argmax).
fn cpu_greedy(model: &CpuModel, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut logits = model.forward(prompt, &mut cache, LogitRows::Last).unwrap();
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let next = logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0 as u32;
        out.push(next);
        logits = model.forward(&[next], &mut cache, LogitRows::Last).unwrap();
    }
    out
}

/// The first step where `ours` leaves `theirs`.
fn parting(ours: &[u32], theirs: &[u32]) -> Option<usize> {
    ours.iter().zip(theirs).position(|(a, b)| a != b)
}

#[test]
fn greedy_continuations_equal_transformers_or_part_only_at_a_near_tie() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = greedy_fixtures();
    let mut checked = 0;
    for case in cases() {
        let fixture = &fixtures[&case.name];
        let dir = synthesized(&case, tmp.path());
        assert_eq!(
            weights_sha256(&dir),
            fixture.weights_sha256,
            "{}: regenerate greedy.json",
            case.name
        );
        assert_eq!(fixture.prompt, case.prompts[0]);
        let model = CpuModel::load(&dir).unwrap();
        let ours = cpu_greedy(&model, &fixture.prompt, fixture.tokens.len());
        match parting(&ours, &fixture.tokens) {
            None => eprintln!("{:<22} greedy {} tokens identical", case.name, ours.len()),
            Some(step) => {
                let margin = fixture.margins[step];
                eprintln!(
                    "{:<22} greedy parts at step {step}, margin {margin:.2e}",
                    case.name
                );
                assert!(
                    margin < NEAR_TIE,
                    "{}: greedy parts from transformers at step {step}, where its margin is \
                     {margin:e} (not a near tie: < {NEAR_TIE:e})",
                    case.name
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, fixtures.len());
}

#[test]
fn canary_greedy_with_moe_routing_renormalized_the_other_way_parts_beyond_a_near_tie() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = greedy_fixtures();
    for case in cases().into_iter().filter(|c| c.spec.moe.is_some()) {
        let fixture = &fixtures[&case.name];
        let dir = synthesized(&case, tmp.path());
        let mut config = ModelConfig::from_dir(&dir).unwrap();
        let moe = config.moe.as_mut().unwrap();
        moe.norm_topk_prob = !moe.norm_topk_prob;
        let model = CpuModel::from_checkpoint(config, &Checkpoint::open(&dir).unwrap()).unwrap();
        let ours = cpu_greedy(&model, &fixture.prompt, fixture.tokens.len());
        let step = parting(&ours, &fixture.tokens);
        assert!(
            step.is_some_and(|s| fixture.margins[s] >= NEAR_TIE),
            "{}: the routing canary's greedy path did not part beyond a near tie ({step:?})",
            case.name
        );
    }
}
