//! strata-node: the engine runtime every backend plugs into — the step interface, paged KV with a
//! tiered prefix cache and its event stream, the continuous-batching scheduler, and the in-process
//! [`Engine`] handle.

pub mod backend;
mod engine;
#[cfg(test)]
mod gates;
pub mod kv;
pub mod rpc;
pub mod scheduler;

pub use engine::{
    Admission, Engine, EngineConfig, RATE_SAMPLE_TOKENS, RequestStream, SubmitError, average_rate,
};
