//! `strata quantize`: a checkpoint's Linear projections rewritten in FP8 or NVFP4, in
//! compressed-tensors' layout (`float-quantized`, `nvfp4-pack-quantized`), so the files load in
//! strata ([`crate::weights`]), in compressed-tensors and in transformers alike.
//!
//! Plans: `fp8` (e4m3, a scale per output channel), `fp8-block` (a scale per 128x128 block),
//! `nvfp4` (e2m1, an e4m3 scale per 16 values mapping each group's largest magnitude to 6, an f32
//! tensor scale), `nvfp4-4o6` (per group, the scale mapping its largest magnitude to 4 or to 6,
//! whichever reconstructs the group with the lower squared error), and `mixed` (attention FP8 per
//! channel, MLP NVFP4 4o6). Embeddings, norms and the LM head stay bf16. Every rounding is to
//! nearest, ties to the even code; scales saturate at e4m3's 448.
//!
//! With a [`Calibration`] (activations measured on real text, [`calibrate`]) each FP8 per-channel
//! Linear also gets a static input scale and each NVFP4 Linear an input global scale, under the
//! `input_activations` schemes compressed-tensors' `FP8` and `NVFP4` presets use.

mod activations;
mod calibrate;

pub use activations::ActivationQuant;
pub use calibrate::{Calibration, fp8_input_scale, nvfp4_input_global_scale, sequences};

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

use crate::config::ModelConfig;
use crate::cpu::LinearInput;
use crate::weights::{
    Checkpoint, GatedMlp, LayerSpec, MlpSpec, TensorSpec, e2m1_to_f32, e4m3_to_f32,
    expected_tensors,
};

/// e4m3's largest finite magnitude, and e2m1's.
const E4M3_MAX: f32 = 448.0;
const E2M1_MAX: f32 = 6.0;
/// The FP8 block of `fp8-block`.
pub const FP8_BLOCK: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    Fp8,
    /// `fp8` with dynamic per-token FP8 activations (compressed-tensors' `FP8_DYNAMIC`).
    Fp8Dynamic,
    Fp8Block,
    Nvfp4,
    Nvfp4FourOverSix,
    Mixed,
}

/// How one Linear is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Fp8Channel,
    Fp8Block,
    Nvfp4 { four_over_six: bool },
}

impl Plan {
    fn format(self, attention: bool) -> Format {
        match self {
            Plan::Fp8 | Plan::Fp8Dynamic => Format::Fp8Channel,
            Plan::Fp8Block => Format::Fp8Block,
            Plan::Nvfp4 => Format::Nvfp4 {
                four_over_six: false,
            },
            Plan::Nvfp4FourOverSix => Format::Nvfp4 {
                four_over_six: true,
            },
            Plan::Mixed if attention => Format::Fp8Channel,
            Plan::Mixed => Format::Nvfp4 {
                four_over_six: true,
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("{}: {problem}", path.display())]
    Io { path: PathBuf, problem: String },
    #[error("{0}")]
    Unsupported(String),
}

/// One quantized Linear's reconstruction error: ‖w − dequantized‖ / ‖w‖.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    pub name: String,
    pub format: &'static str,
    pub relative_rms_error: f64,
    /// The input's largest magnitude over the calibration text, when calibrated.
    pub input_amax: Option<f32>,
}

/// The nearest of `values` (ascending, non-negative) to `x ≥ 0`, ties to the even index.
fn nearest(values: &[f32], x: f32) -> usize {
    let i = values.partition_point(|&v| v < x);
    if i == 0 {
        return 0;
    }
    if i == values.len() {
        return values.len() - 1;
    }
    let (below, above) = (x - values[i - 1], values[i] - x);
    if below < above || (below == above && (i - 1) % 2 == 0) {
        i - 1
    } else {
        i
    }
}

/// The positive e4m3 values, codes 0..=0x7e.
fn e4m3_table() -> Vec<f32> {
    (0u8..=0x7e).map(e4m3_to_f32).collect()
}

/// `x` as e4m3, to nearest (ties to even), saturating at ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    thread_local! {
        static TABLE: Vec<f32> = e4m3_table();
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let code = TABLE.with(|t| nearest(t, x.abs().min(E4M3_MAX)));
    sign | code as u8
}

/// `x` as an e2m1 code (low four bits), to nearest (ties to even), saturating at ±6.
pub fn f32_to_e2m1(x: f32) -> u8 {
    const TABLE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let sign = if x.is_sign_negative() && x != 0.0 {
        0x08
    } else {
        0
    };
    sign | nearest(&TABLE, x.abs().min(E2M1_MAX)) as u8
}

