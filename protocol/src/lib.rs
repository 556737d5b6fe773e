//! strata's canonical request vocabulary: what every surface (OpenAI, Anthropic, Converse, the CLI)
//! is translated into before it reaches an engine. Only what is used today lives here.

mod generate;
mod sampling;

pub use generate::{GenerateRequest, TokenEvent, Usage};
pub use sampling::{FinishReason, SamplingParams, SamplingParamsError};
