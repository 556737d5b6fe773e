//! strata-node: the engine runtime every backend plugs into — the step interface, paged KV with a
//! tiered prefix cache and its event stream, the continuous-batching scheduler, and the in-process
//! [`Engine`] handle, built from one [`EngineSpec`] by [`launch::start_engine`].

pub mod backend;
mod engine;
pub mod eval;
#[cfg(test)]
mod gates;
pub mod kv;
pub mod launch;
pub mod rpc;
pub mod scheduler;
pub mod spec;
pub mod speculative;

pub use engine::{
    Admission, Engine, EngineConfig, RATE_SAMPLE_TOKENS, RequestStream, SubmitError, average_rate,
};
pub use launch::{
    BuiltBackend, CudaPlacement, LoadedModel, ModelLoadError, ServingParts, build_backend, eos_ids,
    front_door_parts, grammar_compiler, start_cuda_engine, start_engine,
};
pub use spec::{Device, DiskTierSpec, EngineSpec, KvBudget, KvTiers};