/// A stored tensor: name, dtype, shape, little-endian bytes.
type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `w` (`rows × cols`) in FP8 with a scale per row (`block` = None) or per block; the stored
/// tensors and the dequantized values (what the loader reads back).
fn fp8(
    name: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    block: Option<usize>,
) -> (Vec<Stored>, Vec<f32>) {
    let (bh, bw) = block.map_or((1, cols), |b| (b, b));
    let (sr, sc) = (rows.div_ceil(bh), cols.div_ceil(bw));
    // Rows of scales, then rows of codes, each on its own thread (the same values in any order).
    let mut scales = vec![0f32; sr * sc];
    scales
        .par_chunks_mut(sc)
        .enumerate()
        .for_each(|(i, row_scales)| {
            for r in i * bh..((i + 1) * bh).min(rows) {
                for c in 0..cols {
                    let s = &mut row_scales[c / bw];
                    *s = s.max(w[r * cols + c].abs());
                }
            }
            for s in row_scales {
                *s = if *s > 0.0 { *s / E4M3_MAX } else { 1.0 };
            }
        });
    let mut q = vec![0u8; rows * cols];
    let mut dq = vec![0f32; rows * cols];
    q.par_chunks_mut(cols)
        .zip(dq.par_chunks_mut(cols))
        .enumerate()
        .for_each(|(r, (q, dq))| {
            for c in 0..cols {
                let s = scales[(r / bh) * sc + c / bw];
                q[c] = f32_to_e4m3(w[r * cols + c] / s);
                dq[c] = e4m3_to_f32(q[c]) * s;
            }
        });
    let scale_shape = if block.is_some() {
        vec![sr, sc]
    } else {
        vec![rows, 1]
    };
    let stored = vec![
        (
            format!("{name}.weight"),
            Dtype::F8_E4M3,
            vec![rows, cols],
            q,
        ),
        (
            format!("{name}.weight_scale"),
            Dtype::F32,
            scale_shape,
            f32_bytes(&scales),
        ),
    ];
    (stored, dq)
}

/// `w` in NVFP4: the packed codes, group scales, tensor scale, and the dequantized values
/// (`scale / global` then the product, as the loader and compressed-tensors compute them).
fn nvfp4(
    name: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    four_over_six: bool,
) -> (Vec<Stored>, Vec<f32>) {
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = if amax > 0.0 {
        E4M3_MAX * E2M1_MAX / amax
    } else {
        1.0
    };
    let mut packed = vec![0u8; rows * cols / 2];
    let mut group_scales = vec![0u8; rows * cols / 16];
    let mut dq = vec![0f32; rows * cols];
    // Each group on its own thread (the same values in any order).
    let groups = w
        .par_chunks_exact(16)
        .zip(packed.par_chunks_exact_mut(8))
        .zip(group_scales.par_iter_mut())
        .zip(dq.par_chunks_exact_mut(16));
    groups.for_each(|(((group, packed), group_scale), dq)| {
        let gmax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let targets: &[f32] = if four_over_six {
            &[E2M1_MAX, 4.0]
        } else {
            &[E2M1_MAX]
        };
        // (squared error, scale code, codes, values) of the best target.
        let mut best: Option<(f64, u8, [u8; 16], [f32; 16])> = None;
        for &target in targets {
            let code = f32_to_e4m3(global * gmax / target);
            let eff = e4m3_to_f32(code) / global;
            let mut codes = [0u8; 16];
            let mut values = [0f32; 16];
            let mut error = 0f64;
            for (i, &x) in group.iter().enumerate() {
                codes[i] = if eff > 0.0 { f32_to_e2m1(x / eff) } else { 0 };
                values[i] = e2m1_to_f32(codes[i]) * eff;
                error += f64::from(x - values[i]).powi(2);
            }
            if best.as_ref().is_none_or(|b| error < b.0) {
                best = Some((error, code, codes, values));
            }
        }
        let (_, code, codes, values) = best.expect("at least one target");
        *group_scale = code;
        for (i, pair) in codes.chunks_exact(2).enumerate() {
            packed[i] = pair[0] | (pair[1] << 4);
        }
        dq.copy_from_slice(&values);
    });
    let stored = vec![
        (
            format!("{name}.weight_packed"),
            Dtype::U8,
            vec![rows, cols / 2],
            packed,
        ),
        (
            format!("{name}.weight_scale"),
            Dtype::F8_E4M3,
            vec![rows, cols / 16],
            group_scales,
        ),
        (
            format!("{name}.weight_global_scale"),
            Dtype::F32,
            vec![1],
            f32_bytes(&[global]),
        ),
    ];
    (stored, dq)
}

