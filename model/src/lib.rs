//! strata-model: everything about a model that needs no accelerator and no async runtime.
//!
//! - [`config`]: architectures from HF `config.json` (+ `generation_config.json`), validated.
//! - [`weights`]: safetensors checkpoints through mmap, single file or sharded, every tensor checked
//!   against the architecture's layout.
//! - [`gguf`]: GGUF files (metadata, tensor table, tensor bytes) and CPU dequantizers for the ggml
//!   block types; not yet part of model loading.
//! - [`tokenizer`] and [`chat`]: the `tokenizers` crate and the model's own Jinja chat template.
//! - [`sampler`], [`stop`] and [`text_stream`]: logits into tokens, tokens into text, and when to stop.
//! - [`cpu`]: the reference forward pass (f32, deterministic, batch-invariant) — the oracle every
//!   fast path is measured against.
//! - [`synth`] and [`inspect`]: synthesized checkpoints for tests and a checkpoint summary.

pub mod chat;
pub mod config;
pub mod cpu;
pub mod gguf;
pub mod grammar;

pub mod inspect;
pub mod packaged;
pub mod quantize;
pub mod rope;
pub mod sampler;
pub mod stop;
pub mod synth;
pub mod text_stream;
pub mod tokenizer;
pub mod weights;

pub use config::{
    Architecture, ConfigError, EmbeddingConfig, GenerationConfig, ModelConfig, RopeScaling,
    SamplingDefaults,
};
