use super::*;
use crate::cpu::{CpuModel, LogitRows};

fn tiny(arch: &str, seed: u64) -> SynthSpec {
    SynthSpec {
        arch: arch.into(),
        ..SynthSpec::tiny(Architecture::Llama, seed)
    }
}

#[test]
fn synthesis_is_deterministic_and_seed_dependent() {
    let dir = tempfile::tempdir().unwrap();
    let read = |name: &str| std::fs::read(dir.path().join(name).join("model.safetensors")).unwrap();
    synthesize(&tiny("qwen3", 7), &dir.path().join("a"), None).unwrap();
    synthesize(&tiny("qwen3", 7), &dir.path().join("b"), None).unwrap();
    synthesize(&tiny("qwen3", 8), &dir.path().join("c"), None).unwrap();
    assert_eq!(read("a"), read("b"));
    assert_ne!(read("a"), read("c"));
}

#[test]
fn every_architecture_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2", "qwen3", "mistral"] {
        let out = dir.path().join(arch);
        let mut spec = tiny(arch, 1);
        if arch == "mistral" {
            spec.sliding_window = Some(4);
        }
        let config = synthesize(&spec, &out, None).unwrap();
        assert_eq!(config.vocab_size, 320);
        let model = CpuModel::load(&out).unwrap();
        let mut cache = model.new_cache();
        let logits = model
            .forward(&[256, 72, 105], &mut cache, LogitRows::All)
            .unwrap();
        assert_eq!(logits.len(), 3 * 320);
        assert!(logits.iter().all(|v| v.is_finite()));
        let spread = logits.iter().cloned().fold(f32::MIN, f32::max)
            - logits.iter().cloned().fold(f32::MAX, f32::min);
        assert!(spread > 1.0, "{arch}: logits too flat ({spread})");
    }
}

#[test]
fn bad_specs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = tiny("gpt2", 1);
    assert!(
        synthesize(&spec, dir.path(), None)
            .unwrap_err()
            .to_string()
            .contains("gpt2")
    );
    spec = tiny("llama", 1);
    spec.kv_heads = 3;
    assert!(
        synthesize(&spec, dir.path(), None)
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads")
    );
    spec = tiny("qwen2", 1);
    spec.sliding_window = Some(8);
    assert!(synthesize(&spec, dir.path(), None).is_err());
}

#[test]
fn byte_level_tokenizer_maps_bytes_to_their_ids() {
    let json = byte_level_tokenizer().to_string();
    let tok: tokenizers::Tokenizer = json.parse().unwrap();
    let enc = tok.encode("hé!", false).unwrap();
    assert_eq!(enc.get_ids(), &[104, 195, 169, 33]);
    let with_bos = tok.encode("a", true).unwrap();
    assert_eq!(with_bos.get_ids(), &[256, 97]);
    assert_eq!(tok.decode(&[104, 195, 169, 33], false).unwrap(), "hé!");
}
