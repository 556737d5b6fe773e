//! Loading checkpoints: sharded vs single-file equivalence, and every kind of bad input giving one
//! clear line that names the file and the problem (never a panic).

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use strata_model::Architecture;
use strata_model::cpu::{CpuModel, LogitRows};
use strata_model::synth::{SynthDtype, SynthSpec, synthesize};

fn spec(arch: &str, dtype: SynthDtype) -> SynthSpec {
    SynthSpec {
        arch: arch.into(),
        dtype,
        seed: 3,
        max_position: 128,
        ..SynthSpec::tiny(Architecture::Llama, 3)
    }
}

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_tensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn logits(dir: &Path) -> Vec<f32> {
    let model = CpuModel::load(dir).unwrap();
    model
        .forward(&[256, 10, 20, 30], &mut model.new_cache(), LogitRows::All)
        .unwrap()
}

/// Synthesizes a checkpoint, lets `mutate` damage it, and returns the load error's text.
fn load_error(mutate: impl FnOnce(&Path)) -> String {
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec("llama", SynthDtype::Bf16), dir.path(), None).unwrap();
    mutate(dir.path());
    let err = CpuModel::load(dir.path())
        .err()
        .expect("loading must fail")
        .to_string();
    assert!(!err.contains('\n'), "one line: {err}");
    err
}

#[test]
fn sharded_f16_and_f32_checkpoints_load_like_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    synthesize(&spec("qwen2", SynthDtype::F32), &single, None).unwrap();
    let reference = logits(&single);

    let sharded = dir.path().join("sharded");
    synthesize(&spec("qwen2", SynthDtype::F32), &sharded, None).unwrap();
    let tensors = read_tensors(&sharded.join("model.safetensors"));
    std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let mut map = HashMap::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        write_tensors(&sharded.join(file), &part.to_vec());
        for t in part {
            map.insert(t.0.clone(), file.to_string());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_eq!(logits(&sharded), reference);

    // f16 weights load and run (values differ from f32 by rounding only).
    let half = dir.path().join("f16");
    synthesize(&spec("qwen2", SynthDtype::F16), &half, None).unwrap();
    let h = logits(&half);
    let worst = h
        .iter()
        .zip(&reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 0.05, "f16 vs f32 logits differ by {worst}");
}

#[test]
fn missing_tensor_is_named() {
    let err = load_error(|d| {
        let path = d.join("model.safetensors");
        let mut t = read_tensors(&path);
        t.retain(|x| x.0 != "model.layers.1.mlp.up_proj.weight");
        write_tensors(&path, &t);
    });
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn wrong_shape_names_both_shapes() {
    let err = load_error(|d| {
        let path = d.join("model.safetensors");
        let mut t = read_tensors(&path);
        let k = t
            .iter_mut()
            .find(|x| x.0 == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        k.2 = vec![64, 32];
        write_tensors(&path, &t);
    });
    assert!(
        err.contains("k_proj") && err.contains("[64, 32]") && err.contains("[32, 64]"),
        "{err}"
    );
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn unsupported_dtype_is_named() {
    let err = load_error(|d| {
        let path = d.join("model.safetensors");
        let mut t = read_tensors(&path);
        let n = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        n.1 = Dtype::I16;
        write_tensors(&path, &t);
    });
    assert!(
        err.contains("model.norm.weight") && err.contains("I16"),
        "{err}"
    );
}

#[test]
fn unexpected_tensor_is_named() {
    let err = load_error(|d| {
        let path = d.join("model.safetensors");
        let mut t = read_tensors(&path);
        t.push((
            "model.layers.0.mlp.extra.weight".into(),
            Dtype::BF16,
            vec![2],
            vec![0; 4],
        ));
        write_tensors(&path, &t);
    });
    assert!(err.contains("model.layers.0.mlp.extra.weight"), "{err}");
}

#[test]
fn truncated_safetensors_is_detected() {
    let err = load_error(|d| {
        let path = d.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    });
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    let err = load_error(|d| std::fs::write(d.join("model.safetensors"), b"\x05\x00").unwrap());
    assert!(err.contains("truncated or corrupt"), "{err}");
}

#[test]
fn malformed_config_and_index_are_named() {
    let err =
        load_error(|d| std::fs::write(d.join("config.json"), "{\"vocab_size\": 12,").unwrap());
    assert!(
        err.contains("config.json") && err.contains("malformed JSON"),
        "{err}"
    );
    let err = load_error(|d| {
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        std::fs::write(
            d.join("config.json"),
            text.replace("LlamaForCausalLM", "FalconForCausalLM"),
        )
        .unwrap();
    });
    assert!(
        err.contains("FalconForCausalLM") && err.contains("not supported"),
        "{err}"
    );
    let err = load_error(|d| std::fs::write(d.join("model.safetensors.index.json"), "[]").unwrap());
    assert!(
        err.contains("model.safetensors.index.json") && err.contains("malformed"),
        "{err}"
    );
    let err = load_error(|d| std::fs::remove_file(d.join("model.safetensors")).unwrap());
    assert!(err.contains("no model.safetensors"), "{err}");
}
