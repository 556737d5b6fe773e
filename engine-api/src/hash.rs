//! Chained content hashes of full KV blocks: `h_i = xxh3_128(h_{i-1}, salt, tokens of block i)`.
//!
//! Chaining makes a block's identity cover its whole prefix, so equal hashes mean equal KV; the
//! salt keeps tenants (and KV formats, adapters) from ever sharing blocks.

use xxhash_rust::xxh3::Xxh3Default;

use crate::kv::{BlockHash, CacheSalt};

/// Tags the first input field so a root block can never collide with a child by construction
/// of the input bytes (the root carries 16 zero bytes after its tag, a child its parent's hash).
const ROOT_TAG: u8 = 0;
const CHILD_TAG: u8 = 1;

/// Hash of one block of `tokens` following `parent` (`None` for the first block of a prompt).
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32], salt: CacheSalt) -> BlockHash {
    let mut hasher = Xxh3Default::new();
    match parent {
        Some(BlockHash(p)) => {
            hasher.update(&[CHILD_TAG]);
            hasher.update(&p.to_le_bytes());
        }
        None => {
            hasher.update(&[ROOT_TAG]);
            hasher.update(&[0u8; 16]);
        }
    }
    hasher.update(&salt.to_le_bytes());
    // Serialise through a stack buffer: no allocation, same bytes on every endianness.
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        hasher.update(&buf[..chunk.len() * 4]);
    }
    BlockHash(hasher.digest128())
}

/// Chained hashes of the full blocks of `tokens`; a trailing partial block has no identity yet.
pub fn prompt_block_hashes(tokens: &[u32], block_size: usize, salt: CacheSalt) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let h = block_hash(parent, block, salt);
            parent = Some(h);
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_links_each_block_to_its_parent() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = prompt_block_hashes(&tokens, 16, 7);
        assert_eq!(
            hashes.len(),
            2,
            "the trailing 8 tokens are not a full block"
        );
        assert_eq!(hashes[0], block_hash(None, &tokens[..16], 7));
        assert_eq!(hashes[1], block_hash(Some(hashes[0]), &tokens[16..32], 7));
        // Same tokens under a different parent are a different block.
        assert_ne!(hashes[1], block_hash(None, &tokens[16..32], 7));
    }

    #[test]
    fn shared_prefix_shares_hashes_until_divergence() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[20] = 9999;
        let (ha, hb) = (
            prompt_block_hashes(&a, 16, 1),
            prompt_block_hashes(&b, 16, 1),
        );
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2], "divergence propagates down the chain");
    }

    #[test]
    fn salt_isolates_identical_tokens() {
        let tokens: Vec<u32> = (0..32).collect();
        let a = prompt_block_hashes(&tokens, 16, 1);
        let b = prompt_block_hashes(&tokens, 16, 2);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(a, prompt_block_hashes(&tokens, 16, 1), "deterministic");
    }

    #[test]
    fn token_order_matters() {
        assert_ne!(
            block_hash(None, &[1, 2, 3, 4], 0),
            block_hash(None, &[2, 1, 3, 4], 0)
        );
        // Long blocks go through several buffer chunks; the chunk boundary must not matter.
        let long: Vec<u32> = (0..200).collect();
        let mut swapped = long.clone();
        swapped.swap(63, 64);
        assert_ne!(block_hash(None, &long, 0), block_hash(None, &swapped, 0));
    }

    #[test]
    fn matches_one_shot_xxh3_over_the_documented_bytes() {
        let mut bytes = vec![CHILD_TAG];
        bytes.extend_from_slice(&5u128.to_le_bytes());
        bytes.extend_from_slice(&3u64.to_le_bytes());
        for t in [10u32, 20, 30] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let expected = BlockHash(xxhash_rust::xxh3::xxh3_128(&bytes));
        assert_eq!(block_hash(Some(BlockHash(5)), &[10, 20, 30], 3), expected);
    }
}