fn relative_rms(w: &[f32], dq: &[f32]) -> f64 {
    let num: f64 = w
        .iter()
        .zip(dq)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let den: f64 = w.iter().map(|a| f64::from(*a).powi(2)).sum();
    if den == 0.0 { 0.0 } else { (num / den).sqrt() }
}

/// compressed-tensors' description of a format.
fn scheme(format: Format) -> (Value, &'static str) {
    match format {
        Format::Fp8Channel => (
            json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false}),
            "float-quantized",
        ),
        Format::Fp8Block => (
            json!({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [FP8_BLOCK, FP8_BLOCK], "symmetric": true, "dynamic": false}),
            "float-quantized",
        ),
        Format::Nvfp4 { .. } => (
            json!({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": true, "dynamic": false}),
            "nvfp4-pack-quantized",
        ),
    }
}

/// compressed-tensors' description of the static activation quantization a calibrated `format`
/// carries scales for (its `FP8` and `NVFP4` presets).
fn input_scheme(format: Format) -> Value {
    match format {
        Format::Fp8Channel => {
            json!({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": true, "dynamic": false, "observer": "static_minmax"})
        }
        Format::Nvfp4 { .. } => {
            json!({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": true, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn", "observer": "static_minmax"})
        }
        Format::Fp8Block => Value::Null,
    }
}

fn quantization_config(plan: Plan, calibrated: bool, kept: &[String]) -> Value {
    let group = |targets: Value, format: Format| {
        let (weights, name) = scheme(format);
        let inputs = if plan == Plan::Fp8Dynamic {
            json!({"num_bits": 8, "type": "float", "strategy": "token", "symmetric": true, "dynamic": true})
        } else if calibrated {
            input_scheme(format)
        } else {
            Value::Null
        };
        json!({"targets": targets, "weights": weights, "input_activations": inputs, "output_activations": null, "format": name})
    };
    let (groups, format) = match plan {
        Plan::Mixed => (
            json!({
                "group_0": group(json!(["re:.*self_attn\\.(q|k|v|o)_proj$"]), plan.format(true)),
                "group_1": group(
                    json!([
                        "re:.*mlp\\..*(gate|up|down)_proj$",
                        "re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"
                    ]),
                    plan.format(false)
                ),
            }),
            "mixed-precision",
        ),
        _ => {
            let f = plan.format(true);
            (json!({"group_0": group(json!(["Linear"]), f)}), scheme(f).1)
        }
    };
    json!({
        "quant_method": "compressed-tensors",
        "format": format,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": std::iter::once("lm_head").chain(kept.iter().map(String::as_str)).collect::<Vec<_>>(),
        "kv_cache_scheme": null,
        "producer": format!("strata {}", env!("CARGO_PKG_VERSION")),
    })
}

/// Files beside the weights that travel with them.
const COPIED: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Quantizes the checkpoint directory `input` by `plan` into `out` (created), reporting each
/// Linear as it is done; returns every report. With `calibration` (measured on this same
/// checkpoint) the files also carry static activation scales.
pub fn quantize(
    input: &Path,
    out: &Path,
    plan: Plan,
    calibration: Option<&Calibration>,
    mut report: impl FnMut(&TensorReport),
) -> Result<Vec<TensorReport>, QuantizeError> {
    refuse_calibration(plan, calibration)?;
    let io = |path: &Path, e: &dyn std::fmt::Display| QuantizeError::Io {
        path: path.to_path_buf(),
        problem: e.to_string(),
    };
    let config = ModelConfig::from_dir(input)?;
    if config.moe.is_some() && calibration.is_some() {
        return Err(QuantizeError::Unsupported(format!(
            "{}: calibrating a mixture of experts ({}) is not supported yet: quantize it without \
             --calibrate (weights only)",
            input.display(),
            config.architecture
        )));
    }
    let gguf = crate::gguf::is_gguf_file(input);
    let raw: Value = if gguf {
        hf_config(&config)?
    } else {
        std::fs::read_to_string(input.join("config.json"))
            .map_err(|e| io(&input.join("config.json"), &e))
            .and_then(|t| {
                serde_json::from_str(&t).map_err(|e| io(&input.join("config.json"), &e))
            })?
    };
    if raw.get("quantization_config").is_some() {
        return Err(QuantizeError::Unsupported(format!(
            "{}: the checkpoint is already quantized",
            input.display()
        )));
    }
    let ckpt = Checkpoint::open(input)?;
    ckpt.validate(&config)?;
    let linears = linears(&config);
    let mut stored: Vec<Stored> = Vec::new();
    let mut reports = Vec::new();
    for spec in expected_tensors(&config) {
        let t = ckpt.get(&spec.name)?;
        let values: Vec<f32> = t
            .bytes
            .chunks_exact(t.dtype.size())
            .map(|b| t.dtype.widen(b))
            .collect();
        let Some(&(layer, input)) = linears.get(&spec.name) else {
            let shift = norm_shift(&config, gguf, &spec.name);
            let bf16: Vec<u8> = values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v + shift).to_le_bytes())
                .collect();
            stored.push((spec.name.clone(), Dtype::BF16, spec.shape.clone(), bf16));
            continue;
        };
        let (parts, r) = quantize_linear(
            &spec.name,
            &spec.shape,
            &values,
            (layer, input),
            plan,
            calibration,
        )?;
        report(&r);
        reports.push(r);
        stored.extend(parts);
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, &e))?;
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(*d, s.clone(), b).map_err(|e| io(out, &e))?,
            ))
        })
        .collect::<Result<_, QuantizeError>>()?;
    let weights = out.join(crate::weights::SINGLE_FILE);
    safetensors::serialize_to_file(views, None, &weights).map_err(|e| io(&weights, &e))?;
    let mut config_json = raw;
    config_json["quantization_config"] =
        quantization_config(plan, calibration.is_some(), &routers(&config));
    config_json["torch_dtype"] = json!("bfloat16");
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config_json).map_err(|e| io(&path, &e))?;
    std::fs::write(&path, text + "\n").map_err(|e| io(&path, &e))?;
    if gguf {
        for (file, json) in gguf_tokenizer_files(input, &config)? {
            let path = out.join(file);
            let text = serde_json::to_string_pretty(&json).map_err(|e| io(&path, &e))?;
            std::fs::write(&path, text + "\n").map_err(|e| io(&path, &e))?;
        }
    }
    for file in COPIED.iter().filter(|_| !gguf) {
        let from = input.join(file);
        if from.is_file() {
            std::fs::copy(&from, out.join(file)).map_err(|e| io(&from, &e))?;
        }
    }
    Ok(reports)
}

