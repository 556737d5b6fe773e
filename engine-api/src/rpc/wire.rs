//! The node RPC's messages, as JSON frames (`strata_quic::frame`), except the KV block payloads
//! of an export, which are rkyv archives ([`KvBlockPayload`]).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use strata_model::grammar::GrammarError;
use strata_protocol::{GenerateRequest, TokenEvent};

use crate::kv::{BlockHash, KvEvent, KvLayout};
use crate::submit::SubmitError;

/// The application protocol of the node service.
pub const ALPN: &[u8] = b"strata-node/1";

/// A call on one stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum NodeRequest {
    Generate(Box<GenerateCall>),
    Load,
    KvDump,
    KvEvents,
    Info,
    /// The bytes of the leading cached run of these blocks: a [`KvExportHead`] frame, then one
    /// [`KvBlockPayload`] frame per block.
    KvExport {
        hashes: Vec<BlockHash>,
    },
    /// Pins the leading cached run of `hashes` under `name` for `ttl_ms` (a primed context);
    /// answered by a `Result<PinReport, String>` frame.
    Pin {
        name: String,
        hashes: Vec<BlockHash>,
        ttl_ms: u64,
    },
    /// Drops the pin `name`; answered by a `bool` frame (whether there was one).
    Unpin {
        name: String,
    },
    /// Every pin; answered by a `Vec<PinReport>` frame.
    Pins,
}

/// Where a pinned prefix's blocks are on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinReport {
    pub name: String,
    pub blocks: usize,
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

/// A request to run, and where to fetch part of its prefix's KV from first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateCall {
    pub request: GenerateRequest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetch: Option<KvFetch>,
}

/// Blocks `from..to` of a request's prompt (full blocks, counted from the first) are cached on
/// the node at `peer`: the node running the request imports them from there before the request
/// starts, when it can, instead of computing them. A fetch that fails or takes too long costs
/// only the time: the request computes what it lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvFetch {
    pub peer: SocketAddr,
    pub from: u32,
    pub to: u32,
}

/// The answer to `KvExport` before its payloads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvExportHead {
    /// The exporter's layout: the importer takes the blocks only if its own is equal.
    pub layout: KvLayout,
    /// Payload frames that follow: the leading run of the asked blocks the exporter holds.
    pub blocks: u32,
}

/// One block's KV bytes, as an rkyv archive (the hot payload of a cross-node fetch: the bytes
/// are read in place, not parsed).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KvBlockPayload {
    /// The block's hash, little-endian.
    pub hash: [u8; 16],
    pub bytes: Vec<u8>,
}

impl KvBlockPayload {
    pub fn encode(hash: BlockHash, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
        let payload = KvBlockPayload {
            hash: hash.0.to_le_bytes(),
            bytes,
        };
        rkyv::to_bytes::<rkyv::rancor::Error>(&payload)
            .map(|b| b.into_vec())
            .map_err(|e| e.to_string())
    }

    /// The block in an archive, validated.
    pub fn decode(frame: &[u8]) -> Result<(BlockHash, Vec<u8>), String> {
        // Archives are read in place from aligned memory.
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(frame.len());
        aligned.extend_from_slice(frame);
        let archived = rkyv::access::<ArchivedKvBlockPayload, rkyv::rancor::Error>(&aligned)
            .map_err(|e| e.to_string())?;
        Ok((
            BlockHash(u128::from_le_bytes(archived.hash)),
            archived.bytes.as_slice().to_vec(),
        ))
    }
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
    /// The node holds as many generate calls as its admission limit allows (running and
    /// waiting): another node, or this one a little later, may take the request.
    Busy,
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
            SubmitError::Sampling(_)
            | SubmitError::NoEmbeddings
            | SubmitError::EmbedWithGeneration => RefusalKind::Sampling,
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
    /// How its KV blocks are laid out: nodes exchange blocks only with equal layouts.
    pub kv_layout: KvLayout,
}
