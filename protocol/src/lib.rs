//! strata's canonical request vocabulary: what every surface (OpenAI, Anthropic, Converse, the CLI)
//! is translated into before it reaches an engine. Only what is used today lives here.

mod generate;
mod sampling;

pub use generate::{
    Constraint, GenerateRequest, Pooling, Resume, TokenEvent, TokenLogprobs, Usage,
};
pub use sampling::{FinishReason, MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError};