/// Every Linear a plan quantizes, by tensor name: its layer and the input it reads. A mixture's
/// experts (and its shared expert) are Linears like a dense MLP's; its router and the shared
/// expert's gate stay bf16 (as every MoE quantizer leaves them: they pick the experts).
fn linears(config: &ModelConfig) -> std::collections::HashMap<String, (usize, LinearInput)> {
    let mut linears = std::collections::HashMap::new();
    for i in 0..config.num_layers {
        let layer = LayerSpec::new(config, i);
        let attention = [
            (&layer.q, "q"),
            (&layer.k, "k"),
            (&layer.v, "v"),
            (&layer.o, "o"),
        ];
        let mut add = |t: &TensorSpec, role: &str| {
            let input = LinearInput::of(role).expect("a projection role");
            linears.insert(t.name.clone(), (i, input));
        };
        for (t, role) in attention {
            add(t, role);
        }
        let mlps: Vec<&GatedMlp> = match &layer.mlp {
            MlpSpec::Dense(mlp) => vec![mlp],
            MlpSpec::Sparse(moe) => moe
                .experts
                .iter()
                .chain(moe.shared.iter().map(|s| &s.0))
                .collect(),
        };
        for mlp in mlps {
            for (t, role) in [(&mlp.gate, "gate"), (&mlp.up, "up"), (&mlp.down, "down")] {
                add(t, role);
            }
        }
    }
    linears
}

/// The modules of a mixture that stay bf16: every sparse layer's router and shared-expert gate.
fn routers(config: &ModelConfig) -> Vec<String> {
    (0..config.num_layers)
        .filter_map(|i| match LayerSpec::new(config, i).mlp {
            MlpSpec::Sparse(moe) => Some(moe),
            MlpSpec::Dense(_) => None,
        })
        .flat_map(|moe| {
            std::iter::once(moe.router)
                .chain(moe.shared.map(|s| s.1))
                .map(|t| t.name.trim_end_matches(".weight").to_string())
        })
        .collect()
}

