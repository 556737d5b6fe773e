//! KV blocks as a router sees them: a block's identity (its chained content hash), where its
//! bytes live, the byte layout two nodes must share to exchange blocks, and the numbered events
//! and dumps of a node's prefix cache.

use serde::{Deserialize, Serialize};

pub use crate::hash::{block_hash, prompt_block_hashes};

/// Identity of a full block's contents: `h_i = xxh3_128(h_{i-1}, tokens of block i, salt)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u128);

/// What a block hash is salted with: the tenant's cache isolation and anything else that changes
/// the KV bytes for the same tokens (KV format, adapter).
pub type CacheSalt = u64;

/// Where a cached block's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

/// What two nodes must share to exchange KV blocks: the same model shape, block size and byte
/// layout. A block's hash names its tokens, not its bytes; this names the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// The backend's name for its KV bytes (`Backend::kv_layout` in strata-node).
    pub backend: String,
    pub model_type: String,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub block_bytes: usize,
}

/// Hashes a [`BlockHash`] by folding its halves: the key is already the output of xxh3-128, so
/// hashing it again (SipHash by default) only costs time.
#[derive(Default, Clone, Copy)]
pub struct BlockHashHasher(u64);

impl std::hash::Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than BlockHash; fold them in FNV-1a style.
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64) ^ ((v >> 64) as u64);
    }
}

/// A map keyed by block hash.
pub type BlockHashMap<V> =
    std::collections::HashMap<BlockHash, V, std::hash::BuildHasherDefault<BlockHashHasher>>;

/// One change to the cache index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventKind {
    /// A block became cached (always on device: it was just computed).
    Stored {
        hash: BlockHash,
        parent: Option<BlockHash>,
        tier: Tier,
    },
    /// A block left the cache entirely.
    Removed { hash: BlockHash, tier: Tier },
    /// A cached block moved between tiers (demotion on eviction, promotion on a hit).
    TierChanged {
        hash: BlockHash,
        from: Tier,
        to: Tier,
    },
}

/// An event with its per-node sequence number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    pub seq: u64,
    pub kind: KvEventKind,
}

/// Full cache state as of event `seq`: every cached block with its parent and tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDump {
    pub seq: u64,
    pub blocks: Vec<(BlockHash, Option<BlockHash>, Tier)>,
}
