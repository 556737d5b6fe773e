//! Quantized checkpoints written by compressed-tensors (tests/oracle/quant, made by
//! make_compressed_tensors.py): FP8 per tensor, per channel and per 32x32 block, and NVFP4; and by
//! NVIDIA ModelOpt (make_modelopt.py): NVFP4 and FP8. Every
//! quantized Linear must read back as the values the library dequantized the same file to, bit for
//! bit once rounded to the library's bf16; the model loads and runs; bad files are refused naming
//! the tensor. The canary reads the NVFP4 file under ModelOpt's names (its tensor scale multiplied,
//! not divided): the comparison must fail.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use strata_model::cpu::{CpuModel, LogitRows};
use strata_model::weights::Checkpoint;

const SCHEMES: [&str; 4] = ["fp8-tensor", "fp8-channel", "fp8-block", "nvfp4"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/quant")
}

/// The library's dequantized weights of `scheme`, by name, as bf16 bits.
fn library_weights(scheme: &str) -> HashMap<String, Vec<u16>> {
    library_weights_at(&fixtures().join(format!("ct-{scheme}.dequantized.safetensors")))
}

/// A fixture of dequantized weights, by name, as bf16 bits.
fn library_weights_at(path: &Path) -> HashMap<String, Vec<u16>> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::BF16);
            let bits = view
                .data()
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            (name, bits)
        })
        .collect()
}

