//! The node RPC's messages, as JSON frames (`strata_quic::frame`).

use serde::{Deserialize, Serialize};
use strata_model::grammar::GrammarError;
use strata_protocol::{GenerateRequest, TokenEvent};

use crate::SubmitError;
use crate::kv::KvEvent;

/// The application protocol of the node service.
pub const ALPN: &[u8] = b"strata-node/1";

/// A call on one stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum NodeRequest {
    Generate(Box<GenerateRequest>),
    Load,
    KvDump,
    KvEvents,
    Info,
}

/// What a `Generate` call streams back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum GenerateFrame {
    /// The engine took the request under this id.
    Accepted {
        id: u64,
    },
    /// The engine refused it at submission.
    Refused(Refusal),
    Event(TokenEvent),
}

/// Why a node refused a request, in a shape a router can turn into its surface's error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub kind: RefusalKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// The prompt does not fit the context window.
    ContextWindow,
    /// The prompt is empty, holds unknown token ids, or needs more KV than the node has.
    Prompt,
    /// Sampling parameters out of range.
    Sampling,
    /// The output constraint does not compile, or the node cannot constrain output.
    Grammar,
    /// The node is stopping, or the call itself was malformed.
    Unavailable,
    /// A fault inside the node.
    Internal,
}

impl From<&SubmitError> for Refusal {
    fn from(e: &SubmitError) -> Self {
        let kind = match e {
            SubmitError::ContextWindow { .. } => RefusalKind::ContextWindow,
            SubmitError::EmptyPrompt
            | SubmitError::ResumeSpent { .. }
            | SubmitError::KvCapacity { .. }
            | SubmitError::TokenOutOfRange { .. } => RefusalKind::Prompt,
            SubmitError::Sampling(_) => RefusalKind::Sampling,
            SubmitError::Grammar(GrammarError::Matcher(_)) => RefusalKind::Internal,
            SubmitError::Grammar(_) | SubmitError::GrammarUnavailable => RefusalKind::Grammar,
            SubmitError::Stopped => RefusalKind::Unavailable,
            SubmitError::Remote(r) => r.kind,
        };
        Self {
            kind,
            message: e.to_string(),
        }
    }
}

/// One item of a `KvEvents` subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum KvFeed {
    Event(KvEvent),
    /// This many events were dropped because the subscriber fell behind: take a dump.
    Lagged {
        missed: u64,
    },
}

/// What a node serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The model's architecture (`model_type`).
    pub model_type: String,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub block_size: usize,
    pub capacity_blocks: usize,
    /// Tensor-parallel ranks behind this node.
    pub tp: usize,
}
