//! Paged KV bookkeeping: chained block hashes, the prefix cache with its device → host → disk
//! tiers, and the numbered KV events a router follows.
//!
//! Nothing here touches KV bytes directly except through [`KvBlockIo`], so every backend (CPU,
//! CUDA) shares one block manager and tests drive it with an in-memory fake.

pub mod block_manager;
pub mod events;
mod read_ahead;
pub mod tiers;
pub mod types;

use std::path::PathBuf;

pub use block_manager::{
    BlockManager, BlockManagerConfig, CommitOutcome, PinStatus, PrefixLookup, RestorePolicy,
    TierTraffic,
};
pub use events::{KvDump, KvEvent, KvEventKind, KvEventLog, KvReplica, ReplicaError};
pub use strata_engine_api::kv::{block_hash, prompt_block_hashes};
pub use tiers::{DiskTier, HostMemory, HostTier};
pub use types::{
    BlockHash, BlockHashHasher, BlockHashMap, BlockId, CacheSalt, KvBlockIo, KvLayout, Tier,
};

/// Errors of the KV block manager and its tiers.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: needed {needed}, only {free} obtainable (free or evictable)")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("KV disk tier I/O failed on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("KV disk block {} holds {actual} bytes, expected {expected}", path.display())]
    ShortBlock {
        path: PathBuf,
        expected: usize,
        actual: u64,
    },
    #[error("KV disk block {} does not match its checksum", path.display())]
    Corrupt { path: PathBuf },
    #[error("KV block {id} does not exist (the device pool has {blocks} blocks)")]
    NoSuchBlock { id: BlockId, blocks: usize },
    #[error("KV block {id} released while not referenced (refcount 0)")]
    NotReferenced { id: BlockId },
    #[error("KV block {id} cannot be committed: {reason}")]
    BadCommit { id: BlockId, reason: &'static str },
    #[error("copying KV block {id} failed: {detail}")]
    Copy { id: BlockId, detail: String },
    #[error("waiting for queued KV block copies to host memory failed: {0}")]
    Settle(String),
    #[error(
        "pinning needs {needed} KV blocks pinned in all, but the lowest KV tier holds {room}: \
         unpin a cached context, or give the node a larger host or disk tier"
    )]
    PinCapacity { needed: usize, room: usize },
    #[error("invalid KV configuration: {0}")]
    Config(String),
}
