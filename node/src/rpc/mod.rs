//! The node RPC service (DESIGN.md §2, §6): the engine behind QUIC with mutual TLS, for routers.
//! The messages and the client are strata-engine-api's (`strata_engine_api::rpc`, re-exported
//! here); the protocol is described there.

mod server;

pub use server::{NodeService, PeerCheck, Peers, serve};
pub use strata_engine_api::rpc::{
    ALPN, GenerateCall, GenerateFrame, KvBlockPayload, KvExportHead, KvFeed, KvFetch,
    KvSubscription, NodeClient, NodeError, NodeInfo, NodeRequest, PinReport, Refusal, RefusalKind,
    RemoteStream,
};

/// Where a pinned prefix's blocks are, as the RPC reports it.
pub fn pin_report(s: crate::kv::PinStatus) -> PinReport {
    PinReport {
        name: s.name,
        blocks: s.blocks,
        device: s.device,
        host: s.host,
        disk: s.disk,
    }
}
