//! The reference backend's copy of the weights: every tensor widened to f32 once at load.
//!
//! f32 costs 2× the memory of a bf16 checkpoint but makes every later read a plain slice and
//! keeps the arithmetic exact with respect to the checkpoint (bf16/f16 → f32 is lossless).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::ModelConfig;
use crate::weights::{Checkpoint, EMBED, FINAL_NORM, LM_HEAD, LayerNames, WeightError};

pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub o: Vec<f32>,
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    pub o_bias: Option<Vec<f32>>,
    pub qk_norm: Option<[Vec<f32>; 2]>,
    pub post_attention_norm: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

pub struct CpuWeights {
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the LM head is tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl CpuWeights {
    /// Validates the checkpoint against `config`, then widens every tensor. Shows a progress bar
    /// when stderr is a terminal.
    pub fn load(config: &ModelConfig, ckpt: &Checkpoint) -> Result<Self, WeightError> {
        ckpt.validate(config)?;
        let bar = ProgressBar::with_draw_target(
            Some(config.num_layers as u64 + 2),
            ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} {msg}") {
            bar.set_style(style);
        }
        let (h, q, kv, inter, hd) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate_size,
            config.head_dim,
        );
        let get = |name: &str, shape: &[usize]| ckpt.get_shaped(name, shape).map(|t| t.to_f32());
        let embed = get(EMBED, &[config.vocab_size, h])?;
        bar.inc(1);
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let n = LayerNames::new(i);
            let qkv_bias = if config.qkv_bias {
                Some([get(&n.q_bias, &[q])?, get(&n.k_bias, &[kv])?, get(&n.v_bias, &[kv])?])
            } else {
                None
            };
            let qk_norm = if config.qk_norm {
                Some([get(&n.q_norm, &[hd])?, get(&n.k_norm, &[hd])?])
            } else {
                None
            };
            layers.push(LayerWeights {
                input_norm: get(&n.input_norm, &[h])?,
                q: get(&n.q, &[q, h])?,
                k: get(&n.k, &[kv, h])?,
                v: get(&n.v, &[kv, h])?,
                o: get(&n.o, &[h, q])?,
                qkv_bias,
                o_bias: if config.o_bias { Some(get(&n.o_bias, &[h])?) } else { None },
                qk_norm,
                post_attention_norm: get(&n.post_attention_norm, &[h])?,
                gate: get(&n.gate, &[inter, h])?,
                up: get(&n.up, &[inter, h])?,
                down: get(&n.down, &[h, inter])?,
            });
            bar.inc(1);
        }
        let final_norm = get(FINAL_NORM, &[h])?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(get(LM_HEAD, &[config.vocab_size, h])?)
        };
        bar.inc(1);
        bar.finish_and_clear();
        Ok(Self { embed, layers, final_norm, lm_head })
    }

    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}
