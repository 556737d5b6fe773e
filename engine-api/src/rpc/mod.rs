//! The node RPC's messages and its client (DESIGN.md §2, §6): the engine behind QUIC with mutual
//! TLS, for routers; the service is strata-node's (`rpc::serve`).
//!
//! One call per bidirectional stream: the caller writes one [`NodeRequest`] frame; the node
//! answers with one frame, or a sequence of them:
//! - `Generate`: [`GenerateFrame::Accepted`] (or `Refused`, with the reason's kind), then the
//!   request's token events until `Finished` or `Failed`. The caller cancels by stopping the
//!   stream (or closing the connection); the node frees the request's blocks before its next step.
//! - `Load`: the engine's [`EngineLoad`](crate::load::EngineLoad).
//! - `KvDump`: every cached block and its tier as of an event number.
//! - `KvEvents`: the KV events from now on, numbered without gaps; a subscriber that fell behind
//!   receives [`KvFeed::Lagged`] and should take a dump.
//! - `Info`: what the node serves (model shape, block size, capacity, KV layout).
//! - `KvExport`: the bytes of the leading cached run of some blocks ([`KvExportHead`], then one
//!   rkyv [`KvBlockPayload`] frame per block). A `Generate` call may carry a [`KvFetch`]: the
//!   node imports those prompt blocks from the peer named before the request starts (nodes dial
//!   each other with their member certificates).
//!
//! The certificates come from the cluster CA (`strata cluster`); the RPC only uses them, so that
//! the node does not depend on the topology group.

mod client;
mod wire;

pub use client::{KvSubscription, NodeClient, NodeError, RemoteStream};
pub use wire::{
    ALPN, GenerateCall, GenerateFrame, KvBlockPayload, KvExportHead, KvFeed, KvFetch, NodeInfo,
    NodeRequest, PinReport, Refusal, RefusalKind,
};