/// The plans whose activation scales are computed at run time take no calibration.
fn refuse_calibration(plan: Plan, calibration: Option<&Calibration>) -> Result<(), QuantizeError> {
    if calibration.is_some() && plan == Plan::Fp8Block {
        return Err(QuantizeError::Unsupported(
            "fp8-block takes no calibration: engines quantize its activations per token group \
             of 128 at run time"
                .into(),
        ));
    }
    if calibration.is_some() && plan == Plan::Fp8Dynamic {
        return Err(QuantizeError::Unsupported(
            "fp8-dynamic takes no calibration: its activation scales are computed per token at \
             run time"
                .into(),
        ));
    }
    Ok(())
}

/// One Linear of `plan`'s format: its stored parts (with a static input scale when calibrated)
/// and its report.
fn quantize_linear(
    name: &str,
    shape: &[usize],
    values: &[f32],
    (layer, input): (usize, LinearInput),
    plan: Plan,
    calibration: Option<&Calibration>,
) -> Result<(Vec<Stored>, TensorReport), QuantizeError> {
    let (rows, cols) = (shape[0], shape[1]);
    let base = name.strip_suffix(".weight").unwrap_or(name);
    let attention = matches!(input, LinearInput::Attention | LinearInput::Output);
    let format = plan.format(attention);
    if matches!(format, Format::Nvfp4 { .. }) && cols % 16 != 0 {
        return Err(QuantizeError::Unsupported(format!(
            "{name}: {cols} columns are not a whole number of NVFP4's 16-value groups"
        )));
    }
    let (mut parts, dq) = match format {
        Format::Fp8Channel => fp8(base, values, rows, cols, None),
        Format::Fp8Block => fp8(base, values, rows, cols, Some(FP8_BLOCK)),
        Format::Nvfp4 { four_over_six } => nvfp4(base, values, rows, cols, four_over_six),
    };
    let input_amax = match calibration {
        Some(c) => {
            let amax = c.amax(layer, input).ok_or_else(|| {
                QuantizeError::Unsupported(format!(
                    "{name}: the calibration saw no input of this projection"
                ))
            })?;
            let (suffix, scale) = match format {
                Format::Nvfp4 { .. } => ("input_global_scale", nvfp4_input_global_scale(amax)),
                _ => ("input_scale", fp8_input_scale(amax)),
            };
            parts.push((
                format!("{base}.{suffix}"),
                Dtype::F32,
                vec![1],
                f32_bytes(&[scale]),
            ));
            Some(amax)
        }
        None => None,
    };
    let r = TensorReport {
        name: name.to_string(),
        format: match format {
            Format::Fp8Channel => "fp8 (channel)",
            Format::Fp8Block => "fp8 (128x128 block)",
            Format::Nvfp4 {
                four_over_six: false,
            } => "nvfp4",
            Format::Nvfp4 {
                four_over_six: true,
            } => "nvfp4 (4o6)",
        },
        relative_rms_error: relative_rms(values, &dq),
        input_amax,
    };
    Ok((parts, r))
}

