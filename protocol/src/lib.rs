//! strata's canonical request vocabulary: what every surface (OpenAI, Anthropic, Converse, the CLI)
//! is translated into before it reaches an engine. Only what is used today lives here.

mod sampling;

pub use sampling::{FinishReason, SamplingParams, SamplingParamsError};
