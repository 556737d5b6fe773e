//! A mixture of experts from a GGUF file (issue 38): tests/oracle/gguf_moe/qwen3moe-q4k-q8.gguf,
//! written by the `gguf` package with llama.cpp's stacked expert tensors (gate and up in Q4_K,
//! down in Q8_0), loads on the CPU reference and computes what transformers computes from the same
//! file (tests/oracle/gguf_moe/make_fixture.py wrote both). A canary that drops the
//! renormalization llama.cpp applies to Qwen3-MoE must break the bound.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use strata_model::ModelConfig;
use strata_model::config::Architecture;
use strata_model::cpu::{CpuModel, LogitRows};
use strata_model::weights::{Checkpoint, LayerSpec};

/// Max |ours − transformers| over a row, relative to max |transformers| of that row.
const BOUND: f32 = 1e-4;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/gguf_moe")
}

fn file() -> PathBuf {
    dir().join("qwen3moe-q4k-q8.gguf")
}

/// A prompt of the fixture and transformers' logits at some of its positions.
type Prompt = (Vec<u32>, Vec<(usize, Vec<f32>)>);

fn fixture() -> Vec<Prompt> {
    let bytes = std::fs::read(dir().join("qwen3moe.logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<usize> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect()
    };
    (0..)
        .map_while(|i| {
            st.tensor(&format!("prompt{i}.positions")).ok()?;
            let logits = st.tensor(&format!("prompt{i}.logits")).unwrap();
            let vocab = logits.shape()[1];
            let values: Vec<f32> = logits
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let tokens = ints(&format!("prompt{i}.tokens"));
            let rows = ints(&format!("prompt{i}.positions"))
                .into_iter()
                .zip(values.chunks_exact(vocab))
                .map(|(p, row)| (p, row.to_vec()))
                .collect();
            Some((tokens.into_iter().map(|t| t as u32).collect(), rows))
        })
        .collect()
}

fn worst_error(model: &CpuModel) -> f32 {
    let vocab = model.config().vocab_size;
    let mut worst = 0.0f32;
    for (prompt, rows) in fixture() {
        let mut cache = model.new_cache();
        let all = model.forward(&prompt, &mut cache, LogitRows::All).unwrap();
        for (position, want) in rows {
            let ours = &all[position * vocab..(position + 1) * vocab];
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = ours
                .iter()
                .zip(&want)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(diff / scale);
        }
    }
    worst
}

#[test]
fn a_gguf_mixture_of_experts_matches_transformers() {
    let config = ModelConfig::from_dir(&file()).unwrap();
    assert_eq!(config.architecture, Architecture::Qwen3Moe);
    let moe = config.moe.as_ref().unwrap();
    assert_eq!(
        (moe.experts, moe.experts_per_token, moe.expert_intermediate),
        (4, 2, 64)
    );
    assert!(moe.norm_topk_prob && moe.sparse_layers == [true, true]);
    // The stacked tensors became one matrix per expert under the Hugging Face names.
    let ckpt = Checkpoint::open(&file()).unwrap();
    let spec = LayerSpec::new(&config, 1);
    for t in spec.tensors() {
        let got = ckpt.get(&t.name).unwrap();
        assert_eq!(got.shape, t.shape, "{}", t.name);
    }
    let model = CpuModel::load(&file()).unwrap();
    let worst = worst_error(&model);
    eprintln!("worst relative error {worst:.2e} (bound {BOUND:e})");
    assert!(worst <= BOUND, "relative error {worst:e} > {BOUND:e}");
}

#[test]
fn canary_routing_without_renormalization_breaks_the_bound() {
    let mut config = ModelConfig::from_dir(&file()).unwrap();
    config.moe.as_mut().unwrap().norm_topk_prob = false;
    let model = CpuModel::from_checkpoint(config, &Checkpoint::open(&file()).unwrap()).unwrap();
    let worst = worst_error(&model);
    assert!(worst > BOUND, "the canary passed ({worst:e})");
}