/// A Hugging Face `config.json` for a GGUF file's model (the Llama and Qwen families, and
/// Gemma 3, without rope scaling; others are refused by name).
fn hf_config(c: &ModelConfig) -> Result<Value, QuantizeError> {
    use crate::config::Architecture;
    let class = match c.architecture {
        Architecture::Llama => "LlamaForCausalLM",
        Architecture::Qwen2 => "Qwen2ForCausalLM",
        Architecture::Qwen3 => "Qwen3ForCausalLM",
        Architecture::Gemma3 => "Gemma3ForCausalLM",
        other => {
            return Err(QuantizeError::Unsupported(format!(
                "quantizing a GGUF {} model is not supported (Llama, Qwen2, Qwen3 and Gemma 3 \
                 are); give its Hugging Face directory",
                other.model_type()
            )));
        }
    };
    // Gemma 3's window is its own (its sliding layers'); another family's is Mistral's.
    let window = c.sliding_window.is_some() && c.gemma3.is_none();
    if c.rope_scaling.is_some() || window || c.o_bias {
        return Err(QuantizeError::Unsupported(
            "quantizing a GGUF model with rope scaling, a sliding window or an output bias is not \
             supported; give its Hugging Face directory"
                .into(),
        ));
    }
    let mut config = json!({
        "architectures": [class],
        "model_type": c.architecture.model_type(),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.qkv_bias,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids,
    });
    if let Some(g) = &c.gemma3 {
        let layer_types: Vec<&str> = g
            .sliding_layers
            .iter()
            .map(|&s| {
                if s {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        let extra = json!({
            "hidden_activation": "gelu_pytorch_tanh",
            // An integer where it is one (transformers 5 requires it so).
            "query_pre_attn_scalar": if g.query_pre_attn_scalar.fract() == 0.0 {
                json!(g.query_pre_attn_scalar as u64)
            } else {
                json!(g.query_pre_attn_scalar)
            },
            "rope_local_base_freq": g.rope_local_theta,
            "sliding_window": c.sliding_window,
            "layer_types": layer_types,
            "attn_logit_softcapping": null,
            "final_logit_softcapping": null,
        });
        config
            .as_object_mut()
            .expect("an object")
            .extend(extra.as_object().expect("an object").clone());
        config["hidden_act"] = json!("gelu_pytorch_tanh");
    }
    Ok(config)
}

/// What to add to a norm weight `name` read from `input` for the output's convention: a GGUF
/// Gemma 3 stores `1 + w` (llama.cpp's converter added the one), a Hugging Face checkpoint `w`.
fn norm_shift(config: &ModelConfig, gguf: bool, name: &str) -> f32 {
    match &config.gemma3 {
        Some(g) if gguf && name.ends_with("norm.weight") => g.norm_offset - 1.0,
        _ => 0.0,
    }
}

/// `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` for a GGUF file's
/// tokenizer, chat template and end tokens.
fn gguf_tokenizer_files(
    path: &Path,
    c: &ModelConfig,
) -> Result<Vec<(&'static str, Value)>, QuantizeError> {
    let bad = |problem: String| QuantizeError::Io {
        path: path.to_path_buf(),
        problem,
    };
    let file = crate::gguf::GgufFile::open(path).map_err(|e| bad(e.problem()))?;
    let built = crate::gguf::tokenizer(file.header()).map_err(|e| bad(e.to_string()))?;
    let template = file.header().get_str("tokenizer.chat_template");
    let generation = crate::config::GenerationConfig::from_dir(path)?;
    Ok(vec![
        ("tokenizer.json", built.json),
        (
            "tokenizer_config.json",
            json!({
                "bos_token": built.bos_token,
                "eos_token": built.eos_token,
                "add_bos_token": built.add_bos_token,
                "chat_template": template,
                "model_max_length": c.max_position_embeddings,
            }),
        ),
        (
            "generation_config.json",
            json!({"bos_token_id": generation.bos_token_id, "eos_token_id": generation.eos_token_ids}),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_with_ties_to_even_and_saturates() {
        for code in 0u8..=0x7e {
            let v = e4m3_to_f32(code);
            assert_eq!(f32_to_e4m3(v), code, "{v}");
            assert_eq!(f32_to_e4m3(-v) & 0x7f, code);
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        // 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): the even code wins.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        // e2m1: 2.5 → 2 (code 4, even), 5 → 4 (code 6), 0.25 → 0, saturation at 6.
        assert_eq!(f32_to_e2m1(2.5), 4);
        assert_eq!(f32_to_e2m1(5.0), 6);
        assert_eq!(f32_to_e2m1(0.25), 0);
        assert_eq!(f32_to_e2m1(100.0), 7);
        assert_eq!(f32_to_e2m1(-3.0), 0x0d);
        for code in 0u8..16 {
            let v = e2m1_to_f32(code);
            if code != 8 {
                assert_eq!(f32_to_e2m1(v), code, "{v}");
            }
        }
    }

    #[test]
    fn four_over_six_never_reconstructs_worse_than_six() {
        let w: Vec<f32> = (0..64 * 64)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0).powi(3))
            .collect();
        let (_, six) = nvfp4("w", &w, 64, 64, false);
        let (_, best) = nvfp4("w", &w, 64, 64, true);
        for (g, (a, b)) in six.chunks(16).zip(best.chunks(16)).enumerate() {
            let err = |d: &[f32]| -> f64 {
                d.iter()
                    .zip(&w[g * 16..])
                    .map(|(x, y)| f64::from(x - y).powi(2))
                    .sum()
            };
            assert!(err(b) <= err(a), "group {g}");
        }
        assert!(
            relative_rms(&w, &best) < relative_rms(&w, &six),
            "4o6 must help on this tensor"
        );
        let (_, fp8_values) = fp8("w", &w, 64, 64, None);
        assert!(relative_rms(&w, &fp8_values) < relative_rms(&w, &best));
    }
}