/// How many values of each library tensor differ from strata's reading of the checkpoint in
/// `dir`, rounded to bf16.
fn mismatches(dir: &Path, want: &HashMap<String, Vec<u16>>) -> usize {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut differing = 0;
    for (name, bits) in want {
        let t = ckpt.get(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours: Vec<u16> = t
            .bytes
            .chunks_exact(4)
            .map(|b| half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_bits())
            .collect();
        assert_eq!(ours.len(), bits.len(), "{name}");
        differing += ours.iter().zip(bits).filter(|(a, b)| a != b).count();
    }
    differing
}

/// Every library tensor of `want` reads back from the checkpoint in `dir` bit for bit, and the
/// model loads (the architecture's tensors, nothing unexpected) and runs.
fn reads_back_and_runs(dir: &Path, want: &HashMap<String, Vec<u16>>, scheme: &str) {
    assert_eq!(mismatches(dir, want), 0, "{scheme}");
    let model = CpuModel::load(dir).unwrap_or_else(|e| panic!("{scheme}: {e}"));
    let mut cache = model.new_cache();
    let logits = model
        .forward(&[1, 5, 9, 14], &mut cache, LogitRows::Last)
        .unwrap();
    assert!(logits.iter().all(|v| v.is_finite()), "{scheme}");
}

#[test]
fn compressed_tensors_checkpoints_dequantize_to_the_librarys_values() {
    for scheme in SCHEMES {
        let dir = fixtures().join(format!("ct-{scheme}"));
        let want = library_weights(scheme);
        assert_eq!(
            want.len(),
            14,
            "{scheme}: every Linear but the LM head is quantized"
        );
        reads_back_and_runs(&dir, &want, scheme);
    }
}

/// Rewrites `dir`'s weights into `out` with `edit` applied to the (name, tensor) list.
fn rewritten(
    dir: &Path,
    out: &Path,
    edit: impl Fn(
        Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    ) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    std::fs::create_dir_all(out).unwrap();
    for file in std::fs::read_dir(dir).unwrap() {
        let file = file.unwrap().path();
        if file.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&file, out.join(file.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let tensors = edit(tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
}

/// Checkpoints NVIDIA ModelOpt 0.47 quantized and exported itself (make_modelopt.py), against the
/// values ModelOpt's own dequantizers compute from the exported tensors.
#[test]
fn modelopt_checkpoints_dequantize_to_the_librarys_values() {
    for scheme in ["nvfp4", "fp8"] {
        let dir = fixtures().join(format!("modelopt-{scheme}"));
        let want = library_weights_at(
            &fixtures().join(format!("modelopt-{scheme}.dequantized.safetensors")),
        );
        assert_eq!(want.len(), 14, "{scheme}: every Linear but the LM head");
        reads_back_and_runs(&dir, &want, scheme);
    }
}

#[test]
fn canary_the_negative_zero_code_read_with_its_sign_breaks_the_modelopt_match() {
    // ModelOpt's NVFP4 file holds the code 0b1000 (its exporter writes it); ModelOpt reads it as
    // +0. Decoding it as -0, as compressed-tensors does, must show in the comparison.
    let want = library_weights_at(&fixtures().join("modelopt-nvfp4.dequantized.safetensors"));
    let ckpt = Checkpoint::open(&fixtures().join("modelopt-nvfp4")).unwrap();
    let mut signed = 0;
    for (name, bits) in &want {
        let t = ckpt.get(name).unwrap();
        for (b, &w) in t.bytes.chunks_exact(4).zip(bits) {
            let v = f32::from_le_bytes(b.try_into().unwrap());
            let as_signed = if v == 0.0 { -0.0f32 } else { v };
            signed += usize::from(half::bf16::from_f32(as_signed).to_bits() != w);
        }
    }
    assert!(
        signed > 0,
        "no zero code in the fixture: the canary cannot fail"
    );
}

#[test]
fn canary_modelopt_names_multiply_the_tensor_scale_and_break_the_match() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("modelopt-names");
    rewritten(&fixtures().join("ct-nvfp4"), &out, |tensors| {
        tensors
            .into_iter()
            .map(|(n, d, s, b)| {
                let n = n
                    .replace(".weight_packed", ".weight")
                    .replace(".weight_global_scale", ".weight_scale_2");
                (n, d, s, b)
            })
            .collect()
    });
    let want = library_weights("nvfp4");
    let differing = mismatches(&out, &want);
    let total: usize = want.values().map(Vec::len).sum();
    assert!(
        differing > total / 2,
        "the canary matched: {differing} of {total} differ"
    );
}

#[test]
fn bad_quantized_checkpoints_are_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let target = "model.layers.1.mlp.down_proj";
    type Edit = fn(&str, Dtype, &[usize], &mut Vec<u8>) -> bool;
    let cases: [(&str, &str, Edit, &str); 4] = [
        // A missing scale.
        (
            "fp8-channel",
            "missing",
            |n, _, _, _| n == "model.layers.1.mlp.down_proj.weight_scale",
            "weight_scale",
        ),
        // A NaN scale.
        (
            "fp8-tensor",
            "nan",
            |n, _, _, b| {
                if n == "model.layers.1.mlp.down_proj.weight_scale" {
                    b[..2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
                }
                false
            },
            "non-finite",
        ),
        // A NaN group scale (e4m3's NaN byte).
        (
            "nvfp4",
            "nan-group",
            |n, _, _, b| {
                if n == "model.layers.1.mlp.down_proj.weight_scale" {
                    b[0] = 0x7f;
                }
                false
            },
            "non-finite",
        ),
        // An asymmetric weight.
        (
            "fp8-channel",
            "zero-point",
            |_, _, _, _| false,
            "zero-point",
        ),
    ];
    for (scheme, label, edit, words) in cases {
        let out = tmp.path().join(label);
        rewritten(&fixtures().join(format!("ct-{scheme}")), &out, |tensors| {
            let mut kept = Vec::new();
            for (n, d, s, mut b) in tensors {
                if !edit(&n, d, &s, &mut b) {
                    kept.push((n, d, s, b));
                }
            }
            if label == "zero-point" {
                kept.push((
                    format!("{target}.weight_zero_point"),
                    Dtype::BF16,
                    vec![1],
                    vec![0, 0],
                ));
            }
            kept
        });
        let err = match Checkpoint::open(&out) {
            Err(e) => e.to_string(),
            Ok(ckpt) => match ckpt.get(&format!("{target}.weight")) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("{label}: accepted"),
            },
        };
        assert!(
            err.contains(target) && err.contains(words),
            "{label}: {err}"
        );
    }
}

/// The library-made fixtures' source model, synthesized again into `dir`.
fn synthesized_source(dir: &Path) -> PathBuf {
    #[derive(serde::Deserialize)]
    struct Cases {
        cases: Vec<Case>,
    }
    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        spec: strata_model::synth::SynthSpec,
    }
    let text = std::fs::read_to_string(fixtures().join("cases.json")).unwrap();
    let case = serde_json::from_str::<Cases>(&text)
        .unwrap()
        .cases
        .remove(0);
    let out = dir.join(&case.name);
    strata_model::synth::synthesize(&case.spec, &out, None).unwrap();
    out
}

#[test]
fn strata_quantize_writes_files_transformers_dequantizes_as_strata_does() {
    use strata_model::quantize::{Plan, quantize};
    let tmp = tempfile::tempdir().unwrap();
    let source = synthesized_source(tmp.path());
    for (label, plan) in [
        ("fp8", Plan::Fp8),
        ("fp8-block", Plan::Fp8Block),
        ("nvfp4", Plan::Nvfp4),
        ("nvfp4-4o6", Plan::Nvfp4FourOverSix),
        ("mixed", Plan::Mixed),
    ] {
        let out = tmp.path().join(label);
        let reports = quantize(&source, &out, plan, None, |_| {}).unwrap();
        assert_eq!(reports.len(), 14, "{label}");
        assert!(
            reports.iter().all(|r| r.relative_rms_error < 0.2),
            "{label}: {reports:?}"
        );
        // What transformers (compressed-tensors' compressors for the mixed plan) read from the
        // files this same quantization wrote, bit for bit.
        let want =
            library_weights_at(&fixtures().join(format!("strata-{label}.dequantized.safetensors")));
        assert_eq!(want.len(), 14, "{label}");
        assert_eq!(mismatches(&out, &want), 0, "{label}");
        let model = CpuModel::load(&out).unwrap_or_else(|e| panic!("{label}: {e}"));
        let logits = model
            .forward(&[1, 5, 9], &mut model.new_cache(), LogitRows::Last)
            .unwrap();
        assert!(logits.iter().all(|v| v.is_finite()), "{label}");
    }
    // A quantized checkpoint is not quantized again.
    let err = quantize(
        &tmp.path().join("fp8"),
        &tmp.path().join("again"),
        Plan::Fp8,
        None,
        |_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("already quantized"), "{err}");
}

/// A real model fetched by scripts/fetch-test-data.sh (missing data fails, it does not skip).
fn real_model(file: &str) -> PathBuf {
    let path = fixtures()
        .join("../../../target/test-data/models")
        .join(file);
    assert!(
        path.is_file(),
        "missing {}: run scripts/fetch-test-data.sh from the repository root",
        path.display()
    );
    path
}

#[test]
fn a_real_gguf_model_quantizes_into_a_directory_that_loads_and_agrees_with_it() {
    use strata_model::quantize::{Plan, quantize};
    let tmp = tempfile::tempdir().unwrap();
    let gguf = real_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let out = tmp.path().join("smollm2-fp8");
    let reports = quantize(&gguf, &out, Plan::Fp8, None, |_| {}).unwrap();
    assert_eq!(reports.len(), 30 * 7);
    for file in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(out.join(file).is_file(), "{file}");
    }
    // The FP8 model predicts what the GGUF model predicts on a short prompt.
    let tokenizer = strata_model::tokenizer::Tokenizer::from_dir(&out).unwrap();
    let prompt = tokenizer.encode("The capital of France is", true).unwrap();
    assert_eq!(
        prompt,
        strata_model::tokenizer::Tokenizer::from_dir(&gguf)
            .unwrap()
            .encode("The capital of France is", true)
            .unwrap()
    );
    let argmax = |dir: &Path| {
        let model = CpuModel::load(dir).unwrap();
        let logits = model
            .forward(&prompt, &mut model.new_cache(), LogitRows::Last)
            .unwrap();
        (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap()
    };
    assert_eq!(argmax(&out), argmax(&gguf));
}

/// The real Gemma 3 GGUF quantized to FP8: transformers loads the directory strata writes
/// (tests/oracle/quant/check_gemma_quantized.py, fixture gemma-fp8-logits.json) and tokenizes and
/// predicts as strata does — the written Gemma 3 config (sliding and global layers, two rope
/// bases, query scalar) and its norms (`1 + w` in the GGUF, `w` written) mean the same to both.
/// The canary: the unquantized GGUF's logits miss the same fixture by far more than the bound.
#[test]
fn a_gemma_gguf_quantizes_into_a_directory_transformers_reads_as_strata_does() {
    use serde_json::Value;
    use strata_model::quantize::{Plan, quantize};
    const BOUND: f32 = 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    let gguf = real_model("gemma-3-270m-q4_k_m.gguf");
    let out = tmp.path().join("gemma-fp8");
    let reports = quantize(&gguf, &out, Plan::Fp8, None, |_| {}).unwrap();
    assert_eq!(reports.len(), 18 * 7);
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("gemma-fp8-logits.json")).unwrap(),
    )
    .unwrap();
    let tokenizer = strata_model::tokenizer::Tokenizer::from_dir(&out).unwrap();
    let quantized = CpuModel::load(&out).unwrap();
    let widened = CpuModel::load(&gguf).unwrap();
    let (mut worst, mut canary) = (0.0f32, 0.0f32);
    for case in fixture["cases"].as_array().unwrap() {
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        };
        let prompt = tokenizer
            .encode(case["prompt"].as_str().unwrap(), true)
            .unwrap();
        assert_eq!(prompt, ids(&case["tokens"]), "{}", case["prompt"]);
        let logits = |m: &CpuModel| {
            m.forward(&prompt, &mut m.new_cache(), LogitRows::Last)
                .unwrap()
        };
        let (ours, base) = (logits(&quantized), logits(&widened));
        let want: Vec<f32> = case["top_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        for (id, want) in ids(&case["top_ids"]).into_iter().zip(want) {
            let got = ours[id as usize];
            worst = worst.max((got - want).abs() / want.abs().max(1.0));
            assert!(
                (got - want).abs() <= BOUND * want.abs().max(1.0),
                "{}: token {id}: {got} vs transformers {want}",
                case["prompt"]
            );
            canary = canary.max((base[id as usize] - want).abs() / want.abs().max(1.0));
        }
    }
    eprintln!("largest relative difference {worst:e}; the unquantized model's {canary:e}");
    assert!(canary > 10.0 * BOUND, "the canary missed by only {canary}");
}

