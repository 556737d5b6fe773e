//! strata's topology: the raft group (openraft) that keeps what every router and node must
//! agree on — members, health leases, model placement, the ownership ring and its epoch, API
//! keys and tenants, router registrations.
//!
//! - [`state`]: the replicated data and its deterministic `apply` (pure, no I/O).
//! - [`ring`]: the ownership ring (rendezvous hashing over virtual nodes) routers consult.
//! - [`store`]: the durable raft log and state machine on one redb file, with snapshots and
//!   log purge, refusing a corrupt file at open; and the feed of committed changes.
//! - [`election`]: when a member stands for election: after a pre-vote.
//! - [`lease_driver`]: proposes lease evaluations while its member leads.
//! - [`network`]: the in-process channel network used by tests.
//! - [`transport`]: the QUIC transport with mutual TLS, for raft and for clients.
//! - [`read`]: linearizable reads (read index).
//! - [`server`]: a member process: raft, endpoints, lease driver, graceful shutdown.

use std::io::Cursor;

pub mod election;
pub mod lease_driver;
pub mod network;
pub mod read;
pub mod ring;
pub mod server;
pub mod state;
pub mod store;
pub mod transport;

pub use state::NodeId;

openraft::declare_raft_types!(
    /// The openraft type configuration of the topology group.
    pub TypeConfig:
        D = state::Command,
        R = state::Outcome,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// A raft node of the topology group.
pub type Raft = openraft::Raft<TypeConfig>;
