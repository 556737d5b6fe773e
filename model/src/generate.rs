//! One sequence, start to finish, on the CPU reference: prefill, sample, decode, detokenize
//! incrementally, stop. `strata generate` uses it; the engine runtime will replace it for serving.

use std::time::{Duration, Instant};

use strata_protocol::{FinishReason, SamplingParams};

use crate::cpu::{CpuModel, ForwardError, KvCache, LogitRows};
use crate::sampler::{Sampled, Sampler, SamplerError};
use crate::stop::{StopStrings, is_stop_token};
use crate::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// What a finished generation produced, with its timings.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<Sampled>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    /// Decode throughput: tokens after the first over the time spent producing them.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if n == 0 || self.decode_time.is_zero() {
            return 0.0;
        }
        n as f64 / self.decode_time.as_secs_f64()
    }
}

/// Generates from `prompt` (token ids, already templated) until a stop token, a stop string,
/// `max_tokens` or the context window. `on_text` receives the text as it becomes final.
pub fn generate(
    model: &CpuModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    eos_ids: &[u32],
    mut on_text: impl FnMut(&str),
) -> Result<Generation, GenerateError> {
    let vocab = model.config().vocab_size;
    let window = model.config().max_position_embeddings;
    let mut sampler = Sampler::new(params, vocab)?;
    sampler.observe_prompt(prompt);
    let mut decoder = IncrementalDecoder::with_context(true, prompt);
    let mut stops = StopStrings::new(&params.stop);
    let mut cache: KvCache = model.new_cache();
    let mut text = String::new();
    let mut tokens = Vec::new();

    let start = Instant::now();
    let mut logits = model.forward(prompt, &mut cache, LogitRows::Last)?;
    let prefill_time = start.elapsed();
    let decode_start = Instant::now();
    let finish = loop {
        if tokens.len() >= params.max_tokens as usize {
            break FinishReason::Length;
        }
        let sampled = sampler.sample(&mut logits)?;
        if is_stop_token(sampled.token, params, eos_ids) {
            break FinishReason::Stop;
        }
        tokens.push(sampled);
        let piece = decoder.push(tokenizer, sampled.token)?;
        let outcome = stops.push(&piece);
        text.push_str(outcome.emit);
        on_text(outcome.emit);
        if outcome.stopped {
            break FinishReason::Stop;
        }
        if cache.len() >= window {
            break FinishReason::Length;
        }
        logits = model.forward(&[sampled.token], &mut cache, LogitRows::Last)?;
    };
    if !stops.is_stopped() {
        let tail = decoder.finish(tokenizer)?;
        let outcome = stops.push(&tail);
        let mut rest = outcome.emit.to_string();
        if !outcome.stopped {
            rest.push_str(&stops.finish());
        }
        text.push_str(&rest);
        on_text(&rest);
    }
    Ok(Generation {
        text,
        tokens,
        finish,
        prompt_tokens: prompt.len(),
        prefill_time,
        decode_time: decode_start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;
    use crate::synth::{SynthSpec, synthesize};

    fn fixture() -> (tempfile::TempDir, CpuModel, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let spec = SynthSpec {
            max_position: 64,
            ..SynthSpec::tiny(Architecture::Llama, 9)
        };
        synthesize(&spec, dir.path(), None).unwrap();
        let model = CpuModel::load(dir.path()).unwrap();
        let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, model, tokenizer)
    }

    #[test]
    fn stop_string_spanning_tokens_ends_the_text_before_it() {
        let (_dir, model, tok) = fixture();
        let prompt = tok.encode("stop here", true).unwrap();
        let params = SamplingParams {
            max_tokens: 24,
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        let mut streamed = String::new();
        let free = generate(&model, &tok, &prompt, &params, &[], |t| {
            streamed.push_str(t)
        })
        .unwrap();
        assert_eq!(streamed, free.text);
        assert_eq!(free.finish, FinishReason::Length);
        assert_eq!(free.tokens.len(), 24);
        // Every synthesized token is one byte, so a 3-char stop string spans at least 3 tokens.
        let chars: Vec<char> = free.text.chars().collect();
        let stop: String = chars[4..7].iter().collect();
        let cut = free.text.find(&stop).unwrap();
        let params = SamplingParams {
            stop: vec![stop],
            ..params
        };
        let stopped = generate(&model, &tok, &prompt, &params, &[], |_| {}).unwrap();
        assert_eq!(stopped.finish, FinishReason::Stop);
        assert_eq!(stopped.text, free.text[..cut]);
    }

    #[test]
    fn context_window_ends_generation_with_length() {
        let (_dir, model, tok) = fixture();
        let prompt = vec![256; 60];
        let params = SamplingParams {
            max_tokens: 100,
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        let g = generate(&model, &tok, &prompt, &params, &[], |_| {}).unwrap();
        assert_eq!(g.finish, FinishReason::Length);
        assert_eq!(
            g.tokens.len(),
            5,
            "60 prompt + 4 cached generated + 1 sampled = window of 64"
        );
        let too_long = vec![256; 65];
        let err = generate(&model, &tok, &too_long, &params, &[], |_| {}).unwrap_err();
        assert!(err.to_string().contains("context window of 64"), "{err}");
    }
}