/// `strata quantize --calibrate` against tests/oracle/quant/calibration.json (check_calibration.py:
/// transformers runs the same model on the same text, compressed-tensors derives the scales, and
/// transformers loads the files strata wrote). The token ids are equal, each Linear input's range
/// is transformers' up to f32 summation order, the scale formulas are the library's bit for bit,
/// and the scales the library loaded are the ones strata writes. Ranges of different inputs of a
/// layer are far apart (checked), so a projection measured at the wrong place fails.
#[test]
fn calibrated_activation_scales_are_transformers_ranges_through_the_librarys_formulas() {
    use serde_json::Value;
    use strata_model::cpu::LinearInput;
    use strata_model::quantize::{
        Calibration, Plan, fp8_input_scale, nvfp4_input_global_scale, quantize, sequences,
    };
    use strata_model::tokenizer::Tokenizer;
    const TOLERANCE: f32 = 1e-5;
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("calibration.json")).unwrap(),
    )
    .unwrap();
    let f32_of = |v: &Value| v.as_f64().unwrap() as f32;
    let tmp = tempfile::tempdir().unwrap();
    let source = synthesized_source(tmp.path());
    let text = std::fs::read_to_string(fixtures().join("calibration.txt")).unwrap();
    let tokens = Tokenizer::from_dir(&source)
        .unwrap()
        .encode(&text, true)
        .unwrap();
    let runs = sequences(&tokens, 128, 4);
    let want: Vec<Vec<u32>> = serde_json::from_value(fixture["sequences"].clone()).unwrap();
    assert_eq!(
        runs, want,
        "strata and transformers cut the text into other tokens"
    );
    let model = CpuModel::load(&source).unwrap();
    let calibration = Calibration::measure(&model, &runs).unwrap();
    assert_eq!(calibration.tokens, runs.iter().map(Vec::len).sum::<usize>());

    let linears = fixture["linears"].as_object().unwrap();
    assert_eq!(linears.len(), 14);
    let site = |name: &str| {
        // model.layers.{i}.{self_attn|mlp}.{role}_proj
        let parts: Vec<&str> = name.split('.').collect();
        let layer: usize = parts[2].parse().unwrap();
        let role = parts[4].strip_suffix("_proj").unwrap();
        (layer, LinearInput::of(role).unwrap())
    };
    let relative = |a: f32, b: f32| ((a - b) / b).abs();
    for (name, lib) in linears {
        let (layer, input) = site(name);
        let ours = calibration.amax(layer, input).unwrap();
        let theirs = f32_of(&lib["amax"]);
        assert!(
            relative(ours, theirs) <= TOLERANCE,
            "{name}: strata {ours}, transformers {theirs}"
        );
        assert_eq!(
            fp8_input_scale(theirs).to_bits(),
            f32_of(&lib["fp8_input_scale"]).to_bits(),
            "{name}"
        );
        assert_eq!(
            nvfp4_input_global_scale(theirs).to_bits(),
            f32_of(&lib["nvfp4_input_global_scale"]).to_bits(),
            "{name}"
        );
    }
    // The canary's premise: the four inputs of a layer are told apart by far more than the
    // tolerance.
    for layer in 0..2 {
        let ranges: Vec<f32> = [
            LinearInput::Attention,
            LinearInput::Output,
            LinearInput::Mlp,
            LinearInput::Down,
        ]
        .iter()
        .map(|&i| calibration.amax(layer, i).unwrap())
        .collect();
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                assert!(
                    relative(*a, *b) > 100.0 * TOLERANCE,
                    "layer {layer}: {ranges:?}"
                );
            }
        }
    }

    // The files: what transformers loaded from them is what strata writes again.
    for (plan, label, key) in [
        (Plan::Fp8, "fp8", "input_scale"),
        (Plan::Nvfp4, "nvfp4", "input_global_scale"),
    ] {
        let out = tmp.path().join(format!("{label}-calibrated"));
        let reports = quantize(&source, &out, plan, Some(&calibration), |_| {}).unwrap();
        assert!(reports.iter().all(|r| r.input_amax.is_some()), "{label}");
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let loaded = fixture["loaded"][label].as_object().unwrap();
        assert_eq!(loaded.len(), 14, "{label}");
        for (module, value) in loaded {
            let t = st.tensor(&format!("{module}.{key}")).unwrap();
            assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[1][..]), "{module}");
            let written = f32::from_le_bytes(t.data().try_into().unwrap());
            assert_eq!(
                written.to_bits(),
                f32_of(value).to_bits(),
                "{label} {module}"
            );
        }
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let inputs =
            &config["quantization_config"]["config_groups"]["group_0"]["input_activations"];
        assert_eq!(
            inputs["dynamic"],
            if label == "fp8" {
                Value::Bool(false)
            } else {
                "local".into()
            }
        );
        // strata reads its calibrated file (activation scales set aside: weight-only arithmetic).
        let plain = tmp.path().join(format!("{label}-plain"));
        quantize(&source, &plain, plan, None, |_| {}).unwrap();
        let logits = |dir: &Path| {
            let m = CpuModel::load(dir).unwrap();
            m.forward(&runs[0][..8], &mut m.new_cache(), LogitRows::Last)
                .unwrap()
        };
        assert_eq!(logits(&out), logits(&plain), "{label}");
    }
    let err = quantize(
        &source,
        &tmp.path().join("block"),
        Plan::Fp8Block,
        Some(&calibration),
        |_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("fp8-block"), "{err}");
}

