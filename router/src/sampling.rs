//! One resolution of a request's sampling settings for every surface: what the request names
//! wins over the checkpoint's defaults ([`GenerationConfig::sampling_defaults`]), an omitted
//! `max_tokens` runs to the room left in the context window, an omitted seed is fresh, and the
//! engine's own range checks apply. Each surface maps its field names in and its error shape out;
//! what only one surface has (OpenAI's penalties, logit bias, logprobs) it adds to the result.

use strata_model::GenerationConfig;
use strata_protocol::{SamplingParams, SamplingParamsError};

/// The settings every surface can name, by their canonical meaning; `None` takes the default.
#[derive(Debug, Clone, Default)]
pub struct Requested {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
}

/// `requested` over `defaults`, with `room` tokens left in the context window after the prompt
/// (the default `max_tokens`, at least 1); checked by [`SamplingParams::validate`].
pub fn resolve(
    defaults: &GenerationConfig,
    room: usize,
    requested: Requested,
) -> Result<SamplingParams, SamplingParamsError> {
    let d = defaults.sampling_defaults();
    let sampling = SamplingParams {
        temperature: requested.temperature.unwrap_or(d.temperature),
        top_p: requested.top_p.unwrap_or(d.top_p),
        top_k: requested.top_k.unwrap_or(d.top_k),
        min_p: requested.min_p.unwrap_or(d.min_p),
        repetition_penalty: requested.repetition_penalty.unwrap_or(d.repetition_penalty),
        seed: requested.seed.unwrap_or_else(fresh_seed),
        max_tokens: requested
            .max_tokens
            .unwrap_or_else(|| u32::try_from(room.max(1)).unwrap_or(u32::MAX)),
        stop: requested.stop,
        ..SamplingParams::default()
    };
    sampling.validate()?;
    Ok(sampling)
}

/// Without a `seed`, every request samples differently.
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_settings_win_over_the_checkpoint_and_the_rest_take_its_defaults() {
        let shipped = GenerationConfig {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20),
            ..GenerationConfig::default()
        };
        let s = resolve(&shipped, 100, Requested::default()).unwrap();
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.6, 0.9, 20));
        assert_eq!(s.max_tokens, 100, "the room left in the window");
        let s = resolve(
            &shipped,
            0,
            Requested {
                temperature: Some(1.0),
                seed: Some(7),
                ..Requested::default()
            },
        )
        .unwrap();
        assert_eq!((s.temperature, s.seed, s.max_tokens), (1.0, 7, 1));
        let greedy = GenerationConfig {
            do_sample: Some(false),
            ..shipped
        };
        assert_eq!(
            resolve(&greedy, 1, Requested::default())
                .unwrap()
                .temperature,
            0.0
        );
    }

    #[test]
    fn out_of_range_settings_name_their_field() {
        let e = resolve(
            &GenerationConfig::default(),
            1,
            Requested {
                top_p: Some(1.5),
                ..Requested::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.field, "top_p");
    }
}
