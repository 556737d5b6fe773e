//! The one seam between the surfaces and an engine (issue 37): [`EngineClient`] is what the HTTP
//! surfaces ask of an engine running in this process (strata-node's `Engine` implements it), and
//! [`StartEngine`] is how a server starts one from a checkpoint (strata-node's `EngineSpec`
//! implements it), so the router crate links no engine, kernels or CUDA.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use strata_model::chat::ChatTemplate;
use strata_model::tokenizer::Tokenizer;
use strata_model::{EmbeddingConfig, GenerationConfig, ModelConfig};
use strata_protocol::GenerateRequest;

use crate::kv::{BlockHash, KvDump};
use crate::load::{EngineLoad, StepTimes};
use crate::rpc::PinReport;
use crate::submit::{RequestStream, SubmitError};

/// The pieces of a checkpoint the front door keeps once the engine owns the weights.
pub struct ServingParts {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// How `/v1/embeddings` pools and scales (the checkpoint's sentence-transformers files).
    pub embedding: EmbeddingConfig,
}

/// An answer that comes later: the engine thread's at its next loop turn (at most one step),
/// or the nodes' over the network. Never blocks the task that awaits it.
pub type Reply<T> = Pin<Box<dyn Future<Output = Result<T, SubmitError>> + Send>>;

/// Where requests run, as the surfaces use it: an engine in this process (strata-node's
/// `Engine`), or the nodes behind a router (strata-router's cluster client). The calls that
/// answer at once are plain; those that wait for the engine thread or the nodes return a
/// [`Reply`].
pub trait EngineClient: Send + Sync {
    fn model_config(&self) -> &ModelConfig;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Validates and starts `request`; its events arrive on the stream. Within the runtime.
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError>;
    fn cancel(&self, id: u64) -> Result<(), SubmitError>;
    /// Whether a request could be sent now: an engine in this process while it runs; a
    /// router while some node is reachable.
    fn available(&self) -> bool;
    /// Requests queued and running, KV blocks by tier, rates, speculation's counters: this
    /// process's engine (named by an empty string), or each node's last report by address.
    fn loads(&self) -> Vec<(String, EngineLoad)>;
    /// Where the engine thread's steps spent their time; `None` behind a router (each node
    /// has its own).
    fn step_times(&self) -> Option<StepTimes>;
    /// Every cached block and its tier, as of an event number; `None` behind a router (each
    /// node has its own cache).
    fn kv_dump(&self) -> Reply<Option<KvDump>>;
    /// Pins the leading cached run of `hashes` under `name` for `ttl` (a primed context),
    /// wherever the prompt ran: one report, or why the tiers cannot hold it.
    fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        ttl: Duration,
    ) -> Reply<Result<PinReport, String>>;
    /// [`EngineClient::pin`] without waiting (a refusal is dropped).
    fn pin_detached(&self, name: String, hashes: Vec<BlockHash>, ttl: Duration);
    /// Drops the pin `name` everywhere; whether one held it.
    fn unpin(&self, name: String) -> Reply<bool>;
    /// Every pin and where its blocks are, one report per name.
    fn pins(&self) -> Reply<Vec<PinReport>>;
    /// Writes every cached block to the disk tier, for an engine about to stop; how many
    /// (`None` behind a router: the nodes park their own).
    fn park_on_disk(&self) -> Reply<Option<usize>>;
}

/// Reports of one name from several places as one: the blocks of the best-placed, and where
/// they all are.
pub fn summed_pins(reports: Vec<PinReport>) -> Vec<PinReport> {
    let mut by_name: Vec<PinReport> = Vec::new();
    for report in reports {
        match by_name.iter_mut().find(|r| r.name == report.name) {
            Some(sum) => {
                sum.blocks = sum.blocks.max(report.blocks);
                sum.device += report.device;
                sum.host += report.host;
                sum.disk += report.disk;
            }
            None => by_name.push(report),
        }
    }
    by_name
}

/// Why an engine did not start: the starter's own error, shown as it words it.
pub type StartError = Box<dyn std::error::Error + Send + Sync>;

/// How a server starts its engine on a checkpoint directory: the engine and the front door's
/// pieces of the checkpoint.
pub trait StartEngine: std::fmt::Debug + Send + Sync {
    fn start(&self, dir: &Path) -> Result<(Arc<dyn EngineClient>, ServingParts), StartError>;
}