/// `--quantize-activations` against transformers running the same files through
/// compressed-tensors' forward (tests/oracle/quant/activation-logits.json, made by
/// check_activation_logits.py): W8A8 with static (calibrated) and per-token FP8 scales, W4A4
/// NVFP4. The last position's logits agree to f32 summation order (about 3e-7 of their range;
/// bound 1e-5); the canary: strata's weight-only arithmetic on the same files is thousands of
/// times further off (7e-2 to 3e-1), so the agreement comes from quantizing each input as the
/// library does.
#[test]
fn activation_quantized_logits_follow_compressed_tensors_forward() {
    use serde_json::Value;
    use strata_model::quantize::{Calibration, Plan, quantize};
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("activation-logits.json")).unwrap(),
    )
    .unwrap();
    let calibration_fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("calibration.json")).unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let source = synthesized_source(tmp.path());
    let runs: Vec<Vec<u32>> =
        serde_json::from_value(calibration_fixture["sequences"].clone()).unwrap();
    let calibration = Calibration::measure(&CpuModel::load(&source).unwrap(), &runs).unwrap();
    let sequences: Vec<Vec<u32>> = serde_json::from_value(fixture["sequences"].clone()).unwrap();
    for (label, plan, calibrated) in [
        ("fp8-static", Plan::Fp8, true),
        ("fp8-dynamic", Plan::Fp8Dynamic, false),
        ("nvfp4-w4a4", Plan::Nvfp4, true),
    ] {
        let out = tmp.path().join(label);
        quantize(
            &source,
            &out,
            plan,
            calibrated.then_some(&calibration),
            |_| {},
        )
        .unwrap();
        let want: Vec<Vec<f32>> =
            serde_json::from_value(fixture["plans"][label]["logits"].clone()).unwrap();
        let logits = |quantized_inputs: bool| {
            let mut model = CpuModel::load(&out).unwrap();
            if quantized_inputs {
                let ckpt = Checkpoint::open(&out).unwrap();
                assert_eq!(model.quantize_activations(&ckpt).unwrap(), 14, "{label}");
            }
            sequences
                .iter()
                .map(|s| {
                    model
                        .forward(s, &mut model.new_cache(), LogitRows::Last)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        };
        let off = |got: &[Vec<f32>]| {
            let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            got.iter()
                .flatten()
                .zip(want.iter().flatten())
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale
        };
        let (quantized, weight_only) = (off(&logits(true)), off(&logits(false)));
        eprintln!("{label}: activation-quantized {quantized:.2e}, weight-only {weight_only:.2e}");
        assert!(quantized <= 1e-5, "{label}: {quantized:.2e} off");
        assert!(
            weight_only >= 1e3 * quantized,
            "{label}: weight-only {weight_only:.2e} vs {quantized:.2e}"
        );
    }
}

/// Kept NVFP4's and FP8's arithmetic on the CPU reference (what the CUDA tiles compute with
/// `--keep-quantized`): on compressed-tensors' and ModelOpt's own files every NVFP4 projection
/// and every FP8 one with a scale per tensor or per channel changes arithmetic, and the last
/// position's logits stay within 1e-4 of their range from the widened model's (the weights differ
/// by at most one bf16 rounding of `w' × s`) without being the same (the canary: `keep_tiled`
/// changed nothing). FP8 with scales per 32 × 32 block is not held by the tiles: nothing changes.
#[test]
fn kept_arithmetic_stays_within_a_rounding_of_the_widened_model() {
    let tokens = [1u32, 17, 42, 99, 5, 250, 3, 77];
    for (dir, projections) in [
        ("ct-nvfp4", 14),
        ("modelopt-nvfp4", 14),
        ("ct-fp8-tensor", 14),
        ("ct-fp8-channel", 14),
        ("modelopt-fp8", 14),
        ("ct-fp8-block", 0),
    ] {
        let dir = fixtures().join(dir);
        let widened = CpuModel::load(&dir).unwrap();
        let mut kept = CpuModel::load(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        // FP8 only when asked for (`fp8_tiles`).
        assert_eq!(
            CpuModel::load(&dir)
                .unwrap()
                .keep_tiled(&ckpt, false)
                .unwrap(),
            if dir.to_string_lossy().ends_with("nvfp4") {
                projections
            } else {
                0
            },
            "{}",
            dir.display()
        );
        let changed = kept.keep_tiled(&ckpt, true).unwrap();
        assert_eq!(changed, projections, "{}", dir.display());
        let logits = |m: &CpuModel| {
            m.forward(&tokens, &mut m.new_cache(), LogitRows::Last)
                .unwrap()
        };
        let (want, got) = (logits(&widened), logits(&kept));
        let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let off = want
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / range;
        eprintln!(
            "{}: kept vs widened {off:.2e} of the logits' range",
            dir.display()
        );
        if projections == 0 {
            assert_eq!(off, 0.0, "{}: nothing is kept", dir.display());
            continue;
        }
        assert!(
            off > 0.0,
            "{}: the kept arithmetic computed the widened model",
            dir.display()
        );
        assert!(off < 1e-4, "{}: {off:.2e}", dir.display());
    }
}

/// `strata quantize` of a mixture: every expert (and the shared expert) quantized like a dense
/// MLP's Linears, the routers and the shared expert's gate left bf16 and named in the config's
/// `ignore`; the files load and compute close to the source.
#[test]
fn a_mixture_of_experts_quantizes_its_experts_and_keeps_its_routers() {
    use strata_model::quantize::{Plan, quantize};
    use strata_model::synth::{SynthSpec, synthesize};
    let tmp = tempfile::tempdir().unwrap();
    let qwen3 = SynthSpec::tiny_moe(3);
    let mut qwen2 = SynthSpec {
        arch: "qwen2_moe".into(),
        ..SynthSpec::tiny_moe(4)
    };
    qwen2.moe.as_mut().unwrap().shared_expert_intermediate = Some(48);
    let tokens = [1u32, 17, 42, 99, 5, 250, 3, 77];
    for (name, spec) in [("qwen3", qwen3), ("qwen2", qwen2)] {
        let source = tmp.path().join(name);
        synthesize(&spec, &source, None).unwrap();
        let reference = CpuModel::load(&source).unwrap();
        let want = reference
            .forward(&tokens, &mut reference.new_cache(), LogitRows::Last)
            .unwrap();
        let range = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (label, plan, bound) in [
            ("fp8", Plan::Fp8, 0.1),
            ("nvfp4", Plan::Nvfp4, 0.45),
            ("mixed", Plan::Mixed, 0.25),
        ] {
            let out = tmp.path().join(format!("{name}-{label}"));
            let reports = quantize(&source, &out, plan, None, |_| {}).unwrap();
            let experts = reports
                .iter()
                .filter(|r| r.name.contains(".experts."))
                .count();
            // Layers 0 and 2 are sparse: eight experts of three Linears each.
            assert_eq!(experts, 2 * 8 * 3, "{name} {label}");
            let shared = reports
                .iter()
                .filter(|r| r.name.contains("shared_expert."))
                .count();
            assert_eq!(
                shared,
                if name == "qwen2" { 6 } else { 0 },
                "{name} {label}"
            );
            assert!(
                reports.iter().all(|r| r.relative_rms_error < 0.2),
                "{reports:?}"
            );
            let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
            let files = SafeTensors::deserialize(&bytes).unwrap();
            let config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                    .unwrap();
            let ignore = config["quantization_config"]["ignore"]
                .as_array()
                .unwrap()
                .clone();
            for layer in [0, 2] {
                let router = format!("model.layers.{layer}.mlp.gate");
                let t = files.tensor(&format!("{router}.weight")).unwrap();
                assert_eq!(
                    t.dtype(),
                    Dtype::BF16,
                    "{name} {label}: {router} stays bf16"
                );
                assert!(ignore.contains(&serde_json::json!(router)), "{ignore:?}");
            }
            let model = CpuModel::load(&out).unwrap_or_else(|e| panic!("{name} {label}: {e}"));
            let got = model
                .forward(&tokens, &mut model.new_cache(), LogitRows::Last)
                .unwrap();
            let off = want
                .iter()
                .zip(&got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / range;
            eprintln!("{name} {label}: logits off by {off:.2e} of their range");
            assert!(off > 0.0 && off < bound, "{name} {label}: {off:.2e}");
        }
    }
}
